"""The loss scaler's state: a pytree of fixed-dtype scalar arrays."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxscale import _validation


class ScalerState(NamedTuple):
    """Dynamic loss-scale state; every field is a 0-d array of fixed dtype.

    Hyperparameters (growth factor, interval, ...) are static configuration and
    never live here, so the state's structure, shapes and dtypes are the same at
    every step: it can be a ``lax.scan`` carry, be donated, or be checkpointed.

    Attributes:
      scale: float32. The current loss scale.
      growth_tracker: int32. Consecutive finite steps since the scale last grew
        or backed off (PyTorch's ``_growth_tracker``).
      overflow_streak: int32. Consecutive overflowing steps tolerated without
        backing off, saturating at ``hysteresis - 1``; always 0 with the default
        ``hysteresis=1`` (PyTorch's rule).
    """

    scale: jax.Array
    growth_tracker: jax.Array
    overflow_streak: jax.Array


def init_scaler_state(init_scale: Any = 2.0**16, growth_tracker: Any = 0) -> ScalerState:
    """Return the initial :class:`ScalerState`.

    Args:
      init_scale: the initial loss scale, rounded to float32 as PyTorch does
        (``torch.full((), init_scale, dtype=torch.float32)``). Must be positive
        and finite in float32.
      growth_tracker: the initial count of consecutive finite steps (PyTorch's
        ``_growth_tracker``, e.g. from a checkpoint). Must be in ``[0, 2**31)``.

    Returns:
      A :class:`ScalerState` with a float32 scale and int32 trackers.

    >>> from jaxscale import init_scaler_state
    >>> state = init_scaler_state(1024.0)
    >>> float(state.scale), int(state.growth_tracker)
    (1024.0, 0)
    """
    scale = _validation.positive_float32("init_scale", init_scale)
    tracker = _validation.as_int("growth_tracker", growth_tracker)
    if not 0 <= tracker < 2**31:
        raise ValueError(f"growth_tracker must be in [0, 2**31), got {tracker!r}")
    return ScalerState(
        scale=jnp.asarray(scale, dtype=jnp.float32),
        growth_tracker=jnp.asarray(tracker, dtype=jnp.int32),
        overflow_streak=jnp.zeros((), dtype=jnp.int32),
    )
