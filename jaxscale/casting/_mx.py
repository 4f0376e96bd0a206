"""MX block scaling (MXFP8): float8 data with one power-of-two scale per 32 elements, bit
for bit as torchao's ``to_mx`` computes it.

A block of ``block_size`` consecutive elements along one axis shares an E8M0 scale (a
biased exponent byte, ``2**(byte - 127)``; 255 is NaN). torchao derives it from the
block's largest magnitude ``amax`` in one of two modes:

* ``"rceil"`` (NVIDIA's cuBLAS recipe, torchao's default for training): the exponent
  is ``ceil(log2(amax / max))``, with ``max`` the float8 type's largest value (448 for
  e4m3), both operations in float32 as PyTorch computes them: the quotient correctly
  rounded, ``log2`` correctly rounded. Rounding ``log2`` matters: for ``amax`` a few
  ulps above ``448·2**k`` the exact logarithm is just above ``k`` but its float32
  rounding is ``k``, so the exponent is ``k`` where an exact ceiling gives ``k + 1``.
  The data is ``x · 2**(127 - byte)`` clamped to ``±max``.
* ``"floor"`` (the OCP MX specification's): the exponent is ``amax``'s own binary
  exponent minus the float8 type's largest (8 for e4m3), and the data is
  ``x / 2**(byte - 127)`` clamped.

XLA's CPU backend flushes float32 subnormals to zero (and ``inf · 2**-127`` is then
``inf · 0``, a NaN), so the quotient, the exponent and the scaling are computed on the
bits of the numbers: a subnormal ``amax`` or quotient, an infinite or NaN ``amax``,
all-zero blocks and the boundaries of the logarithm's rounding all come out as
torchao's.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.explicit_axes import also_on_explicit_axes
from jaxscale.casting._stochastic_float8 import stochastic_to_float8

E8M0 = np.dtype(jnp.float8_e8m0fnu)
# the float8 types MX scales, with their largest value and its binary exponent
_ELEMENTS = {
    np.dtype(jnp.float8_e4m3fn): (448.0, 8),
    np.dtype(jnp.float8_e5m2): (57344.0, 15),
}
SCALE_MODES = ("rceil", "floor")
_NAN_BYTE, _INFINITY_BYTE = 255, 254


@also_on_explicit_axes
def quantize_mx(
    x: jax.Array,
    dtype: Any = jnp.float8_e4m3fn,
    *,
    block_size: int = 32,
    axis: int = -1,
    scale_mode: str = "rceil",
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``x`` in an MX format: float8 data and one E8M0 scale per block of ``block_size``
    consecutive elements along ``axis``; torchao's ``to_mx``, bit for bit.

    Args:
      x: a float32 or bfloat16 array whose ``axis`` is a multiple of ``block_size``.
      dtype: the data's type, ``jnp.float8_e4m3fn`` (MXFP8) or ``jnp.float8_e5m2``.
      block_size: elements per scale (32 in the MX specification).
      axis: the axis blocks run along (a matmul's contracting axis).
      scale_mode: ``"rceil"`` or ``"floor"``: how a block's scale is derived from its
        largest magnitude (see the module's notes).
      key: ``None`` (round to nearest, as torchao), or a PRNG key: the scaled values
        rounded to float8 stochastically (unbiased).

    Returns:
      ``(data, scale)``: ``data`` of ``x``'s shape in ``dtype``, ``x`` divided by its
      block's scale and saturated; ``scale`` (``jnp.float8_e8m0fnu``) of ``x``'s shape
      with ``axis`` divided by ``block_size``. A block with an infinite element has
      scale ``2**127``, one with a NaN the NaN scale; an all-zero block ``2**-127``.

    Raises:
      ValueError: for another ``dtype`` or ``scale_mode``, ``x`` not float32 or
        bfloat16, or an ``axis`` that does not split into blocks.

    >>> import jax.numpy as jnp, jaxscale
    >>> data, scale = jaxscale.quantize_mx(jnp.arange(64.0).reshape(2, 32))
    >>> scale.shape, scale.astype(jnp.float32).tolist()  # 31 / 448 and 63 / 448, rounded up
    ((2, 1), [[0.125], [0.25]])
    >>> data.astype(jnp.float32)[:, -1].tolist()  # 31 / 0.125 and 63 / 0.25, in float8
    [256.0, 256.0]
    """
    element = np.dtype(dtype)
    if element not in _ELEMENTS:
        raise ValueError(f"MX data is float8_e4m3fn or float8_e5m2, got {element.name}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be 'rceil' or 'floor', got {scale_mode!r}")
    x = jnp.asarray(x)
    if x.dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(f"quantize_mx expects float32 or bfloat16, got {x.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of shape {x.shape}")
    axis %= x.ndim
    if x.shape[axis] % block_size:
        raise ValueError(
            f"axis {axis} of shape {x.shape} does not split into blocks of {block_size}"
        )
    return quantize_to_mx_blocks(x, element, block_size, axis, scale_mode, key)


