"""Stochastic rounding of float32 to bfloat16 or float16, in integer arithmetic.

Rounding to nearest loses an update smaller than half a unit in the last place
(ulp) of the parameter: a bfloat16 weight of 1.0 ignores any step below 2⁻⁹. Rounding
stochastically, up with probability equal to the distance from the lower neighbour
in ulps, is exact in expectation, so small steps add up over many updates.

bfloat16 keeps the top 16 bits of a float32. torchao's ``_fp32_to_bf16_sr`` rounds
away from zero iff a uniform 16-bit integer ``r`` is below the 16 bits dropped:
``r < (bits(x) & 0xFFFF)``, which happens with probability ``(bits & 0xFFFF) / 2**16``,
exactly the fraction of an ulp ``x`` lies beyond its truncation. Here the same rule
is computed on the bits and the bfloat16 is assembled from them, never through a
float conversion (XLA's CPU flushes subnormal floats to zero; bit arithmetic does not).

float16's ulp is not a fixed group of float32 bits (its exponent range is narrower),
so the float16 rule finds ``x``'s two float16 neighbours from the nearest one and
rounds away from zero with probability ``(|x| - |lower|) / ulp``, compared with the
same 16 random bits. That fraction is a multiple of 2⁻¹³ wherever the neighbours are
normal float16 numbers (``|x| >= 2**-14``), so there the rounding is unbiased; among
float16 subnormals the probability is the fraction rounded up to a multiple of 2⁻¹⁶.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.jaxprs import is_traced
from jaxscale._src.threefry import random_bits

TARGETS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_FLOAT16_MAX_BITS = 0x7BFF  # 65504
_FLOAT16_TOP_ULP = np.float32(32.0)  # the spacing above 65504, up to where infinity would be


def stochastic_round(
    x: jax.Array, dtype: Any = jnp.bfloat16, *, key: jax.Array | None = None, bits: Any = None
) -> jax.Array:
    """``x`` (float32) rounded to ``dtype`` stochastically: to one of its two neighbours in
    ``dtype``, away from zero with probability equal to ``x``'s distance from the
    neighbour nearer zero, in units of the gap between them.

    With ``bits`` and ``dtype=bfloat16`` this is torchao's ``_fp32_to_bf16_sr`` fed the
    same draws, bit for bit: away from zero iff ``bits < (bitcast_uint32(x) & 0xFFFF)``.
    So a float32 at or above the largest finite bfloat16's upper neighbour rounds to
    infinity as torchao's does, and ±inf stays ±inf. A NaN stays a NaN (its sign and top
    payload bits kept, quieted), where torchao's bit arithmetic turns a NaN whose
    payload lies in the low 16 bits into ±inf or ±0.

    For ``dtype=float16`` the result is always one of ``x``'s two float16 neighbours
    (±65504 and ±inf above the largest finite float16), unbiased where they are normal
    numbers; see the module's notes for subnormals.

    Args:
      x: a float32 array.
      dtype: ``jnp.bfloat16`` (the default) or ``jnp.float16``.
      key: a JAX PRNG key to draw the random bits from; or
      bits: an integer array of ``x``'s shape with values in ``[0, 2**16)``: the
        uniform draws, one per element (only their low 16 bits are read).

    Returns:
      An array of ``dtype`` and ``x``'s shape.

    Raises:
      ValueError: for ``x`` not float32, another ``dtype``, neither or both of ``key``
        and ``bits``, ``bits`` of another shape, or concrete ``bits`` out of range.

    >>> import jax.numpy as jnp, jaxscale
    >>> x = jnp.float32(1.0 + 2**-9)  # a quarter of the way from 1 to the next bfloat16
    >>> jaxscale.stochastic_round(jnp.full(4, x), bits=jnp.array([0, 16383, 16384, 65535])).tolist()
    [1.0078125, 1.0078125, 1.0, 1.0]
    """
    target = np.dtype(dtype)
    if target not in TARGETS:
        raise ValueError(f"stochastic_round rounds to bfloat16 or float16, got dtype={target.name}")
    x = jnp.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(
            f"stochastic_round expects a float32 x, got {x.dtype}: pass x.astype(jnp.float32)"
        )
    draws = _uniform_16_bit(x.shape, key, bits)
    if target == np.dtype(jnp.bfloat16):
        return _to_bfloat16(x, draws)
    return _to_float16(x, draws)


def _uniform_16_bit(shape: tuple[int, ...], key: Any, bits: Any) -> jax.Array:
    if (key is None) == (bits is None):
        raise ValueError(
            "stochastic_round needs exactly one of key= (a JAX PRNG key) or bits= (an "
            "integer array of x's shape with values in [0, 2**16)), got "
            + ("neither" if key is None else "both")
        )
    if key is not None:
        return _draws(key, shape)
    bits = jnp.asarray(bits)
    if not jnp.issubdtype(bits.dtype, jnp.integer) or bits.shape != shape:
        raise ValueError(
            f"bits must be an integer array of x's shape {shape}, got {bits.dtype} of shape "
            f"{bits.shape}"
        )
    if not is_traced(bits) and bits.size:
        # compared as Python integers: the bounds do not fit every integer dtype
        low, high = int(np.min(np.asarray(bits))), int(np.max(np.asarray(bits)))
        if low < 0 or high >= 1 << 16:
            raise ValueError(f"bits must lie in [0, 2**16), got values from {low} to {high}")
    return bits.astype(jnp.uint32) & 0xFFFF


def _draws(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """16 uniform random bits per element of ``shape``: the low half of
    ``jax.random.bits(key, shape, jnp.uint32)``. Each element's word is a hash of the key
    and the element's index (JAX's partitionable Threefry), computed as arithmetic that
    XLA fuses into the rounding, so no array of random words is written; a shard of a
    sharded parameter hashes its own indices on its device, so the draws need no
    communication and do not depend on the mesh."""
    return random_bits(key, shape) & 0xFFFF


def _to_bfloat16(x: jax.Array, draws: jax.Array) -> jax.Array:
    pattern = lax.bitcast_convert_type(x, jnp.uint32)
    away = (draws < (pattern & 0xFFFF)).astype(jnp.uint32)
    # the top half plus one: a larger magnitude of the same sign (0x7F7F + 1 is infinity)
    rounded = (pattern >> 16) + away
    is_nan = (pattern & 0x7FFFFFFF) > 0x7F800000
    quiet_nan = (pattern >> 16) | 0x0040
    top = jnp.where(is_nan, quiet_nan, rounded) & 0xFFFF
    return lax.bitcast_convert_type(top.astype(jnp.uint16), jnp.bfloat16)


def _to_float16(x: jax.Array, draws: jax.Array) -> jax.Array:
    nearest = x.astype(jnp.float16)
    nearest_bits = lax.bitcast_convert_type(nearest, jnp.uint16)
    magnitude = jnp.abs(x)
    # the neighbour nearer zero: the nearest one, or the next smaller magnitude of the
    # same sign (a float16 of magnitude above |x| is never zero)
    overshoots = jnp.abs(nearest.astype(jnp.float32)) > magnitude
    lower_bits = jnp.where(overshoots, nearest_bits - 1, nearest_bits)
    lower = jnp.abs(lax.bitcast_convert_type(lower_bits, jnp.float16).astype(jnp.float32))
    upper = jnp.abs(lax.bitcast_convert_type(lower_bits + 1, jnp.float16).astype(jnp.float32))
    at_top = (lower_bits & 0x7FFF) == _FLOAT16_MAX_BITS
    gap = jnp.where(at_top, _FLOAT16_TOP_ULP, upper - lower)  # a power of two
    # (|x| - lower) is exact, and dividing by a power of two is too
    threshold = (magnitude - lower) / gap * np.float32(1 << 16)
    away = draws.astype(jnp.float32) < threshold
    rounded = jnp.where(away, lower_bits + 1, lower_bits)
    rounded = lax.bitcast_convert_type(rounded, jnp.float16)
    return jnp.where(jnp.isfinite(x), rounded, nearest)
