"""bfloat16 parameters that learn: the main example's transformer trained with its
parameters in bfloat16 under each way of writing them, against float32 parameters.

Every setting computes in bfloat16 under ``jaxscale.autocast`` (no loss scaling: bfloat16
has float32's range) and runs Adam's arithmetic in float32; they differ in how the new
parameter is written and what is kept beside it:

* float32 parameters: the reference;
* bfloat16, round to nearest: Adam on float32 copies, the new value rounded to nearest;
* bfloat16, stochastic rounding: ``jaxscale.stochastic_rounding`` (torchao's write);
* bfloat16, Kahan summation: ``jaxscale.kahan_summation`` (a bfloat16 compensation);
* bfloat16, float32 master weights: ``jaxscale.master_weights``.

Prints a markdown table (written beside the plot as ``.md``) of the final training loss,
validation loss and accuracy, and plots the training losses.

    python examples/compare_low_precision.py --plot examples/figures/low_precision.png
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import char_lm

import jaxscale

BF16 = jnp.bfloat16


def round_to_nearest(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Adam on float32 copies of the parameters, the new value rounded to nearest: what
    a bfloat16 parameter gets without any of jaxscale's transforms (but with float32
    optimizer arithmetic and state, as the other settings have)."""

    def widen(tree: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(jnp.float32), tree)

    def init(params: Any) -> Any:
        return inner.init(widen(params))

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        wide = widen(params)
        updates, state = inner.update(widen(grads), state, wide)
        written = jax.tree.map(
            lambda p, u: (p + u).astype(BF16).astype(jnp.float32) - p, wide, updates
        )
        return written, state

    return optax.GradientTransformation(init, update)


SETTINGS: dict[str, tuple[Any, Callable[[optax.GradientTransformation], Any]]] = {
    "float32 parameters": (jnp.float32, lambda tx: tx),
    "bfloat16, round to nearest": (BF16, round_to_nearest),
    "bfloat16, stochastic rounding": (
        BF16, lambda tx: jaxscale.stochastic_rounding(tx, key=jax.random.key(0))
    ),
    "bfloat16, Kahan summation": (BF16, jaxscale.kahan_summation),
    "bfloat16, float32 master weights": (BF16, jaxscale.master_weights),
}  # fmt: skip


def train(name: str, config: char_lm.Config, dataset: char_lm.Dataset) -> dict[str, Any]:
    dtype, wrap = SETTINGS[name]
    model = char_lm.CharTransformer(
        len(dataset.chars), config.seq_len, config.width, config.layers, config.heads,
        nnx.Rngs(config.seed),
    )  # fmt: skip
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), params))
    optimizer = nnx.Optimizer(model, wrap(optax.adam(config.learning_rate)), wrt=nnx.Param)
    loss_fn = jaxscale.autocast(char_lm.loss_fn, dtype=BF16)

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    stream = dataset.batches("train", config.batch_size, config.seq_len, seed=config.seed)
    losses = []
    start = time.perf_counter()
    for _ in tqdm(range(config.steps), desc=f"  {name}", leave=False):
        losses.append(step(model, optimizer, *next(stream)))
    losses = [float(v) for v in jax.device_get(losses)]
    seconds = time.perf_counter() - start
    val_loss, val_accuracy = char_lm.evaluate(model, dataset, config)
    return {
        "setting": name,
        "train_loss": float(np.mean(losses[-50:])),
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "seconds": seconds,
        "losses": losses,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| parameters | train loss (last 50 steps) | validation loss | validation accuracy |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['setting']} | {row['train_loss']:.4f} | {row['val_loss']:.4f} | "
            f"{100 * row['val_accuracy']:.2f}% |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for row in rows:
        window = min(25, len(row["losses"]))
        smooth = np.convolve(row["losses"], np.ones(window) / window, mode="valid")
        axis.plot(np.arange(window, len(row["losses"]) + 1), smooth, label=row["setting"])
    axis.set_xlabel("step")
    axis.set_ylabel("training loss, running mean of 25")
    axis.set_title("bfloat16 parameters under each write, and float32")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=char_lm.Config().steps)
    parser.add_argument("--learning-rate", type=float, default=char_lm.Config().learning_rate)
    parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("low_precision.png"),
                        help="the plot; the table is written beside it, as .md")  # fmt: skip
    args = parser.parse_args(argv)
    config = char_lm.Config(
        precision="bfloat16", scaler=False, steps=args.steps, devices=1,
        learning_rate=args.learning_rate,
    )  # fmt: skip
    dataset = char_lm.Dataset.load()
    rows = [train(name, config, dataset) for name in SETTINGS]
    report = table(rows)
    print(report)
    plot(rows, args.plot)
    args.plot.with_suffix(".md").write_text(report + "\n")
    return report


if __name__ == "__main__":
    main()