# One jit call (inlined by XLA): a few hundred small operations, which run eagerly one
# compilation each would take tens of seconds the first time. precision_stats knows the
# call by its name: what goes in is the high-precision tensor, what comes out its MX data.
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def quantize_to_mx_blocks(
    x: jax.Array, element: np.dtype, block_size: int, axis: int, scale_mode: str,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    moved = jnp.moveaxis(x, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // block_size, block_size)
    blocks = blocks.astype(jnp.float32)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    amax = jnp.where(jnp.isnan(blocks).any(axis=-1), jnp.float32(jnp.nan), amax)  # as torch.amax
    largest, largest_exponent = _ELEMENTS[element]
    if scale_mode == "rceil":
        exponent = _rceil_exponent(amax, largest)
        # x · 2**(127 - byte), but x · 1 for the zero byte; a NaN amax makes the whole
        # block NaN (torchao multiplies by the NaN quotient)
        multiplier = jnp.where(exponent == 0, 0, 127 - exponent)
        scaled = _times_power_of_two(blocks, multiplier[..., None])
        scaled = jnp.where(jnp.isnan(amax)[..., None], jnp.float32(jnp.nan), scaled)
    else:
        exponent = _floor_exponent(amax, largest_exponent)
        # x / 2**(byte - 127), the divisor at least 2**-126; the NaN byte divides by
        # infinity: finite values become zeros, infinities and NaNs NaN
        multiplier = jnp.where(exponent == 0, 126, 127 - exponent)
        scaled = _times_power_of_two(blocks, jnp.maximum(multiplier, -127)[..., None])
        scaled = jnp.where((exponent == _NAN_BYTE)[..., None], blocks * 0.0, scaled)
    clipped = jnp.clip(scaled, -largest, largest)
    if key is None:
        data = clipped.astype(element).reshape(moved.shape)
    else:
        data = stochastic_to_float8(clipped, element, key).reshape(moved.shape)
    scale = lax.bitcast_convert_type(exponent.astype(jnp.uint8), E8M0)
    return jnp.moveaxis(data, -1, axis), jnp.moveaxis(scale, -1, axis)


@also_on_explicit_axes
def dequantize_mx(
    data: jax.Array, scale: jax.Array, dtype: Any = jnp.float32, *, axis: int = -1
) -> jax.Array:
    """The values :func:`quantize_mx` stored: ``data · scale`` in ``dtype``, each scale
    spread over its block along ``axis`` (torchao's ``MXTensor.dequantize``). A NaN
    scale makes its block NaN.

    Args:
      data: the float8 data.
      scale: the ``float8_e8m0fnu`` scales, ``data``'s shape with ``axis`` divided by
        the block size.
      dtype: the result's dtype.
      axis: the axis the blocks run along.

    >>> import jax.numpy as jnp, jaxscale
    >>> data, scale = jaxscale.quantize_mx(jnp.linspace(-1.0, 1.0, 64), block_size=32)
    >>> jaxscale.dequantize_mx(data, scale)[jnp.array([0, 31, 63])].tolist()
    [-1.0, -0.015625, 1.0]
    """
    return dequantize_mx_blocks(data, scale, np.dtype(dtype), axis % data.ndim)


@functools.partial(jax.jit, static_argnums=(2, 3))
def dequantize_mx_blocks(
    data: jax.Array, scale: jax.Array, dtype: np.dtype, axis: int
) -> jax.Array:
    # XLA folds a quantization and this dequantization of a constant (a weight a jitted
    # function closes over) into a wrong constant: on the CPU with XLA 0.10, blocks of a
    # 64x32 array quantized along axis 0 took another block's scale. The barrier keeps
    # the two apart, so the folded program computes what the compiled one does.
    data, scale = lax.optimization_barrier((data, scale))
    moved = jnp.moveaxis(data, axis, -1)
    biased = jnp.moveaxis(lax.bitcast_convert_type(scale, jnp.uint8), axis, -1)[..., None]
    blocks = moved.reshape(*biased.shape[:-1], -1).astype(jnp.float32)
    values = _times_power_of_two(blocks, biased.astype(jnp.int32) - 127)
    values = jnp.where(biased == _NAN_BYTE, jnp.float32(jnp.nan), values)
    return jnp.moveaxis(values.reshape(moved.shape).astype(dtype), -1, axis)


def _times_power_of_two(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x · 2**exponent`` for float32 ``x`` (subnormal ones included) and an int32
    ``exponent`` in [-127, 127], exact wherever the result is a normal float32.

    XLA's CPU backend reads a subnormal operand as zero and writes a subnormal result as
    zero, so a subnormal ``x`` is taken as its integer significand times ``2**-149``,
    and the power of two is applied in factors that are each a normal float32."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    subnormal = ((bits >> 23) & 0xFF) == 0
    significand = (bits & 0x7FFFFF).astype(jnp.int32).astype(jnp.float32)
    significand = jnp.where((bits >> 31) == 1, -significand, significand)
    value = jnp.where(subnormal, significand, x)
    total = exponent + jnp.where(subnormal, -149, 0)  # in [-276, 127]
    first = jnp.clip(total, -126, 127)
    second = jnp.clip(total - first, -126, 0)
    third = total - first - second  # in [-24, 0]
    return value * _power_of_two(first) * _power_of_two(second) * _power_of_two(third)


def _power_of_two(exponent: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(((exponent + 127).astype(jnp.uint32)) << 23, jnp.float32)


def _floor_exponent(amax: jax.Array, largest_exponent: int) -> jax.Array:
    """torchao's FLOOR: ``amax``'s binary exponent minus the float8 type's, clamped to
    [-127, 128], biased by 127 (255, the NaN byte, also for a NaN ``amax``)."""
    bits = lax.bitcast_convert_type(amax, jnp.uint32)
    unbiased = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127 - largest_exponent
    biased = jnp.clip(unbiased, -127, 128) + 127
    return jnp.where(jnp.isnan(amax), _NAN_BYTE, biased)


def _rceil_exponent(amax: jax.Array, largest: float) -> jax.Array:
    """torchao's RCEIL: ``ceil(log2(float32(amax / largest)))`` with a correctly rounded
    float32 ``log2``, clamped to [-127, 127] and biased by 127; 254 for an infinite
    ``amax``, 255 for a NaN one."""
    quotient = _divided_by(amax, largest)  # float32 bits, subnormals kept
    exponent_bits = ((quotient >> 23) & 0xFF).astype(jnp.int32)
    fraction = (quotient & 0x7FFFFF).astype(jnp.int32)
    # quotient = m · 2**e with m in [1, 2) for a normal quotient; for a subnormal one
    # the same from its leading bit (the exponent is then below -126 and is clamped to
    # -127 unless the quotient lies in [2**-127, 2**-126): e = -127, m = fraction / 2**22)
    normal = exponent_bits > 0
    e = jnp.where(normal, exponent_bits - 127, -127)
    # the fraction of m above 1, in units of 2**-23 (normal) or 2**-22 (subnormal)
    above_one = jnp.where(normal, fraction, (fraction - (1 << 22)) * 2)
    limits = jnp.asarray(_log2_rounds_down_limits(), jnp.int32)
    rounds_down = above_one <= limits[jnp.clip(e + 127, 0, 254)]
    ceiling = jnp.where(rounds_down, e, e + 1)
    # a quotient below 2**-127 (its leading bit below the subnormal's top one)
    ceiling = jnp.where(~normal & (fraction < (1 << 22)), -127, ceiling)
    biased = jnp.clip(ceiling, -127, 127) + 127
    biased = jnp.where(jnp.isinf(amax), _INFINITY_BYTE, biased)
    return jnp.where(jnp.isnan(amax), _NAN_BYTE, biased)


@functools.cache
def _log2_rounds_down_limits() -> np.ndarray:
    """For each exponent ``e`` (-127 to 127): the largest ``j`` such that the float32
    rounding of ``log2((1 + j·2**-23)·2**e)`` is ``e`` itself (0 where only ``j = 0``
    is): ``log2`` is then within half a float32 spacing of ``e``, on ``e``'s side
    toward ``e + 1``."""
    limits = np.zeros(255, np.int64)
    for index, e in enumerate(range(-127, 128)):
        if e == 0:
            continue  # log2 of a number above 1 is a positive float32, never 0
        toward = np.nextafter(np.float32(e), np.float32(e + 1))
        half_gap = (float(toward) - e) / 2
        # log2(1 + j·2**-23) = log1p(j·2**-23) / ln 2 < half_gap (never equal: irrational)
        j = int(math.expm1(half_gap * math.log(2)) * 2**23) + 2
        while j > 0 and math.log1p(j * 2.0**-23) / math.log(2) >= half_gap:
            j -= 1
        limits[index] = j
    return limits


def _divided_by(amax: jax.Array, divisor: float) -> jax.Array:
    """The float32 bits of ``amax / divisor``, correctly rounded (to nearest, ties to
    even), subnormal quotients included; ``divisor`` is ``d · 2**s`` with ``d`` odd and
    below 2**5 (448 = 7·2**6, 57344 = 7·2**13). Infinite and NaN ``amax`` give their own
    bits (handled by the caller)."""
    odd, shift = _odd_and_shift(divisor)
    bits = lax.bitcast_convert_type(amax, jnp.uint32) & 0x7FFF_FFFF
    biased = (bits >> 23).astype(jnp.int32)
    significand = jnp.where(biased > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF)
    # normalise a subnormal amax: the significand's leading bit at 2**23
    lead = jnp.where(significand == 0, 0, lax.clz(significand).astype(jnp.int32) - 8)
    significand = significand << lead.astype(jnp.uint32)
    exponent = jnp.where(biased > 0, biased - 150, -149) - lead  # amax = sig · 2**exponent
    # sig · 2**5 / odd: 26 or 27 quotient bits and a remainder
    numerator = significand << 5
    quotient = numerator // odd
    sticky = (numerator % odd) != 0
    exponent = exponent - 5 - shift  # the quotient's value is quotient · 2**exponent
    # keep 24 significant bits, or fewer where the result is subnormal
    width = 32 - lax.clz(quotient).astype(jnp.int32)  # 26 or 27
    result_exponent = exponent + width - 1  # of the leading bit
    drop = jnp.where(result_exponent >= -126, width - 24, width - 24 + (-126 - result_exponent))
    drop = jnp.clip(drop, 0, 31)
    kept = quotient >> drop.astype(jnp.uint32)
    remainder = quotient & ((jnp.uint32(1) << drop.astype(jnp.uint32)) - 1)
    half = jnp.uint32(1) << jnp.maximum(drop - 1, 0).astype(jnp.uint32)
    above_half = (remainder > half) | ((remainder == half) & sticky)
    at_half = (remainder == half) & ~sticky
    round_up = (drop > 0) & (above_half | (at_half & ((kept & 1) == 1)))
    kept = kept + round_up.astype(jnp.uint32)
    # assemble: a normal result has its leading bit at 2**23 (a carry from rounding
    # moves it to 2**24, which the exponent field absorbs)
    subnormal = result_exponent < -126
    field = jnp.where(subnormal, 0, result_exponent + 127).astype(jnp.uint32)
    result = jnp.where(subnormal, kept, (field << 23) + (kept - 0x800000))
    result = jnp.where(significand == 0, jnp.uint32(0), result)
    return jnp.where(biased == 0xFF, bits, result)


def _odd_and_shift(divisor: float) -> tuple[int, int]:
    mantissa, exponent = math.frexp(divisor)
    odd, shift = int(mantissa * 2**24), exponent - 24
    while odd % 2 == 0:
        odd, shift = odd // 2, shift + 1
    if odd >= 1 << 5 or odd * 2.0**shift != divisor:
        raise ValueError(f"divisor {divisor} is not a small odd number times a power of two")
    return odd, shift
