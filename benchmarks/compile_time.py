"""Trace + compile time of a train step, by number of parameter leaves.

For users who restart, sweep or debug, compile time is step time. Each variant is
the same Adam train step with a different way to scale the loss and skip
non-finite steps (``benchmarks/recipes.py``), on one of two losses:

* ``mlp``: a chain of ``leaves`` 64×64 layers, ``x = tanh(x @ w)``, on a batch of
  8, then the mean square: a model, with a forward and a backward pass;
* ``quadratic``: ``sum((w - 1)**2)`` over ``leaves`` arrays of ``size`` elements,
  so the step is nothing but the optimizer and the check: the hardest case.

The figure is the median over interleaved
repeats of the time from a fresh ``jax.jit`` to a compiled executable (tracing,
lowering and XLA's compilation), split into the time to lower (trace and emit
StableHLO) and the time XLA compiles.
Ratios are to the plain step of the same size; the NNX facade's, and Optax's
``apply_if_finite`` inside ``nnx.Optimizer``, to the same ``nnx.Optimizer`` step
without loss scaling.

With ``--persistent-cache`` every step is compiled once first with JAX's persistent
compilation cache on, and the rounds then time what a restarted process, the next
run of a sweep or another host of the job pays: the trace and lowering, and the
executable loaded from the cache instead of compiled.

    python -m benchmarks.compile_time --leaves 100 500 1000
    python -m benchmarks.compile_time --gpu-target h100 --leaves 100 500  # no GPU needed
    python -m benchmarks.compile_time --leaves 100 --persistent-cache
"""

from __future__ import annotations

import argparse
import atexit
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxscale
from benchmarks import gpu_target, recipes
from benchmarks.harness import machine


def _quadratic_params(leaves: int, size: int) -> dict[str, jax.Array]:
    return {f"w{i:04d}": jnp.full((size,), 0.5 + i / leaves, jnp.float32) for i in range(leaves)}


def _quadratic_loss(params: dict[str, jax.Array]) -> jax.Array:
    return sum(jnp.sum(jnp.square(w - 1.0)) for w in params.values())


_WIDTH = 64
_BATCH = jnp.linspace(-1.0, 1.0, 8 * _WIDTH, dtype=jnp.float32).reshape(8, _WIDTH)


def _mlp_params(leaves: int, size: int) -> dict[str, jax.Array]:
    del size  # the layers are 64×64
    keys = jax.random.split(jax.random.key(0), leaves)
    scale = 1.0 / jnp.sqrt(_WIDTH)
    return {
        f"w{i:04d}": jax.random.normal(keys[i], (_WIDTH, _WIDTH)) * scale for i in range(leaves)
    }


def _mlp_loss(params: dict[str, jax.Array]) -> jax.Array:
    x = _BATCH
    for w in params.values():
        x = jnp.tanh(x @ w)
    return jnp.mean(jnp.square(x))


LOSSES = {"mlp": (_mlp_params, _mlp_loss), "quadratic": (_quadratic_params, _quadratic_loss)}


Build = Callable[[Any, recipes.Loss], tuple[Callable[..., Any], tuple[Any, ...]]]


def _recipe(make: Callable[[Any], recipes.Recipe]) -> Build:
    """A recipe of ``benchmarks/recipes.py`` on the quadratic loss: (step, its arguments)."""

    def build(params: Any, loss: recipes.Loss) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        recipe = make(loss)  # new function objects: nothing cached
        return recipe.step, (params, *recipe.init(params))

    return build


def _nnx(with_scaler: bool, if_finite: bool = False) -> Build:
    """``nnx.Optimizer`` (with ``jaxscale.GradScaler``, or over Optax's
    ``apply_if_finite``): the step as a pure function of the objects' state, as
    ``nnx.jit`` runs it."""

    def build(params: Any, loss: recipes.Loss) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        model = recipes.ParamLeaves(params)
        tx = optax.adam(recipes.LEARNING_RATE)
        if if_finite:
            tx = optax.apply_if_finite(tx, 10)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        objects = (model, optimizer, jaxscale.GradScaler()) if with_scaler else (model, optimizer)
        graphdef, state = nnx.split(objects)
        body = recipes.nnx_step(loss, with_scaler)

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
    "apply_if_finite + nnx.Optimizer": _nnx(with_scaler=False, if_finite=True),
    "Flax DynamicScale": _recipe(recipes.flax_dynamic_scale),
    "jmp": _recipe(recipes.jmp_loss_scale),
}
# Flax's and jmp's recipes take minutes and several GB to compile at 500 leaves.
SLOW = {"Flax DynamicScale", "jmp"}
# Each variant's ratio is to the step it adds loss scaling to.
BASELINES = {
    "GradScaler + nnx.Optimizer": "nnx.Optimizer",
    "apply_if_finite + nnx.Optimizer": "nnx.Optimizer",
}


