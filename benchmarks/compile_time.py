"""Trace + compile time of a train step, by number of parameter leaves.

For users who restart, sweep or debug, compile time is step time. Each variant is
the same Adam train step (a quadratic loss over ``leaves`` parameter arrays of
``size`` elements) with a different way to scale the loss and skip non-finite
steps (``benchmarks/recipes.py``); the figure is the median over interleaved
repeats of the time from a fresh ``jax.jit`` to a compiled executable (tracing,
lowering and XLA's compilation), split into the time to lower (trace and emit
StableHLO) and the time XLA compiles.
Ratios are to the plain step of the same size; the NNX facade's is to the same
``nnx.Optimizer`` step without loss scaling.

    python -m benchmarks.compile_time --leaves 100 500 1000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxscale
from benchmarks import recipes
from benchmarks.harness import machine


def _params(leaves: int, size: int) -> dict[str, jax.Array]:
    return {f"w{i:04d}": jnp.full((size,), 0.5 + i / leaves, jnp.float32) for i in range(leaves)}


def _loss(params: dict[str, jax.Array]) -> jax.Array:
    return sum(jnp.sum(jnp.square(w - 1.0)) for w in params.values())


Build = Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]


def _recipe(make: Callable[[Any], recipes.Recipe]) -> Build:
    """A recipe of ``benchmarks/recipes.py`` on the quadratic loss: (step, its arguments)."""

    def build(params: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        recipe = make(_loss)  # new function objects: nothing cached
        return recipe.step, (params, *recipe.init(params))

    return build


def _nnx(with_scaler: bool) -> Build:
    """``nnx.Optimizer`` (with ``jaxscale.GradScaler``): the step as a pure function of
    the objects' state, as ``nnx.jit`` runs it."""

    def build(params: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        model = recipes.ParamLeaves(params)
        optimizer = nnx.Optimizer(model, optax.adam(recipes.LEARNING_RATE), wrt=nnx.Param)
        objects = (model, optimizer, jaxscale.GradScaler()) if with_scaler else (model, optimizer)
        graphdef, state = nnx.split(objects)
        body = recipes.nnx_step(_loss, with_scaler)

        def step(state: Any) -> Any:
            live = nnx.merge(graphdef, state)
            body(*live)
            return nnx.state(live)

        return step, (state,)

    return build


VARIANTS: dict[str, Build] = {
    "plain": _recipe(recipes.plain),
    "grad_scaler": _recipe(recipes.grad_scaler),
    "GradScaler triple": _recipe(recipes.facade_triple),
    "optax.apply_if_finite": _recipe(recipes.apply_if_finite),
    "nnx.Optimizer": _nnx(with_scaler=False),
    "GradScaler + nnx.Optimizer": _nnx(with_scaler=True),
}
# Each variant's ratio is to the step it adds loss scaling to.
BASELINES = {"GradScaler + nnx.Optimizer": "nnx.Optimizer"}


def time_compile(build: Build, params: Any) -> tuple[float, float]:
    """(seconds to lower, seconds for XLA to compile) of a fresh jit of the step."""
    step, args = build(params)
    start = time.perf_counter()
    lowered = jax.jit(step).lower(*args)
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


def run(leaves: int, size: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Per variant: (median total seconds, median lower seconds, median compile seconds)."""
    params = _params(leaves, size)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for build in VARIANTS.values():  # warm-up: imports, JAX's own caches
        time_compile(build, _params(2, size))
    for _ in range(repeats):
        for name, build in VARIANTS.items():
            samples[name].append(time_compile(build, params))
    return {
        name: (
            statistics.median(lower + compile_ for lower, compile_ in values),
            statistics.median(lower for lower, _ in values),
            statistics.median(compile_ for _, compile_ in values),
        )
        for name, values in samples.items()
    }


def table(results: dict[int, dict[str, tuple[float, float, float]]]) -> str:
    names = list(VARIANTS)
    lines = [
        "| leaves | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for leaves, by_name in results.items():
        plain = by_name["plain"][0]
        cells = [f"{plain:.2f} s (lower {by_name['plain'][1]:.2f})"]
        for name in names[1:]:
            total, lower, _ = by_name[name]
            baseline = by_name[BASELINES.get(name, "plain")][0]
            cells.append(f"{total / baseline:.2f}× (lower {lower:.2f} s)")
        lines.append(f"| {leaves} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--size", type=int, default=20_000, help="elements per leaf")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = {n: run(n, args.size, args.repeats) for n in args.leaves}
    report = table(results)
    info = machine()
    print(f"{info['cpu']}, JAX {info['jax']}; {args.size}-element leaves, median of "
          f"{args.repeats} interleaved repeats")  # fmt: skip
    print(report)
    return report


if __name__ == "__main__":
    main()
