"""Skipping a step: keep the state from before it and emit updates that change nothing."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex

from jaxscale.core._jaxprs import bind_equation

T = TypeVar("T")


def skipped_update(update: jax.Array) -> jax.Array:
    """The update emitted for a skipped step: ``-0.0`` for floats, ``0`` otherwise.

    ``-0.0`` rather than ``+0.0``: ``p + (-0.0) == p`` bitwise for every float
    ``p``, including ``p == -0.0``, so ``optax.apply_updates`` leaves parameters
    exactly as they were.
    """
    if jnp.issubdtype(update.dtype, jnp.floating):
        return jnp.full_like(update, -0.0)
    return jnp.zeros_like(update)


def mask_updates(found_inf: jax.Array, updates: Any) -> Any:
    """``updates``, or :func:`skipped_update` of each leaf when ``found_inf``."""
    return jax.tree.map(lambda u: jnp.where(found_inf, skipped_update(u), u), updates)


def skip_by_select(found_inf: jax.Array, fn: Callable[[T], T], carry: T) -> T:
    """Run ``fn`` and select ``carry`` back where ``found_inf``: pure dataflow, no branch.

    Every value ``fn`` returns is selected as soon as ``fn`` computes it, and
    ``fn``'s later operations read the selected value: an optimizer that computes
    its new moments and then its update from them reads the moments it returns.
    When the step is not skipped that is the very same value, so the results are
    bitwise those of ``fn``; when it is skipped everything ``fn`` returns is
    ``carry`` anyway. What it buys is a program XLA can update in place: the
    parameters' update reads the moments after they are written, instead of
    recomputing them from the moments the write destroys, which would make XLA
    copy every moment first (see ``benchmarks/RESULTS.md``).

    The carry's values are taken before ``fn`` runs: a carry may hold mutable
    containers (Flax NNX's state holds ``Variable`` objects, which ``nnx.merge``
    shares with the objects it builds).
    """
    before, tree = jax.tree.flatten(carry)

    def flat_fn(*leaves: Any) -> list[Any]:
        return jax.tree.leaves(fn(jax.tree.unflatten(tree, leaves)))

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*before)
    jaxpr = closed.jaxpr
    if len(out_shape) != len(before):
        raise ValueError(
            f"the skipped function must return its carry's structure: {len(before)} "
            f"leaves in, {len(out_shape)} out"
        )
    selected = _outputs_to_select(jaxpr, before)
    after = _evaluate_selecting(jaxpr, closed.consts, before, found_inf, selected)
    outs = [
        new if var in selected else jnp.where(found_inf, old, new)
        for var, old, new in zip(jaxpr.outvars, before, after, strict=True)
    ]
    return jax.tree.unflatten(tree, outs)


def _outputs_to_select(jaxpr: Any, olds: list[Any]) -> dict[Any, Any]:
    """{output variable: the value it is selected against} for outputs computed in ``jaxpr``.

    ``olds`` holds, output by output, the value to select back when skipped, or
    ``None`` for an output not to select. An output that is an input passed
    through, a literal, or returned in several places is left out: the caller
    selects it once the whole ``jaxpr`` has run.
    """
    counts = collections.Counter(var for var in jaxpr.outvars if isinstance(var, jex.Var))
    passed_through = set(jaxpr.invars) | set(jaxpr.constvars)
    return {
        var: old
        for var, old in zip(jaxpr.outvars, olds, strict=True)
        if old is not None
        and isinstance(var, jex.Var)
        and counts[var] == 1
        and var not in passed_through
    }


def _evaluate_selecting(
    jaxpr: Any, consts: Any, args: list[Any], found_inf: jax.Array, selected: dict[Any, Any]
) -> list[Any]:
    """Evaluate ``jaxpr``, replacing each variable of ``selected`` by its select once computed.

    Nested ``jit`` calls are evaluated inline, so that an output computed inside
    one is selected where it is computed.
    """
    env: dict[Any, Any] = {}

    def read(var: Any) -> Any:
        return var.val if isinstance(var, jex.Literal) else env[var]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(var) for var in eqn.invars]
        handled: set[Any] = set()
        if eqn.primitive.name in ("pjit", "jit"):
            inner = eqn.params["jaxpr"]
            olds = [selected.get(var) for var in eqn.outvars]
            inner_selected = _outputs_to_select(inner.jaxpr, olds)
            handled = {
                var
                for inner_var, var in zip(inner.jaxpr.outvars, eqn.outvars, strict=True)
                if inner_var in inner_selected
            }
            outs = _evaluate_selecting(inner.jaxpr, inner.consts, invals, found_inf, inner_selected)
        else:
            outs = bind_equation(eqn, invals)
        for var, value in zip(eqn.outvars, outs, strict=True):
            if var in selected and var not in handled:
                value = jnp.where(found_inf, selected[var], value)
            env[var] = value
    return [read(var) for var in jaxpr.outvars]


def _same_types(before: Any, after: Any) -> bool:
    """Whether two trees of ``jax.ShapeDtypeStruct`` have the same structure and leaf types.

    Weak typing is ignored (a loop promotes it). Everything else counts, including
    what JAX records of a value's sharding and, under ``shard_map``, whether it
    varies across devices.
    """
    before_leaves, before_tree = jax.tree.flatten(before)
    after_leaves, after_tree = jax.tree.flatten(after)
    if before_tree != after_tree:  # type: ignore[operator]
        return False
    return all(
        b.update(weak_type=False) == a.update(weak_type=False)
        for b, a in zip(before_leaves, after_leaves, strict=True)
    )


def skip_by_loop(found_inf: jax.Array, fn: Callable[[T], T], carry: T) -> T:
    """Run ``fn`` inside a ``lax.while_loop`` that runs it zero times or once.

    XLA updates a loop's carry in place. A loop needs ``fn`` to return a carry of
    exactly the carry's types; when it does not (under ``shard_map`` an update
    computed from per-device gradients turns a replicated carry into a per-device
    one), this is decided from the types before any loop is built, and the skip
    is made by :func:`skip_by_select` instead.
    """
    if not _same_types(jax.eval_shape(lambda c: c, carry), jax.eval_shape(fn, carry)):
        return skip_by_select(found_inf, fn, carry)

    def body(state: tuple[jax.Array, T]) -> tuple[jax.Array, T]:
        _, current = state
        return jnp.asarray(False), fn(current)

    initial = (jnp.logical_not(found_inf), carry)
    _, result = lax.while_loop(lambda state: state[0], body, initial)
    return result


def run_unless(found_inf: jax.Array, fn: Callable[[T], T], carry: T) -> T:
    """``fn(carry)`` when ``found_inf`` is false; ``carry`` itself, untouched, when it is true.

    ``fn`` must return a carry of the same structure, shapes and dtypes. How the
    skip is made depends on where it runs, chosen when XLA compiles:

    * CPU and TPU: :func:`skip_by_loop`, a loop that runs ``fn`` zero times or
      once. XLA updates its carry in place and compiles it quickly whatever the
      number of leaves. (On XLA's CPU backend a select whose predicate is reduced
      from every gradient takes time quadratic in the number of leaves to
      compile: 81 s at 200 leaves against 3.5 s for the loop.)
    * elsewhere (GPU): :func:`skip_by_select`. Pure dataflow, updated in place:
      the values ``fn`` returns are selected as soon as they are computed, so the
      parameters' update reads the moments already written, XLA needs no copies,
      and nothing ``fn`` reads has to be materialised first. A loop or
      conditional would copy its predicate to the host, a synchronisation every
      step.

    Outside ``jit`` ``found_inf`` is a concrete array and a Python branch decides:
    eager execution already waits for every operation.
    """
    if not isinstance(found_inf, jax.core.Tracer):
        return carry if bool(found_inf) else fn(carry)

    def loop(found_inf: jax.Array, carry: T) -> T:
        return skip_by_loop(found_inf, fn, carry)

    def select(found_inf: jax.Array, carry: T) -> T:
        return skip_by_select(found_inf, fn, carry)

    return lax.platform_dependent(found_inf, carry, cpu=loop, tpu=loop, default=select)


def update_unless(
    found_inf: jax.Array,
    update: Callable[[Any, Any], tuple[Any, Any]],
    grads: Any,
    state: Any,
) -> tuple[Any, Any]:
    """``update(grads, state)`` when ``found_inf`` is false; else ``-0.0`` updates and ``state``.

    ``update`` returns ``(updates, new_state)``, as an Optax ``update`` does, and
    runs through :func:`run_unless`. A skipped step returns :func:`skipped_update`
    of every update and ``state`` untouched.

    When the updates have the gradients' structure, shapes and dtypes (as for
    every optimizer that maps gradients to updates leaf by leaf), the gradients
    travel through the skip in the updates' place: the update reads them from its
    carry and writes the updates over them, and the ``-0.0`` of a skipped step is
    selected afterwards, where it fuses into whatever consumes the updates. So no
    buffer of updates is filled beforehand and, in a loop (CPU, TPU), the updates
    leave it in the gradients' own buffer. Otherwise the carry starts from
    ``-0.0`` updates.
    """
    updates_shape, _ = jax.eval_shape(update, grads, state)
    if _same_types(jax.eval_shape(lambda g: g, grads), updates_shape):

        def update_in_place(carry: tuple[Any, Any]) -> tuple[Any, Any]:
            return update(*carry)

        updates, state = run_unless(found_inf, update_in_place, (grads, state))
        return mask_updates(found_inf, updates), state

    def update_from_zero(carry: tuple[Any, Any]) -> tuple[Any, Any]:
        return update(grads, carry[1])

    return run_unless(found_inf, update_from_zero, (skipped_updates_like(updates_shape), state))


def skipped_updates_like(updates: Any) -> Any:
    """A tree of :func:`skipped_update` values with the structure, shapes and dtypes of ``updates``.

    ``updates`` may hold ``jax.ShapeDtypeStruct`` leaves (from ``jax.eval_shape``).
    """
    return jax.tree.map(lambda u: skipped_update(jnp.zeros(u.shape, u.dtype)), updates)
