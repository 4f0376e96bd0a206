"""Train a character-level transformer in float16 with jaxscale.GradScaler.

The main example: a Flax NNX model with float32 parameters and float16
compute, trained on Python's documentation (it ships with Python, so nothing
is downloaded) as one of 256 simulated data-parallel devices, which is where
float16 gradients underflow without loss scaling (see ``char_lm.py``). It shows
a progress bar, prints a summary and writes a plot of the loss and the loss
scale over the run, and beside it (``.md``) the summary's figures as a table: the
README's table is that file, as ``--plot examples/figures/char_lm_training.png``
wrote it.

    python examples/train_char_lm.py                   # float16 + jaxscale
    python examples/train_char_lm.py --no-scaler       # float16 without loss scaling
    python examples/train_char_lm.py --precision float32
    python examples/train_char_lm.py --precision float8-rowwise  # torchao's float8 recipe
    python examples/train_char_lm.py --grad-dtype float32  # float32 weight gradients
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import char_lm


def plot(history: char_lm.History, path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = np.arange(1, len(history.loss) + 1)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, history.loss, lw=0.6, alpha=0.4, label="loss per step")
    window = 25
    if len(history.loss) >= window:
        smooth = np.convolve(history.loss, np.ones(window) / window, mode="valid")
        top.plot(steps[window - 1 :], smooth, lw=1.5, label=f"mean of {window} steps")
    top.set_ylabel("training loss (nats/char)")
    top.set_title(title)
    top.legend()
    bottom.plot(steps, history.scale, drawstyle="steps-post", color="tab:green")
    skipped = np.flatnonzero(history.skipped)
    if skipped.size:
        bottom.scatter(
            steps[skipped],
            np.array(history.scale)[skipped],
            color="tab:red",
            s=12,
            zorder=3,
            label=f"skipped steps ({skipped.size})",
        )
        bottom.legend()
    bottom.set_yscale("log", base=2)
    bottom.set_ylabel("loss scale")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _power_of_two(scale: float) -> str:
    exponent = math.log2(scale)
    return f"2**{exponent:.0f}" if exponent == int(exponent) else f"{scale:g}"


def summary_table(config: char_lm.Config, history: char_lm.History, summary: dict) -> str:
    """The run's figures as a markdown table: everything but the time, which varies."""
    rows = [
        ("configuration", config.label),
        ("steps", f"{config.steps} of {config.batch_size}x{config.seq_len} characters"),
        ("data-parallel devices", f"{config.devices}"),
        ("train loss (last 50 steps)", f"{summary['train_loss']:.3f} nats/char"),
        ("validation loss", f"{summary['val_loss']:.3f} nats/char"),
        ("validation accuracy", f"{summary['val_accuracy']:.1%}"),
        ("largest loss scale", _power_of_two(max(history.scale))),
        ("loss scale at the end", _power_of_two(summary["final_scale"])),
        ("skipped steps", f"{int(summary['skipped_steps'])}"),
    ]
    rows += [(f"step {step} skipped", origin) for step, origin in history.origins.items()]
    lines = ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, float]:
    defaults = char_lm.Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="sequences per step (on this device)")  # fmt: skip
    parser.add_argument("--precision", choices=char_lm.PRECISIONS, default=defaults.precision,
                        help="the compute precision: float32, or autocast's dtype or "
                             "float8 recipe")  # fmt: skip
    parser.add_argument(
        "--no-scaler", action="store_true", help="train float16 without loss scaling"
    )
    parser.add_argument("--devices", type=int, default=defaults.devices,
                        help="simulated data-parallel devices (1: plain training)")  # fmt: skip
    parser.add_argument("--grad-dtype", choices=["float32"], default=None,
                        help="weight gradients out of their matmuls in float32 "
                             "(jaxscale.autocast's grad_dtype)")  # fmt: skip
    parser.add_argument("--no-locate", action="store_true",
                        help="skip jaxscale.locate_nonfinite (where each skipped step's inf "
                             "was born)")  # fmt: skip
    parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("char_lm_training.png"),
                        help="the plot; the summary table goes beside it, as .md")  # fmt: skip
    parser.add_argument("--sample", type=int, default=200, help="characters to generate at the end")
    args = parser.parse_args(argv)

    config = char_lm.Config(
        precision=args.precision,
        scaler=not args.no_scaler,
        steps=args.steps,
        batch_size=args.batch_size,
        devices=args.devices,
        locate=not args.no_locate,
        grad_dtype=args.grad_dtype,
    )
    print(f"Training: {config.label}; {config.steps} steps of {config.batch_size}x{config.seq_len} "
          f"characters, as one of {config.devices} data-parallel devices")  # fmt: skip
    bar = tqdm(total=config.steps, unit="step")

    def report(step: int, history: char_lm.History) -> None:
        bar.update(step - bar.n)
        bar.set_postfix_str(
            f"loss {history.loss[-1]:.3f}, scale {history.scale[-1]:g}, "
            f"skipped {sum(history.skipped)}"
        )

    dataset = char_lm.Dataset.load()
    model, history, summary = char_lm.train(config, dataset, on_step=report)
    bar.close()
    plot(history, args.plot, f"{config.label}: character LM on Python's documentation")

    print("\nSummary")
    print(f"  configuration        {config.label}")
    print(f"  train loss (last 50) {summary['train_loss']:.4f} nats/char")
    print(f"  validation loss      {summary['val_loss']:.4f} nats/char")
    print(f"  validation accuracy  {summary['val_accuracy']:.2%} of next characters")
    print(f"  loss scale           {_power_of_two(summary['final_scale'])} at the end")
    print(f"  skipped steps        {int(summary['skipped_steps'])} of {config.steps}")
    for step, origin in history.origins.items():  # from jaxscale.locate_nonfinite
        print(f"    step {step:4d}: {origin}")
    print(f"  training time        {summary['seconds']:.1f} s")
    print(f"  plot                 {args.plot}")
    table = args.plot.with_suffix(".md")
    table.write_text(summary_table(config, history, summary) + "\n")
    print(f"  table                {table}")
    if args.sample:
        text = char_lm.sample(model, dataset, "The ", args.sample, config.seq_len)
        print(f'\nSample ({args.sample} characters the model wrote after "The "):\n' + text)
    return summary


if __name__ == "__main__":
    main()
