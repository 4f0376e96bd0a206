"""Quantizing to float8 with dynamic scales, bit for bit as torchao does.

torchao's current (dynamic) scaling, ``hp_tensor_to_float8_dynamic``:

* ``amax = max(|x|)`` over the tensor, or over one axis with ``keepdim``;
* ``scale = float32(fmax / max(float64(amax), 1e-12))``: the quotient in double
  precision rounded once to float32. For the float8 maxima (448 = 7·2^6 and
  57344 = 7·2^13) and a float32 ``amax`` that is the correctly rounded float32
  quotient: a quotient of integers below 2^24 cannot have 28 equal bits after the
  24th, so rounding to double first never moves it onto a float32 midpoint;
* with ``round_scales_to_power_of_2``, ``scale = exp2(floor(log2(scale)))`` with a
  correctly rounded float32 ``log2``: ``2^e`` for ``scale = m·2^e``, except that
  ``log2`` of a scale just below ``2^(e+1)`` rounds to ``e + 1`` in float32, and then
  the result is ``2^(e+1)``. How far below depends on ``e`` (the float32 spacing
  just below ``e + 1``); the table is computed once, below;
* ``data = float8(clamp(float32(x) * scale, -fmax, fmax))``.

XLA's float32 division is correctly rounded on the CPU but not on every GPU, so
the quotient's float estimate is corrected in integers, as
:func:`jaxscale.core.correctly_rounded_reciprocal` does for ``1 / scale``; JAX's
``log2`` and ``exp2`` are not correctly rounded on the CPU (``log2(2**13)`` gives
12.999999), so the power of two is read from the bits.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale.casting._stochastic_float8 import stochastic_to_float8
from jaxscale.core import _scaling

EPS = 1e-12
FLOAT8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def float8_max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


def quantize_float8(
    x: jax.Array,
    dtype: Any = jnp.float8_e4m3fn,
    *,
    axis: int | None = None,
    power_of_2: bool = False,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``x`` as float8 data and the float32 scale it was multiplied by: torchao's dynamic
    scaling, bit for bit.

    ``scale = finfo(dtype).max / max(amax, 1e-12)`` with ``amax`` the largest
    magnitude of ``x`` (``axis=None``) or along ``axis`` (with keepdims, so the scale
    broadcasts against ``x``); with ``power_of_2`` the scale is rounded down to a
    power of two as torchao's ``exp2(floor(log2(scale)))`` does;
    ``data = dtype(clip(float32(x) * scale, -max, max))``. ``x / scale`` is
    recovered as ``data.astype(float32) / scale``.

    Args:
      x: a floating array (float32, bfloat16 or float16).
      dtype: ``jnp.float8_e4m3fn`` (the default) or ``jnp.float8_e5m2``.
      axis: ``None`` for one scale for the tensor, or the axis to scale along
        (rowwise scaling scales each row along the axis it is contracted over).
      power_of_2: round each scale down to a power of two.
      key: ``None`` (round to nearest, as torchao), or a PRNG key: the scaled values
        rounded to float8 stochastically (unbiased: to the float8 value above or below,
        with probability proportional to nearness).

    Returns:
      ``(data, scale)``: ``data`` in ``dtype`` with ``x``'s shape, ``scale`` float32
      of shape ``()`` or ``x``'s shape with ``axis`` of size 1.

    Raises:
      ValueError: for a ``dtype`` that is not a float8 type, or ``x`` not floating.

    >>> import jax.numpy as jnp, jaxscale
    >>> data, scale = jaxscale.quantize_float8(jnp.array([1.0, -2.0, 0.5]))
    >>> data.dtype, float(scale), data.astype(jnp.float32).tolist()
    (dtype(float8_e4m3fn), 224.0, [224.0, -448.0, 112.0])
    """
    target = np.dtype(dtype)
    if target not in FLOAT8_DTYPES:
        raise ValueError(f"float8 dtype must be float8_e4m3fn or float8_e5m2, got {target.name}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize_float8 expects a floating array, got {x.dtype}")
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None)
    scale = amax_to_scale(amax.astype(jnp.float32), target, power_of_2=power_of_2)
    if key is not None:
        limit = np.float32(float8_max(target))
        scaled = jnp.clip(x.astype(jnp.float32) * scale, -limit, limit)
        return stochastic_to_float8(scaled, target, key), scale
    return scaled_to_float8(x, scale, target), scale


