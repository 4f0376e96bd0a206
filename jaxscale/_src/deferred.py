"""Values a transform computed elementwise from another, recomputable slice by slice.

A transform that hands its inner optimizer a function of the gradients (a loss
scaler's unscaled gradients, ``master_weights``' float32 casts) writes that function's
result out in full when the inner optimizer reads it from a loop, as
``low_precision_state`` does when it updates its state a slice at a time: XLA fuses an
elementwise producer into its consumers, but not into a loop that slices it. The
transform names such a value here while the inner optimizer is traced, and the loop
then slices the source and applies the function to each slice: the same operations on
the same elements, so the same values, and nothing of the gradients' size written.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

# id of a derived value -> (the value itself, its source, the function of the source and
# of the constants, the constants)
_Entry = tuple[Any, Any, Callable[..., Any], tuple[Any, ...]]
_DERIVED: contextvars.ContextVar[dict[int, _Entry]] = contextvars.ContextVar(
    "jaxscale_elementwise_derived",
    default={},  # noqa: B039
)


@contextlib.contextmanager
def derived_elementwise(
    derived: Any, sources: Any, function: Callable[..., Any], *constants: Any
) -> Iterator[None]:
    """Within the block, each leaf of ``derived`` is known as ``function(source,
    *constants)`` of the leaf of ``sources`` in its place (same tree), elementwise:
    ``function`` of a slice of the source is that slice of the derived leaf. The
    ``constants`` (a loss scaler's inverse scale) are the arrays ``function`` reads
    beside the source, passed rather than closed over, so that a caller that retypes
    arrays for a computation can retype them too. Leaves that are their source, or of
    another shape, are not recorded."""
    known = dict(_DERIVED.get())
    for value, source in zip(jax.tree.leaves(derived), jax.tree.leaves(sources), strict=True):
        if value is not source and np.shape(value) == np.shape(source):
            known[id(value)] = (value, source, function, constants)
    token = _DERIVED.set(known)
    try:
        yield
    finally:
        _DERIVED.reset(token)


def elementwise_chain(
    value: Any,
) -> tuple[Any, list[tuple[Callable[..., Any], tuple[Any, ...]]]] | None:
    """``(source, steps)``: the first source ``value`` was derived from, and the
    ``(function, constants)`` that derive it, first applied first; ``None`` for a value
    not recorded by :func:`derived_elementwise`."""
    known = _DERIVED.get()
    steps: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    while (entry := known.get(id(value))) is not None and entry[0] is value:
        value = entry[1]
        steps.append((entry[2], entry[3]))
    if not steps:
        return None
    return value, steps[::-1]


def applied(steps: list[tuple[Callable[..., Any], tuple[Any, ...]]], piece: Any) -> Any:
    """``piece`` through each of :func:`elementwise_chain`'s ``steps`` in turn."""
    for function, constants in steps:
        piece = function(piece, *constants)
    return piece


def elementwise_origin(value: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """``(source, function)`` with ``value == function(source)`` elementwise, following
    a value derived from a derived value back to the first source; ``None`` for a value
    not recorded by :func:`derived_elementwise`."""
    chain = elementwise_chain(value)
    if chain is None:
        return None
    source, steps = chain
    return source, functools.partial(applied, steps)
