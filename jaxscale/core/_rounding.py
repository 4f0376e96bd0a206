"""Multiply a float32 by a Python float exactly as PyTorch's loss-scale update does.

PyTorch computes ``static_cast<float>(scale * factor)`` with ``scale`` a float32 and
``factor`` a C++ double: the product is formed in double precision (rounded once to
53 bits) and then rounded to float32. For factors that are powers of two this equals
a float32 multiply, but for factors such as 1.5 or 0.3 a float32 multiply rounds
differently about one time in five, and the difference compounds over a run.

JAX computes float64 only with ``jax_enable_x64``, so :func:`multiply_as_double` emulates
the double-precision multiply with exact integer arithmetic on the float32 bits:
the 24-bit significand of ``x`` times the 53-bit significand of ``factor`` is formed
in 16-bit limbs, rounded to nearest-even at 53 bits, and then rounded to
nearest-even at float32 precision (normal or subnormal). Every operation is on
uint32/int32 scalars, so XLA can neither reassociate it nor flush it to zero.

A power-of-two factor (PyTorch's defaults, 2.0 and 0.5) needs none of that: the
product is exact in double precision, so only the exponent moves, and only a result
below float32's normal range is rounded. That case is a separate, much shorter
program: the scale's update is compiled into every train step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.jaxprs import is_traced

_LIMB_BITS = 16
_LIMB_MASK = 0xFFFF
_DOUBLE_SIGNIFICAND_BITS = 53
_FLOAT_SIGNIFICAND_BITS = 24
# Bits dropped when a 53-bit significand is rounded to a normal float32.
_DOUBLE_TO_FLOAT_DROP = _DOUBLE_SIGNIFICAND_BITS - _FLOAT_SIGNIFICAND_BITS
_FLOAT_INF_BITS = 0x7F800000


def _u32(value: int) -> jax.Array:
    return jnp.asarray(value, dtype=jnp.uint32)


def _i32(value: int) -> jax.Array:
    return jnp.asarray(value, dtype=jnp.int32)


def decompose_factor(factor: float) -> tuple[int, int]:
    """Return ``(significand, exponent)`` with ``factor == significand * 2**exponent``.

    ``significand`` is odd (trailing zero bits are moved into the exponent), so a
    power-of-two factor has significand 1. ``factor`` must be positive and finite.
    """
    if not (math.isfinite(factor) and factor > 0.0):
        raise ValueError(f"factor must be positive and finite, got {factor!r}")
    mantissa, exponent = math.frexp(factor)
    significand = int(mantissa * 2**_DOUBLE_SIGNIFICAND_BITS)
    exponent -= _DOUBLE_SIGNIFICAND_BITS
    trailing_zeros = (significand & -significand).bit_length() - 1
    return significand >> trailing_zeros, exponent + trailing_zeros


class _Limbs:
    """An unsigned integer held as little-endian 16-bit limbs in uint32 scalars."""

    def __init__(self, limbs: list[jax.Array]):
        self.limbs = limbs

    def _limb(self, index: int) -> jax.Array:
        if 0 <= index < len(self.limbs):
            return self.limbs[index]
        return _u32(0)

    def bit(self, position: int) -> jax.Array:
        """Bit ``position`` (static) as uint32 0 or 1; bits below 0 read as 0."""
        if position < 0:
            return _u32(0)
        limb = self._limb(position // _LIMB_BITS)
        return (limb >> (position % _LIMB_BITS)) & 1

    def field(self, low: int, width: int) -> jax.Array:
        """Bits ``[low, low + width)`` as a uint32 (``width <= 32``; ``low`` may be < 0)."""
        result = _u32(0)
        for index in range(len(self.limbs)):
            shift = index * _LIMB_BITS - low
            if shift >= width or shift + _LIMB_BITS <= 0:
                continue
            limb = self.limbs[index]
            part = limb << shift if shift >= 0 else limb >> -shift
            result = result | part
        if width < 32:
            result = result & _u32((1 << width) - 1)
        return result

    def any_below(self, position: int) -> jax.Array:
        """Whether any bit below ``position`` (static) is set, as a bool."""
        nonzero = jnp.asarray(False)
        for index in range(len(self.limbs)):
            low = index * _LIMB_BITS
            if low >= position:
                break
            limb = self.limbs[index]
            if position - low < _LIMB_BITS:
                limb = limb & _u32((1 << (position - low)) - 1)
            nonzero = nonzero | (limb != 0)
        return nonzero


def _multiply_significands(significand: jax.Array, factor_significand: int) -> _Limbs:
    """Exact product of a 24-bit traced significand and a static integer (< 2**53)."""
    x_limbs = [significand & _LIMB_MASK, significand >> _LIMB_BITS]
    f_limbs = []
    remaining = factor_significand
    while remaining:
        f_limbs.append(remaining & _LIMB_MASK)
        remaining >>= _LIMB_BITS
    columns: list[list[jax.Array]] = [[] for _ in range(len(x_limbs) + len(f_limbs) + 1)]
    for i, x_limb in enumerate(x_limbs):
        for j, f_limb in enumerate(f_limbs):
            if f_limb == 0:
                continue
            partial = x_limb * _u32(f_limb)  # < 2**32: fits in uint32
            columns[i + j].append(partial & _LIMB_MASK)
            columns[i + j + 1].append(partial >> _LIMB_BITS)
    limbs = []
    carry = _u32(0)
    for column in columns:
        total = carry
        for term in column:
            total = total + term  # at most a few 16-bit terms: no overflow
        limbs.append(total & _LIMB_MASK)
        carry = total >> _LIMB_BITS
    return _Limbs(limbs)


def _round_to_double(product: _Limbs, length: int) -> tuple[jax.Array, jax.Array, int, jax.Array]:
    """Round a product of static bit length ``length`` to a 53-bit significand.

    Returns ``(hi, lo, shift, carried)``: the significand ``hi * 2**32 + lo`` lies in
    ``[2**52, 2**53)``, the value is ``significand * 2**(shift + carried)`` times the
    product's own scale, and ``carried`` (int32 0/1) is set when rounding overflowed
    to the next power of two.
    """
    drop = length - _DOUBLE_SIGNIFICAND_BITS
    hi = product.field(drop + 32, _DOUBLE_SIGNIFICAND_BITS - 32)
    lo = product.field(drop, 32)
    if drop <= 0:  # the product fits in 53 bits: exact, no rounding
        return hi, lo, drop, _i32(0)
    guard = product.bit(drop - 1)
    sticky = product.any_below(drop - 1)
    round_up = (guard == 1) & (sticky | (product.bit(drop) == 1))
    increment = round_up.astype(jnp.uint32)
    new_lo = lo + increment
    new_hi = hi + ((new_lo == 0) & round_up).astype(jnp.uint32)
    carried = new_hi == _u32(1 << (_DOUBLE_SIGNIFICAND_BITS - 32))
    new_hi = jnp.where(carried, _u32(1 << (_DOUBLE_SIGNIFICAND_BITS - 33)), new_hi)
    return new_hi, new_lo, drop, carried.astype(jnp.int32)


def _shift_right_64(hi: jax.Array, lo: jax.Array, amount: jax.Array) -> jax.Array:
    """Low 32 bits of ``(hi * 2**32 + lo) >> amount`` for ``0 < amount < 64``."""
    small = jnp.minimum(amount, 31).astype(jnp.uint32)
    spill = (32 - jnp.minimum(amount, 31)).astype(jnp.uint32)
    below_32 = (lo >> small) | (hi << spill)
    above_32 = hi >> (jnp.maximum(amount, 32) - 32).astype(jnp.uint32)
    return jnp.where(amount < 32, below_32, above_32)


def _low_bits_nonzero(hi: jax.Array, lo: jax.Array, count: jax.Array) -> jax.Array:
    """Whether any of the lowest ``count`` bits of ``hi * 2**32 + lo`` is set (``count < 64``)."""
    lo_count = jnp.minimum(count, 31).astype(jnp.uint32)
    lo_mask = (_u32(1) << lo_count) - 1
    hi_count = (jnp.clip(count, 32, 63) - 32).astype(jnp.uint32)
    hi_mask = (_u32(1) << hi_count) - 1
    in_lo = jnp.where(count >= 32, lo != 0, (lo & lo_mask) != 0)
    in_hi = (count > 32) & ((hi & hi_mask) != 0)
    return in_lo | in_hi


def _double_to_float_bits(hi: jax.Array, lo: jax.Array, exponent: jax.Array) -> jax.Array:
    """Float32 bits (sign clear) of ``(hi * 2**32 + lo) * 2**exponent``, rounded to nearest-even.

    The significand lies in ``[2**52, 2**53)``. Results below the normal range are
    rounded to float32 subnormals; results too large for float32 become +inf.
    """
    leading_exponent = exponent + (_DOUBLE_SIGNIFICAND_BITS - 1)
    biased = leading_exponent + 127
    # Bits to drop: 29 for a normal float32, more for a subnormal; 60 already rounds to 0.
    drop = jnp.clip(_DOUBLE_TO_FLOAT_DROP + 1 - biased, _DOUBLE_TO_FLOAT_DROP, 60)
    with_guard = _shift_right_64(hi, lo, drop - 1)
    sticky = _low_bits_nonzero(hi, lo, drop - 1)
    kept = with_guard >> 1
    round_up = ((with_guard & 1) == 1) & (sticky | ((kept & 1) == 1))
    kept = kept + round_up.astype(jnp.uint32)
    # For normal results kept lies in [2**23, 2**24]; adding it to (biased - 1) << 23
    # carries into the exponent exactly when rounding overflowed the significand.
    normal_bits = (jnp.clip(biased, 1, 255) - 1).astype(jnp.uint32) * _u32(1 << 23) + kept
    normal_bits = jnp.where(
        (biased >= 255) | (normal_bits >= _FLOAT_INF_BITS), _u32(_FLOAT_INF_BITS), normal_bits
    )
    return jnp.where(biased >= 1, normal_bits, kept)


def _normalized(bits: jax.Array, exponent_field: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(significand, exponent)`` of the float32 with ``bits``: its magnitude is
    ``significand * 2**exponent``, with bit 23 the leading bit (subnormals shifted up).
    Zero gives significand 0."""
    fraction = bits & _u32(0x7FFFFF)
    is_normal = exponent_field != 0
    significand = jnp.where(is_normal, fraction | _u32(0x800000), fraction)
    exponent = jnp.where(is_normal, exponent_field - 150, _i32(-149))
    leading_zeros = lax.clz(significand).astype(jnp.int32) - 8
    normalize = jnp.where(significand == 0, 0, leading_zeros)
    return significand << normalize.astype(jnp.uint32), exponent - normalize


