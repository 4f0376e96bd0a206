"""``stochastic_rounding``: half-precision parameters written with stochastic rounding,
as torchao's optimizers write bfloat16 parameters (``bf16_stochastic_round=True``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale.optim._stochastic_round import TARGETS, stochastic_round
from jaxscale.optim._widened import float32_state
from jaxscale.optim._wrapping import (
    PARAMETER_WRITERS,
    require_no_writer_inside,
    require_params,
    validated_inner,
)


class StochasticRoundingState(NamedTuple):
    """State of :func:`stochastic_rounding`.

    Attributes:
      key: the PRNG key the next applied step draws its random bits from.
      inner_state: the wrapped optimizer's state, in the dtypes it keeps for the
        parameters (or ``state_dtype``).
    """

    key: jax.Array
    inner_state: Any


PARAMETER_WRITERS[StochasticRoundingState] = "stochastic_rounding"


def stochastic_rounding(
    inner: optax.GradientTransformation, *, key: jax.Array, state_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Run ``inner`` in float32 and write each bfloat16 or float16 parameter as
    ``stochastic_round(float32(p) + float32(u))``.

    That is torchao's write of a bfloat16 parameter (``_AdamW(...,
    bf16_stochastic_round=True)``): the new value is one of the two half-precision
    numbers around the float32 result, the farther one with probability equal to the
    fraction of the gap it lies beyond the nearer one, so the parameter moves by the
    update in expectation even when the update is far below its ulp. ``inner`` sees
    gradients and parameters widened to float32, as torchao computes. The updates
    returned make ``optax.apply_updates(params, updates)`` land on the rounded values
    (the difference of two neighbouring half-precision numbers is exact in float32).
    Parameters of float32 or wider get ``inner``'s updates unchanged.

    ``inner``'s state keeps the dtypes ``inner`` gives it for the parameters as they
    are (``optax.adamw`` on bfloat16 parameters: bfloat16 moments, as torchao's
    ``_AdamW`` keeps them): each update widens it to float32 for ``inner`` and rounds
    the new state back to nearest. ``state_dtype=jnp.float32`` keeps it in float32
    instead (``optax.adamw(..., mu_dtype=jnp.float32)`` does that for the first
    moment alone).

    The key lives in the state and is split on every update; under
    :func:`jaxscale.grad_scaler` a skipped step leaves it unchanged with the rest of
    the state, so the same draws are used by the next applied step. Each parameter's
    draws come from the step's key folded with the parameter's index, drawn in the
    parameter's shape: a sharded parameter draws its shard's bits on its own device,
    and the draws do not depend on the mesh.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      key: a JAX PRNG key (``jax.random.key(0)`` or ``jax.random.PRNGKey(0)``).
      state_dtype: ``None`` (``inner``'s own dtypes), or a floating dtype or its name
        for every floating leaf of ``inner``'s state.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`StochasticRoundingState`.

    Raises:
      TypeError: for an ``inner`` that is not an Optax transform, or a ``key`` that
        is not a PRNG key.
      ValueError: from ``update`` called without ``params``; for a ``state_dtype``
        that is not floating.

    >>> import jax, jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
    >>> tx = jaxscale.stochastic_rounding(optax.sgd(1e-3), key=jax.random.key(0))
    >>> state = tx.init(params)
    >>> for _ in range(10):  # each step is a tenth of bfloat16's ulp at 1.0
    ...     updates, state = tx.update({"w": jnp.ones(1000, jnp.bfloat16)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> round(float(params["w"].astype(jnp.float32).mean()), 3)  # 1 - 10 * 1e-3 on average
    0.99
    """
    inner = validated_inner(inner, "stochastic_rounding")
    _check_key(key)
    widened_state = float32_state(inner, "stochastic_rounding", state_dtype)

    def init_fn(params: optax.Params) -> StochasticRoundingState:
        inner_state = widened_state.init(params)
        require_no_writer_inside(inner_state, "stochastic_rounding")
        return StochasticRoundingState(key, inner_state)

    def update_fn(
        updates: optax.Updates,
        state: StochasticRoundingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, StochasticRoundingState]:
        require_params(params, "stochastic_rounding")
        next_key, step_key = jax.random.split(state.key)
        # one key per leaf: the step's key folded with the leaf's index
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.tree.unflatten(
            treedef, [jax.random.fold_in(step_key, index) for index in range(len(leaves))]
        )

        def rounded(inner_updates: Any, wide_params: Any, keys: Any) -> tuple[Any, Any]:
            # computed with the inner update (slice by slice where its state is), so that
            # the float32 sum is not written out whole
            return jax.tree.map(_rounded, params, wide_params, inner_updates, keys), keys

        # (the keys passed beside the state, not closed over: an update that retypes its
        # arrays for a mesh, as on explicit mesh axes, retypes them too)
        written, (inner_state, _) = widened_state.update(
            updates, state.inner_state, params, finish=rounded, beside=keys, **extra_args
        )
        written = jax.tree.map(_as_update, params, written)
        return written, StochasticRoundingState(next_key, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _rounded(param: Any, wide: Any, update: Any, key: jax.Array) -> Any:
    """``SR(float32(param) + update)`` in ``param``'s dtype, for a half-precision
    ``param`` (``wide`` is it in float32); ``update`` for any other."""
    dtype = getattr(param, "dtype", None)
    if dtype is None or np.dtype(dtype) not in TARGETS:
        return update
    return stochastic_round(wide + update.astype(jnp.float32), dtype, key=key)


def _as_update(param: Any, written: Any) -> Any:
    """The float32 update that takes ``param`` to ``written`` (a rounded half-precision
    parameter: the difference of two neighbouring half-precision numbers is exact in
    float32), or ``written`` itself, an update, for any other parameter."""
    dtype = getattr(param, "dtype", None)
    if dtype is None or np.dtype(dtype) not in TARGETS:
        return written
    return written.astype(jnp.float32) - param.astype(jnp.float32)


def _check_key(key: Any) -> None:
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == np.uint32 and getattr(key, "shape", None) == (2,)
    if not (typed or raw):
        raise TypeError(
            "key must be a JAX PRNG key, e.g. key=jax.random.key(0), got "
            f"{type(key).__name__} {key!r}"
        )
