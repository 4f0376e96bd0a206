"""Skipping a step: keep the state from before it and emit updates that change nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

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


def keep_unless(found_inf: jax.Array, before: Any, after: Any) -> Any:
    """``before`` when ``found_inf`` (the step is skipped), else ``after``, leaf by leaf."""
    return jax.tree.map(lambda old, new: jnp.where(found_inf, old, new), before, after)


def skip_by_select(found_inf: jax.Array, fn: Callable[[T], T], carry: T) -> T:
    """Run ``fn`` and select ``carry`` back where ``found_inf``: pure dataflow, no branch.

    The carry's values are taken before ``fn`` runs: a carry may hold mutable
    containers (Flax NNX's state holds ``Variable`` objects, which ``nnx.merge``
    shares with the objects it builds), and ``fn`` may write its results into them.
    """
    before = jax.tree.map(lambda leaf: leaf, carry)
    return keep_unless(found_inf, before, fn(carry))


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

    * CPU and TPU: :func:`skip_by_loop`. XLA updates the loop's carry in place:
      donated parameters and optimizer state are neither copied nor rewritten, and
      a skipped step does none of ``fn``'s work. (With a select, XLA copies donated
      buffers that ``fn`` reads and the select overwrites.)
    * elsewhere (GPU): :func:`skip_by_select`. Pure dataflow: a loop or conditional
      would copy its predicate to the host and wait for it, a host synchronisation
      every step. XLA may then copy donated buffers that ``fn`` reads, so on GPU a
      skip is cheap but not free of copies.

    Outside ``jit`` ``found_inf`` is a concrete array and a Python branch decides:
    eager execution already waits for every operation, and a loop would compile
    anew on every call (its body captures the call's arrays as constants).
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
    buffer of updates is filled beforehand and, on CPU and TPU, the loop hands its
    updates out in the gradients' own buffer. Otherwise the carry starts from
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
