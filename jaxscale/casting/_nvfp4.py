"""NVFP4: E2M1 values, one E4M3 scale per 16, a float32 scale per tensor.

NVIDIA's four-bit format stores each value as ``float4_e2m1fn`` (magnitudes 0, 0.5, 1,
1.5, 2, 3, 4 and 6) with one ``float8_e4m3fn`` scale per block of 16 consecutive
values along the last axis (``1x16``; weights may take ``16x16`` tiles, one scale per
16 rows and 16 columns) and a float32 scale for the whole tensor. Two arithmetics
compute the scales, and they differ on a few percent of blocks:

* ``"te"``: TransformerEngine's chain (``core_nvfp4.cuh``), which torchao's NVFP4
  training kernels follow, from the tensor's largest magnitude ``amax``::

      S_enc  = 448 * 6 / amax, at most FLT_MAX; 1 where amax is 0 or S_enc is 0
      S_dec  = e4m3(min(block_amax * (S_enc * (1/6)), 448))    # one rounding, no floor
      encode = min(1 / (float32(S_dec) * (1 / S_enc)), FLT_MAX)
      codes  = e2m1(clip(x * encode, -6, 6))                   # to nearest, ties even

  A block of zeros, or one whose scale underflows E4M3, gets scale zero (its codes
  zero). The tensor's decode scale is ``1 / S_enc``.
* ``"to_nvfp4"``: torchao's ``NVFP4Tensor.to_nvfp4`` (``nvfp4_quantize``), with one
  level (block scales ``e4m3(clamp(block_amax / 6, 2**-6, 448))``, codes of
  ``x * (1 / scale)``) or two (a given per-tensor scale ``s``, from
  :func:`nvfp4_per_tensor_scale`: block scales ``e4m3(clamp(block_amax / 6 / s, ...))``
  and codes of ``x * ((1 / s) / scale)``).

Stochastic rounding (the training recipe's, for output gradients) replaces the
rounding to nearest of the codes: each scaled value goes to one of its two E2M1
neighbours, the farther with probability equal to its distance from the nearer one in
units of their gap.

The random Hadamard transform (:func:`random_hadamard_transform`) multiplies blocks of
16 by a 16x16 Hadamard matrix scaled by 1/4 with a diagonal of signs, in bfloat16 as
TransformerEngine does: it spreads an outlier over its block before the weight
gradient's operands are quantized, and, being orthogonal, cancels in the product.

Every division that torch computes as one correctly rounded float32 operation is one
here too (see :mod:`jaxscale._src.exact`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.exact import divide_exactly
from jaxscale._src.explicit_axes import also_on_explicit_axes
from jaxscale._src.threefry import random_uniform
from jaxscale.casting._mx import _divided_by

E2M1 = np.dtype(jnp.float4_e2m1fn)
E4M3 = np.dtype(jnp.float8_e4m3fn)
FP4_MAX = np.float32(6.0)
FP8_MAX = np.float32(448.0)
_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
_E4M3_SMALLEST_NORMAL = np.float32(2.0**-6)  # torch.finfo(torch.float8_e4m3fn).tiny
_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
ARITHMETICS = ("te", "to_nvfp4")
BLOCKS = ((1, 16), (16, 16))
# TransformerEngine's default sign vector for the weight gradient's Hadamard transform
DEFAULT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def nvfp4_per_tensor_scale(amax: Any) -> jax.Array:
    """torchao's ``per_tensor_amax_to_scale``: ``amax / (448 * 6)`` in float32, the
    per-tensor scale of the two-level ``"to_nvfp4"`` arithmetic."""
    amax = jnp.asarray(amax, jnp.float32)
    return lax.bitcast_convert_type(_divided_by(amax, 2688.0), jnp.float32)


@also_on_explicit_axes
def quantize_nvfp4(
    x: jax.Array,
    *,
    arithmetic: str = "te",
    block: tuple[int, int] = (1, 16),
    amax: Any = None,
    per_tensor_scale: Any = None,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x`` in NVFP4: E2M1 codes, E4M3 block scales and a float32 per-tensor scale, bit
    for bit TransformerEngine's chain (``"te"``) or torchao's ``NVFP4Tensor.to_nvfp4``
    (``"to_nvfp4"``); see the module's notes for both.

    Args:
      x: a float32 or bfloat16 array whose last axis is a multiple of 16 (for
        ``block=(16, 16)``: two-dimensional, both axes multiples of 16).
      arithmetic: ``"te"`` or ``"to_nvfp4"``.
      block: ``(1, 16)``: one scale per 16 values along the last axis; ``(16, 16)``:
        one per 16x16 tile (``"te"`` only, TransformerEngine's weight scaling).
      amax: ``"te"``: the tensor's largest magnitude to scale by (a float32 scalar);
        ``x``'s own by default.
      per_tensor_scale: ``"to_nvfp4"``: the per-tensor scale of two-level scaling
        (:func:`nvfp4_per_tensor_scale` of an amax); one level when ``None``.
      key: a PRNG key: round the codes stochastically instead of to nearest.

    Returns:
      ``(codes, scales, per_tensor_scale)``: ``codes`` of ``x``'s shape in
      ``jnp.float4_e2m1fn``; ``scales`` in ``jnp.float8_e4m3fn``, one per block of a
      row (``x.shape[:-1] + (x.shape[-1] // 16,)``; a 16x16 tile's scale repeated on
      its 16 rows); ``per_tensor_scale`` the float32 decode factor (``"te"``:
      ``1 / S_enc``; ``"to_nvfp4"``: the one given, or 1). ``x`` is about
      ``codes * scales * per_tensor_scale`` (:func:`dequantize_nvfp4`).

    Raises:
      ValueError: for another ``arithmetic`` or ``block``, ``x`` not float32 or
        bfloat16 or not divisible into blocks, or the other arithmetic's argument.

    >>> import jax.numpy as jnp, jaxscale
    >>> x = jnp.linspace(-1.0, 1.0, 32).reshape(2, 16)
    >>> codes, scales, global_scale = jaxscale.quantize_nvfp4(x)
    >>> codes.dtype, scales.shape, float(global_scale)
    (dtype(float4_e2m1fn), (2, 1), 0.00037202381645329297)
    >>> back = jaxscale.dequantize_nvfp4(codes, scales, global_scale)
    >>> [round(v, 3) for v in back[0, :4].tolist()]
    [-1.0, -1.0, -1.0, -0.667]
    """
    x = jnp.asarray(x)
    _check(x, arithmetic, block, amax, per_tensor_scale)
    values = x.astype(jnp.float32)
    rows = block[0]
    tiles = _tiles(values, rows)  # (..., R / rows, rows, C / 16, 16)
    block_amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))  # (..., R / rows, C / 16)
    if arithmetic == "te":
        global_amax = jnp.max(jnp.abs(values)) if amax is None else jnp.asarray(amax, jnp.float32)
        scales, encode, decode = _te_scales(block_amax, global_amax)
    else:
        scales, encode, decode = _to_nvfp4_scales(block_amax, per_tensor_scale)
    scaled = tiles * encode[..., None, :, None]
    codes = _to_e2m1(jnp.clip(scaled, -FP4_MAX, FP4_MAX), key)
    codes = codes.reshape(x.shape)
    scales = jnp.repeat(scales, rows, axis=-2) if rows > 1 else scales
    return codes, scales.reshape(*x.shape[:-1], x.shape[-1] // 16), decode


@also_on_explicit_axes
def dequantize_nvfp4(
    codes: jax.Array, scales: jax.Array, per_tensor_scale: Any, dtype: Any = jnp.float32
) -> jax.Array:
    """The values :func:`quantize_nvfp4` stored: ``codes * (per_tensor_scale * scales)``
    per block (torchao's ``dequantize``; for ``"te"`` the decode scale
    ``float32(S_dec) * (1 / S_enc)`` it divided by), in ``dtype``."""
    blocks = codes.astype(jnp.float32).reshape(*codes.shape[:-1], -1, 16)
    factor = jnp.asarray(per_tensor_scale, jnp.float32) * scales.astype(jnp.float32)
    return (blocks * factor[..., None]).reshape(codes.shape).astype(dtype)


def random_hadamard_transform(x: jax.Array, signs: Any = DEFAULT_SIGNS) -> jax.Array:
    """Each block of 16 along ``x``'s last axis times ``diag(signs) · H16 / 4`` (the
    Sylvester Hadamard matrix), in bfloat16 with a float32 sum, as TransformerEngine
    transforms the weight gradient's operands (torchao's ``reference_rht`` of ``A`` is
    this of ``A.T``). The result is bfloat16.

    >>> import jax.numpy as jnp, jaxscale
    >>> x = jnp.zeros((1, 16), jnp.bfloat16).at[0, 0].set(4.0)  # an outlier
    >>> jnp.abs(jaxscale.random_hadamard_transform(x)).tolist()[0][:4]  # spread over 16
    [1.0, 1.0, 1.0, 1.0]
    """
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[-1] % 16:
        raise ValueError(f"the last axis must be a multiple of 16, got shape {x.shape}")
    matrix = jnp.asarray(_rht_matrix(tuple(int(s) for s in signs)))
    blocks = x.astype(jnp.bfloat16).reshape(-1, 16)

    def transform(blocks: jax.Array) -> jax.Array:
        return lax.dot_general(
            blocks, matrix, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
            precision=lax.Precision.HIGHEST,
        )  # fmt: skip

    def materialized_first(blocks: jax.Array) -> jax.Array:
        # XLA's CPU backend before jaxlib 0.12 folds a transposed operand (a weight
        # gradient's dy.T, for a layer of 16 outputs written as w.T @ x) into this dot and
        # then cannot run it: "Unsupported element type for DotThunk::Execute: BF16 x BF16
        # = F32". The barrier makes the blocks an array of their own first.
        return transform(lax.optimization_barrier(blocks))

    product = lax.platform_dependent(blocks, cpu=materialized_first, default=transform)
    return product.astype(jnp.bfloat16).reshape(x.shape)


@functools.cache
def _rht_matrix(signs: tuple[int, ...]) -> np.ndarray:
    if len(signs) != 16 or any(s not in (1, -1) for s in signs):
        raise ValueError(f"signs must be 16 values of 1 or -1, got {signs!r}")
    hadamard = np.array([[1.0]])
    while hadamard.shape[0] < 16:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    matrix = (np.diag(np.array(signs, np.float64)) @ hadamard) * 0.25
    result = matrix.astype(jnp.bfloat16)
    result.setflags(write=False)
    return result


def _check(x: jax.Array, arithmetic: str, block: Any, amax: Any, per_tensor_scale: Any) -> None:
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic must be 'te' or 'to_nvfp4', got {arithmetic!r}")
    if tuple(block) not in BLOCKS:
        raise ValueError(f"block must be (1, 16) or (16, 16), got {block!r}")
    if x.dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(f"quantize_nvfp4 expects float32 or bfloat16, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % 16:
        raise ValueError(f"the last axis must be a multiple of 16, got shape {x.shape}")
    if tuple(block) == (16, 16):
        if arithmetic != "te":
            raise ValueError("16x16 blocks are TransformerEngine's weight scaling: arithmetic='te'")
        if x.ndim != 2 or x.shape[0] % 16:
            raise ValueError(f"16x16 blocks need a 2-D array of 16k rows, got shape {x.shape}")
    if arithmetic == "te" and per_tensor_scale is not None:
        raise ValueError("per_tensor_scale is to_nvfp4's; the 'te' arithmetic takes amax")
    if arithmetic == "to_nvfp4" and amax is not None:
        raise ValueError(
            "amax is the 'te' arithmetic's; to_nvfp4 takes per_tensor_scale "
            "(jaxscale.nvfp4_per_tensor_scale(amax))"
        )


def _tiles(values: jax.Array, rows: int) -> jax.Array:
    """``values`` as ``(..., R / rows, rows, C / 16, 16)`` (``R`` the second-to-last axis;
    a vector is one row)."""
    shaped = values if values.ndim >= 2 else values[None]
    *lead, r, c = shaped.shape
    return shaped.reshape(*lead, r // rows, rows, c // 16, 16)


def _te_scales(block_amax: jax.Array, amax: jax.Array) -> tuple[Any, Any, Any]:
    """TransformerEngine's chain: E4M3 block scales, the encode factor per block and the
    tensor's decode scale ``1 / S_enc``."""
    candidate = jnp.minimum(np.float32(2688.0) / amax, _FLOAT32_MAX)
    s_enc = jnp.where((amax == 0) | (candidate == 0), np.float32(1.0), candidate)
    s_dec = block_amax * (s_enc * np.float32(1.0 / 6.0))
    scales = jnp.minimum(s_dec, FP8_MAX).astype(E4M3)
    decode = np.float32(1.0) / s_enc
    encode = jnp.minimum(np.float32(1.0) / (scales.astype(jnp.float32) * decode), _FLOAT32_MAX)
    return scales, encode, decode


def _to_nvfp4_scales(block_amax: jax.Array, per_tensor_scale: Any) -> tuple[Any, Any, Any]:
    """torchao's ``nvfp4_quantize``: E4M3 block scales, the encode factor per block and
    the per-tensor scale."""
    block_scale = lax.bitcast_convert_type(_divided_by(block_amax, 6.0), jnp.float32)
    if per_tensor_scale is None:
        scales = jnp.clip(block_scale, _E4M3_SMALLEST_NORMAL, FP8_MAX).astype(E4M3)
        encode = np.float32(1.0) / scales.astype(jnp.float32)
        return scales, encode, jnp.float32(1.0)
    tensor_scale = jnp.asarray(per_tensor_scale, jnp.float32).reshape(())
    scales = jnp.clip(divide_exactly(block_scale, tensor_scale), _E4M3_SMALLEST_NORMAL, FP8_MAX)
    scales = scales.astype(E4M3)
    encode = (np.float32(1.0) / tensor_scale) / scales.astype(jnp.float32)
    return scales, encode, tensor_scale


def _to_e2m1(scaled: jax.Array, key: jax.Array | None) -> jax.Array:
    """Clipped float32 values to E2M1: to nearest (ties to even), or stochastically."""
    if key is None:
        return scaled.astype(E2M1)
    magnitude = jnp.abs(scaled)
    grid = jnp.asarray(_GRID)
    steps = grid[1:].reshape((1,) * magnitude.ndim + (7,))
    below = jnp.sum((magnitude[..., None] >= steps).astype(jnp.int32), axis=-1)
    lower = grid[below]
    upper = grid[jnp.minimum(below + 1, 7)]
    gap = jnp.where(upper > lower, upper - lower, np.float32(1.0))
    fraction = (magnitude - lower) / gap
    draws = random_uniform(key, scaled.shape)
    rounded = jnp.where(draws < fraction, upper, lower)
    return jnp.where(scaled < 0, -rounded, rounded).astype(E2M1)
