"""Full train step overhead: forward, backward and Adam on a small float16 transformer.

The model is the main example's character transformer (``examples/char_lm.py``),
written in float32 and run under ``jaxscale.autocast`` (float16 matmuls, float32
softmax, norms and loss), as the example trains it. Every variant computes the same
loss on the same batch under ``jax.jit`` with the parameters and optimizer state
donated; the baseline trains in float16 without any loss scaling. The NNX group
compares ``nnx.Optimizer.update`` under ``nnx.jit`` with the same step driven by
``jaxscale.GradScaler``.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import dynamic_scale as flax_dynamic_scale

import jaxscale
from benchmarks.harness import JaxStepper, Result, Stepper, measure, table
from benchmarks.optimizer_step import jmp_masked_step

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import char_lm

LEARNING_RATE = 1e-3
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


def optax_variant(kind: str):
    def make(model, x, y):
        loss, params = functional(model)
        inner = optax.adam(LEARNING_RATE)
        if kind == "baseline":
            tx = inner
        elif kind == "grad_scaler":
            tx = jaxscale.grad_scaler(inner)
        else:
            tx = optax.apply_if_finite(inner, 10)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, x, y):
            if kind == "grad_scaler":
                grads = jax.grad(lambda p: jaxscale.scale(loss(p, x, y), opt_state))(params)
            else:
                grads = jax.grad(loss)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return JaxStepper(step, (params, tx.init(params)), (x, y))

    return make


def facade_optax_triple(model, x, y):
    loss, params = functional(model)
    tx = optax.adam(LEARNING_RATE)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, scaler, x, y):
        grads = jax.grad(lambda p: scaler.scale(loss(p, x, y)))(params)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    return JaxStepper(step, (params, tx.init(params), jaxscale.GradScaler()), (x, y))


def flax_dynamic_scale_recipe(model, x, y):
    """Flax's ImageNet example: DynamicScale.value_and_grad, then jnp.where masking."""
    loss, params = functional(model)
    tx = optax.adam(LEARNING_RATE)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, ds, x, y):
        ds, is_finite, _, grads = ds.value_and_grad(loss)(params, x, y)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_opt_state = jax.tree.map(
            functools.partial(jnp.where, is_finite), new_opt_state, opt_state
        )
        new_params = jax.tree.map(functools.partial(jnp.where, is_finite), new_params, params)
        return new_params, new_opt_state, ds

    return JaxStepper(step, (params, tx.init(params), flax_dynamic_scale.DynamicScale()), (x, y))


def jmp_recipe(model, x, y):
    import jmp

    loss, params = functional(model)
    tx = optax.adam(LEARNING_RATE)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, loss_scale, x, y):
        grads = jax.grad(lambda p: loss_scale.scale(loss(p, x, y)))(params)
        return jmp_masked_step(tx, params, opt_state, loss_scale, grads)

    return JaxStepper(
        step, (params, tx.init(params), jmp.DynamicLossScale(jnp.float32(2.0**15))), (x, y)
    )


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


OPTAX_GROUP = {
    "float16, no loss scaling (baseline)": optax_variant("baseline"),
    "jaxscale.grad_scaler(adam)": optax_variant("grad_scaler"),
    "jaxscale.GradScaler, optax triple": facade_optax_triple,
    "optax.apply_if_finite(adam)": optax_variant("apply_if_finite"),
    "flax DynamicScale + jnp.where masking": flax_dynamic_scale_recipe,
    "jmp.DynamicLossScale + select_tree": jmp_recipe,
}
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
        "optax": measure(
            bind(OPTAX_GROUP), "float16, no loss scaling (baseline)", repeats=args.repeats
        ),
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
