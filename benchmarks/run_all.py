"""Run every benchmark and write the figures, with the machine, to a markdown file.

    python -m benchmarks.run_all                    # CPU (PyTorch on the CPU too)
    python -m benchmarks.run_all --torch cuda       # on a GPU machine
    python -m benchmarks.run_all --gpu-lowering     # only the lowering report, any machine

Results go to ``benchmarks/results/<platform>-<device>.md``; copy the figures you
trust into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import pathlib
import re

import jax

from benchmarks import (
    autocast_step,
    compile_time,
    counts,
    diagnosis_step,
    float8_step,
    lowering,
    memory_bound_step,
    optimizer_state,
    optimizer_step,
    train_step,
    unscale_throughput,
)
from benchmarks.harness import machine, table


def capture(fn, *args):
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        result = fn(*args)
    return result, buffer.getvalue()


def main(argv: list[str] | None = None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", choices=["cpu", "cuda", "none"], default="cpu")
    parser.add_argument(
        "--layouts", nargs="+", default=["10M/50", "10M/500", "100M/50", "100M/500"]
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--gpu-lowering",
        action="store_true",
        help="only lower the train steps for cuda, rocm, tpu and cpu and report what they run",
    )
    args = parser.parse_args(argv)

    info = machine()
    sections = [
        f"# jaxscale benchmarks, {datetime.date.today().isoformat()}",
        "\n".join(f"- {key}: {value}" for key, value in info.items()),
    ]

    def emit(title: str, body: str) -> None:
        sections.append(f"## {title}\n\n{body.strip()}")
        print(f"\n## {title}\n\n{body.strip()}", flush=True)

    _, text = capture(lowering.main, [])
    emit("Train steps lowered for cuda, rocm, tpu and cpu (jax.export, no device needed)", text)
    if args.gpu_lowering:
        return _write(sections, "lowering")

    # float8 and MX against bfloat16: matmul-bound sizes on an accelerator, small on a CPU
    sizes = ["--width", "512", "--tokens", "2048", "--layers", "2"]
    if jax.default_backend() != "cpu":
        sizes = ["--width", "4096", "--tokens", "8192", "--layers", "4"]
    recipes = ["--recipes", *float8_step.RECIPES, "mxfp8", "mxfp8_wgrad_with_hp"]
    _, text = capture(float8_step.main, [*sizes, *recipes, "--repeats", str(args.repeats)])
    emit("Float8 and MX recipes against bfloat16", text)
    state_args = ["--layout", "10M/50", "--repeats", str(args.repeats)]
    _, text = capture(optimizer_state.main, [*state_args, "--allocator", "default"])
    emit("Low-precision parameters and optimizer state, 10M/50", text)

    layouts = optimizer_step.main(
        ["--layouts", *args.layouts, "--repeats", str(args.repeats), "--torch", args.torch]
    )
    for layout, groups in layouts.items():
        for group, results in groups.items():
            emit(f"Optimizer step, {layout} parameters/leaves, {group}", table(results))
    for group, results in autocast_step.main(["--repeats", str(args.repeats)]).items():
        unit = {"per": "compile"} if group == "trace + compile" else {}
        emit(f"Autocast vs hand-set float16 dtypes, {group}", table(results, **unit))
    memory_bound = memory_bound_step.main(["--repeats", str(args.repeats), "--torch", args.torch])
    for spec, groups in memory_bound.items():
        for group, results in groups.items():
            emit(
                f"Memory-bound step (gradient computed in the jit), {spec}, {group}", table(results)
            )
    groups = train_step.main(["--repeats", str(args.repeats)])
    for group, results in groups.items():
        emit(f"Full train step (float16 transformer), {group}", table(results))
    for loss in compile_time.LOSSES:
        _, text = capture(compile_time.main, ["--loss", loss])
        emit(f"Trace + compile time by number of leaves, {loss} loss", text)
    _, text = capture(diagnosis_step.main, ["--repeats", str(args.repeats)])
    emit("locate_nonfinite when on: step and compile time", text)
    _, text = capture(unscale_throughput.main, ["--repeats", str(args.repeats)])
    emit("unscale_and_check throughput", text)
    _, text = capture(counts.main, [])
    emit("Counts: host transfers and recompilations over 1,000 steps", text)
    if jax.default_backend() == "cpu":
        # last: it keeps freed memory in this process's heap from then on
        _, text = capture(optimizer_state.main, [*state_args, "--allocator", "reuse"])
        emit("Low-precision state, 10M/50, freed memory reused (benchmarks/allocation.py)", text)

    return _write(sections, "all")


def _write(sections: list[str], kind: str) -> pathlib.Path:
    device = re.sub(r"[^A-Za-z0-9]+", "-", jax.devices()[0].device_kind).strip("-").lower()
    suffix = "" if kind == "all" else f"-{kind}"
    out = pathlib.Path(__file__).parent / "results" / f"{jax.default_backend()}-{device}{suffix}.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n\n".join(sections) + "\n")
    print(f"\nwritten: {out}")
    return out


if __name__ == "__main__":
    main()
