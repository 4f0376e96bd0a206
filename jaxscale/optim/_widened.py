"""An optimizer run in float32 on half-precision parameters, its state kept narrow.

:func:`stochastic_rounding` and :func:`kahan_summation` run their wrapped optimizer on
float32 copies of bfloat16 or float16 parameters and gradients, as torchao and optimi
compute, and write the parameters their own way. The wrapped optimizer's state keeps
the dtypes it has for the parameters as they are (``optax.adamw`` on bfloat16
parameters keeps bfloat16 moments, as torchao's ``_AdamW`` does): each update widens
it to float32 and rounds the new state back to nearest, leaf by leaf
(:mod:`jaxscale.optim._in_place`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale._src.deferred import derived_elementwise
from jaxscale.optim._in_place import AS_IS, Slot, update_in_place
from jaxscale.optim._wrapping import as_float32_where_narrower, floating_dtype


def float32_state(
    inner: optax.GradientTransformationExtraArgs, transform: str, state_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    """``inner`` computing in float32: ``update`` widens the gradients, the parameters and
    the state, and stores the new state in the dtypes ``init`` gave it: ``inner``'s own
    for the parameters, or ``state_dtype`` for every floating leaf."""
    dtype = None if state_dtype is None else floating_dtype(state_dtype, "state_dtype")
    del transform

    def init_fn(params: optax.Params) -> Any:
        state = inner.init(params)
        if dtype is None:
            return state
        return jax.tree.map(
            lambda leaf: leaf.astype(dtype) if _is_floating_array(leaf) and leaf.ndim else leaf,
            state,
        )

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, Any]:
        slots = jax.tree.map(_slot_of, state)

        def update(updates: Any, wide_state: Any, params: Any) -> Any:
            return inner.update(updates, wide_state, params, **extra_args)

        wide_updates = as_float32_where_narrower(updates)
        wide_params = as_float32_where_narrower(params)
        # the casts are made slice by slice where the state is updated in slices
        with (
            derived_elementwise(wide_updates, updates, _as_float32),
            derived_elementwise(wide_params, params, _as_float32),
        ):
            return update_in_place(update, wide_updates, state, slots, (wide_params,))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as_float32(leaf: Any) -> Any:
    return leaf.astype(jnp.float32)


def _is_floating_array(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _slot_of(leaf: Any) -> Slot:
    """Widened and narrowed back for a half-precision array; as it is otherwise (scalars,
    float32, and the float8 or integer codes of a state that stores itself, such as
    :func:`jaxscale.low_precision_state`'s)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and np.dtype(dtype) in _HALF and np.ndim(leaf):
        return Slot("cast", dtype=np.dtype(dtype))
    return AS_IS
