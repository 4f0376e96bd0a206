"""Full train step overhead: forward, backward and Adam on a small float16 transformer.

The model is the main example's character transformer (``examples/char_lm.py``),
written in float32 and run under ``jaxscale.autocast`` (float16 matmuls, float32
softmax, norms and loss), as the example trains it. Every variant computes the same
loss on the same batch under ``jax.jit`` with the parameters and optimizer state
donated; the baseline trains in float16 without any loss scaling. The Optax group
is every recipe of ``benchmarks/recipes.py``. The NNX group
compares ``nnx.Optimizer.update`` under ``nnx.jit`` with the same step driven by
``jaxscale.GradScaler``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale
from benchmarks import recipes
from benchmarks.harness import Result, Stepper, measure, table

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import char_lm

LEARNING_RATE = recipes.LEARNING_RATE
AUTOCAST_LOSS = jaxscale.autocast(char_lm.loss_fn)


def model_and_batch(width: int, layers: int, batch: int, seq_len: int):
    model = char_lm.CharTransformer(
        vocab=96,
        seq_len=seq_len,
        width=width,
        layers=layers,
        heads=8,
        rngs=nnx.Rngs(0),
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 96, (batch, seq_len)), jnp.int32)
    y = jnp.asarray(rng.integers(0, 96, (batch, seq_len)), jnp.int32)
    return model, x, y


def functional(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x, y):
        return AUTOCAST_LOSS(nnx.merge(graphdef, params, rest), x, y)

    return loss, params


def recipe_variant(name: str):
    """The recipe ``name`` of ``benchmarks/recipes.py`` on the transformer's loss."""

    def make(model, x, y):
        loss, params = functional(model)
        return recipes.RECIPES[name](loss).stepper(params, (x, y))

    return make


class NnxTrainStepper(Stepper):
    def __init__(self, model, x, y, with_scaler: bool):
        self.model, self.x, self.y = model, x, y
        self.optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
        self.scaler = jaxscale.GradScaler() if with_scaler else None

        @nnx.jit
        def plain(model, optimizer, x, y):
            optimizer.update(model, nnx.grad(AUTOCAST_LOSS)(model, x, y))

        @nnx.jit
        def scaled(model, optimizer, scaler, x, y):
            grads = nnx.grad(lambda m: scaler.scale(AUTOCAST_LOSS(m, x, y)))(model)
            scaler.step(optimizer, model, grads)
            scaler.update()

        self.fn = scaled if with_scaler else plain

    def step(self) -> None:
        if self.scaler is None:
            self.fn(self.model, self.optimizer, self.x, self.y)
        else:
            self.fn(self.model, self.optimizer, self.scaler, self.x, self.y)

    def block(self) -> None:
        jax.block_until_ready(nnx.state(self.model))


OPTAX_GROUP = {name: recipe_variant(name) for name in recipes.RECIPES}
NNX_GROUP = {
    "nnx.Optimizer, no loss scaling (baseline)": lambda m, x, y: NnxTrainStepper(m, x, y, False),
    "jaxscale.GradScaler + nnx.Optimizer": lambda m, x, y: NnxTrainStepper(m, x, y, True),
}


def main(argv: list[str] | None = None) -> dict[str, list[Result]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)

    def bind(group):
        return {
            name: (
                lambda make=make: make(
                    *model_and_batch(args.width, args.layers, args.batch, args.seq_len)
                )
            )
            for name, make in group.items()
        }

    groups = {
        "optax": measure(bind(OPTAX_GROUP), recipes.BASELINE, repeats=args.repeats),
        "nnx": measure(
            bind(NNX_GROUP), "nnx.Optimizer, no loss scaling (baseline)", repeats=args.repeats
        ),
    }
    params = sum(
        x.size
        for x in jax.tree.leaves(nnx.state(model_and_batch(args.width, args.layers, 1, 8)[0]))
    )
    print(f"transformer: {params / 1e6:.1f}M parameters, batch {args.batch}x{args.seq_len}")
    for name, results in groups.items():
        print(f"\n### full train step, {name}\n\n{table(results)}", flush=True)
    return groups


if __name__ == "__main__":
    main()
