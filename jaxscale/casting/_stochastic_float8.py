"""float32 to float8 with stochastic rounding: to one of the two float8 values around
``x``, the farther from zero with probability proportional to how near ``x`` is to it,
so the rounding is unbiased.

For the gradient operands of the float8 and MX recipes
(``Float8Recipe(stochastic_gradients=True)``): a float8 gradient rounded to nearest
loses every contribution below half a step; rounded stochastically it keeps them in
expectation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.threefry import random_uniform


def stochastic_to_float8(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """``x`` (float32, already scaled and within the format's range) in ``dtype``
    (``float8_e4m3fn`` or ``float8_e5m2``), rounded stochastically from ``key``.

    The result is ``x`` when ``x`` is a float8 value, else one of its two float8
    neighbours: the one farther from zero with probability ``(|x| - |lower|) / (|upper|
    - |lower|)``. Infinities and NaNs round as a cast does. The draws are in ``x``'s
    shape (a shard's on its own device)."""
    target = np.dtype(dtype)
    nearest = x.astype(target)
    code = lax.bitcast_convert_type(nearest, jnp.uint8)
    magnitude = jnp.abs(x)
    # float8's codes order magnitudes within a sign: the neighbour nearer zero is the
    # nearest value, or the code below it when the nearest is farther from zero
    overshoots = jnp.abs(nearest.astype(jnp.float32)) > magnitude
    lower_code = jnp.where(overshoots, code - 1, code)
    lower = lax.bitcast_convert_type(lower_code, target)
    upper = lax.bitcast_convert_type(lower_code + 1, target)
    lower_magnitude = jnp.abs(lower.astype(jnp.float32))
    gap = jnp.abs(upper.astype(jnp.float32)) - lower_magnitude
    exact = magnitude == lower_magnitude  # a float8 value (also the largest: no upper)
    probability = jnp.where(exact, 0.0, (magnitude - lower_magnitude) / jnp.where(exact, 1.0, gap))
    draws = random_uniform(key, x.shape)
    rounded = jnp.where(draws < probability, upper, lower)
    return jnp.where(jnp.isfinite(x), rounded, nearest)
