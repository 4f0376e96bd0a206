"""State a Flax Linen or Haiku module writes keeps the dtype it was traced with.

PyTorch's autocast leaves a module's buffers in their dtype: a running statistic or
a power iteration's vector is updated in place (``buffer.copy_(value)``), which
casts the new value to the buffer's own dtype. A Linen module returns its updated
variables from ``apply(..., mutable=...)`` instead, and a Haiku module its state
from ``apply``, as values like any other, so under autocast a value computed by a
matmul (``SpectralNorm``'s ``sigma``) would come back float16, change the state's
dtype from that step on, and no longer fit a ``lax.scan`` carry or the ``jit``
compiled for the first step.

While autocast traces a function, each value written over a Linen variable the
call was given (``Scope.put_variable`` of an existing variable:
``self.variable(...).value = ...``, BatchNorm's statistics) and each value of
``hk.set_state`` passes through :data:`STATE_WRITE`, an identity that autocast's
interpreter replaces with a cast to the value's traced dtype. Variables a Linen
call creates (captured intermediates, ``sow``) are left alone. An NNX module's
variables and an Equinox ``State`` are kept in their dtypes where the call's
state and results are read (``jaxscale._src.stateful_call``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale._src.jaxprs import identity_primitive
from jaxscale.casting._interpreter import HIGHER_ORDER, Autocaster, Tag

STATE_WRITE = identity_primitive("jaxscale_state_write")
"""Marks a value written over a module's variable, inside a function autocast traces."""


def _marked(value: Any) -> Any:
    if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.floating):
        return STATE_WRITE.bind(value)
    return value


@contextlib.contextmanager
def state_writes_marked() -> Iterator[None]:
    """While it is open, the writes of Linen and Haiku modules to their state are
    marked (each a no-op when that library was never imported)."""
    with contextlib.ExitStack() as stack:
        haiku_base = sys.modules.get("haiku._src.base")
        if haiku_base is not None:
            # Haiku's stack of state setters (what hk.custom_setter pushes, which
            # only works inside a transformed function): every hk.set_state value
            stack.enter_context(haiku_base.state_setter_stack(_marking_setter))
        scope = getattr(sys.modules.get("flax.core.scope"), "Scope", None)
        if scope is not None:
            stack.enter_context(_marking_put_variable(scope))
        yield


def _marking_setter(next_setter: Any, value: Any, context: Any) -> Any:
    del context
    return next_setter(jax.tree.map(_marked, value))


@contextlib.contextmanager
def _marking_put_variable(scope: Any) -> Iterator[None]:
    put_variable = scope.put_variable

    def marking_put_variable(self: Any, col: str, name: str, value: Any) -> Any:
        if self.has_variable(col, name):
            value = jax.tree.map(_marked, value)
        return put_variable(self, col, name, value)

    scope.put_variable = marking_put_variable
    try:
        yield
    finally:
        scope.put_variable = put_variable


def _written_in_its_traced_dtype(
    autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]
) -> tuple[list[Any], list[Tag]]:
    # the mark is not bound again: the value leaves in the dtype it was traced with
    return [autocaster.cast(invals[0], eqn.invars[0].aval.dtype, in_tags[0])], [in_tags[0]]


HIGHER_ORDER[STATE_WRITE.name] = _written_in_its_traced_dtype