def _scaled_by_power_of_two(significand: jax.Array, exponent: jax.Array) -> jax.Array:
    """Float32 bits (sign clear) of ``significand * 2**exponent``, rounded to nearest-even.

    ``significand`` lies in ``[2**23, 2**24)``, so a normal result is exact and only a
    subnormal one is rounded; a result too large for float32 is +inf.
    """
    biased = exponent + 150  # the exponent field of a normal result
    normal_bits = (jnp.clip(biased, 1, 254).astype(jnp.uint32) << 23) | (
        significand & _u32(0x7FFFFF)
    )
    # A subnormal result keeps significand >> (1 - biased); from 26 bits on that rounds to 0.
    drop = jnp.clip(1 - biased, 1, 26).astype(jnp.uint32)
    kept = significand >> drop
    remainder = significand - (kept << drop)
    half = _u32(1) << (drop - 1)
    round_up = (remainder > half) | ((remainder == half) & ((kept & 1) == 1))
    # kept + 1 may reach 2**23: the bits of the smallest normal float32, as they should.
    subnormal_bits = kept + round_up.astype(jnp.uint32)
    return jnp.where(
        biased >= 255, _u32(_FLOAT_INF_BITS), jnp.where(biased >= 1, normal_bits, subnormal_bits)
    )


