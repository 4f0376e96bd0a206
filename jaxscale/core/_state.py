"""The loss scaler's state: a pytree of fixed-dtype scalar arrays, shared by every interface."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxscale._src import validation as _validation


class ScalerState(NamedTuple):
    """Dynamic loss-scale state; every field is a 0-d array of fixed dtype.

    Hyperparameters (growth factor, interval, ...) are static configuration and
    never live here, so the state's structure, shapes and dtypes are the same at
    every step: it can be a ``lax.scan`` carry, be donated, or be checkpointed.
    The Optax transform and the ``GradScaler`` facade both keep exactly this
    state, updated by :func:`~jaxscale.update_scale`.

    Attributes:
      scale: float32. The current loss scale.
      growth_tracker: int32. Consecutive finite steps since the scale last grew
        or backed off (PyTorch's ``_growth_tracker``).
      overflow_streak: int32. Consecutive overflowing steps tolerated without
        backing off, saturating at ``hysteresis - 1``; always 0 with the default
        ``hysteresis=1`` (PyTorch's rule).
      found_inf: bool. Whether the last step's gradients held an inf or NaN, so
        that it was skipped.
      skipped_steps: int32. Steps skipped since the start, saturating at
        ``2**31 - 1``.
    """

    scale: jax.Array
    growth_tracker: jax.Array
    overflow_streak: jax.Array
    found_inf: jax.Array
    skipped_steps: jax.Array


def init_scaler_state(
    init_scale: Any = 2.0**16, growth_tracker: Any = 0, *, skipped_steps: Any = 0
) -> ScalerState:
    """Return the initial :class:`ScalerState`.

    Args:
      init_scale: the initial loss scale, rounded to float32 as PyTorch does
        (``torch.full((), init_scale, dtype=torch.float32)``). Must be positive
        and finite in float32.
      growth_tracker: the initial count of consecutive finite steps (PyTorch's
        ``_growth_tracker``, e.g. from a checkpoint). Must be in ``[0, 2**31)``.
      skipped_steps: the initial count of skipped steps (e.g. from a
        checkpoint). Must be in ``[0, 2**31)``.

    Returns:
      A :class:`ScalerState` with a float32 scale, int32 counters and
      ``found_inf`` False.

    >>> from jaxscale import init_scaler_state
    >>> state = init_scaler_state(1024.0)
    >>> float(state.scale), int(state.growth_tracker), bool(state.found_inf)
    (1024.0, 0, False)
    """
    scale = _validation.positive_float32("init_scale", init_scale)
    tracker = _validation.int32_count("growth_tracker", growth_tracker)
    skipped = _validation.int32_count("skipped_steps", skipped_steps)
    return ScalerState(
        scale=jnp.asarray(scale, dtype=jnp.float32),
        growth_tracker=jnp.asarray(tracker, dtype=jnp.int32),
        overflow_streak=jnp.zeros((), dtype=jnp.int32),
        found_inf=jnp.asarray(False),
        skipped_steps=jnp.asarray(skipped, dtype=jnp.int32),
    )
