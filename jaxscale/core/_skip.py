"""Skipping a step: keep the state from before it and emit updates that change nothing."""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale._src.jaxprs import (
    bind_as_call,
    call_jaxpr,
    fresh_variable,
    identity_primitive,
    inlined_equations,
    is_traced,
    is_variable,
    select_equation,
    sharding_only,
    substituted,
)

T = TypeVar("T")

# The predicate of the skip whose update is being traced, for an update that writes a
# value piece by piece (a loop over slices of a state) and applies the skip to each
# piece itself: a select after the whole loop would keep the old value beside the new.
_PREDICATE: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "jaxscale_skip_predicate", default=None
)
# Marks a value its update has already selected against the skip.
_SKIP_APPLIED = identity_primitive("jaxscale_skip_applied")


def skip_predicate() -> jax.Array | None:
    """The predicate (true: skip) of the step whose update is being traced by
    :func:`run_unless` or :func:`update_unless`, or ``None`` outside one. An update that
    keeps the old value of a state it writes where this is true, and passes the result
    through :func:`skip_applied`, is not selected again after it."""
    return _PREDICATE.get()


def skip_applied(value: jax.Array) -> jax.Array:
    """``value``, marked as already selected against :func:`skip_predicate`."""
    return _SKIP_APPLIED.bind(value)


@contextlib.contextmanager
def _skipping(found_inf: jax.Array) -> Iterator[None]:
    token = _PREDICATE.set(found_inf)
    try:
        yield
    finally:
        _PREDICATE.reset(token)


@contextlib.contextmanager
def skip_predicate_as(predicate: jax.Array | None) -> Iterator[None]:
    """Within the block, :func:`skip_predicate` returns ``predicate``: the same
    predicate in another type (retyped for a mesh whose axes an update made automatic
    while it runs), where the step has one."""
    if predicate is None or _PREDICATE.get() is None:
        yield
        return
    with _skipping(predicate):
        yield


def skipped_update(update: jax.Array) -> jax.Array:
    """The update emitted for a skipped step: ``-0.0`` for floats, ``0`` otherwise.

    ``-0.0`` rather than ``+0.0``: ``p + (-0.0) == p`` bitwise for every float
    ``p``, including ``p == -0.0``, so ``optax.apply_updates`` leaves parameters
    exactly as they were.
    """
    return _skipped_value(update.shape, update.dtype)


def _skipped_value(shape: Any, dtype: Any) -> jax.Array:
    fill = -0.0 if jnp.issubdtype(dtype, jnp.floating) else 0
    return lax.full(shape, fill, dtype)


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

    found_inf = jnp.asarray(found_inf, jnp.bool_)
    with _skipping(found_inf):
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*before)
    if len(out_shape) != len(before):
        raise ValueError(
            f"the skipped function must return its carry's structure: {len(before)} "
            f"leaves in, {len(out_shape)} out"
        )
    return jax.tree.unflatten(tree, _run_selecting(found_inf, closed, before, before))


def _run_selecting(
    found_inf: jax.Array, closed: Any, args: list[Any], olds: list[Any]
) -> list[Any]:
    """Run ``closed`` on ``args``, each output selected against its ``olds`` entry (where it
    is computed, or at the end for an output passed through), as one call.

    The program with its selects is written as a jaxpr and bound as a single ``jit``
    equation: evaluating ``closed`` anew, equation by equation, would cost the trace
    of the update a second time, and the trace is most of a step's time to lower.
    """
    found_inf = jnp.asarray(found_inf, jnp.bool_)
    jaxpr = closed.jaxpr
    which = fresh_variable(jax.typeof(found_inf))
    old_atoms, extra_vars, extra_inputs = _values_to_select_back(jaxpr.invars, args, olds)
    renamed: dict[Any, Any] = {}
    equations = inlined_equations(jaxpr, renamed)
    outvars = [substituted(var, renamed) for var in jaxpr.outvars]
    read = {var for eqn in equations for var in eqn.invars if is_variable(var)}
    read_back = [atom in read for atom in old_atoms]
    equations, results = _with_selects(which, equations, outvars, old_atoms, read_back)
    # The update's constants (values it closed over, traced ones among them) become inputs.
    invars = [*jaxpr.constvars, which, *jaxpr.invars, *extra_vars]
    program = call_jaxpr(closed, invars, results, equations)
    inputs = [*closed.consts, found_inf, *args, *extra_inputs]
    return bind_as_call(program, inputs, "skip_unless_finite")