def scaled_to_float8(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``dtype(clip(float32(x) * scale, -max, max))``: the product rounded once to
    float32, saturated (JAX's cast of an out-of-range float32 to float8_e4m3fn is NaN).

    Traced as one ``jit`` call named ``cast_to_float8`` (XLA inlines it), so that
    :func:`jaxscale.precision_stats` finds each cast with the high-precision values it
    was given."""
    return cast_to_float8(x, scale, np.dtype(dtype))


@functools.partial(jax.jit, static_argnums=2)
def cast_to_float8(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    limit = np.float32(float8_max(dtype))
    scaled = x.astype(jnp.float32) * scale
    return jnp.clip(scaled, -limit, limit).astype(dtype)


def amax_to_scale(amax: jax.Array, dtype: Any, *, power_of_2: bool = False) -> jax.Array:
    """torchao's ``amax_to_scale``: ``float32(max / max(float64(amax), 1e-12))``,
    optionally rounded down to a power of two. ``amax`` is float32."""
    fmax = float8_max(dtype)
    clamped = np.float32(np.float64(fmax) / EPS)  # the quotient when amax is below 1e-12
    scale = jnp.where(
        amax < _SMALLEST_FLOAT32_FROM_EPS, clamped, divide_correctly_rounded(fmax, amax)
    )
    if power_of_2:
        scale = round_down_to_power_of_2(scale)
    # A scale is a few values (one a row at most) computed by a hundred integer
    # operations; without the barrier XLA fuses that computation into the consumer of
    # every element it scales, and XLA 0.12's CPU compiler then takes minutes on the
    # fusion of a rowwise power-of-2 scale with a float8 round trip.
    return lax.optimization_barrier(scale)


# float64(amax) < 1e-12 for a float32 amax is amax < the smallest float32 >= 1e-12
_SMALLEST_FLOAT32_FROM_EPS = (
    np.float32(EPS)
    if float(np.float32(EPS)) >= EPS
    else np.nextafter(np.float32(EPS), np.float32(np.inf))
)


def divide_correctly_rounded(numerator: float, x: jax.Array) -> jax.Array:
    """``numerator / x`` correctly rounded to float32, for a constant ``numerator`` whose
    significand fits 24 bits and a float32 ``x`` whose quotient is a normal float32.

    The significands' quotient ``n·2^25 / d`` (26 bits, in ``[2^24, 2^26)``) is
    estimated by the float division, which a GPU gets to within an ulp or two, and
    corrected in integers to within one, as the loss scale's reciprocal is
    (:func:`jaxscale.core._scaling.quotient_within_one`); a last exact step makes it
    the floor, so that the remainder left decides the rounding. The exponents are
    subtracted. ``x`` zero, subnormal, infinite or NaN falls back to the float division.

    A dozen integer operations rather than a 26-step long division: the scale is
    computed for every float8 cast, and LLVM's loop vectorizer (in XLA 0.12's CPU
    compiler) takes time exponential in the length of such a chain of selects.
    """
    mantissa, exponent = math.frexp(numerator)  # numerator = mantissa * 2**exponent
    n = int(mantissa * 2**24)  # numerator = n * 2**(exponent - 24), n in [2**23, 2**24)
    if n * 2.0 ** (exponent - 24) != numerator:
        raise ValueError(f"the numerator's significand must fit 24 bits, got {numerator!r}")
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    x_exponent = ((bits >> 23) & 0xFF).astype(jnp.int32)
    d = (bits & 0x7FFFFF) | 0x800000
    # quotient = floor(n * 2**25 / d), remainder = the rest, in [0, d)
    quotient, remainder = _scaling.quotient_within_one(n << 25, d)
    signed_d = d.astype(jnp.int32)
    below, above = remainder < 0, remainder >= signed_d
    remainder = remainder + jnp.where(below, signed_d, 0) - jnp.where(above, signed_d, 0)
    quotient = quotient - below.astype(jnp.int32) + above.astype(jnp.int32)
    quotient = lax.bitcast_convert_type(quotient, jnp.uint32)
    whole = (quotient >> 25) == 1  # n >= d: n / d in [1, 2), else in (0.5, 1)
    kept = jnp.where(whole, quotient >> 2, quotient >> 1)
    guard = jnp.where(whole, (quotient >> 1) & 1, quotient & 1)
    sticky = jnp.where(whole, (quotient & 1) != 0, False) | (remainder != 0)
    up = (guard == 1) & (sticky | ((kept & 1) == 1))  # to nearest, ties to even
    kept = kept + up.astype(jnp.uint32)
    carried = (kept >> 24) == 1
    kept = jnp.where(carried, kept >> 1, kept)
    biased = (
        exponent + 276 - x_exponent
        + jnp.where(whole, -23, -24)
        + carried.astype(jnp.int32)
    )  # fmt: skip
    result = lax.bitcast_convert_type(
        (biased.astype(jnp.uint32) << 23) | (kept & 0x7FFFFF), jnp.float32
    )
    special = (x_exponent == 0xFF) | (x_exponent == 0)
    return jnp.where(special, np.float32(numerator) / x, result)


@functools.cache
def _round_up_limits() -> np.ndarray:
    """For each float32 exponent ``e`` (-126 to 127): the largest ``k`` such that the
    correctly rounded float32 ``log2`` of ``(2 - k·2^-23)·2^e`` is ``e + 1``."""
    limits = np.zeros(254, np.int64)
    for index, e in enumerate(range(-126, 128)):
        target = e + 1
        if target == 0:
            continue  # log2 just below 0 is a tiny negative number, never 0
        below = np.nextafter(np.float32(target), np.float32(-np.inf))  # largest float32 < e+1
        half_gap = (float(target) - float(below)) / 2
        # 1 - log2(2 - k·2^-23) = -log1p(-k·2^-24) / ln 2 <= half_gap
        k = int(half_gap * math.log(2) * 2**24) + 2
        while k > 0 and -math.log1p(-k * 2.0**-24) / math.log(2) > half_gap:
            k -= 1
        limits[index] = k
    return limits


def round_down_to_power_of_2(scale: jax.Array) -> jax.Array:
    """torchao's ``exp2(floor(log2(scale)))`` with a correctly rounded float32 ``log2``,
    for float32 ``scale``: read from the exponent and significand bits."""
    bits = lax.bitcast_convert_type(scale, jnp.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(jnp.int32)
    k = (1 << 23) - (bits & 0x7FFFFF).astype(jnp.int32)  # significand = 2 - k·2^-23
    e = exponent - 127
    limits = jnp.asarray(_round_up_limits(), jnp.int32)
    limit = limits[jnp.clip(e + 126, 0, 253)]
    up = (k <= limit) & ((bits & 0x7FFFFF) != 0)
    new_exponent = exponent + up.astype(jnp.int32)
    power = lax.bitcast_convert_type((new_exponent.astype(jnp.uint32)) << 23, jnp.float32)
    normal = (exponent > 0) & (exponent < 0xFF)
    return jnp.where(normal, power, scale)
