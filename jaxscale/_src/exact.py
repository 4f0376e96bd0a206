"""Float32 divisions rounded once, as torch computes them, where XLA would not.

XLA's algebraic simplifier turns a division by a constant, or by a broadcast value,
into a multiplication by its reciprocal: two roundings, which land one float32 ulp off
the correctly rounded quotient in about a third of cases. A quantizer that must equal
torch's bit for bit divides through an operand the simplifier cannot see through.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def divide_exactly(numerator: jax.Array, denominator: Any) -> jax.Array:
    """``numerator / denominator`` (the latter broadcast to the former's shape) correctly
    rounded: the divisor passes through a select on the numerator (a NaN numerator is
    divided by one, which keeps it NaN), which the simplifier does not rewrite."""
    denominator = jnp.broadcast_to(denominator, numerator.shape)
    return numerator / jnp.where(jnp.isnan(numerator), np.float32(1), denominator)


def divide_by_constant(numerator: jax.Array, constant: Any) -> jax.Array:
    """``numerator / constant`` correctly rounded, the constant held behind an
    optimization barrier: for an array of a few elements (one per block), which the
    barrier materialises."""
    held = lax.optimization_barrier(jnp.full(numerator.shape, constant, jnp.float32))
    return numerator / held