def _values_to_select_back(
    invars: list[Any], args: list[Any], olds: list[Any]
) -> tuple[list[Any], list[Any], list[Any]]:
    """``(atoms, new_vars, new_inputs)``: the atom each output is selected against, and
    the inputs the program needs for them beyond its own.

    An old value that is one of ``args`` is that input's variable; any other (the
    ``-0.0`` of a skipped update, one array for all updates of a shape) becomes an
    input of its own, once.
    """
    by_identity = {id(arg): var for arg, var in zip(args, invars, strict=True)}
    atoms, new_vars, new_inputs = [], [], []
    for old in olds:
        var = by_identity.get(id(old))
        if var is None:
            var = by_identity[id(old)] = fresh_variable(jax.typeof(old))
            new_vars.append(var)
            new_inputs.append(old)
        atoms.append(var)
    return atoms, new_vars, new_inputs


def _with_selects(
    which: Any,
    equations: list[Any],
    outvars: list[Any],
    olds: list[Any],
    read_back: list[bool],
) -> tuple[list[Any], list[Any]]:
    """``equations`` with a select after each equation computing an output, and the
    outputs, each selected against its ``olds`` atom when ``which`` is true.

    Where ``read_back`` is true (an output replacing a value the update also reads,
    as Adam's new moments replace the moments it reads), later equations read the
    selected value, so that what the update computes from a value it returns
    (Adam's step from its new moments) reads what is returned: XLA then updates
    the old value's buffer in place instead of copying it first. An output whose
    old value the update never reads (the ``-0.0`` of a skipped update) is read as
    computed: whatever reads it is itself an output, selected against its own old
    value, so a second select there would only cost XLA one more select to
    compile in every fusion that reads it (the parameters' update inside
    ``nnx.Optimizer``). An output passed through from an input, a literal,
    returned in two places or not read back is selected after the last equation.
    """
    counts = collections.Counter(var for var in outvars if is_variable(var))
    computed = {var for eqn in equations for var in eqn.outvars}
    # (a selected value retyped for its sharding alone is selected too)
    selected_already: set[Any] = set()
    for eqn in equations:
        if eqn.primitive is _SKIP_APPLIED or (
            sharding_only(eqn) and all(var in selected_already for var in eqn.invars)
        ):
            selected_already.update(eqn.outvars)
    in_place = {
        var: old
        for var, old, back in zip(outvars, olds, read_back, strict=True)
        if back
        and is_variable(var)
        and counts[var] == 1
        and var in computed
        and var not in selected_already
    }
    selecting: list[Any] = []
    selected: dict[Any, Any] = {}
    for eqn in equations:
        selecting.append(eqn.replace(invars=[substituted(v, selected) for v in eqn.invars]))
        for var in eqn.outvars:
            if var in in_place:
                selected[var] = fresh_variable(var.aval)
                selecting.append(select_equation(which, [var, in_place[var]], selected[var], eqn))
    results = []
    for var, old in zip(outvars, olds, strict=True):
        if is_variable(var) and var in in_place:
            results.append(selected[var])
        elif is_variable(var) and var in selected_already:
            results.append(var)
        else:
            out = fresh_variable(var.aval)
            selecting.append(select_equation(which, [var, old], out))
            results.append(out)
    return selecting, results


def run_unless(found_inf: jax.Array, fn: Callable[[T], T], carry: T) -> T:
    """``fn(carry)`` when ``found_inf`` is false; ``carry`` itself, untouched, when it is true.

    ``fn`` must return a carry of the same structure, shapes and dtypes. Under
    ``jit`` the skip is :func:`skip_by_select` on every platform: pure dataflow,
    so no predicate is read back to the host (a loop or conditional would do that
    on a GPU every step), and updated in place, so nothing is copied and nothing
    ``fn`` reads has to be materialised before the decision. Outside ``jit``
    ``found_inf`` is a concrete array and a Python branch decides: eager execution
    already waits for every operation.
    """
    if not is_traced(found_inf):
        return carry if bool(found_inf) else fn(carry)
    return skip_by_select(found_inf, fn, carry)


