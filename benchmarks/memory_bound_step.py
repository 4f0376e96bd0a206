"""A memory-bound train step: the gradient is computed in the same jit and is cheap.

Adam on float32 parameters, donated; the gradient of ``0.5 * sum((p - d) ** 2)`` is
``p - d``, computed inside the jitted step, so without loss scaling XLA fuses it into
Adam's pass and never materialises it. A scaler that decides before it updates must
see every gradient first. Variants, each a ratio to plain Adam in the same process:

* ``grad_scaler(adam)`` and the ``GradScaler`` facade driving the same Optax triple,
  with the skip as jaxscale makes it on this platform (a loop on CPU);
* the same two with the skip forced to a select (what jaxscale does on GPU), to see
  which boundary XLA fuses better when the gradient is produced in the step;
* ``optax.apply_if_finite(adam)``.

    python -m benchmarks.memory_bound_step --layouts 10M/50 10M/500 100M/50
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxscale
from benchmarks.harness import JaxStepper, Result, measure, table
from benchmarks.optimizer_step import fresh, tree
from jaxscale.core import _skip

LEARNING_RATE = 1e-3


@contextlib.contextmanager
def select_skip() -> Iterator[None]:
    """Trace with every skip made by a select, as on GPU."""
    original = _skip.run_unless

    def select(found_inf: jax.Array, fn: Callable[[Any], Any], carry: Any) -> Any:
        if not isinstance(found_inf, jax.core.Tracer):
            return original(found_inf, fn, carry)
        return _skip.skip_by_select(found_inf, fn, carry)

    targets = [_skip, *_users_of_run_unless()]
    for module in targets:
        module.run_unless = select
    try:
        yield
    finally:
        for module in targets:
            module.run_unless = original


def _users_of_run_unless() -> list[Any]:
    from jaxscale.facade import _optimizers
    from jaxscale.transform import _grad_scaler

    return [_optimizers, _grad_scaler]


def loss(params: dict[str, jax.Array], data: dict[str, jax.Array]) -> jax.Array:
    pairs = zip(params.values(), data.values(), strict=True)
    return sum(0.5 * jnp.sum((p - d) ** 2) for p, d in pairs)


def optax_variant(kind: str) -> Callable[..., JaxStepper]:
    def make(params: dict[str, jax.Array], data: dict[str, jax.Array]) -> JaxStepper:
        inner = optax.adam(LEARNING_RATE)
        tx = {
            "adam": inner,
            "grad_scaler": jaxscale.grad_scaler(inner),
            "apply_if_finite": optax.apply_if_finite(inner, 10),
        }[kind]

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, data):
            if kind == "grad_scaler":
                grads = jax.grad(lambda p: jaxscale.scale(loss(p, data), opt_state))(params)
            else:
                grads = jax.grad(loss)(params, data)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        p = fresh(params)
        return JaxStepper(step, (p, tx.init(p)), (data,))

    return make


def facade_triple(params: dict[str, jax.Array], data: dict[str, jax.Array]) -> JaxStepper:
    tx = optax.adam(LEARNING_RATE)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, scaler, data):
        grads = jax.grad(lambda p: scaler.scale(loss(p, data)))(params)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    p = fresh(params)
    return JaxStepper(step, (p, tx.init(p), jaxscale.GradScaler()), (data,))


def with_select(make: Callable[..., JaxStepper]) -> Callable[..., JaxStepper]:
    def build(params: dict[str, jax.Array], data: dict[str, jax.Array]) -> JaxStepper:
        stepper = make(params, data)
        with select_skip():  # the step is traced (compiled) here, in the warm-up call
            stepper.step()
            stepper.block()
        return stepper

    return build


VARIANTS = {
    "optax.adam (baseline)": optax_variant("adam"),
    "jaxscale.grad_scaler(adam)": optax_variant("grad_scaler"),
    "jaxscale.GradScaler, optax triple": facade_triple,
    "grad_scaler(adam), skip by select": with_select(optax_variant("grad_scaler")),
    "GradScaler triple, skip by select": with_select(facade_triple),
    "optax.apply_if_finite(adam)": optax_variant("apply_if_finite"),
}


def main(argv: list[str] | None = None) -> dict[str, list[Result]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["10M/50"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    results = {}
    for layout in args.layouts:
        count, leaves = layout.split("/")
        n_params = int(float(count.rstrip("M")) * 1e6)
        params = tree(n_params, int(leaves), seed=0)
        data = tree(n_params, int(leaves), seed=1)
        factories = {name: functools.partial(make, params, data) for name, make in VARIANTS.items()}
        results[layout] = measure(factories, "optax.adam (baseline)", repeats=args.repeats)
        print(f"\n### memory-bound step, {layout}\n\n{table(results[layout])}", flush=True)
    return results


if __name__ == "__main__":
    main()
