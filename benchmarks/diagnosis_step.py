"""What ``jaxscale.locate_nonfinite`` costs when on: step time and compile time.

Three steps, each against itself without the diagnosis, in one process:

* ``flagship``: the main example's train step (``examples/char_lm.py``: the character
  transformer under autocast, GradScaler, Adam), jitted with its state donated; the
  located variant wraps the gradient computation in ``locate_nonfinite``, as the
  example does.
* ``float8 rowwise MLP``: the gradient of a 4-layer MLP (width 512, batch 256) with every
  matmul in the rowwise float8 recipe, whose matmuls are each a few dozen small jitted
  functions for the search to read, and an SGD step;
* ``memory-bound``: Adam with ``jaxscale.grad_scaler`` on 10M float32 parameters in 50
  leaves and the loss ``0.5 * sum((p - d) ** 2)``, the gradient in the same jit.

Step time (median of interleaved repeats) and compile time (trace, lower and compile
of a fresh function, median of three) are reported as ratios to the plain step.

    python -m benchmarks.diagnosis_step
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale
from benchmarks.harness import JaxStepper, Result, measure, table

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import char_lm


def flagship(locate: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    graphdef, state, body, tokens = char_lm.split_step(char_lm.Config(locate=locate, batch_size=32))

    def step(state: Any, x: jax.Array, y: jax.Array, last: Any) -> tuple[Any, ...]:
        live = nnx.merge(graphdef, state)
        loss, _, _, report = body(*live, x, y)
        # the step's outputs, the report among them, so that nothing is dead code
        return nnx.state(live), x, y, (loss, report)

    return step, (state, tokens, tokens, None)


def float8_mlp(locate: bool, width: int = 512, depth: int = 4, batch: int = 256):
    keys = jax.random.split(jax.random.key(0), depth + 1)
    params = [jax.random.normal(key, (width, width)) / width**0.5 for key in keys[:depth]]
    x = jax.random.normal(keys[-1], (batch, width))

    def forward(params: Any, x: jax.Array) -> jax.Array:
        for w in params:
            x = jax.nn.gelu(x @ w)
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    gradient = jax.grad(jaxscale.autocast(forward, dtype=jnp.bfloat16, float8="rowwise"))

    def step(params: Any, x: jax.Array, last: Any) -> tuple[Any, ...]:
        report = None
        if locate:
            grads, report = jaxscale.locate_nonfinite(gradient)(params, x)
        else:
            grads = gradient(params, x)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), x, report

    return step, (params, x, None)


def memory_bound(locate: bool, size: int = 10_000_000, leaves: int = 50):
    rng = np.random.default_rng(0)
    params = {
        f"p{i}": jnp.asarray(rng.normal(size=size // leaves), jnp.float32) for i in range(leaves)
    }
    data = jax.tree.map(lambda p: p * 0.5, params)
    tx = jaxscale.grad_scaler(optax.adam(1e-3))

    def step(params: Any, opt_state: Any, data: Any, last: Any) -> tuple[Any, ...]:
        def loss(p: Any) -> jax.Array:
            terms = jax.tree.map(lambda a, b: jnp.sum((a - b) ** 2), p, data)
            return jaxscale.scale(0.5 * sum(jax.tree.leaves(terms)), opt_state)

        gradient = jax.grad(loss)
        report = None
        if locate:
            grads, report = jaxscale.locate_nonfinite(gradient)(params)
        else:
            grads = gradient(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, data, report

    return step, (params, tx.init(params), data, None)


# workload -> (step factory, arguments donated)
WORKLOADS = {
    "flagship": (flagship, (0,)),
    "float8 rowwise MLP": (float8_mlp, (0,)),
    "memory-bound 10M/50": (memory_bound, (0, 1)),
}


def compile_seconds(make: Callable[[bool], Any], locate: bool, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        step, state = make(locate)
        start = time.perf_counter()
        jax.jit(step).lower(*state).compile()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(workloads: list[str], repeats: int = 7) -> list[tuple[str, list[Result], float, float]]:
    found = []
    for name in workloads:
        make, donated = WORKLOADS[name]

        def stepper(locate: bool, make: Any = make, donated: Any = donated) -> JaxStepper:
            step, state = make(locate)
            return JaxStepper(jax.jit(step, donate_argnums=donated), state)

        results = measure(
            {"plain": lambda: stepper(False), "locate_nonfinite": lambda: stepper(True)},
            "plain",
            repeats=repeats,
            inner=3,
        )
        plain, located = compile_seconds(make, False), compile_seconds(make, True)
        found.append((name, results, plain, located))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    for name, results, plain, located in run(args.workloads, args.repeats):
        print(f"\n### {name}\n")
        print(table(results))
        print(f"\ncompile: plain {plain:.2f} s, with locate_nonfinite {located:.2f} s "
              f"({located / plain:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