def update_unless(
    found_inf: jax.Array,
    update: Callable[[Any, Any], tuple[Any, Any]],
    grads: Any,
    state: Any,
) -> tuple[Any, Any]:
    """``update(grads, state)`` when ``found_inf`` is false; else ``-0.0`` updates and ``state``.

    ``update`` returns ``(updates, new_state)``, as an Optax ``update`` does, and
    runs through :func:`run_unless` with the updates of a skipped step
    (:func:`skipped_updates_like`) as the starting value of the updates: each
    update is selected against its ``-0.0`` where it is computed, so no buffer of
    ``-0.0`` is ever filled.
    """
    if not is_traced(found_inf):
        if not bool(found_inf):
            return update(grads, state)
        updates_shape, _ = jax.eval_shape(update, grads, state)
        return skipped_updates_like(updates_shape), state
    # Traced once (its jaxpr gives the updates' shapes too), then bound once with its selects.
    before, state_tree = jax.tree.flatten(state)
    trees: list[Any] = []

    def flat_update(*leaves: Any) -> list[Any]:
        updates, new_state = update(grads, jax.tree.unflatten(state_tree, leaves))
        flat_updates, updates_tree = jax.tree.flatten(updates)
        flat_state, new_state_tree = jax.tree.flatten(new_state)
        if new_state_tree != state_tree:  # type: ignore[operator]
            raise ValueError(
                f"the update must return a state of its input's structure: {state_tree} in, "
                f"{new_state_tree} out"
            )
        _require_same_avals(state, before, flat_state)
        trees.append((updates_tree, len(flat_updates)))
        return [*flat_updates, *flat_state]

    found_inf = jnp.asarray(found_inf, jnp.bool_)
    with _skipping(found_inf):
        closed, out_shape = jax.make_jaxpr(flat_update, return_shape=True)(*before)
    updates_tree, count = trees[-1]
    skipped = _skipped_values_shared(out_shape[:count])
    outs = _run_selecting(found_inf, closed, before, [*skipped, *before])
    return jax.tree.unflatten(updates_tree, outs[:count]), jax.tree.unflatten(
        state_tree, outs[count:]
    )


def _require_same_avals(state: Any, before: list[Any], after: list[Any]) -> None:
    """A skipped step selects the old state back, so each new leaf must have its old
    leaf's shape and dtype: an optimizer that widens a leaf (``optax.adam`` on
    bfloat16 parameters whose moments it returns in float32) is named here."""
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state)]
    for path, old, new in zip(paths, before, after, strict=True):
        old_type, new_type = jax.typeof(old), jax.typeof(new)
        if (old_type.shape, old_type.dtype) != (new_type.shape, new_type.dtype):
            was = f"{old_type.dtype}{list(old_type.shape)}"
            now = f"{new_type.dtype}{list(new_type.shape)}"
            raise ValueError(
                f"the optimizer's state leaf {path or '<root>'} is {was} before the update and "
                f"{now} after it; a skipped step keeps the old "
                "state, so an update must return every leaf in its shape and dtype (keep the "
                "state's dtypes fixed, e.g. optax.adam(..., mu_dtype=...), or store the state "
                "with jaxscale.low_precision_state)"
            )


def skipped_updates_like(updates: Any) -> Any:
    """A tree of :func:`skipped_update` values with the structure, shapes and dtypes of ``updates``.

    ``updates`` may hold ``jax.ShapeDtypeStruct`` leaves (from ``jax.eval_shape``).
    """
    return jax.tree.map(lambda u: _skipped_value(u.shape, u.dtype), updates)


def _skipped_values_shared(shapes: list[Any]) -> list[jax.Array]:
    """:func:`skipped_update` values for ``shapes``, one array per shape and dtype.

    Only for values traced into a program: the skip's program then takes one
    ``-0.0`` input per shape instead of one per update. Arrays handed to a user
    must be distinct (donating one buffer twice is an error).
    """
    made: dict[tuple[Any, Any], jax.Array] = {}
    for shape in shapes:
        key = (tuple(shape.shape), jnp.dtype(shape.dtype))
        if key not in made:
            made[key] = _skipped_value(*key)
    return [made[(tuple(s.shape), jnp.dtype(s.dtype))] for s in shapes]
