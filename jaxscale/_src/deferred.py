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
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

# id of a derived value -> (the value itself, its source, the function of the source)
_DERIVED: contextvars.ContextVar[dict[int, tuple[Any, Any, Callable[[Any], Any]]]] = (
    contextvars.ContextVar("jaxscale_elementwise_derived", default={})  # noqa: B039
)


@contextlib.contextmanager
def derived_elementwise(
    derived: Any, sources: Any, function: Callable[[Any], Any]
) -> Iterator[None]:
    """Within the block, each leaf of ``derived`` is known as ``function(source)`` of the
    leaf of ``sources`` in its place (same tree), elementwise: ``function`` of a slice of
    the source is that slice of the derived leaf. Leaves that are their source, or of
    another shape, are not recorded."""
    known = dict(_DERIVED.get())
    for value, source in zip(jax.tree.leaves(derived), jax.tree.leaves(sources), strict=True):
        if value is not source and np.shape(value) == np.shape(source):
            known[id(value)] = (value, source, function)
    token = _DERIVED.set(known)
    try:
        yield
    finally:
        _DERIVED.reset(token)


def elementwise_origin(value: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """``(source, function)`` with ``value == function(source)`` elementwise, following
    a value derived from a derived value back to the first source; ``None`` for a value
    not recorded by :func:`derived_elementwise`."""
    known = _DERIVED.get()
    functions: list[Callable[[Any], Any]] = []
    while (entry := known.get(id(value))) is not None and entry[0] is value:
        value, function = entry[1], entry[2]
        functions.append(function)
    if not functions:
        return None

    def composed(piece: Any) -> Any:
        for function in reversed(functions):
            piece = function(piece)
        return piece

    return value, composed