def time_compile(
    build: Build, params: Any, loss: recipes.Loss, target: Any = None
) -> tuple[float, float]:
    """(seconds to lower, seconds for XLA to compile) of a fresh jit of the step, for
    this machine's default device or for ``target`` (a device of ``gpu_target``)."""
    step, args = build(params, loss)
    # Lowered on the flat list of arrays: jmp's loss scale cannot be rebuilt from the
    # placeholders JAX's lowering puts in a tree's leaves.
    leaves, tree = jax.tree.flatten(args)
    if target is not None:
        leaves = gpu_target.placed_like(leaves, target)

    def flat_step(*leaves: Any) -> Any:
        return step(*jax.tree.unflatten(tree, leaves))

    gc.collect()  # a collection of earlier rounds' garbage would land in this one's time
    start = time.perf_counter()
    lowered = jax.jit(flat_step).lower(*leaves)
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


Timings = tuple[float, float, float, float]


def run(
    leaves: int,
    size: int,
    repeats: int,
    loss: str = "mlp",
    target: Any = None,
    names: list[str] | None = None,
    cached: bool = False,
) -> dict[str, Timings]:
    """Per variant (all, or ``names`` with the steps they are compared with; Flax's and
    jmp's only up to ``recipes.MAX_LEAVES_FOR_SLOW`` leaves): (median total seconds,
    median lower seconds, median compile seconds, median of each round's ratio of the
    total to its baseline's). The order of the variants is reversed every other round,
    so that a drift of the machine's speed within a round favours none. With ``cached``
    (JAX's persistent compilation cache on, see :func:`use_persistent_cache`) each
    step is compiled once before the rounds, which then load it from the cache."""
    make_params, loss_fn = LOSSES[loss]
    params = make_params(leaves, size)
    wanted = set(VARIANTS) if names is None else {*names, "plain", *map(BASELINES.get, names)}
    variants = {
        name: build
        for name, build in VARIANTS.items()
        if name in wanted and (leaves <= recipes.MAX_LEAVES_FOR_SLOW or name not in SLOW)
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for build in variants.values():  # warm-up: imports, JAX's own caches
        time_compile(build, make_params(2, size), loss_fn, target)
        if cached:  # written to the cache here, read in every round
            time_compile(build, params, loss_fn, target)
    for round_ in range(repeats):
        order = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
        for name in order:
            samples[name].append(time_compile(variants[name], params, loss_fn, target))
    totals = {
        name: [lower + compile_ for lower, compile_ in values] for name, values in samples.items()
    }
    return {
        name: (
            statistics.median(totals[name]),
            statistics.median(lower for lower, _ in values),
            statistics.median(compile_ for _, compile_ in values),
            statistics.median(
                t / b
                for t, b in zip(totals[name], totals[BASELINES.get(name, "plain")], strict=True)
            ),
        )
        for name, values in samples.items()
    }


def use_persistent_cache() -> str:
    """Turn on JAX's persistent compilation cache in a new temporary folder, removed
    when the process ends, for every compile however short (by default JAX caches only
    those over a second); its path."""
    folder = tempfile.mkdtemp(prefix="jaxscale-compile-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def table(results: dict[int, dict[str, Timings]], per_round: bool = False) -> str:
    """Ratios of the medians; with ``per_round``, also the median of each round's ratio."""
    names = [name for name in VARIANTS if any(name in by_name for by_name in results.values())]
    lines = [
        "| leaves | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for leaves, by_name in results.items():
        plain = by_name["plain"][0]
        cells = [f"{plain:.2f} s (lower {by_name['plain'][1]:.2f})"]
        for name in names[1:]:
            if name not in by_name:
                cells.append("-")
                continue
            total, lower, _, round_ratio = by_name[name]
            ratio = f"{total / by_name[BASELINES.get(name, 'plain')][0]:.2f}"
            if per_round:
                ratio += f" / {round_ratio:.2f}"
            cells.append(f"{ratio}× (lower {lower:.2f} s)")
        lines.append(f"| {leaves} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--loss", choices=list(LOSSES), default="mlp")
    parser.add_argument("--size", type=int, default=20_000, help="elements per quadratic leaf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), help="only these (and their baselines)"
    )
    parser.add_argument(
        "--per-round", action="store_true", help="also the median of each round's ratio"
    )
    parser.add_argument(
        "--gpu-target",
        choices=list(gpu_target.TARGETS),
        help="compile for this GPU instead of the default device, with no GPU here "
        "(XLA's deviceless compile; needs JAX's CUDA plugin)",
    )
    parser.add_argument(
        "--persistent-cache",
        action="store_true",
        help="time the steps loaded from JAX's persistent compilation cache, as a "
        "restarted process does, instead of compiled",
    )
    args = parser.parse_args(argv)
    if args.persistent_cache:
        use_persistent_cache()
    target = gpu_target.device(args.gpu_target) if args.gpu_target else None
    results = {
        n: run(n, args.size, args.repeats, args.loss, target, args.variants, args.persistent_cache)
        for n in args.leaves
    }
    report = table(results, args.per_round)
    info = machine()
    leaves = "64×64 tanh layers" if args.loss == "mlp" else f"{args.size}-element leaves"
    compiled_for = f", compiled for {args.gpu_target} (no device)" if target else ""
    if args.persistent_cache:
        compiled_for += ", loaded from JAX's persistent compilation cache"
    print(f"{info['cpu']}, JAX {info['jax']}{compiled_for}; {args.loss} loss, {leaves}, "
          f"median of {args.repeats} interleaved repeats")  # fmt: skip
    print(report)
    return report


if __name__ == "__main__":
    main()
