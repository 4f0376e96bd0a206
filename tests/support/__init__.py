"""What several test modules share: reference implementations, drivers and paths.

Test modules import from here (``from support import third_party``), never from one
another; ``pyproject.toml`` puts ``tests/`` on the path.
"""
