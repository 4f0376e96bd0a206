"""An optimizer step whose state is stored narrow, computed a slice of each leaf at a time.

A transform that stores its wrapped optimizer's state in bfloat16, float8 or 8 or 4
bits widens it to float32 for the update and narrows the new state after. Done on
whole arrays, XLA keeps the widened state, old and new, as temporaries: on the CPU
a compiled 8-bit Adam step held 16 bytes per parameter beyond its arguments, where
float32 Adam's holds none. This module computes the same arithmetic so that its
temporaries stay a small constant:

* The update is read once as an :class:`~jaxscale._src.elementwise.ElementwiseProgram`.
  Scalars (counts, schedules, norms) are computed on whole arrays; every parameter's
  arrays (its gradient, its state, its step) form a component.
* A component that writes a narrowed state runs in a loop over slices of its rows
  (strided, so that every slice spans every device's shard of a leaf sharded along
  its leading axis and the loop moves nothing between devices): each iteration reads
  the slice of the stored state, widens it, computes the new state, narrows it and
  writes it back into its own buffers. Where the gradient is a value the step
  computed (a training step's), the loop writes each slice of the update into the
  gradient's buffer too, so that nothing reads the old state after it; where the
  gradient was passed in (an argument XLA would copy to write into), the update is
  computed on whole arrays, outside the loop, where XLA fuses it into the addition
  that applies it, and XLA keeps a copy of the old narrow state for it. The loop's
  trip count is fixed when the program is traced, so it reads nothing back from the
  device (XLA's GPU runtime runs a loop of known trip count without reading its
  predicate).
* A conditional on a scalar (``optax.MultiSteps``, ``optax.apply_if_finite``) is read
  as both branches computed and the one taken selected; a row of a slice the step
  leaves as it was keeps its stored codes and scales, which quantizing its values
  again need not give back.
* A program that is not elementwise (a matrix preconditioner, a factored moment) is
  computed on whole arrays, as before.

The arithmetic is the same operations on the same values, so the results equal the
whole-array computation's (up to XLA rounding one float32 operation differently in
another fusion, which the tests bound).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.cpu_backend import slices_bfloat16_in_place
from jaxscale._src.deferred import elementwise_origin
from jaxscale._src.elementwise import ElementwiseProgram
from jaxscale._src.explicit_axes import (
    explicit_spec,
    first_explicitly_sharded,
    on_automatic_axes,
)
from jaxscale._src.jaxprs import is_staged_argument
from jaxscale.core import skip_applied, skip_predicate, skip_predicate_as
from jaxscale.optim._blockwise import (
    BlockFormat,
    BlockLayout,
    block_layout,
    by_leading_axes,
    codes_row_shape,
    dequantize_rows,
    quantize_rows,
    row_shape,
    row_view,
    rows_of,
)
from jaxscale.optim._handed_down import claim

# Elements of one leaf processed per loop iteration: small on a CPU, whose temporaries
# are what a host's memory holds; large elsewhere, where a loop iteration is a kernel
# launch and most leaves fit in one.
CPU_SLICE = 1 << 16
ACCELERATOR_SLICE = 1 << 22
# A block-quantized leaf of at least this many elements runs as a loop of two or more
# iterations on an accelerator, even where it fits one slice. A loop is a unit XLA
# schedules whole; computed whole, the leaves' blocks' maxima are independent of one
# another's quantizations, and XLA's GPU backend computed many leaves' maxima before
# their quantizations, holding their float32 values together (GPT-2 small's layout
# with 8-bit state, compiled for an H100: 1.90 bytes per parameter of temporaries;
# in loops, 0.09).
LOOPED_FROM = 1 << 16


@dataclasses.dataclass(frozen=True)
class Slot:
    """How one leaf of a state is kept between steps.

    ``kind`` is ``"as is"`` (the optimizer's own array), ``"cast"`` (stored in
    ``dtype``, computed in float32) or ``"blocks"`` (codes and scales of ``fmt`` laid
    out as ``layout``, with the ``signed`` map).
    """

    kind: str
    dtype: Any = None
    fmt: BlockFormat | None = None
    layout: BlockLayout | None = None
    signed: bool = True

    def arrays(self, stored: Any) -> tuple[Any, ...]:
        """The arrays a stored leaf is kept in: itself, or its codes and scales."""
        if self.kind != "blocks":
            return (stored,)
        codes, scale = stored
        return (codes, scale)

    def stored(self, arrays: Sequence[Any], like: Any) -> Any:
        """The stored leaf from :meth:`arrays`, of ``like``'s type."""
        if self.kind != "blocks":
            return arrays[0]
        codes, scale = arrays
        return type(like)(codes, scale)

    @property
    def blocks(self) -> tuple[BlockLayout, BlockFormat]:
        """The layout and format of a ``"blocks"`` slot."""
        if self.layout is None or self.fmt is None:
            raise ValueError(f"a {self.kind!r} slot has no blocks")
        return self.layout, self.fmt

    def widened(self, stored: Any) -> Any:
        """The whole leaf, as the optimizer computes with it."""
        if self.kind == "as is":
            return stored
        if self.kind == "cast":
            return stored.astype(jnp.float32)
        layout, _ = self.blocks
        view = row_view(layout)
        rows = self.read_rows(
            [a.reshape(*view, *shape) for a, shape in zip(stored, self.row_shapes(()), strict=True)]
        )
        return rows.reshape(layout.shape)

    def row_shapes(self, row: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shape a row of each of :meth:`arrays` is read as, in a loop whose rows of
        values have shape ``row``: that, or the codes' and the scales' (one per block)
        of this slot's own rows."""
        if self.kind != "blocks":
            return (row,)
        own, fmt = self.blocks
        return codes_row_shape(own, fmt), (own.blocks_per_row,)

    def narrowed(self, wide: Any, like: Any) -> Any:
        """The whole leaf stored, of ``like``'s type."""
        if self.kind == "as is":
            return wide
        if self.kind == "cast":
            return wide.astype(self.dtype)
        layout, _ = self.blocks
        codes, scale = self.write_rows(rows_of(wide.astype(jnp.float32), layout))
        return self.stored((codes.reshape(like[0].shape), scale.reshape(like[1].shape)), like)

    def read_rows(self, rows: Sequence[Any]) -> Any:
        """Stored rows widened to float32 rows."""
        if self.kind == "as is":
            return rows[0]
        if self.kind == "cast":
            return rows[0].astype(jnp.float32)
        return dequantize_rows(rows[0], rows[1], *self.blocks, self.signed)

    def write_rows(self, rows: Any) -> tuple[Any, ...]:
        """float32 rows narrowed to stored rows."""
        if self.kind == "as is":
            return (rows,)
        if self.kind == "cast":
            return (rows.astype(self.dtype),)
        return quantize_rows(rows, *self.blocks, self.signed)


AS_IS = Slot("as is")


def slice_sizes() -> dict[str, int]:
    """Elements per loop iteration by platform, as ``lax.platform_dependent`` names them
    (read when a step is traced, so that a test can make the slices small)."""
    return {"cpu": CPU_SLICE, "default": ACCELERATOR_SLICE}


def trip_count(rows: int, row_length: int, elements: int, least: int = 1) -> int:
    """How many iterations divide ``rows`` into slices of at most ``elements`` elements
    (one row per iteration where a row is longer), and at least ``least`` where a count
    up to four times that divides ``rows``. Among the counts that do, the one with the
    fewest factors of two, then the smallest: an iteration takes every ``count``-th
    row, so a leaf sharded along its leading axis over a power-of-two number of devices
    keeps whole slices on each device while the rows left per iteration stay divisible
    by the device count."""
    fitting = [
        count
        for count in range(1, rows + 1)
        if rows % count == 0 and (rows // count) * row_length <= elements
    ]
    if not fitting:
        return rows
    if fitting[0] < least:
        fitting = [count for count in fitting if least <= count <= 4 * least] or fitting
    smallest = fitting[0]
    # the same slice size within a factor of four: prefer the odd part
    candidates = [count for count in fitting if count <= 4 * smallest]
    return min(candidates, key=lambda count: (_twos(count), count))


def _twos(count: int) -> int:
    return (count & -count).bit_length() - 1


def element_rows(shape: tuple[int, ...]) -> BlockLayout:
    """The rows a loop reads a state kept element by element in (bfloat16): the rows of
    the last axis, where the tensor has two axes or more and a row fits a slice (the
    layout holds no blocks, so a tensor sharded along any axis keeps its shards in
    place); else runs of 256 elements, or rows of the leading axes that hold them."""
    if len(shape) >= 2 and 1 <= shape[-1] <= CPU_SLICE:
        rows = block_layout(shape, shape[-1])
    else:
        whole = block_layout(shape, 256, partial_blocks=True)
        assert whole is not None
        rows = by_leading_axes(whole, CPU_SLICE)
    assert rows is not None
    return rows


def update_in_place(
    update: Callable[..., tuple[Any, Any]],
    updates: Any,
    stored: Any,
    slots: Any,
    rest: tuple[Any, ...],
) -> tuple[Any, Any]:
    """``update(updates, widened_state, *rest)`` with the state stored as ``slots`` say.

    ``stored`` is the state as kept (a tree whose leaves are arrays or stored leaves),
    ``slots`` a tree of :class:`Slot` of the same structure. Returns ``(new_updates,
    new_stored)``, the new state stored as the old one is.

    A parameter writer's step handed down (:mod:`jaxscale.optim._handed_down`) is
    computed with the update, its own state carried beside this one; the updates
    returned are then computed on whole arrays, for a writer that cannot use what the
    step wrote (XLA drops them where it can).
    """
    if first_explicitly_sharded(updates, stored, rest) is not None:
        return _on_automatic_axes(update, updates, stored, slots, rest)
    step = claim()
    if step is None:
        return _update_in_place(update, updates, stored, slots, rest)
    finish = step.finish

    def finished(updates: Any, wide: tuple[Any, Any], *rest: Any) -> tuple[Any, Any]:
        wide_state, beside = wide
        new_updates, new_state = update(updates, wide_state, *rest)
        written, new_beside = finish(new_updates, beside)
        return written, (new_state, new_beside)

    beside_slots = jax.tree.map(lambda _: AS_IS, step.beside)
    written, (new_stored, new_beside) = _update_in_place(
        finished, updates, (stored, step.beside), (slots, beside_slots), rest
    )
    plain_updates, _ = update(updates, _widened_state(stored, slots), *rest)
    step.updates = jax.tree.leaves(plain_updates)
    step.written, step.new_beside = written, new_beside
    return plain_updates, new_stored


def _on_automatic_axes(update: Callable[..., tuple[Any, Any]], *arguments: Any) -> tuple[Any, Any]:
    """:func:`update_in_place` for arrays sharded along explicit mesh axes: computed with
    the axes made automatic (:func:`on_automatic_axes`), whose type rules the loop's
    reshapes and slices need not follow. The new state is sharded as the old one, each
    update as its gradient (an update shaped otherwise, replicated); what a parameter
    writer's step handed down records is retyped as the results are."""
    updates, stored, slots, rest = arguments
    step = claim()
    if step is not None:
        step.claimed = False  # (claimed again inside, where the loop runs)

    def computed(updates: Any, stored: Any, rest: tuple[Any, ...], beside: Any) -> Any:
        if step is not None:
            step.beside = beside  # (the writer's own state, retyped as the arguments)
        new_updates, new_stored = update_in_place(update, updates, stored, slots, rest)
        if step is None or step.updates is None:
            return new_updates, new_stored, None
        return new_updates, new_stored, (step.written, step.new_beside)

    def specs(results: Any) -> Any:
        new_updates, _, handed = results
        state_specs = _specs_of(stored)
        if handed is None:
            return _specs_like(new_updates, updates, *rest), state_specs, None
        written, _ = handed
        handed_specs = (_specs_like(written, updates, *rest), _specs_of(beside))
        return _specs_like(new_updates, updates, *rest), state_specs, handed_specs

    def within(retyped: Callable[[Any], Any]) -> list[Any]:
        # a loss scaler's skip predicate, which the loop reads for each slice
        return [skip_predicate_as(retyped(skip_predicate()))]

    beside = None if step is None else step.beside
    new_updates, new_stored, handed = on_automatic_axes(
        computed, (updates, stored, rest, beside), specs, within
    )
    if step is not None and handed is not None:
        step.updates = jax.tree.leaves(new_updates)
        step.written, step.new_beside = handed
    return new_updates, new_stored


def _specs_of(tree: Any) -> Any:
    """``tree`` with each array replaced by its explicit partition spec (``None`` where
    it is replicated)."""
    leaves, structure = jax.tree.flatten(tree)
    return jax.tree.unflatten(structure, [explicit_spec(leaf) for leaf in leaves])


def _specs_like(results: Any, *candidates: Any) -> Any:
    """:func:`_specs_of` the first of ``candidates`` (the gradients, the parameters) whose
    structure and shapes the results have (updates, what a writer wrote: an update of
    ``optax.lookahead`` is shaped as its parameters); ``None`` (replicated) for each
    leaf of results shaped as none of them."""
    leaves, structure = jax.tree.flatten(results)
    shapes = [np.shape(leaf) for leaf in leaves]
    for candidate in candidates:
        candidate_leaves, candidate_structure = jax.tree.flatten(candidate)
        same = cast(Any, structure) == candidate_structure
        if same and shapes == [np.shape(leaf) for leaf in candidate_leaves]:
            return jax.tree.unflatten(structure, [explicit_spec(x) for x in candidate_leaves])
    return jax.tree.unflatten(structure, [None] * len(leaves))


def _widened_state(stored: Any, slots: Any) -> Any:
    """The stored state, every leaf widened as its slot says."""
    _, state_tree, _, wide_list = _flat_state(stored, slots)
    return jax.tree.unflatten(state_tree, wide_list)


def _flat_state(stored: Any, slots: Any) -> tuple[list[Slot], Any, list[Any], list[Any]]:
    """``(slots, tree, stored leaves, widened leaves)``: the state flattened to its slots'
    tree (a stored leaf may be a tree of its own arrays)."""
    is_stored = lambda node: isinstance(node, Slot)  # noqa: E731
    slot_list, state_tree = jax.tree.flatten(slots, is_leaf=is_stored)
    state_tree = cast(Any, state_tree)  # flatten_up_to: a PyTreeDef method typeshed lacks
    stored_list = state_tree.flatten_up_to(stored)
    wide_list = [slot.widened(leaf) for slot, leaf in zip(slot_list, stored_list, strict=True)]
    return slot_list, state_tree, stored_list, wide_list


def _update_in_place(update: Any, *arguments: Any) -> tuple[Any, Any]:
    """:func:`update_in_place`, without a step handed down."""
    updates, stored, slots, rest = arguments
    slot_list, state_tree, stored_list, wide_list = _flat_state(stored, slots)
    wide_state = jax.tree.unflatten(state_tree, wide_list)
    arguments = (updates, wide_state, *rest)
    flat, arguments_tree = jax.tree.flatten(arguments)
    update_trees: list[Any] = []

    def traced(*leaves: Any) -> list[Any]:
        new_updates, new_state = update(*jax.tree.unflatten(arguments_tree, leaves))
        flat_updates, update_tree = jax.tree.flatten(new_updates)
        update_trees.append(update_tree)
        return [*flat_updates, *state_tree.flatten_up_to(new_state)]

    program = ElementwiseProgram.read(traced, *flat)
    if program is not None and not _same_layout(program, wide_list, update_trees[-1].num_leaves):
        program = None  # a state that changes shape is named by the caller's check
    if program is None:  # computed on whole arrays
        new_updates, new_state = update(*arguments)
        new_list = state_tree.flatten_up_to(new_state)
        leaves = zip(slot_list, new_list, wide_list, stored_list, strict=True)
        narrowed = [_narrowed_unless_unchanged(*leaf) for leaf in leaves]
        return new_updates, jax.tree.unflatten(state_tree, narrowed)

    update_tree = update_trees[-1]
    count = update_tree.num_leaves
    outputs, values = program.evaluate(flat)
    new_updates_list = outputs[:count]
    new_list = outputs[count:]
    # the flat argument index of each leaf of the state and of the gradients
    grads_count = len(jax.tree.leaves(updates))
    state_inputs = range(grads_count, grads_count + len(wide_list))
    narrowed_list: list[Any] = [None] * len(slot_list)
    # a leaf the update returns as it took it is kept as stored, not quantized again
    for index in range(len(slot_list)):
        if program.outvars[count + index] is program.invars[state_inputs[index]]:
            narrowed_list[index] = stored_list[index]
    kept = {index for index, leaf in enumerate(narrowed_list) if leaf is not None}
    # a scalar the last loop computed, for which the next loop's first slices wait
    previous = jnp.float32(0)
    for component, members in _components(program, slot_list, count, kept).items():
        results, previous = _run_component(
            program, component, members, slot_list, stored_list, flat, values,
            state_inputs, count, previous, new_updates_list,
        )  # fmt: skip
        for index, value in results.items():
            if index < count:
                new_updates_list[index] = value
            else:
                narrowed_list[index - count] = value
    for index, (slot, wide, like) in enumerate(zip(slot_list, new_list, stored_list, strict=True)):
        if narrowed_list[index] is None:
            narrowed_list[index] = slot.narrowed(wide, like)
    return (
        jax.tree.unflatten(update_tree, new_updates_list),
        jax.tree.unflatten(state_tree, narrowed_list),
    )


def _narrowed_unless_unchanged(slot: Slot, new: Any, old: Any, stored: Any) -> Any:
    """``new`` stored as ``slot`` says, but for the rows of blocks the update left as they
    were, which keep their stored codes and scales: a block format's codes and scales
    quantized again from their own values are not always the same (a block's largest
    value may not be on the map's ends), so an update that changes nothing
    (``optax.MultiSteps`` between its applied steps) would move the state each time."""
    narrowed = slot.narrowed(new, stored)
    if slot.kind != "blocks":
        return narrowed  # a cast back and forth is exact
    layout, _ = slot.blocks
    view = row_view(layout)
    unchanged = unchanged_rows(rows_of(new, layout), rows_of(old, layout), len(view))

    def chosen(kept: Any, made: Any, row: tuple[int, ...]) -> Any:
        rows = where_rows(unchanged, kept.reshape(*view, *row), made.reshape(*view, *row))
        return rows.reshape(kept.shape)

    arrays = zip(slot.arrays(stored), slot.arrays(narrowed), slot.row_shapes(()), strict=True)
    return slot.stored([chosen(*each) for each in arrays], stored)


def unchanged_rows(new: Any, old: Any, leading: int) -> Any:
    """Whether each row of ``new`` (its axes after the ``leading`` ones) holds ``old``'s
    values (NaN where NaN), of the leading axes' shape. Decided row by row: a row's
    blocks lie on one device under a sharding of the leading axes, so the decision needs
    no collective."""
    same = (new == old) | (jnp.isnan(new) & jnp.isnan(old))
    return jnp.all(same, axis=tuple(range(leading, same.ndim)))


def where_rows(rows: Any, kept: Any, made: Any) -> Any:
    """``kept``'s rows where ``rows`` (a boolean of the leading axes) holds, else
    ``made``'s."""
    return jnp.where(lax.expand_dims(rows, tuple(range(rows.ndim, kept.ndim))), kept, made)


def _components(
    program: ElementwiseProgram, slots: list[Slot], count: int, kept: set[int]
) -> dict[int, list[int]]:
    """For each component whose new state is stored narrow, the state leaves it writes
    (indices into the flat state), but those ``kept`` as they are."""
    found: dict[int, list[int]] = {}
    for index, slot in enumerate(slots):
        component = program.component_of(program.outvars[count + index])
        if component is not None and slot.kind != "as is" and index not in kept:
            found.setdefault(component, []).append(index)
    return found


def _run_component(
    program: ElementwiseProgram,
    component: int,
    narrowed: list[int],
    slots: list[Slot],
    stored: list[Any],
    flat: list[Any],
    values: dict[Any, Any],
    state_inputs: range,
    count: int,
    previous: Any,
    whole_updates: list[Any],
) -> tuple[dict[int, Any], Any]:
    """One component's new state computed in place, slice by slice: each stored leaf, by
    flat output index (the updates' count first), and the scalar its loop returned
    (``previous`` when none ran), for which the next component's loop waits. Its
    updates are computed on whole arrays (``whole_updates``, by flat output index) where
    they cannot be written into their gradients' buffers."""
    outvars = program.outvars
    state_outputs = [
        i
        for i in range(len(slots))
        if program.component_of(outvars[count + i]) == component
        and program.invars[state_inputs[i]] in program.array_inputs(component)
    ]
    state_outputs = sorted(set(state_outputs) | set(narrowed))
    shape = tuple(outvars[count + narrowed[0]].aval.shape)
    layout = next(
        (slots[i].layout for i in narrowed if slots[i].layout is not None),
        None,
    ) or element_rows(shape)
    # what the loop carries: each state leaf's stored arrays
    inputs = program.array_inputs(component)
    carried: list[tuple[Slot, list[Any]]] = [
        (slots[i], [*slots[i].arrays(stored[i])]) for i in state_outputs
    ]
    sources: dict[Any, int] = {}
    for position, i in enumerate(state_outputs):
        var = program.invars[state_inputs[i]]
        if var in inputs:
            sources[var] = position
    # an input that is a carried array itself (the masters a writer keeps, passed to
    # its optimizer as the parameters too) is read from the carried slice, so that
    # nothing else holds the old array while the loop writes over it
    for v in inputs:
        if v in sources or v in program.constants:
            continue
        value = flat[program.invars.index(v)]
        for position, (slot, arrays) in enumerate(carried):
            if slot.kind == "as is" and arrays[0] is value:
                sources[v] = position
    others = [v for v in inputs if v not in sources]
    # An input a wrapping transform computed elementwise (a loss scaler's unscaled
    # gradient, a float32 cast) is sliced from its source and recomputed per slice, so
    # that it is not written out whole for the loop to read.
    other_values: list[Any] = []
    other_functions: list[Callable[[Any], Any] | None] = []
    for v in others:
        value = values[v] if v in program.constants else flat[program.invars.index(v)]
        origin = None if v in program.constants else elementwise_origin(value)
        other_values.append(value if origin is None else origin[0])
        other_functions.append(None if origin is None else origin[1])
    wanted = [outvars[count + i] for i in state_outputs]
    # A block format needs a loop: its scales are maxima over blocks, which XLA computes
    # from a widened copy of whatever it reduces. A state stored element by element
    # (bfloat16) is read and written in one elementwise pass, which XLA fuses and writes
    # in place, but for the update computed from it, which reads the old state after the
    # new one is written: XLA keeps a copy of the old state for it. A loop that writes
    # each slice of the update into the buffer of its gradient (where the shapes and
    # dtypes allow, as in a training step) reads nothing old after it, so it needs no
    # copy; it runs where the platform slices bfloat16 in place (not XLA's CPU backend
    # before jaxlib 0.11.2, whose loop over bfloat16 is far slower than the copy).
    blocks = any(slots[i].kind == "blocks" for i in narrowed)
    # The floating widths a platform's loop slices as unsigned integers: XLA's CPU
    # backend widens a whole float8 array to slice it (and a bfloat16 one before jaxlib
    # 0.11.2); an accelerator slices both as they are, where a view of an argument as
    # integers would be a copy of it.
    viewed = {"cpu": (8,) if slices_bfloat16_in_place() else (8, 16), "default": ()}
    carriers = _gradient_carriers(
        program, component, count, shape, others, other_values, other_functions
    )
    # An update narrower than the old state it would keep alive, computed outside, is
    # written by the loop into a buffer of its own instead (a bfloat16 parameter
    # stochastic rounding writes, where the gradients were passed to the step: 2 bytes
    # where the copy of two bfloat16 moments is 4)
    kept_bytes = sum(np.dtype(a.dtype).itemsize for _, arrays in carried for a in arrays[:1])
    for k in range(count):
        var = outvars[k]
        if k in carriers or not _in(program, k, component) or tuple(var.aval.shape) != shape:
            continue
        if np.dtype(var.aval.dtype).itemsize < kept_bytes:
            carriers[k] = (None, (None, jnp.zeros(shape, var.aval.dtype), None))
    if not blocks and len(carriers) < sum(1 for k in range(count) if _in(program, k, component)):
        carriers = {}  # an update computed outside keeps the old state alive anyway
    looped = blocks and layout.rows * layout.row_length >= LOOPED_FROM
    layers, rows_per_layer = row_view(layout)
    plans = {
        platform: _Plan(
            iterations=trip_count(
                rows_per_layer,
                layout.row_length * layers,
                elements,
                least=2 if looped and platform != "cpu" else 1,
            )
            if blocks or (carriers and 16 not in viewed[platform])
            else 1,
            carried_updates=blocks or bool(carriers and 16 not in viewed[platform]),
            viewed_as_bits=viewed[platform],
        )
        for platform, elements in slice_sizes().items()
    }
    update_indices = list(carriers)

    def run(plan: _Plan) -> tuple[list[list[Any]], list[Any], Any]:
        taken = (
            {position for position, _ in carriers.values() if position is not None}
            if plan.carried_updates
            else set()
        )
        kept_others, kept_values, kept_functions = (
            [x for position, x in enumerate(inputs) if position not in taken]
            for inputs in (others, other_values, other_functions)
        )
        carried_indices = update_indices if plan.carried_updates else []
        state_arrays, update_arrays, done = _loop(
            program, component, wanted, carried, sources, kept_others, kept_values,
            kept_functions, values, (layers, rows_per_layer), row_shape(layout), plan.iterations,
            [outvars[k] for k in carried_indices], [carriers[k][1] for k in carried_indices],
            previous, plan.viewed_as_bits,
        )  # fmt: skip
        if not plan.carried_updates:  # computed on whole arrays
            update_arrays = [whole_updates[k] for k in update_indices]
        return (
            [
                [a.reshape(np.shape(like)) for a, like in zip(new, old, strict=True)]
                for new, (_, old) in zip(state_arrays, carried, strict=True)
            ],
            [a.reshape(shape) for a in update_arrays],
            done,
        )

    if len(set(plans.values())) == 1:
        carry, updates, done = run(plans["cpu"])
    else:  # the plan the compiling platform wants, chosen when XLA lowers the step
        carry, updates, done = lax.platform_dependent(
            **{platform: functools.partial(run, plan) for platform, plan in plans.items()}
        )
    results = {
        count + i: slots[i].stored(carry[position], stored[i])
        for position, i in enumerate(state_outputs)
    }
    if skip_predicate() is not None:
        # marked as returned (after the platform's choice and the reshapes), where the
        # skip's rewrite sees the mark
        results = {i: jax.tree.map(skip_applied, leaf) for i, leaf in results.items()}
    results.update(zip(update_indices, updates, strict=True))
    return results, done


# where an update is written: (the position of its gradient among the component's
# other inputs, or None for a buffer of its own; (the gradient's variable or None, the
# array written into, the function that makes the gradient of its slice))
_Carrier = tuple[int | None, tuple[Any, Any, Callable[[Any], Any] | None]]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a component runs on one platform: in ``iterations`` slices, its updates
    written into their gradients' buffers or computed on whole arrays, and the widths of
    the floating arrays it slices as unsigned integers (the others as they are)."""

    iterations: int
    carried_updates: bool
    viewed_as_bits: tuple[int, ...]


def _in(program: ElementwiseProgram, k: int, component: int) -> bool:
    """Whether update ``k`` of ``program`` is computed by ``component``."""
    return program.component_of(program.outvars[k]) == component


def _gradient_carriers(
    program: ElementwiseProgram,
    component: int,
    count: int,
    shape: tuple[int, ...],
    others: list[Any],
    other_values: list[Any],
    other_functions: list[Callable[[Any], Any] | None],
) -> dict[int, _Carrier]:
    """For each update of ``component`` (by flat output index) written into its
    gradient's buffer: the gradient's position in ``others`` and ``(variable, source,
    function)``.
    An update is written where the program's input of the same index (the gradient of
    the same leaf) is read by the component, and it, or the array it is computed from
    elementwise, has the update's shape and dtype and is computed in the step (as a
    training step computes its gradients) rather than passed to it."""
    found: dict[int, _Carrier] = {}
    for k in range(count):
        var = program.outvars[k]
        if program.component_of(var) != component or tuple(var.aval.shape) != shape:
            continue
        gradient = program.invars[k]
        if gradient not in others:
            continue
        position = others.index(gradient)
        source = other_values[position]  # (the array the gradient is computed from)
        if np.shape(source) != shape or jnp.result_type(source) != var.aval.dtype:
            continue
        if is_staged_argument(source):
            # XLA would copy an argument's buffer to write into it, where the update
            # computed on whole arrays needs only a copy of the narrow old state
            continue
        found[k] = (position, (gradient, source, other_functions[position]))
    return found


def _loop(
    program: ElementwiseProgram,
    component: int,
    wanted: list[Any],
    carried: list[tuple[Slot, list[Any]]],
    sources: dict[Any, int],
    others: list[Any],
    other_values: list[Any],
    *rest: Any,
) -> tuple[list[list[Any]], list[Any], Any]:
    """:func:`_sliced_loop`; where it fails on arrays sharded along explicit mesh axes,
    an error that says so and names the fix (JAX's sharding type errors come from
    inside the loop)."""
    try:
        return _sliced_loop(
            program, component, wanted, carried, sources, others, other_values, *rest
        )
    except Exception as error:  # (JAX's sharding type errors have no public base class)
        explicit = _explicitly_sharded([a for _, stored in carried for a in stored], other_values)
        if explicit is None:
            raise
        shape, spec = explicit
        raise NotImplementedError(
            "a state updated a slice at a time (low_precision_state; stochastic_rounding "
            "and kahan_summation where the backend slices bfloat16 in place) does not yet "
            f"run on arrays sharded along explicit mesh axes: an array of shape {shape} is "
            f"sharded as {spec}. Make the mesh with automatic axes, jax.make_mesh(shape, "
            "names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)) or "
            "jax.sharding.Mesh(devices, names), and place the arrays with NamedSharding as "
            "before: each state leaf stays sharded with its parameter and the step "
            "communicates nothing"
        ) from error


def _explicitly_sharded(*trees: Any) -> tuple[tuple[int, ...], Any] | None:
    """The shape and partition spec of the first array sharded along an explicit mesh
    axis (sharding in types, ``jax.make_mesh``'s default), or ``None``."""
    for leaf in jax.tree.leaves(trees):
        aval = jax.typeof(leaf)
        sharding = getattr(aval, "sharding", None)
        kinds = getattr(getattr(sharding, "mesh", None), "axis_types", ())
        spec = getattr(sharding, "spec", None)
        explicit = any(kind == jax.sharding.AxisType.Explicit for kind in kinds)
        if explicit and spec is not None and any(axis is not None for axis in spec):
            return tuple(aval.shape), spec
    return None


def _sliced_loop(
    program: ElementwiseProgram,
    component: int,
    wanted: list[Any],
    carried: list[tuple[Slot, list[Any]]],
    sources: dict[Any, int],
    others: list[Any],
    other_values: list[Any],
    other_functions: list[Callable[[Any], Any] | None],
    values: dict[Any, Any],
    rows: tuple[int, int],
    row: tuple[int, ...],
    iterations: int,
    updates: list[Any],
    carrier_inputs: list[tuple[Any, Any, Callable[[Any], Any] | None]],
    previous: Any,
    viewed_as_bits: tuple[int, ...] = (8, 16),
) -> tuple[list[list[Any]], list[Any], Any]:
    """The carried arrays after ``iterations`` iterations, each over every
    ``iterations``-th row of each layer (``rows``: the layers of a stack, its first
    axis, and the rows of each; one layer for a tensor that is not a stack; ``row``:
    the shape a row of values is read as, a carried state's as its slot says), which
    it keeps apart: the component evaluated on the slice, the new state written
    in place, and each of ``updates`` written into the buffer of its gradient
    (``carrier_inputs``: the input variable, its source array and the function that
    computes it from the source's slice).

    With ``updates`` the loop is pipelined: an iteration computes from slices the
    previous one read, writes its results, then reads the next slices from the arrays
    it has written. Every read of a carried array thus follows every write to it, so
    XLA updates each one in place (where an iteration reading one carried array to
    write another made XLA's CPU backend copy every carried array per iteration). Its
    first slices wait for ``previous``, a scalar the previous loop returned; it returns
    its own (its count of iterations) as the third result, else ``previous``.

    It slices the floating arrays of the widths in ``viewed_as_bits`` as unsigned
    integers of their width (on a platform that widens them whole to slice them)."""
    layers, rows_per_layer = rows
    group = rows_per_layer // iterations
    as_bits = functools.partial(_as_bits, widths=viewed_as_bits)

    def from_bits(pieces: list[Any], dtypes: list[Any]) -> list[Any]:
        return [_from_bits(p, dtype) for p, dtype in zip(pieces, dtypes, strict=True)]

    def as_rows(array: Any, trailing: tuple[int, ...] = row) -> Any:
        # (layers, group, iterations, *a row): strided slices
        return array.reshape(layers, group, iterations, *trailing)

    def piece(array: Any, step: Any) -> Any:
        start = (0, 0, step) + (0,) * (array.ndim - 3)
        size = (layers, group, 1, *array.shape[3:])
        return lax.dynamic_slice(array, start, size)[:, :, 0]

    carried_dtypes = [[jnp.result_type(a) for a in stored] for _, stored in carried]
    arrays = [
        [as_rows(as_bits(a), shape) for a, shape in zip(stored, slot.row_shapes(row), strict=True)]
        for slot, stored in carried
    ]
    arrays += [[as_rows(as_bits(source))] for _, source, _ in carrier_inputs]
    other_dtypes = [jnp.result_type(v) for v in other_values]
    other_rows = [as_rows(as_bits(v)) for v in other_values]
    carrier_dtypes = [jnp.result_type(source) for _, source, _ in carrier_inputs]
    wanted_all = [*wanted, *updates]

    def compute(step: Any, slices: list[list[Any]]) -> list[list[Any]]:
        inputs = {
            v: _from_bits(piece(a, step), dtype)
            if function is None
            else function(_from_bits(piece(a, step), dtype))
            for v, a, function, dtype in zip(
                others, other_rows, other_functions, other_dtypes, strict=True
            )
        }
        for var, position in sources.items():
            slot, _ = carried[position]
            inputs[var] = slot.read_rows(from_bits(slices[position], carried_dtypes[position]))
        for (var, _, function), dtype, pieces in zip(
            carrier_inputs, carrier_dtypes, slices[len(carried) :], strict=True
        ):
            if var is None:  # a buffer of the update's own, read by nothing
                continue
            value = _from_bits(pieces[0], dtype)
            inputs[var] = value if function is None else function(value)

        shape = (layers, group, *row)

        def positions() -> Any:  # each element's row-major index in its leaf
            layer = lax.broadcasted_iota(jnp.uint32, shape, 0)
            rows_of_slice = lax.broadcasted_iota(jnp.uint32, shape, 1)
            index = rows_of_slice * np.uint32(iterations) + jnp.asarray(step).astype(jnp.uint32)
            index = layer * np.uint32(rows_per_layer) + index
            for axis, length in enumerate(row, start=2):
                index = index * np.uint32(length) + lax.broadcasted_iota(jnp.uint32, shape, axis)
            return index

        results = program.evaluate_slice(component, wanted_all, inputs, values, shape, positions)
        written = []
        state_slices, state_results = slices[: len(carried)], results[: len(carried)]
        for (slot, _), old, result, dtypes in zip(
            carried, state_slices, state_results, carried_dtypes, strict=True
        ):
            new = [
                as_bits(n.astype(dtype))
                for n, dtype in zip(slot.write_rows(result), dtypes, strict=True)
            ]
            if program.branches and slot.kind == "blocks":
                # a row the update left as it was (a branch that keeps the state: the
                # steps between optax.MultiSteps' applied ones) keeps its stored codes
                # and scales: quantized again, a block need not give them back
                unchanged = unchanged_rows(result, slot.read_rows(from_bits(old, dtypes)), 2)
                new = [where_rows(unchanged, o, n) for o, n in zip(old, new, strict=True)]
            if skip is not None:  # a skipped step writes back what it read
                new = [jnp.where(skip, o, n) for o, n in zip(old, new, strict=True)]
            written.append(new)
        for update, dtype in zip(results[len(carried) :], carrier_dtypes, strict=True):
            # (a skipped step's updates are replaced after the loop, as any update is)
            written.append([as_bits(update.astype(dtype))])
        return written

    def write(arrays: list[list[Any]], written: list[list[Any]], step: Any) -> list[list[Any]]:
        return [
            [
                lax.dynamic_update_slice(
                    a, p[:, :, None].astype(a.dtype), (0, 0, step) + (0,) * (a.ndim - 3)
                )
                for a, p in zip(now, new, strict=True)
            ]
            for now, new in zip(arrays, written, strict=True)
        ]

    def read(arrays: list[list[Any]], step: Any) -> list[list[Any]]:
        return [[piece(a, step) for a in now] for now in arrays]

    def direct(step: Any, arrays: list[list[Any]]) -> list[list[Any]]:
        return write(arrays, compute(step, read(arrays, step)), step)

    def pipelined(step: Any, carry: tuple[Any, list[list[Any]], list[list[Any]]]) -> Any:
        # Iteration ``step`` writes slice ``step - 1`` from the slices the previous one
        # read, then reads slice ``step``; the first only reads (it writes back slice 0
        # as it is, read in the fusion that writes it, which XLA does in place).
        count, arrays, slices = carry
        at = jnp.maximum(step - 1, 0)
        new = compute(at, slices)
        kept = read(arrays, at)
        new = [
            [jnp.where(step == 0, k, n.astype(k.dtype)) for k, n in zip(ks, ns, strict=True)]
            for ks, ns in zip(kept, new, strict=True)
        ]
        arrays = write(arrays, new, at)
        return count + 1, arrays, read(arrays, jnp.minimum(step, iterations - 1))

    # Inside a loss scaler's skip, each slice keeps its old value when the step is
    # skipped (and the caller marks the arrays, so that the skip selects nothing after).
    skip = skip_predicate()
    done = previous
    if iterations == 1:
        arrays = direct(0, arrays)
    elif not carrier_inputs:
        # each iteration reads and writes a slice of each carried array in one fusion,
        # which XLA does in place
        arrays = lax.fori_loop(0, iterations, direct, arrays)
    else:
        # an iteration that read one carried array (the state) to write another (the
        # update, in the gradient's buffer) would make XLA's CPU backend copy every
        # carried array per iteration: each reads what the previous iteration read.
        # The slices carried are made after the previous loop ends (they wait for the
        # count it returns, a scalar every device has), so that XLA does not hold every
        # loop's slices from the start of the step.
        wait = previous * 0  # (XLA keeps a float's product with zero)
        empty = [
            [(jnp.zeros(_slice_shape(a), jnp.float32) + wait).astype(a.dtype) for a in now]
            for now in arrays
        ]
        done, arrays, _ = lax.fori_loop(
            0, iterations + 1, pipelined, (jnp.float32(0), arrays, empty)
        )
    update_arrays = [
        _from_bits(pieces[0], dtype)
        for pieces, dtype in zip(arrays[len(carried) :], carrier_dtypes, strict=True)
    ]
    state_arrays = [
        from_bits(pieces, dtypes)
        for pieces, dtypes in zip(arrays[: len(carried)], carried_dtypes, strict=True)
    ]
    return state_arrays, update_arrays, done


def _slice_shape(rows: Any) -> tuple[int, ...]:
    """The shape of one iteration's slice of a ``(layers, group, iterations, *a row)``
    view."""
    layers, group, _, *row = rows.shape
    return (layers, group, *row)


def _as_bits(array: Any, widths: tuple[int, ...] = (8, 16)) -> Any:
    """A floating array of one of the bit ``widths`` as unsigned integers of its width:
    XLA's CPU backend slices a float8 array (and a bfloat16 one before jaxlib 0.11.2)
    inside a loop by converting all of it to float32 first (written whole, outside the
    loop), and slices integers as they are. (A view of an argument is a copy of it, but
    a fraction of the float32 one.)"""
    dtype = jnp.result_type(array)
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits not in widths:
        return array  # (and a 4-bit type, which has no integer of its width)
    return lax.bitcast_convert_type(array, jnp.uint16 if dtype.itemsize == 2 else jnp.uint8)


def _from_bits(piece: Any, dtype: Any) -> Any:
    """A slice of :func:`_as_bits`'s array in ``dtype`` again."""
    return piece if piece.dtype == dtype else lax.bitcast_convert_type(piece, dtype)


def _same_layout(program: ElementwiseProgram, wide: list[Any], count: int) -> bool:
    """Whether the new state has the old one's shapes and dtypes, leaf by leaf."""
    news = program.outvars[count:]
    return len(news) == len(wide) and all(
        tuple(new.aval.shape) == tuple(np.shape(old)) and new.aval.dtype == jnp.result_type(old)
        for new, old in zip(news, wide, strict=True)
    )
