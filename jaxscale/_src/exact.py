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


def divide_exactly(numerator: jax.Array, denominator: Any) -> jax.Array:
    """``numerator / denominator`` (the latter broadcast to the former's shape) correctly
    rounded: the divisor passes through a select on the numerator (a NaN numerator is
    divided by one, which keeps it NaN), which the simplifier does not rewrite."""
    denominator = jnp.broadcast_to(denominator, numerator.shape)
    return numerator / jnp.where(jnp.isnan(numerator), np.float32(1), denominator)


def divide_by_constant(numerator: jax.Array, constant: Any) -> jax.Array:
    """``numerator / constant`` correctly rounded, the constant chosen by a select on the
    numerator (:func:`divide_exactly`): computed with each array, so that arrays
    divided by the same constant share no operand (XLA's GPU backend fuses the
    quantizations of every leaf sharing one into a single kernel, which holds all their
    float32 values at once; an optimization barrier does not hold there, as XLA's GPU
    backend removes barriers before it fuses)."""
    return divide_exactly(numerator, np.float32(constant))
