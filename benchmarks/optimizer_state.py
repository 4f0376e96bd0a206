"""Low-precision parameters and optimizer state: bytes per parameter and step time.

For one parameter layout (10M parameters in 50 leaves by default), each variant
runs ``update`` + ``apply_updates`` under ``jax.jit`` with parameters and state
donated, on fixed gradients, interleaved with the baseline ``optax.adamw`` on
float32 parameters:

* on bfloat16 parameters: ``master_weights(adamw)``, ``stochastic_rounding(adamw)``,
  ``kahan_summation(adamw)``, and ``adamw`` alone (round to nearest, which stalls);
* on float32 parameters: ``low_precision_state(adamw, dtype)`` for bfloat16,
  float8_e4m3fn and 8 bits (torchao's ``AdamWFp8`` and ``AdamW8bit`` formats).

Bytes per parameter count what the step keeps between calls beyond the gradients:
the parameters and the optimizer's state (``nbytes`` of every leaf), and Adam's
state alone.

    python -m benchmarks.optimizer_state --layout 10M/50 --repeats 7
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxscale
from benchmarks.harness import JaxStepper, measure, table

LEARNING_RATE = 1e-3
BF16, F32 = jnp.bfloat16, jnp.float32


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LEARNING_RATE)


VARIANTS: dict[str, tuple[Any, Callable[[], optax.GradientTransformation]]] = {
    "adamw, float32 parameters (baseline)": (F32, adamw),
    "adamw, bfloat16 parameters (round to nearest)": (BF16, adamw),
    "master_weights(adamw), bfloat16 parameters": (BF16, lambda: jaxscale.master_weights(adamw())),
    "stochastic_rounding(adamw), bfloat16 parameters": (
        BF16, lambda: jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0))
    ),
    "kahan_summation(adamw), bfloat16 parameters": (
        BF16, lambda: jaxscale.kahan_summation(adamw())
    ),
    "low_precision_state(adamw, bfloat16)": (F32, lambda: jaxscale.low_precision_state(adamw())),
    "low_precision_state(adamw, float8_e4m3fn)": (
        F32, lambda: jaxscale.low_precision_state(adamw(), jnp.float8_e4m3fn)
    ),
    "low_precision_state(adamw, int8)": (
        F32, lambda: jaxscale.low_precision_state(adamw(), "int8")
    ),
}  # fmt: skip
BASELINE = "adamw, float32 parameters (baseline)"


def parameters(n_params: int, n_leaves: int, dtype: Any) -> dict[str, jax.Array]:
    # leaves of a multiple of 256 elements, so that the 8-bit formats quantize every one
    size = n_params // n_leaves // 256 * 256
    key = jax.random.key(0)
    return {
        f"p{i:03d}": (1e-2 * jax.random.normal(jax.random.fold_in(key, i), (size,))).astype(dtype)
        for i in range(n_leaves)
    }


def stepper(dtype: Any, make_tx: Callable[[], Any], n_params: int, n_leaves: int) -> JaxStepper:
    tx = make_tx()
    params = parameters(n_params, n_leaves, dtype)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

    def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), (params, tx.init(params)), (grads,))


def bytes_per_parameter(dtype: Any, make_tx: Callable[[], Any]) -> tuple[float, float]:
    """(parameters and state, the optimizer's state alone), per parameter."""
    params = jax.eval_shape(lambda: parameters(1 << 20, 4, dtype))
    state = jax.eval_shape(make_tx().init, params)
    count = sum(leaf.size for leaf in jax.tree.leaves(params))

    def nbytes(tree: Any) -> int:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))

    return (nbytes(params) + nbytes(state)) / count, nbytes(state) / count


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="10M/50", help="parameters/leaves, e.g. 10M/50")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    count, leaves = args.layout.split("/")
    n_params = int(float(count.rstrip("M")) * 1e6)

    print("| variant | bytes per parameter (parameters + state) | optimizer state alone |")
    print("|---|---|---|")
    memory = {}
    for name, (dtype, make_tx) in VARIANTS.items():
        memory[name] = bytes_per_parameter(dtype, make_tx)
        print(f"| {name} | {memory[name][0]:.3f} | {memory[name][1]:.3f} |")

    variants = {
        name: (lambda d=dtype, m=make_tx: stepper(d, m, n_params, int(leaves)))
        for name, (dtype, make_tx) in VARIANTS.items()
    }
    results = measure(variants, BASELINE, repeats=args.repeats)
    print(f"\nStep time, {args.layout} parameters/leaves, ratio to {BASELINE}:\n")
    print(table(results), flush=True)
    return {"memory": memory, "step": results}


if __name__ == "__main__":
    main()
