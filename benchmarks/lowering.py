"""What the GPU (or TPU) will run: the train steps of ``examples/gpu_lowering.py``
lowered for cuda, rocm, tpu and cpu, on any machine, with
:func:`jaxscale.lowering_report`.

    python -m benchmarks.lowering --platforms cuda rocm tpu cpu
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import gpu_lowering


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platforms", nargs="+", default=["cuda", "rocm", "tpu", "cpu"])
    args = parser.parse_args(argv)
    text = gpu_lowering.table(args.platforms)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
