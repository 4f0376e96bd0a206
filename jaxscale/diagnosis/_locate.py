"""``locate_nonfinite``: where, in a traced program, the first inf or NaN was born.

The function is traced to a jaxpr and evaluated anew (:mod:`._evaluator`), every
value bitwise the function's own, carrying a small :class:`Record`: after each
equation, an output holding a NaN where none of the equation's inputs held one,
or an infinity where none held one, is an origin, and the first origin is kept
with ``where``.

Each possible origin gets an entry in a host-side table built while tracing: the
primitive, forward or backward, the user's source line and the output dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.jaxprs import is_ref, is_traced, name_stack_text
from jaxscale._src.leaves import read_references
from jaxscale._src.scopes import in_float8_matmul
from jaxscale._src.stateful_call import TracedCall
from jaxscale.diagnosis._evaluator import NOT_IN_A_LOOP, CarryingEvaluator, EquationRun
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


class Locator(CarryingEvaluator):
    """Carries the first origin of a non-finite value (a :class:`Record`); keeps the
    table of possible origins."""

    def __init__(self) -> None:
        self.origins: list[Origin] = []
        # per jaxpr being evaluated: its equations not yet folded into the record, each
        # as (its output's info, its inputs' infos, its table entry). They are folded
        # at once, in vector operations: fewer for XLA to compile than a few scalar
        # operations per equation.
        self._pending: list[list[tuple[Info, list[Info], int]]] = []
        # per jaxpr being evaluated, the codes computed so far, {id(value): (value,
        # code)}: a value several equations read is reduced once. Per jaxpr, since a
        # loop body's code of a value closed over belongs to the body's trace.
        self._codes: list[dict[int, tuple[Any, jax.Array]]] = []

    def eval(self, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
        if kwargs.get("inline"):  # the caller's trace: its pending equations and codes
            return super().eval(*args, **kwargs)
        self._pending.append([])
        self._codes.append({})
        try:
            return super().eval(*args, **kwargs)
        finally:
            self._pending.pop()
            self._codes.pop()

    def settle(self, carry: Any, iteration: Any) -> Any:
        pending = self._pending[-1] if self._pending else []
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
        # a NaN where no input held one, or an infinity where none held one
        born = jnp.bitwise_and(vector[outputs], jnp.bitwise_not(in_codes))
        first = jnp.argmax(born != 0)
        kind = jnp.where(jnp.bitwise_and(born[first], NAN) != 0, NAN, INF)
        entries = jnp.asarray([entry for _, _, entry in pending], jnp.int32)
        pending.clear()
        return keep_first(carry, jnp.any(born != 0), entries[first], iteration, kind)

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
            return code
        return jnp.asarray(info, jnp.int32)

    def add(self, origin: Origin) -> int:
        self.origins.append(origin)
        return len(self.origins) - 1

    def value_info(self, value: Any) -> Info:
        # A reference has no value of its own to check: what is written into it was
        # checked where it was made, and what is read from it is checked as read.
        if not is_floating(value) or is_ref(value):
            return None
        if np.ndim(value) == 0 and not is_traced(value):
            return nonfinite_code(value)  # a literal: known now
        return _Deferred(value)

    def output_infos(
        self, eqn: Any, invals: list[Any], in_infos: list[Any], outvals: list[Any]
    ) -> list[Any]:
        if preserves_nonfinite(eqn):
            return [in_infos[0]] * len(outvals)  # exactly the input's: nothing to read
        return super().output_infos(eqn, invals, in_infos, outvals)

    def after_equation(self, ran: EquationRun, carry: Any) -> Any:
        eqn = ran.eqn
        if preserves_nonfinite(eqn):
            return carry  # its output holds the inf and NaN of its input, no others
        known_inputs = [info for info in ran.in_infos if info is not None]
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
            self._pending[-1].append((info, known_inputs, entry))
        return carry


# -- the transform -----------------------------------------------------------------------


def locate_nonfinite(fn: F) -> Callable[..., tuple[Any, NonfiniteReport]]:
    """Find where the first inf or NaN of a call was born: which operation, forward or
    backward, which line, which loop iteration.

    ``locate_nonfinite(fn)`` returns a function with ``fn``'s signature that returns
    ``(fn(*args, **kwargs), report)``. The outputs are bitwise ``fn``'s. ``report``
    is a :class:`NonfiniteReport`: a pytree of arrays (jittable, no host callback,
    no transfer), to be returned from a compiled step like any metric;
    ``report.found`` is a boolean array and ``report.describe()`` (on the host)
    says what was found.

    The origin is the first operation, in evaluation order, whose output holds a
    NaN where none of its floating inputs held one, or an infinity where none of
    its inputs held one (an intended ``-inf`` mask is no origin; the
    ``-inf - (-inf)`` of a fully masked softmax row is). A non-finite value already
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
    >>> grad_fn = jaxscale.locate_nonfinite(jax.grad(loss))
    >>> grads, report = jax.jit(grad_fn)(jnp.ones((2, 2)), jnp.array([[-1.0, -1.0]]))
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
