"""Skipping a step: keep the state from before it and emit updates that change nothing."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def skipped_update(update: jax.Array) -> jax.Array:
    """The update emitted for a skipped step: ``-0.0`` for floats, ``0`` otherwise.

    ``-0.0`` rather than ``+0.0``: ``p + (-0.0) == p`` bitwise for every float
    ``p``, including ``p == -0.0``, so ``optax.apply_updates`` leaves parameters
    exactly as they were.
    """
    if jnp.issubdtype(update.dtype, jnp.floating):
        return jnp.full_like(update, -0.0)
    return jnp.zeros_like(update)


def mask_updates(found_inf: jax.Array, updates: Any) -> Any:
    """``updates``, or :func:`skipped_update` of each leaf when ``found_inf``."""
    return jax.tree.map(lambda u: jnp.where(found_inf, skipped_update(u), u), updates)


def keep_unless(found_inf: jax.Array, before: Any, after: Any) -> Any:
    """``before`` when ``found_inf`` (the step is skipped), else ``after``, leaf by leaf."""
    return jax.tree.map(lambda old, new: jnp.where(found_inf, old, new), before, after)
