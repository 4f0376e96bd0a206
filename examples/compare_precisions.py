"""float32, float16 without loss scaling, and float16 with jaxscale, side by side.

Trains the character-level transformer of ``char_lm.py`` three times on the same
data (float16 means ``jaxscale.autocast``, PyTorch's autocast policy) and reports,
for each, the final losses, the next-character accuracy on held-out text and the
share of gradient elements that float16 flushes to zero.
Writes a markdown table (printed, and saved next to the plot as ``.md``) and a plot of
the loss curves. The README's tables are these files, included as they were written
(a test compares them), so a figure there is the output of the command it names.

    python examples/compare_precisions.py                  # as one of 256 devices
    python examples/compare_precisions.py --devices 1 256  # where the effect appears
    python examples/compare_precisions.py --float8 --devices 1  # bfloat16 vs float8 recipes

``--float8`` compares bfloat16 autocast with torchao's float8 training recipes
(``autocast(..., dtype=bfloat16, float8=recipe)``; no loss scaling, as torchao trains).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import char_lm
from tqdm import tqdm


def train_with_progress(config: char_lm.Config, dataset: char_lm.Dataset):
    """``char_lm.train`` with a progress bar (each setting runs a few minutes on a CPU)."""
    with tqdm(total=config.steps, unit="step", desc=f"  {config.label}", leave=False) as bar:

        def report(step: int, history: char_lm.History) -> None:
            bar.update(step - bar.n)
            bar.set_postfix_str(f"loss {history.loss[-1]:.3f}")

        return char_lm.train(config, dataset, on_step=report)


SETTINGS = [("float32", False), ("float16", False), ("float16", True)]
FLOAT8_SETTINGS = [
    ("bfloat16", False),
    ("float8-tensorwise", False),
    ("float8-rowwise", False),
    ("float8-rowwise_with_gw_hp", False),
    ("float8-mxfp8", False),
    ("float8-mxfp8_wgrad_with_hp", False),
]


def compare_float8(steps: int, devices: int, dataset: char_lm.Dataset) -> tuple[list, dict]:
    rows, histories = [], {}
    for precision, scaler in FLOAT8_SETTINGS:
        config = char_lm.Config(precision=precision, scaler=scaler, steps=steps, devices=devices)
        print(f"  training {config.label} ...", flush=True)
        _, history, summary = train_with_progress(config, dataset)
        histories[config.label] = history
        rows.append({"setting": config.label, "devices": devices, "underflow": float("nan"),
                     **summary})  # fmt: skip
    return rows, histories


def compare(steps: int, devices: int, dataset: char_lm.Dataset) -> list[dict[str, object]]:
    rows = []
    histories = {}
    reference = None
    for precision, scaler in SETTINGS:
        config = char_lm.Config(precision=precision, scaler=scaler, steps=steps, devices=devices)
        print(f"  training {config.label} ...", flush=True)
        model, history, summary = train_with_progress(config, dataset)
        histories[config.label] = history
        if precision == "float32":
            reference = (model, config)
        rows.append({"setting": config.label, "devices": devices, **summary})
    # underflow, measured on the float32 run's final parameters for every setting alike
    model, config = reference
    scale = rows[-1]["final_scale"]
    underflow = char_lm.underflow_fractions(
        model, dataclasses.replace(config, precision="float16"), dataset, scale
    )
    rows[0]["underflow"] = 0.0
    rows[1]["underflow"] = underflow["underflow_unscaled"]
    rows[2]["underflow"] = underflow["underflow_scaled"]
    return rows, histories


def table(rows: list[dict[str, object]], *, float8: bool = False) -> str:
    """The markdown table of the comparison (for ``--float8``: the setting, losses and
    accuracy, without the columns float8 training has no values for)."""
    if float8:
        lines = ["| setting | train loss | val loss | val accuracy |", "|---|---|---|---|"]
        lines += [
            f"| {r['setting']} | {r['train_loss']:.3f} | {r['val_loss']:.3f} | "
            f"{r['val_accuracy']:.1%} |"
            for r in rows
        ]
        return "\n".join(lines)
    lines = [
        "| devices | setting | train loss | val loss | val accuracy "
        "| gradient elements flushed to 0 | skipped steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['devices']} | {r['setting']} | {r['train_loss']:.3f} | {r['val_loss']:.3f} | "
            f"{r['val_accuracy']:.1%} | {_percent(r['underflow'])} | {int(r['skipped_steps'])} |"
        )
    return "\n".join(lines)


def _percent(fraction: float) -> str:
    return "n/a" if fraction != fraction else f"{fraction:.2%}"


def plot(all_histories: dict[int, dict[str, char_lm.History]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(
        1, len(all_histories), figsize=(6 * len(all_histories), 4), squeeze=False
    )
    for axis, (devices, histories) in zip(axes[0], all_histories.items(), strict=True):
        for label, history in histories.items():
            window = min(25, len(history.loss))
            smooth = np.convolve(history.loss, np.ones(window) / window, mode="valid")
            axis.plot(np.arange(window, len(history.loss) + 1), smooth, label=label)
        axis.set_title(f"as one of {devices} data-parallel devices")
        axis.set_xlabel("step")
        axis.set_ylabel("training loss, running mean")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=char_lm.Config().steps)
    parser.add_argument("--devices", type=int, nargs="+", default=[char_lm.Config().devices])
    parser.add_argument(
        "--plot",
        type=pathlib.Path,
        default=None,
        help="the plot's path (default: precision_comparison.png, or float8_comparison.png "
        "with --float8); the table is written beside it, as .md",
    )
    parser.add_argument("--float8", action="store_true",
                        help="bfloat16 against torchao's float8 recipes instead")  # fmt: skip
    args = parser.parse_args(argv)
    if args.plot is None:
        name = "float8_comparison" if args.float8 else "precision_comparison"
        args.plot = pathlib.Path(f"{name}.png")
    dataset = char_lm.Dataset.load()
    rows, all_histories = [], {}
    run = compare_float8 if args.float8 else compare
    for devices in args.devices:
        print(f"As one of {devices} data-parallel devices:")
        device_rows, all_histories[devices] = run(args.steps, devices, dataset)
        rows += device_rows
    report = table(rows, float8=args.float8)
    print("\n" + report)
    plot(all_histories, args.plot)
    args.plot.with_suffix(".md").write_text(report + "\n")
    print(f"\nplot: {args.plot}\ntable: {args.plot.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
