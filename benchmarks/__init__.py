"""Benchmarks of jaxscale: run as modules, e.g. ``python -m benchmarks.run_all``."""
