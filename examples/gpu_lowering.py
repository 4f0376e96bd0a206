"""Will this train step wait for the host on a GPU? Checked on a machine without one.

The same small step is written with each of jaxscale's interfaces (the Optax
transform; the PyTorch-style facade driving ``nnx.Optimizer``, a Linen
``TrainState`` and a bare Optax optimizer) and the main example's step under
autocast, in float16 and float8. Each one is lowered for the accelerator with
:func:`jaxscale.lowering_report`, which needs no accelerator, and the table says
what the accelerator would run: loops and conditionals on data (each one waits
for the host every step on a GPU), host transfers, dtype conversions and the
dtypes of every matmul. Use the same call on your own step.

    python examples/gpu_lowering.py --platforms cuda rocm tpu
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

import jaxscale

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import char_lm


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(64, 128, rngs=rngs)
        self.second = nnx.Linear(128, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.second(jnp.tanh(self.first(x)))


X = jnp.ones((32, 64))
Y = jnp.zeros((32, 8))


def _mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def _clip(grads: Any, max_norm: float = 1.0) -> Any:
    return optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())[0]


def _split_step(objects: Any, body: Callable[..., None]) -> tuple[Callable[..., Any], tuple]:
    """An NNX step as a pure jitted function of the objects' state."""
    graphdef, state = nnx.split(objects)

    @jax.jit
    def step(state, x, y):
        live = nnx.merge(graphdef, state)
        body(*live, x, y)
        return nnx.state(live)

    return step, (state, X, Y)


def transform_step() -> tuple[Callable[..., Any], tuple]:
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = jaxscale.grad_scaler(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))

    @jax.jit
    def step(params, opt_state, x, y):
        def loss(p):
            return jaxscale.scale(_mse(nnx.merge(graphdef, p), x, y), opt_state)

        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params), X, Y)


def facade_nnx_step() -> tuple[Callable[..., Any], tuple]:
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def body(model, optimizer, scaler, x, y):
        grads = nnx.grad(lambda m: scaler.scale(_mse(m, x, y)))(model)
        grads = _clip(scaler.unscale_(optimizer, grads))
        scaler.step(optimizer, model, grads)
        scaler.update()

    return _split_step((model, optimizer, jaxscale.GradScaler()), body)


def facade_train_state_step() -> tuple[Callable[..., Any], tuple]:
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    @jax.jit
    def step(state, scaler, x, y):
        grads = jax.grad(lambda p: scaler.scale(_mse(nnx.merge(graphdef, p), x, y)))(state.params)
        grads = _clip(scaler.unscale_(state, grads))
        state = scaler.step(state, grads=grads)
        scaler.update()
        return state, scaler

    return step, (state, jaxscale.GradScaler(), X, Y)


def facade_optax_step() -> tuple[Callable[..., Any], tuple]:
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
    tx = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state, scaler, x, y):
        grads = jax.grad(lambda p: scaler.scale(_mse(nnx.merge(graphdef, p), x, y)))(params)
        grads = _clip(scaler.unscale_(tx, grads))
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    return step, (params, tx.init(params), jaxscale.GradScaler(), X, Y)


def flagship_step(precision: str = "float16") -> tuple[Callable[..., Any], tuple]:
    """The main example's train step: autocast + GradScaler on the character transformer
    (for float16; the bfloat16 and float8 settings train without a scaler)."""
    config = char_lm.Config(
        precision=precision, width=128, layers=2, heads=4, seq_len=64, batch_size=16
    )
    graphdef, state, body, tokens = char_lm.split_step(config)

    @jax.jit
    def step(state, x, y):
        live = nnx.merge(graphdef, state)
        outputs = body(*live, x, y)
        return nnx.state(live), outputs

    return step, (state, tokens, tokens)


STEPS: dict[str, Callable[[], tuple[Callable[..., Any], tuple]]] = {
    "transform: grad_scaler(chain(clip, adam))": transform_step,
    "facade: nnx.Optimizer, unscale_ + clip": facade_nnx_step,
    "facade: TrainState, unscale_ + clip": facade_train_state_step,
    "facade: optax triple, unscale_ + clip": facade_optax_step,
    "main example: autocast + GradScaler": flagship_step,
    "main example: autocast float8 tensorwise": functools.partial(
        flagship_step, "float8-tensorwise"
    ),
    "main example: autocast float8 rowwise": functools.partial(flagship_step, "float8-rowwise"),
}


@functools.cache
def built(name: str) -> tuple[Callable[..., Any], tuple]:
    """The step ``name`` of :data:`STEPS` and its arguments, built once for every platform."""
    return STEPS[name]()


@functools.cache
def lowered(name: str, platform: str) -> jaxscale.LoweringReport:
    """The lowering report of the step ``name`` of :data:`STEPS` for ``platform``."""
    step, args = built(name)
    return jaxscale.lowering_report(step, *args, platform=platform)


def table(platforms: list[str], names: list[str] | None = None) -> str:
    """A markdown table of the reports of ``names`` (every step by default) per platform."""
    lines = [
        "| step | platform | loops | conditionals on data (on constants) | host transfers "
        "| array converts (elements) | matmul dtypes | sums by dtype |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names or list(STEPS):
        for platform in platforms:
            r = lowered(name, platform)
            dots = ", ".join(f"{n}x {k}" for k, n in sorted(r.matmul_dtypes.items()))
            sums = ", ".join(f"{n}x {k}" for k, n in sorted(r.sum_dtypes.items()))
            lines.append(
                f"| {name} | {platform} | {r.loops} | "
                f"{r.data_conditionals} ({r.constant_conditionals}) | "
                f"{r.host_transfers} | {r.array_converts} ({r.converted_elements:,}) | {dots} "
                f"| {sums} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platforms", nargs="+", default=["cuda"])
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS),
                        metavar="NAME", help="which steps (default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    text = table(args.platforms, args.steps)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
