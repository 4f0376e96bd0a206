"""``kahan_summation``: half-precision parameters updated with a compensation buffer.

Kahan summation (as optimi's ``kahan_sum`` applies it to an optimizer) keeps, next to
each half-precision parameter, a buffer of the same dtype holding what rounding the
parameter lost. Each step adds the update to the buffer, adds the buffer to the
parameter, and keeps in the buffer what that addition rounded away, so the
parameter follows the float32 sum of the updates to within about one of its ulps,
for two bytes per parameter instead of a float32 master's four.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxscale.optim._widened import float32_state
from jaxscale.optim._wrapping import (
    PARAMETER_WRITERS,
    is_narrower,
    map_with_optional,
    require_no_writer_inside,
    require_params,
    validated_inner,
)


class KahanSummationState(NamedTuple):
    """State of :func:`kahan_summation`.

    Attributes:
      compensation: a tree like the parameters: for each floating parameter narrower
        than float32, what its updates lost to rounding so far, in its dtype;
        ``None`` for the other leaves.
      inner_state: the wrapped optimizer's state, in the dtypes it keeps for the
        parameters (or ``state_dtype``).
    """

    compensation: Any
    inner_state: Any


PARAMETER_WRITERS[KahanSummationState] = "kahan_summation"


def kahan_summation(
    inner: optax.GradientTransformation, *, state_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Run ``inner`` in float32 and add its updates to each half-precision parameter
    with Kahan summation.

    For a parameter ``p`` narrower than float32 with compensation ``c`` (same dtype,
    zero at first) and ``inner``'s float32 update ``u``, in float32 arithmetic as
    optimi's fused kernel computes it::

        c32 = float32(c) + u
        p_new = round(float32(p) + float32(round(c32)))    # round: to p's dtype
        c_new = round((c32 + float32(p)) - float32(p_new))

    and the update returned is ``float32(p_new) - float32(p)``, so that
    ``optax.apply_updates`` lands on ``p_new`` exactly. Over many steps ``p`` stays
    within about one ulp of ``float32(p0)`` plus the float32 sum of ``inner``'s
    updates. float32 (and wider) parameters get ``inner``'s updates and no buffer.

    ``inner`` sees gradients and parameters widened to float32, and its state keeps
    the dtypes ``inner`` gives it for the parameters as they are (bfloat16 moments for
    bfloat16 parameters, as optimi keeps them), widened for each update and rounded
    back to nearest; ``state_dtype=jnp.float32`` keeps it in float32 instead.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      state_dtype: ``None`` (``inner``'s own dtypes), or a floating dtype or its name
        for every floating leaf of ``inner``'s state.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`KahanSummationState`.

    Raises:
      TypeError: for an ``inner`` that is not an Optax transform.
      ValueError: from ``update`` called without ``params``; for a ``state_dtype`` that
        is not floating.

    >>> import jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> tx = jaxscale.kahan_summation(optax.sgd(1e-3))
    >>> state = tx.init(params)
    >>> for _ in range(10):  # each step is a tenth of bfloat16's ulp at 1.0
    ...     updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> params["w"].tolist()  # 0.99 to bfloat16's nearest; round to nearest alone stays at 1.0
    [0.98828125, 0.98828125]
    """
    inner = validated_inner(inner, "kahan_summation")
    widened_state = float32_state(inner, "kahan_summation", state_dtype)

    def init_fn(params: optax.Params) -> KahanSummationState:
        compensation = jax.tree.map(
            lambda p: jnp.zeros_like(p) if is_narrower(p, jnp.float32) else None, params
        )
        inner_state = widened_state.init(params)
        require_no_writer_inside(inner_state, "kahan_summation")
        return KahanSummationState(compensation, inner_state)

    def update_fn(
        updates: optax.Updates,
        state: KahanSummationState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, KahanSummationState]:
        require_params(params, "kahan_summation")

        def summed(inner_updates: Any, wide_params: Any, compensation: Any) -> tuple[Any, Any]:
            # computed with the inner update (slice by slice where its state is), so that
            # the float32 sums are not written out whole
            steps = map_with_optional(_kahan_step, compensation, inner_updates, wide_params, params)
            is_step = lambda node: isinstance(node, _Step)  # noqa: E731
            written = jax.tree.map(lambda step: step.written, steps, is_leaf=is_step)
            compensation = jax.tree.map(lambda step: step.compensation, steps, is_leaf=is_step)
            return written, compensation

        written, (inner_state, compensation) = widened_state.update(
            updates,
            state.inner_state,
            params,
            finish=summed,
            beside=state.compensation,
            **extra_args,
        )
        new_updates = map_with_optional(_as_update, compensation, written, params)
        return new_updates, KahanSummationState(compensation, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _Step(NamedTuple):
    written: Any  # the new half-precision parameter, or the float32 update of another
    compensation: Any  # the new compensation in float32 (stored rounded), or None


def _kahan_step(compensation: Any, update: Any, wide: Any, param: Any) -> _Step:
    """One parameter's Kahan step from its compensation (widened to float32, ``None``
    for a parameter that keeps none), ``inner``'s update and the parameter in float32."""
    if compensation is None:
        return _Step(update, None)
    dtype = param.dtype
    total = compensation + update.astype(jnp.float32)
    new_param = (wide + total.astype(dtype).astype(jnp.float32)).astype(dtype)
    # (rounded to the compensation's dtype where it is stored, as optimi rounds it)
    return _Step(new_param, (total + wide) - new_param.astype(jnp.float32))


def _as_update(compensation: Any, written: Any, param: Any) -> Any:
    """The float32 update that takes ``param`` to ``written``, its new value (exact in
    float32), where ``param`` keeps a compensation; ``written``, an update, elsewhere."""
    if compensation is None:
        return written
    return written.astype(jnp.float32) - param.astype(jnp.float32)
