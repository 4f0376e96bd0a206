"""What the GPU (or TPU) will run: train steps lowered for a platform, on any machine.

What a step does on an accelerator is decided when JAX lowers it: ``jax.export``
lowers a jitted function for ``cuda``, ``rocm``, ``tpu`` or ``cpu`` without such a device,
and the StableHLO module says what will run. For each train step below this
reports:

* ``while`` loops and conditionals whose predicate is data. Either one copies its
  predicate to the host and waits for it, every step, on a GPU. (Conditionals on
  a constant, such as ``lax.platform_dependent``'s platform index, are folded
  away by XLA and are not counted.)
* host callbacks, sends and receives, infeed and outfeed;
* conversions of arrays (not scalars) between dtypes, and the elements they touch;
* the dtypes of every ``dot_general`` and convolution.

    python -m benchmarks.lowering --platforms cuda rocm tpu cpu
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import math
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import jaxscale

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import char_lm

_DEFINITION = re.compile(r"^\s*(%[\w#:]+)\s*=\s*(\"?[\w.]+\"?)(.*)$")
_TENSOR = re.compile(r"tensor<([^>]*)>")
_HOST_OPS = ("stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed")


@dataclasses.dataclass
class Lowered:
    """What one lowered module contains."""

    loops: int
    data_conditionals: int
    constant_conditionals: int
    host_transfers: int
    array_converts: int
    converted_elements: int
    matmul_dtypes: dict[str, int]

    @property
    def syncs_with_host(self) -> bool:
        return bool(self.loops or self.data_conditionals or self.host_transfers)


def _elements(tensor: str) -> int:
    dims = [d for d in tensor.split("x")[:-1] if d]
    return math.prod(int(d) for d in dims) if dims else 1


def analyse(module: str) -> Lowered:
    """Count what matters in a StableHLO module's text."""
    constants: set[str] = set()
    loops = data_cases = constant_cases = host = converts = converted = 0
    matmuls: collections.Counter[str] = collections.Counter()
    lines = module.splitlines()
    for number, line in enumerate(lines):
        match = _DEFINITION.match(line)
        if match:
            names, op = match.group(1), match.group(2).strip('"')
            name = names.split(":")[0]
            if op == "stablehlo.constant" or (
                op == "stablehlo.case" and _is_constant_case(lines, number, constants)
            ):
                constants.add(name)
        if "stablehlo.while" in line:
            loops += 1
        if '"stablehlo.case"' in line or '"stablehlo.if"' in line or "stablehlo.if " in line:
            operand = re.search(r"\((%[\w#]+)\)", line)
            if operand and operand.group(1) in constants:
                constant_cases += 1
            else:
                data_cases += 1
        if any(op in line for op in _HOST_OPS) or (
            "custom_call" in line and "callback" in line.lower()
        ):
            host += 1
        if "stablehlo.convert" in line:
            tensors = _TENSOR.findall(line)
            if tensors and _elements(tensors[0]) > 1:
                converts += 1
                converted += _elements(tensors[0])
        if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
            tensors = _TENSOR.findall(line)
            if tensors:
                kinds = [t.split("x")[-1] for t in tensors]
                matmuls[" x ".join(kinds[:2]) + " -> " + kinds[-1]] += 1
    return Lowered(loops, data_cases, constant_cases, host, converts, converted, dict(matmuls))


def _is_constant_case(lines: list[str], start: int, constants: set[str]) -> bool:
    """A case on a constant whose every branch returns a constant is itself a constant."""
    operand = re.search(r"\((%[\w#]+)\)", lines[start])
    if not operand or operand.group(1) not in constants:
        return False
    returns = []
    for line in lines[start:]:
        if "stablehlo.return" in line:
            returns += re.findall(r"(%[\w#]+)", line.split("stablehlo.return", 1)[1])
        if line.strip().startswith("}) :"):
            break
    return bool(returns) and all(r in constants for r in returns)


# -- the train steps ---------------------------------------------------------------------


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
    vocab = 96
    config = char_lm.Config(
        precision=precision, width=128, layers=2, heads=4, seq_len=64, batch_size=16
    )
    model = char_lm.CharTransformer(
        vocab, config.seq_len, config.width, config.layers, config.heads, nnx.Rngs(0)
    )
    optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(growth_interval=config.growth_interval)
    graphdef, state = nnx.split((model, optimizer, scaler))
    body = char_lm.train_step_body(config)
    tokens = jnp.asarray(
        np.random.default_rng(0).integers(0, vocab, (config.batch_size, config.seq_len)),
        jnp.int32,
    )

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
def lowered(name: str, platform: str) -> Lowered:
    step, args = STEPS[name]()
    exported = jax.export.export(step, platforms=[platform])(*args)
    return analyse(exported.mlir_module())


def table(platforms: list[str]) -> str:
    lines = [
        "| step | platform | loops | conditionals on data (on constants) | host transfers "
        "| array converts (elements) | matmul dtypes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in STEPS:
        for platform in platforms:
            r = lowered(name, platform)
            dots = ", ".join(f"{n}x {k}" for k, n in sorted(r.matmul_dtypes.items()))
            lines.append(
                f"| {name} | {platform} | {r.loops} | "
                f"{r.data_conditionals} ({r.constant_conditionals}) | "
                f"{r.host_transfers} | {r.array_converts} ({r.converted_elements:,}) | {dots} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platforms", nargs="+", default=["cuda", "rocm", "tpu", "cpu"])
    args = parser.parse_args(argv)
    text = table(args.platforms)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
