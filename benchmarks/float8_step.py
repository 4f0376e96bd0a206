"""What float8 buys: a train step of linear layers under each float8 recipe, against bfloat16.

A stack of transformer MLP blocks (LayerNorm, ``width → 4·width``, GELU,
``4·width → width``, residual) in plain JAX with float32 parameters, trained with
Adam. The loss runs under ``jaxscale.autocast(dtype=bfloat16)`` (the baseline) and
under ``jaxscale.autocast(dtype=bfloat16, float8=recipe)`` for each recipe asked
for, so every linear layer's three matmuls (forward, input gradient, weight
gradient) run as the recipe says and everything else in bfloat16. Parameters and
optimizer state are donated. The ratio is float8's step time over bfloat16's,
measured interleaved in one process; the trace + compile time of each step is
reported too (one compile each, ahead of time).

Float8 pays where the matmuls dominate: large widths and many tokens. On a GPU
without float8 tensor cores, and on a CPU, XLA widens float8 operands and the
recipes cost more than bfloat16.

    python -m benchmarks.float8_step                                  # GPU sizes
    python -m benchmarks.float8_step --width 256 --tokens 512 --layers 2  # CPU sizes
"""

from __future__ import annotations

import argparse
import functools
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale
from benchmarks.harness import JaxStepper, Result, measure, table

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def init_params(key: jax.Array, width: int, layers: int) -> list[dict[str, jax.Array]]:
    params = []
    for layer_key in jax.random.split(key, layers):
        up_key, down_key = jax.random.split(layer_key)
        params.append(
            {
                "scale": jnp.ones((width,), jnp.float32),
                "up": jax.random.normal(up_key, (width, 4 * width)) / np.sqrt(width),
                "up_bias": jnp.zeros((4 * width,), jnp.float32),
                "down": jax.random.normal(down_key, (4 * width, width)) / np.sqrt(4 * width),
                "down_bias": jnp.zeros((width,), jnp.float32),
            }
        )
    return params


def mlp_loss(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    for layer in params:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        h = (x - mean) * jax.lax.rsqrt(var + 1e-6) * layer["scale"]
        h = jax.nn.gelu(h @ layer["up"] + layer["up_bias"])
        x = x + h @ layer["down"] + layer["down_bias"]
    return jnp.mean(jnp.square(x.astype(jnp.float32) - y))


def train_step(recipe: str | None) -> Any:
    loss = jaxscale.autocast(mlp_loss, dtype=jnp.bfloat16, float8=recipe)
    tx = optax.adam(1e-4)

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def variant(
    recipe: str | None, width: int, tokens: int, layers: int, compiles: dict[str | None, Any]
) -> JaxStepper:
    """The step compiled ahead of time (the seconds and program kept in ``compiles``)."""
    keys = jax.random.split(jax.random.key(0), 3)
    params = init_params(keys[0], width, layers)
    x = jax.random.normal(keys[1], (tokens, width), jnp.float32)
    y = jax.random.normal(keys[2], (tokens, width), jnp.float32)
    tx, step = train_step(recipe)
    opt_state = tx.init(params)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, x, y).compile()
    compiles[recipe] = (time.perf_counter() - start, float8_matmuls(compiled.as_text()))
    print(f"compiled {recipe or 'bfloat16'}: {compiles[recipe][0]:.1f} s", flush=True)
    return JaxStepper(compiled, (params, opt_state), (x, y))


def float8_matmuls(hlo: str) -> int:
    """How many matmuls of the compiled program read float8 operands: XLA's ``dot``s and
    the GPU's cuBLAS(Lt) calls (a CPU widens float8 operands before its dots)."""
    calls = re.findall(r"^.*(?:= \S+ dot\(|custom-call\().*$", hlo, flags=re.MULTILINE)
    return sum(1 for line in calls if re.search(r"f8e(4m3fn|5m2)\[", line.split("=", 1)[1]))


def main(argv: list[str] | None = None) -> dict[str, list[Result]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    sizes = (args.width, args.tokens, args.layers)

    compiles: dict[str | None, tuple[float, int]] = {}
    names = {None: "bfloat16 (baseline)", **{r: f"float8 {r}" for r in args.recipes}}
    variants = {
        name: functools.partial(variant, recipe, *sizes, compiles) for recipe, name in names.items()
    }
    results = measure(variants, names[None], repeats=args.repeats)
    flops = 3 * 2 * 2 * args.tokens * args.width * 4 * args.width * args.layers
    print(f"width {args.width}, {args.tokens} tokens, {args.layers} blocks "
          f"({flops / 1e12:.2f} TFLOP of linear-layer matmuls per step)")  # fmt: skip
    print(table(results))
    base = compiles[None][0]
    compiled = []
    for (recipe, name), r in zip(names.items(), results, strict=True):
        seconds, matmuls = compiles[recipe]
        compiled.append(Result(name, seconds, seconds / base, [seconds]))
        print(f"{name}: {flops / r.seconds / 1e12:.3g} TFLOP/s of linear-layer matmuls, "
              f"{matmuls} matmuls on float8 operands in the compiled step")  # fmt: skip
    print()
    print(table(compiled, unit="ms", per="compile"), flush=True)
    return {"step": results, "trace + compile": compiled}


if __name__ == "__main__":
    main()
