"""The answer of :func:`jaxscale.locate_nonfinite`: a pytree of arrays and a host-side table.

The arrays say whether an origin was found, which entry of the table it is, in
which loop iteration and of which kind. The table, built while the function was
traced, says what each entry is: an argument (with its path) or an operation (its
primitive, forward or backward, source line, output dtype). The table is the
pytree's static part, so the report can be returned from ``jit`` like any metric
and read on the host afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.explicit_axes import foreign_mesh, on_mesh, replicated_here
from jaxscale._src.frames import Location
from jaxscale._src.jaxprs import is_traced
from jaxscale.core.shared import NonfiniteRecord, empty_nonfinite_record

INF, NAN = 1, 2
"""Bits of a non-finite code: the value holds an infinity, a NaN."""

_KIND_WORDS = {INF: "inf", NAN: "nan"}


@dataclasses.dataclass(frozen=True)
class Origin:
    """One entry of the table: where a non-finite value can be born.

    ``source`` is ``"argument"``, ``"closed-over"`` or ``"operation"``. For an
    argument, ``path`` is its ``jax.tree_util.keystr`` path among the call's
    arguments; a closed-over value (an array the function uses without taking it as
    an argument, such as a batch captured by a ``lambda``) has no path, and is
    told apart by its ``shape``; for an operation, ``primitive`` names it,
    ``phase`` is ``"forward"`` or ``"backward"`` and ``location`` gives the user's
    line. ``dtype`` is the value's dtype.
    """

    source: str
    dtype: str
    path: str = ""
    primitive: str = ""
    phase: str = ""
    location: Location = dataclasses.field(default_factory=lambda: Location("", "", ""))
    shape: tuple[int, ...] = ()

    def text(self) -> str:
        if self.source == "argument":
            return f"argument {self.path}"
        if self.source == "closed-over":
            return f"a value the function closes over, shape {self.shape}"
        return f"{self.phase} {self.primitive} at {self.location.text()}"


Record = NonfiniteRecord
"""The traced part of a report: the first origin found so far."""


def empty_record() -> Record:
    return empty_nonfinite_record()


def keep_first(record: Record, found: jax.Array, entry: Any, iteration: Any, kind: Any) -> Record:
    """``record`` if it has found something already, else the new finding where ``found``."""
    take = jnp.logical_and(found, jnp.logical_not(record.found))
    return Record(
        jnp.logical_or(record.found, found),
        jnp.where(take, jnp.asarray(entry, jnp.int32), record.entry),
        jnp.where(take, jnp.asarray(iteration, jnp.int32), record.iteration),
        jnp.where(take, jnp.asarray(kind, jnp.int32), record.kind),
    )


@jax.tree_util.register_pytree_node_class
class NonfiniteReport:
    """Where the first inf or NaN of a call that reached its outputs was born (see
    :func:`jaxscale.locate_nonfinite`).

    Attributes:
      found: boolean scalar array: whether a non-finite value born in the call reached
        its outputs.
      entry, iteration, kind: int32 scalar arrays (see :meth:`describe`).
      origins: the host-side table of possible origins (static).
    """

    def __init__(self, record: Record, origins: tuple[Origin, ...]):
        self.record = record
        self.origins = origins

    @property
    def found(self) -> jax.Array:
        return self.record.found

    def tree_flatten(self) -> tuple[tuple[Record], tuple[Origin, ...]]:
        return (self.record,), self.origins

    @classmethod
    def tree_unflatten(cls, origins: tuple[Origin, ...], children: Any) -> NonfiniteReport:
        return cls(children[0], origins)

    def origin(self) -> Origin | None:
        """The :class:`Origin` found (host side), or ``None``."""
        record = jax.device_get(self.record)
        return self.origins[int(record.entry)] if bool(record.found) else None

    def describe(self) -> str:
        """One line for a log, read on the host: what was born where.

        ``"backward dot_general at model.py:88 (in flax/nnx/nn/linear.py:233),
        iteration 5: inf (float16)"``; ``"argument [0]['b']: nan (float32)"``;
        ``"a value the function closes over, shape (32, 8): inf (float32)"``; or
        ``"no inf or NaN reached the outputs of this call"``.
        """
        if is_traced(self.record.found):
            raise TypeError(
                "describe() reads the report on the host; return the report from the "
                "jitted function and call describe() outside"
            )
        record = jax.device_get(self.record)
        if not bool(record.found):
            return "no inf or NaN reached the outputs of this call"
        origin = self.origins[int(record.entry)]
        where = origin.text()
        if int(record.iteration) >= 0:
            where += f", iteration {int(record.iteration)}"
        return f"{where}: {_KIND_WORDS[int(record.kind)]} ({origin.dtype})"

    def __repr__(self) -> str:
        if is_traced(self.record.found):
            return f"NonfiniteReport(<traced>, {len(self.origins)} possible origins)"
        return f"NonfiniteReport({self.describe()!r})"


def nonfinite_code(value: Any) -> jax.Array:
    """int32 scalar: ``NAN`` if ``value`` holds a NaN, plus ``INF`` if it holds an infinity.

    0 for values that are not floating (integers, booleans, keys).
    """
    if not is_floating(value):
        return jnp.zeros((), jnp.int32)
    if np.ndim(value) == 0 and not is_traced(value):
        known = np.asarray(value)
        return jnp.asarray(NAN * bool(np.isnan(known)) + INF * bool(np.isinf(known)), jnp.int32)
    return nonfinite_codes([value])[0]


# Values of one shape and dtype whose codes one reduction computes: fewer kernels for
# XLA to compile than a reduction per value, each still small (cf. the scaler's check).
_CODES_PER_REDUCTION = 8


def nonfinite_codes(values: list[Any]) -> list[jax.Array]:
    """:func:`nonfinite_code` of each of ``values`` (floating arrays), computed together:
    the values of one shape and dtype, a few at a time, in one reduction of several
    operands (which XLA's CPU backend also leaves whole, where it splits a reduction of
    one operand into three kernels)."""
    groups: dict[tuple[Any, Any, Any], list[int]] = {}
    for i, value in enumerate(values):
        key = (np.shape(value), np.dtype(value.dtype), foreign_mesh(value))
        groups.setdefault(key, []).append(i)
    codes: list[Any] = [None] * len(values)
    for (_, _, mesh), members in groups.items():
        # a value computed on a mesh of other axis types (a float8 matmul's, made with
        # explicit axes automatic) is checked on its own, its codes retyped after
        with on_mesh(mesh):
            _codes_of_group(values, members, codes)
        for i in members if mesh is not None else ():
            codes[i] = replicated_here(codes[i])
    return codes


def _codes_of_group(values: list[Any], members: list[int], codes: list[Any]) -> None:
    """:func:`nonfinite_codes` of the ``members`` of ``values`` (one shape and dtype),
    written into ``codes``."""
    if members:
        for start in range(0, len(members), _CODES_PER_REDUCTION):
            chunk = members[start : start + _CODES_PER_REDUCTION]
            # whether each value holds an infinity, and whether a NaN: maxima of each
            # element's flags (a maximum, which every platform's all-reduce computes
            # where a value is sharded; XLA's CPU collectives refuse a bitwise or)
            flags = [flag for i in chunk for flag in _flags(values[i])]
            reduced = lax.reduce(
                tuple(flags), (np.int8(0),) * len(flags), _max_each, tuple(range(flags[0].ndim))
            )
            for k, i in enumerate(chunk):
                infinity, nan = reduced[2 * k], reduced[2 * k + 1]
                codes[i] = infinity.astype(jnp.int32) * INF + nan.astype(jnp.int32) * NAN


def _max_each(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(lax.max(x, y) for x, y in zip(a, b, strict=True))


def _flags(value: Any) -> tuple[jax.Array, jax.Array]:
    """Whether each element is infinite, and whether it is a NaN, as int8 (0 or 1), in
    ``lax`` operations: ``jnp.isnan`` and friends are jitted functions, each a function
    of its own in the lowered program, and a located program reads hundreds of values."""
    value = jnp.asarray(value)
    if _has_infinity(value.dtype):
        infinity = lax.convert_element_type(
            lax.eq(lax.abs(value), lax.full_like(value, np.inf)), jnp.int8
        )
    else:
        infinity = lax.full_like(value, 0, jnp.int8)
    return infinity, lax.convert_element_type(lax.ne(value, value), jnp.int8)


def _has_infinity(dtype: Any) -> bool:
    """Whether ``dtype`` holds an infinity (``float8_e4m3fn`` and the MX element types
    do not: their infinity rounds to NaN or saturates)."""
    return bool(np.isinf(np.asarray(np.inf).astype(dtype)))


def is_floating(value: Any) -> bool:
    """Whether ``value`` has a floating dtype (not integers, booleans or keys)."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and is_floating_dtype(dtype)


def is_floating_dtype(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes (keys)
        return False
