"""``locate_nonfinite``: where, in a traced program, the first inf or NaN that reaches
the outputs was born.

The function is traced to a jaxpr and evaluated anew (:mod:`._evaluator`), every
value bitwise the function's own, carrying a small :class:`Record`: after each
equation, an output holding a NaN where none of the equation's inputs held one,
or an infinity where none held one, is a possible origin. When a jaxpr ends (the
function's, a loop body's, a branch's), the possible origins from which a chain of
non-finite values leads to its outputs are origins, and the first is kept with
``where``.

Each possible origin gets an entry in a host-side table built while tracing: the
primitive, forward or backward, the user's source line and the output dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.explicit_axes import foreign_mesh, replicated_here
from jaxscale._src.jaxprs import is_ref, is_traced, name_stack_text
from jaxscale._src.leaves import read_references
from jaxscale._src.scopes import in_float8_matmul
from jaxscale._src.stateful_call import TracedCall
from jaxscale.diagnosis._evaluator import (
    NOT_IN_A_LOOP,
    CarryingEvaluator,
    EquationRun,
    runs_apart,
)
from jaxscale.diagnosis._report import (
    INF,
    NAN,
    NonfiniteReport,
    Origin,
    empty_record,
    is_floating,
    is_floating_dtype,
    keep_first,
    nonfinite_code,
    nonfinite_codes,
)

F = TypeVar("F", bound=Callable[..., Any])


# Primitives whose output holds an inf (a NaN) exactly when their one floating input
# does: they move, repeat or negate values, or widen them to a dtype that holds them.
_PRESERVING = {
    "reshape", "transpose", "squeeze", "broadcast_in_dim", "rev", "copy", "neg", "abs",
    "stop_gradient", "optimization_barrier", "sharding_constraint", "name",
}  # fmt: skip


def preserves_nonfinite(eqn: Any) -> bool:
    """Whether ``eqn``'s output is non-finite exactly where its input is, in kind."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        source, target = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
        return bool(
            is_floating_dtype(source)
            and is_floating_dtype(target)
            and jnp.finfo(target).max >= jnp.finfo(source).max
        )
    return name in _PRESERVING and len(eqn.invars) == 1 and len(eqn.outvars) == 1


