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

from jaxscale.core._stateful_call import TracedCall
from jaxscale.diagnosis._evaluator import NOT_IN_A_LOOP, CarryingEvaluator, Phase
from jaxscale.diagnosis._frames import Location
from jaxscale.diagnosis._report import (
    INF,
    NAN,
    NonfiniteReport,
    Origin,
    empty_record,
    keep_first,
    nonfinite_code,
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
            _is_floating_dtype(source)
            and _is_floating_dtype(target)
            and jnp.finfo(target).max >= jnp.finfo(source).max
        )
    return name in _PRESERVING and len(eqn.invars) == 1 and len(eqn.outvars) == 1


def _is_floating_dtype(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


class Locator(CarryingEvaluator):
    """Carries the first origin of a non-finite value (a :class:`Record`); keeps the
    table of possible origins."""

    def __init__(self) -> None:
        self.origins: list[Origin] = []
        # per jaxpr being evaluated: the (born, kind) flags of its equations not yet folded
        # into the record, each with its table entry (folded at once: fewer operations
        # to compile than a select per equation)
        self._pending: list[list[tuple[jax.Array, jax.Array, int]]] = []

    def eval(self, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
        self._pending.append([])
        try:
            return super().eval(*args, **kwargs)
        finally:
            self._pending.pop()

    def settle(self, carry: Any, iteration: Any) -> Any:
        pending = self._pending[-1] if self._pending else []
        if not pending:
            return carry
        born = jnp.stack([b for b, _, _ in pending])
        kinds = jnp.stack([k for _, k, _ in pending])
        entries = np.asarray([e for _, _, e in pending], np.int32)
        first = jnp.argmax(born)
        pending.clear()
        return keep_first(
            carry, jnp.any(born), jnp.asarray(entries)[first], iteration, kinds[first]
        )

    def add(self, origin: Origin) -> int:
        self.origins.append(origin)
        return len(self.origins) - 1

    def value_info(self, value: Any) -> Any:
        return nonfinite_code(value)

    def output_infos(
        self, eqn: Any, invals: list[Any], in_infos: list[Any], outvals: list[Any]
    ) -> list[Any]:
        if preserves_nonfinite(eqn):
            return [in_infos[0]] * len(outvals)  # exactly the input's: nothing to read
        return super().output_infos(eqn, invals, in_infos, outvals)

    def after_equation(
        self,
        eqn: Any,
        invals: list[Any],
        in_infos: list[Any],
        outvals: list[Any],
        out_infos: list[Any],
        carry: Any,
        iteration: Any,
        phase: Phase,
        here: Location,
    ) -> Any:
        in_code: Any = jnp.zeros((), jnp.int32)
        for code in in_infos:
            in_code = jnp.bitwise_or(in_code, code)
        if preserves_nonfinite(eqn):
            return carry  # its output holds the inf and NaN of its input, no others
        for value, code in zip(outvals, out_infos, strict=True):
            if code is None or not _is_floating(value):
                continue
            born = jnp.bitwise_and(code, jnp.bitwise_not(in_code))
            entry = self.add(
                Origin(
                    "operation",
                    str(value.dtype),
                    primitive=eqn.primitive.name,
                    phase="backward" if phase.backward else "forward",
                    location=here,
                )
            )
            kind = jnp.where(jnp.bitwise_and(born, NAN) != 0, NAN, INF)
            self._pending[-1].append((born != 0, kind, entry))
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
    in an argument is reported as the origin ``argument`` with its path. The search
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
        for path, value in zip(call.input_paths, call.inputs, strict=True):
            if _is_floating(value):
                entry = locator.add(Origin("argument", str(value.dtype), path=path))
                code = nonfinite_code(value)
                kind = jnp.where(jnp.bitwise_and(code, NAN) != 0, NAN, INF)
                record = keep_first(record, code != 0, entry, NOT_IN_A_LOOP, kind)
        closed = call.closed
        outs, record = locator.eval(
            closed.jaxpr, closed.consts, call.inputs, record, NOT_IN_A_LOOP,
            backward_outputs=None,
        )  # fmt: skip
        return call.finish(outs), NonfiniteReport(record, tuple(locator.origins))

    return located


def _is_floating(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    try:
        return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False