def multiply_by_power_of_two(x: jax.Array, exponent: jax.Array | int) -> jax.Array:
    """``multiply_as_double(x, 2.0**exponent)`` for a float32 ``x`` and an int32 ``exponent``
    that may be traced: one short program serves several power-of-two factors."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    exponent_field = ((bits >> 23) & 0xFF).astype(jnp.int32)
    significand, own_exponent = _normalized(bits, exponent_field)
    magnitude = _scaled_by_power_of_two(
        significand, own_exponent + jnp.asarray(exponent, jnp.int32)
    )
    is_special = (significand == 0) | (exponent_field == 0xFF)
    result = jnp.where(is_special, bits, (bits & _u32(0x80000000)) | magnitude)
    return lax.bitcast_convert_type(result, jnp.float32)


def multiply_as_double(x: jax.Array, factor: float) -> jax.Array:
    """Return ``float32(float64(x) * factor)`` bit for bit, for a float32 array ``x``.

    ``factor`` is a static, positive, finite Python float. The product is the
    double-precision product rounded to nearest-even at 53 bits, then rounded to
    nearest-even at float32 precision, exactly as ``static_cast<float>(x * factor)``
    in C++. Subnormal inputs and results are handled exactly (nothing is flushed),
    a product beyond float32's range is ``inf``, and ``±0``, ``±inf`` and NaN inputs
    are returned unchanged (their products with a positive factor).

    >>> import jax.numpy as jnp
    >>> from jaxscale.core import multiply_as_double
    >>> float(multiply_as_double(jnp.float32(0.45562499761581420898), 0.3))
    0.1366875022649765
    """
    factor_significand, factor_exponent = decompose_factor(factor)
    if x.dtype != jnp.float32:
        raise TypeError(f"multiply_as_double expects a float32 array, got {x.dtype}")
    if not is_traced(x):
        # A concrete value: NumPy's float64 multiply is C's double multiply and its
        # float32 cast rounds to nearest-even keeping subnormals, the same two roundings,
        # without dispatching the integer emulation below op by op.
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are results here
            rounded = (np.asarray(x, np.float64) * factor).astype(np.float32)
        return jnp.asarray(rounded)
    if factor_significand == 1:
        return multiply_by_power_of_two(x, factor_exponent)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & _u32(0x80000000)
    exponent_field = ((bits >> 23) & 0xFF).astype(jnp.int32)
    significand, exponent = _normalized(bits, exponent_field)
    # factor > 0, so ±0, ±inf and NaN are their own products.
    is_special = (significand == 0) | (exponent_field == 0xFF)

    product = _multiply_significands(significand, factor_significand)
    # significand in [2**23, 2**24) and factor_significand in [2**(b-1), 2**b)
    # give a product of bit length 23 + b or 24 + b: two static cases.
    short_length = 23 + factor_significand.bit_length()
    is_long = product.bit(short_length) == 1
    short = _round_to_double(product, short_length)
    long = _round_to_double(product, short_length + 1)
    hi = jnp.where(is_long, long[0], short[0])
    lo = jnp.where(is_long, long[1], short[1])
    shift = jnp.where(is_long, long[2] + long[3], short[2] + short[3])
    magnitude = _double_to_float_bits(hi, lo, exponent + factor_exponent + shift)
    result = jnp.where(is_special, bits, sign | magnitude)
    return lax.bitcast_convert_type(result, jnp.float32)