class _Deferred:
    """What is kept about a floating value until its equation's flags are settled: the
    value, whose non-finite code is then computed with others of its shape."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


Info = Any  # None (not floating), a known int32 code, or a _Deferred value


class _Node:
    """A floating output of an equation of the jaxpr being evaluated: its table entry,
    the value it is (by identity) and the values it was computed from."""

    __slots__ = ("entry", "inputs", "key")

    def __init__(self, entry: int, key: int | None, inputs: list[int]):
        self.entry, self.key, self.inputs = entry, key, inputs


class _Level:
    """What is kept while one jaxpr (a function, a loop's body, a branch) is evaluated:
    the equations not yet settled, every output settled (its node, whether it is
    non-finite, whether it was born non-finite there and how), and the higher-order
    equations that ran, each as (the nodes before it, the carry it took, the carry it
    gave, how many floating outputs it has: the nodes after those)."""

    def __init__(self, carry: Any):
        self.start = carry
        self.pending: list[tuple[Info, list[Info], int]] = []
        self.nodes: list[_Node] = []
        self.nonfinite: list[jax.Array] = []
        self.born: list[jax.Array] = []
        self.kinds: list[jax.Array] = []
        self.calls: list[tuple[int, Any, Any, int]] = []
        self.settled_carry = carry
        self.linked: list[Any] = []


def _key(info: Info) -> int | None:
    """The identity of the value ``info`` describes (a value an equation keeps as it
    was, a reshape say, shares its input's)."""
    return id(info.value) if isinstance(info, _Deferred) else None


class Locator(CarryingEvaluator):
    """Carries the first origin of a non-finite value that reaches the outputs (a
    :class:`Record`); keeps the table of possible origins.

    Within each jaxpr evaluated apart (the function, a loop's body, a branch), an
    output born non-finite counts as an origin only where a chain of non-finite values
    leads from it to the jaxpr's outputs (or into a higher-order equation whose
    outputs are non-finite): a value the code masks (``jnp.where`` discarding a NaN,
    a clip of an infinite factor) is not the origin of anything."""

    def __init__(self) -> None:
        self.origins: list[Origin] = []
        # per jaxpr being evaluated apart (one inlined shares its caller's)
        self._levels: list[_Level] = []
        # per jaxpr being evaluated, the codes computed so far, {id(value): (value,
        # code)}: a value several equations read is reduced once. Per jaxpr, since a
        # loop body's code of a value closed over belongs to the body's trace.
        self._codes: list[dict[int, tuple[Any, jax.Array]]] = []

    def eval(self, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
        if kwargs.get("inline"):  # the caller's trace: its pending equations and codes
            return super().eval(*args, **kwargs)
        carry = args[3] if len(args) > 3 else kwargs["carry"]
        self._levels.append(_Level(carry))
        self._codes.append({})
        try:
            return super().eval(*args, **kwargs)
        finally:
            self._levels.pop()
            self._codes.pop()

    def settle(self, carry: Any, iteration: Any) -> Any:
        # The equations so far become nodes, their codes computed in vector operations
        # (fewer for XLA to compile than a few scalar operations per equation); which
        # of them are origins is decided when the jaxpr ends.
        level = self._levels[-1] if self._levels else None
        if level is None:
            return carry
        level.settled_carry = carry
        pending = level.pending
        if not pending:
            return carry
        self._compute_codes([info for out, ins, _ in pending for info in (out, *ins)])
        # every code involved once in a vector (a last 0 pads the rows of inputs)
        slots: dict[int, int] = {}
        codes: list[jax.Array] = []

        def slot(info: Info) -> int:
            key = id(info.value) if isinstance(info, _Deferred) else id(info)
            if key not in slots:
                slots[key] = len(codes)
                codes.append(self._code(info))
            return slots[key]

        outputs = np.asarray([slot(out) for out, _, _ in pending], np.int32)
        inputs = [[slot(info) for info in ins] for _, ins, _ in pending]
        table = np.full((len(pending), max(map(len, inputs), default=0) or 1), len(codes), np.int32)
        for row, columns in enumerate(inputs):
            table[row, : len(columns)] = columns
        vector = jnp.concatenate([jnp.stack(codes), jnp.zeros((1,), jnp.int32)])
        in_codes = lax.reduce(vector[table], np.int32(0), lax.bitwise_or, (1,))
        out_codes = vector[outputs]
        # a NaN where no input held one, or an infinity where none held one
        born = jnp.bitwise_and(out_codes, jnp.bitwise_not(in_codes))
        level.nonfinite.append(out_codes != 0)
        level.born.append(born != 0)
        level.kinds.append(jnp.where(jnp.bitwise_and(born, NAN) != 0, NAN, INF))
        for out, ins, entry in pending:
            keys = [k for k in (_key(info) for info in ins) if k is not None]
            level.nodes.append(_Node(entry, _key(out), keys))
        pending.clear()
        return carry

    def finish(self, carry: Any, iteration: Any, out_infos: list[Any]) -> Any:
        level = self._levels[-1]
        self.settle(carry, iteration)
        if not level.nodes:
            return carry
        reaching = self._reaching(level, out_infos)
        born = jnp.logical_and(jnp.concatenate(level.born), reaching)
        kinds = jnp.concatenate(level.kinds)
        entries = np.asarray([node.entry for node in level.nodes], np.int32)
        # In the order things ran: the origins of each run of equations, and what each
        # higher-order equation found inside (it was given the carry without this
        # jaxpr's origins before it, which are earlier).
        record, start = level.start, 0
        for position, before, after, outputs in [*level.calls, (len(level.nodes), None, None, 0)]:
            if position > start:
                run = born[start:position]
                first = jnp.argmax(run)
                record = keep_first(
                    record, jnp.any(run), jnp.asarray(entries[start:position])[first],
                    iteration, kinds[start:position][first],
                )  # fmt: skip
            if before is not None:
                # found inside, and what it found reaches this jaxpr's outputs
                inside = jnp.logical_and(after.found, jnp.logical_not(before.found))
                inside = jnp.logical_and(inside, jnp.any(reaching[position : position + outputs]))
                record = keep_first(record, inside, after.entry, after.iteration, after.kind)
            start = position
        return record

    def _reaching(self, level: _Level, out_infos: list[Any]) -> jax.Array:
        """Whether each node is non-finite and a chain of non-finite nodes leads from it
        to the jaxpr's outputs."""
        count = len(level.nodes)
        producer: dict[int, int] = {}
        sources: list[int] = []
        targets: list[int] = []
        depth = np.zeros(count, np.int64)  # the longest chain of nodes ending at each
        for index, node in enumerate(level.nodes):
            for key in node.inputs:
                made = producer.get(key)
                if made is not None:
                    sources.append(made)
                    targets.append(index)
                    depth[index] = max(depth[index], depth[made] + 1)
            if node.key is not None:
                # the same value again: a nested jit's output is its last equation's
                made = producer.get(node.key)
                if made is not None:
                    sources.append(made)
                    targets.append(index)
                    depth[index] = max(depth[index], depth[made] + 1)
                producer[node.key] = index
        sink = np.zeros(count, bool)
        for info in out_infos:
            output = _key(info)
            if output is not None and output in producer:
                sink[producer[output]] = True
        nonfinite = jnp.concatenate(level.nonfinite)
        reaching = jnp.logical_and(nonfinite, sink)
        if not sources:
            return reaching
        source_index = np.asarray(sources, np.int32)
        target_index = np.asarray(targets, np.int32)

        def step(_: Any, reaching: Any) -> Any:
            # a node reaches the outputs where one it feeds does
            fed = (
                jnp.zeros((count,), jnp.int32)
                .at[source_index]
                .max(reaching[target_index].astype(jnp.int32))
            )
            return jnp.logical_and(nonfinite, jnp.logical_or(sink, fed > 0))

        return lax.fori_loop(0, int(depth.max()), step, reaching)

    def _compute_codes(self, infos: list[Info]) -> None:
        needed = {}
        for info in infos:
            if isinstance(info, _Deferred) and self._known_code(info.value) is None:
                needed[id(info.value)] = info.value
        values = list(needed.values())
        for value, code in zip(values, nonfinite_codes(values), strict=True):
            self._codes[-1][id(value)] = (value, code)

    def _known_code(self, value: Any) -> jax.Array | None:
        entry = self._codes[-1].get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def _code(self, info: Info) -> jax.Array:
        if isinstance(info, _Deferred):
            code = self._known_code(info.value)
            assert code is not None  # computed by _compute_codes
        else:
            code = info
        # (computed on another mesh, inside a region with explicit axes made automatic:
        # retyped for the vector it joins here, before any operation on it)
        if foreign_mesh(code) is not None:
            code = replicated_here(code)
        return jnp.asarray(code, jnp.int32)

    def add(self, origin: Origin) -> int:
        self.origins.append(origin)
        return len(self.origins) - 1

    def value_info(self, value: Any) -> Info:
        # A reference has no value of its own to check: what is written into it was
        # checked where it was made, and what is read from it is checked as read.
        if not is_floating(value) or is_ref(value):
            return None
        if np.ndim(value) == 0 and not is_traced(value) and not isinstance(value, jax.Array):
            return nonfinite_code(value)  # a literal: known now
        return _Deferred(value)

    def output_infos(
        self, eqn: Any, invals: list[Any], in_infos: list[Any], outvals: list[Any]
    ) -> list[Any]:
        if preserves_nonfinite(eqn):
            return [in_infos[0]] * len(outvals)  # exactly the input's: nothing to read
        return super().output_infos(eqn, invals, in_infos, outvals)

    def link_outputs(self, values: Sequence[Any]) -> None:
        # a custom derivative's outputs are its body's, evaluated beside it
        self._levels[-1].linked = [v for v in values if is_floating(v)]

    def after_equation(self, ran: EquationRun, carry: Any) -> Any:
        eqn = ran.eqn
        level = self._levels[-1]
        linked, level.linked = level.linked, []
        if runs_apart(eqn):
            # settled just before it ran: what it found inside, in its place
            outputs = sum(info is not None for info in ran.out_infos)
            level.calls.append((len(level.nodes), level.settled_carry, carry, outputs))
        if preserves_nonfinite(eqn):
            return carry  # its output holds the inf and NaN of its input, no others
        known_inputs = [info for info in ran.in_infos if info is not None]
        known_inputs += [_Deferred(value) for value in linked]
        for value, info in zip(ran.outvals, ran.out_infos, strict=True):
            if info is None:
                continue
            entry = self.add(
                Origin(
                    "operation",
                    str(value.dtype),
                    primitive=_operation_name(eqn),
                    phase="backward" if ran.phase.backward else "forward",
                    location=ran.here,
                )
            )
            level.pending.append((info, known_inputs, entry))
        return carry


# -- the transform -----------------------------------------------------------------------


def locate_nonfinite(fn: F) -> Callable[..., tuple[Any, NonfiniteReport]]:
    """Find where the first inf or NaN that reaches a call's outputs was born: which
    operation, forward or backward, which line, which loop iteration.

    ``locate_nonfinite(fn)`` returns a function with ``fn``'s signature that returns
    ``(fn(*args, **kwargs), report)``. The outputs are bitwise ``fn``'s. ``report``
    is a :class:`NonfiniteReport`: a pytree of arrays (jittable, no host callback,
    no transfer), to be returned from a compiled step like any metric;
    ``report.found`` is a boolean array and ``report.describe()`` (on the host)
    says what was found.

    The origin is the first operation, in evaluation order, whose output holds a
    NaN where none of its floating inputs held one, or an infinity where none of
    its inputs held one (an intended ``-inf`` mask is no origin; the
    ``-inf - (-inf)`` of a fully masked softmax row is), and from which a chain of
    non-finite values leads to the outputs: a value the code masks (a NaN
    ``jnp.where`` discards, an infinite factor clipped) is none, and hides nothing
    after it. Of ``jax.grad(f)``, the outputs are the gradients. A non-finite value already
    in an argument is reported as the origin ``argument`` with its path, and one in
    an array the function closes over (a batch captured by a ``lambda``) as
    ``closed-over`` with its shape. The search
    reaches inside nested ``jit``, ``scan``, ``fori_loop``/``while_loop`` (with the
    iteration: how many iterations the innermost loop had run), ``cond``/``switch``
    (the branch taken), ``checkpoint``/``remat``, the rules of ``custom_jvp`` and
    ``custom_vjp`` and ``vmap``'d code, and the backward pass of a ``jax.grad``
    (``nnx.grad``, ``jax.value_and_grad``) taken inside ``fn``: operations of the
    backward pass, and values computed only for it, are ``backward`` and name the
    line of the forward operation they differentiate. ``shard_map`` bodies and
    other higher-order primitives run as traced, checked as a whole.

    ``fn`` may be any callable: a function, a Flax NNX module or a bound method.
    It composes with :func:`jaxscale.autocast` in either order.

    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def loss(w, x):
    ...     return jnp.sum(jnp.log(x @ w))
    >>> grad_fn = jaxscale.locate_nonfinite(jax.value_and_grad(loss))
    >>> (value, grads), report = jax.jit(grad_fn)(jnp.ones((2, 2)), jnp.array([[-1.0, -1.0]]))
    >>> bool(report.found)
    True
    >>> report.describe().split(" at ")[0], report.describe().split(": ")[-1]
    ('forward log', 'nan (float32)')
    """
    if not callable(fn):
        raise TypeError(f"locate_nonfinite expects a callable, got {type(fn).__name__} {fn!r}")

    @functools.wraps(fn)
    def located(*args: Any, **kwargs: Any) -> tuple[Any, NonfiniteReport]:
        call = TracedCall(fn, args, kwargs)
        locator = Locator()
        record = empty_record()
        closed = call.closed
        # The inputs, then the arrays the function closes over (a reference's value as
        # the call finds it): a non-finite value already there is the origin, not the
        # first operation it turns into a NaN.
        checked = [
            (
                Origin("argument", str(value.dtype), path=path),
                read_references(value),
            )
            for path, value in zip(call.input_paths, call.inputs, strict=True)
            if is_floating(value)
        ] + [
            (
                Origin("closed-over", str(value.dtype), shape=tuple(jnp.shape(value))),
                read_references(value),
            )
            for value in closed.consts
            if is_floating(value)
        ]
        codes = nonfinite_codes([value for _, value in checked])  # checked together
        for (origin, _), code in zip(checked, codes, strict=True):
            entry = locator.add(origin)
            kind = jnp.where(jnp.bitwise_and(code, NAN) != 0, NAN, INF)
            record = keep_first(record, code != 0, entry, NOT_IN_A_LOOP, kind)
        outs, record = locator.eval(
            closed.jaxpr, closed.consts, call.inputs, record, NOT_IN_A_LOOP,
            backward_outputs=None,
        )  # fmt: skip
        return call.finish(outs), NonfiniteReport(record, tuple(locator.origins))

    return located


def _operation_name(eqn: Any) -> str:
    """The operation the user wrote that ``eqn`` is part of: a float8 matmul's for any
    equation autocast's float8 matmul is made of (its quantization, its product, the
    product's rescaling and cast to the autocast dtype), else ``eqn``'s primitive."""
    if in_float8_matmul(name_stack_text(eqn)):
        return "float8 dot_general"
    return str(eqn.primitive.name)
