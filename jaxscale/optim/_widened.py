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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale._src.cpu_backend import loops_over_bfloat16
from jaxscale._src.deferred import derived_elementwise
from jaxscale._src.jaxprs import is_traced
from jaxscale.optim._in_place import AS_IS, Slot, update_in_place
from jaxscale.optim._wrapping import as_float32_where_narrower, floating_dtype

# (inner's updates, the float32 parameters, the wrapper's own state widened) -> (the
# updates to return, the wrapper's new state)
Finish = Callable[[Any, Any, Any], tuple[Any, Any]]


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
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None = None,
        *,
        finish: Finish | None = None,
        beside: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, Any]:
        """``inner``'s updates and new state. With ``finish``, a wrapping transform's own
        step computed with ``inner``'s (slice by slice where the state is, so that its
        float32 values are not written out whole): ``finish(inner's updates, the
        float32 parameters, beside widened)`` gives the updates returned and ``beside``'s
        new value (float32 where it is narrower, stored back in its own dtypes), and the
        new state returned is ``(inner's, beside's)``."""
        inner_slots = jax.tree.map(_slot_of, state)
        beside_slots = jax.tree.map(_slot_of, beside)
        # Where no loop would run over a bfloat16 state (XLA's CPU backend before jaxlib
        # 0.11.2; an eager call), the wrapper's step is computed after inner's, on whole
        # arrays, which XLA fuses keeping less than both in one program (Kahan: 6.04
        # bytes/param against 6.72)
        eager = not any(is_traced(leaf) for leaf in jax.tree.leaves(updates))
        apart = finish is not None and (eager or not loops_over_bfloat16())

        def update(updates: Any, wide_state: Any, params: Any) -> Any:
            if finish is None or apart:
                return inner.update(updates, wide_state, params, **extra_args)
            inner_state, wide_beside = wide_state
            new_updates, new_state = inner.update(updates, inner_state, params, **extra_args)
            new_updates, new_beside = finish(new_updates, params, wide_beside)
            return new_updates, (new_state, new_beside)

        if finish is None or apart:
            stored, slots = state, inner_slots
        else:
            stored, slots = (state, beside), (inner_slots, beside_slots)
        wide_updates = as_float32_where_narrower(updates)
        wide_params = as_float32_where_narrower(params)
        # the casts are made slice by slice where the state is updated in slices
        with (
            derived_elementwise(wide_updates, updates, _as_float32),
            derived_elementwise(wide_params, params, _as_float32),
        ):
            results = update_in_place(update, wide_updates, stored, slots, (wide_params,))
        if not apart:
            return results
        assert finish is not None
        new_updates, new_state = results
        wide_beside = jax.tree.map(lambda slot, leaf: slot.widened(leaf), beside_slots, beside)
        new_updates, new_beside = finish(new_updates, wide_params, wide_beside)
        new_beside = jax.tree.map(
            lambda slot, new, old: slot.narrowed(new, old), beside_slots, new_beside, beside
        )
        return new_updates, (new_state, new_beside)

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
    if _is_floating_array(leaf) and np.dtype(leaf.dtype) in _HALF and np.ndim(leaf):
        return Slot("cast", dtype=np.dtype(leaf.dtype))
    return AS_IS
