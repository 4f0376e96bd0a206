"""Block-wise quantization of optimizer state, bit for bit as torchao's low-bit optimizers.

A tensor is cut into blocks of ``block_size`` consecutive elements (in row-major
order, as torchao's ``view(-1, block_size)``) and each block stored with one float32
scale:

* ``float8_e4m3fn`` (torchao's ``OptimStateFp8``, ``quantize_fp8``):
  ``scale = max(amax, 1e-12) / 448``, ``codes = float8(x / scale)``;
  ``x ≈ float32(codes) * scale``.
* ``"int8"`` (torchao's ``OptimState8bit``: ``scale_tensor`` and
  ``quantize_8bit_with_qmap``, after Dettmers et al. 2022): ``scale = max(amax,
  1e-12)``, ``x / scale`` in [-1, 1] looked up in a 256-entry dynamic map (signed for
  first moments, unsigned for second moments) and stored as the ``uint8`` index of
  the nearest entry (ties up); ``x ≈ map[codes] * scale``.

Every quotient is one correctly rounded float32 division, as in torch. XLA's
algebraic simplifier rewrites a division by a constant or by a broadcast value into
a multiplication by its reciprocal, which lands one ulp off in about a third of
cases, so the divisor is materialised behind an optimisation barrier that the
simplifier cannot see through.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale.optim import _dynamic_maps

INT8 = "int8"
FLOAT8 = np.dtype(jnp.float8_e4m3fn)
_EPS = np.float32(1e-12)
_FLOAT8_MAX = np.float32(448.0)


def format_of(dtype: Any) -> Any:
    """``"int8"`` or ``float8_e4m3fn``: the block-wise formats; ValueError for others."""
    if isinstance(dtype, str):
        if dtype == INT8:
            return INT8
    else:
        try:
            if np.dtype(dtype) == FLOAT8:
                return FLOAT8
        except TypeError:
            pass
    raise ValueError(f'block-wise quantization stores jnp.float8_e4m3fn or "int8", got {dtype!r}')


def qmap(signed: bool) -> np.ndarray:
    return _dynamic_maps.SIGNED if signed else _dynamic_maps.UNSIGNED


def divide_exactly(numerator: jax.Array, denominator: Any) -> jax.Array:
    """``numerator / denominator`` correctly rounded, ``denominator`` broadcast first:
    see the module's notes."""
    denominator = jnp.broadcast_to(denominator, numerator.shape)
    return numerator / lax.optimization_barrier(denominator)


def quantize_blockwise(
    x: jax.Array, dtype: Any, *, block_size: int = 256, signed: bool = True
) -> tuple[jax.Array, jax.Array]:
    """``x`` as block-wise quantized codes and one float32 scale per block: torchao's
    ``quantize_fp8`` (``dtype=jnp.float8_e4m3fn``) or ``scale_tensor`` followed by
    ``quantize_8bit_with_qmap`` (``dtype="int8"``), bit for bit.

    ``x`` is read as float32 and cut into blocks of ``block_size`` consecutive
    elements in row-major order. Each block's scale is ``max(amax, 1e-12) / 448``
    (float8) or ``max(amax, 1e-12)`` (8-bit); float8 codes are ``float8_e4m3fn(x /
    scale)``; 8-bit codes index torchao's dynamic map (``signed``: 256 values in
    [-1, 1] for signed state such as Adam's first moment; unsigned: in [0, 1], for
    second moments), the entry nearest ``x / scale``, ties to the larger.

    Args:
      x: a floating array whose size is a multiple of ``block_size``.
      dtype: ``jnp.float8_e4m3fn`` or ``"int8"``.
      block_size: elements per block.
      signed: for ``"int8"``, which map (ignored for float8, which has a sign bit).

    Returns:
      ``(codes, scale)``: ``codes`` of ``x``'s shape (``float8_e4m3fn``, or ``uint8``
      indices for ``"int8"``), ``scale`` float32 of shape ``(x.size // block_size,)``.

    Raises:
      ValueError: for another ``dtype``, a size that is not a multiple of
        ``block_size``, or ``x`` not floating.

    >>> import jax.numpy as jnp, jaxscale
    >>> codes, scale = jaxscale.quantize_blockwise(
    ...     jnp.array([0.5, -1.0, 0.25, 0.0]), "int8", block_size=4)
    >>> codes.tolist(), scale.tolist()
    ([219, 0, 201, 127], [1.0])
    >>> [round(v, 4) for v in jaxscale.dequantize_blockwise(codes, scale, "int8").tolist()]
    [0.5008, -0.993, 0.2477, 0.0]
    """
    fmt = format_of(dtype)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize_blockwise expects a floating array, got {x.dtype}")
    _check_blocks(x.size, block_size)
    blocks = x.astype(jnp.float32).reshape(-1, block_size)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=1, keepdims=True), _EPS)
    if fmt is FLOAT8:
        scale = divide_exactly(amax, _FLOAT8_MAX)
        codes = divide_exactly(blocks, scale).astype(FLOAT8)
    else:
        scale = amax
        codes = _nearest_in_map(divide_exactly(blocks, scale), qmap(signed), signed)
    return codes.reshape(x.shape), scale.reshape(-1)


def dequantize_blockwise(
    codes: jax.Array, scale: jax.Array, dtype: Any, *, signed: bool = True
) -> jax.Array:
    """The float32 values :func:`quantize_blockwise` stored: torchao's ``dequantize``.

    ``float32(codes) * scale`` for float8, ``map[codes] * scale`` for ``"int8"``, each
    block of ``codes.size // scale.size`` elements with its own scale.

    Raises:
      ValueError: for another ``dtype``, or a ``scale`` whose size does not divide
        ``codes.size``.
    """
    fmt = format_of(dtype)
    if scale.ndim != 1 or scale.size == 0 or codes.size % scale.size:
        raise ValueError(
            f"scale must hold one value per block of codes: codes has {codes.size} elements, "
            f"scale has shape {tuple(scale.shape)}"
        )
    values = (
        codes.astype(jnp.float32)
        if fmt is FLOAT8
        else jnp.asarray(qmap(signed))[codes.astype(jnp.int32)]
    )
    return (values.reshape(scale.size, -1) * scale[:, None]).reshape(codes.shape)


def _check_blocks(size: int, block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if size == 0 or size % block_size:
        raise ValueError(
            f"an array of {size} elements does not split into blocks of {block_size}: pass a "
            "block_size that divides its size"
        )


def _ordered_keys(bits: Any) -> Any:
    """float32 bit patterns (uint32, NumPy or JAX) -> keys in the floats' order: the sign
    bit set for positive numbers, every bit flipped for negative ones."""
    sign = bits >> 31  # 1 for negative numbers
    return bits ^ (np.uint32(0x8000_0000) | (np.uint32(0x7FFF_FFFF) * sign))


@functools.cache
def _bucket_table(signed: bool) -> np.ndarray:
    """For each of the 2**16 buckets of float32 values sharing their key's top 16 bits:
    the index of the last map entry at or below the bucket's smallest value (-1 where
    none is). A bucket spans 2**16 consecutive floats, 2**-8 to 2**-7 of their
    magnitude, and holds at most one further entry of either map (checked here), so one
    comparison finds the entry."""
    table = qmap(signed)
    keys = _ordered_keys(table.view(np.uint32)).astype(np.int64)
    starts = np.arange(1 << 16, dtype=np.int64) << 16
    last_at_or_below = np.searchsorted(keys, starts, side="right") - 1
    inside = np.searchsorted(keys, starts + (1 << 16) - 1, side="right") - 1 - last_at_or_below
    assert inside.max() <= 1, "two map entries in one bucket"
    return last_at_or_below.astype(np.int16)


def _nearest_in_map(normalized: jax.Array, table: np.ndarray, signed: bool) -> jax.Array:
    """torchao's ``quantize_8bit_with_qmap``: the last entry ``<= normalized`` (entry 0
    below the first, and for NaN), then one step up where ``normalized`` is at least
    halfway to the next entry.

    torchao finds the entry by a branchless binary search, eight gathers deep. The same
    entry is found here from the value's bucket (:func:`_bucket_table`) and one
    comparison, which takes a third of the time on a CPU."""
    values = jnp.asarray(table)
    unsigned_zero = jnp.where(normalized == 0, np.float32(0.0), normalized)  # -0.0 is 0.0
    buckets = _ordered_keys(lax.bitcast_convert_type(unsigned_zero, jnp.uint32)) >> 16
    buckets = buckets.astype(jnp.int32)
    below = jnp.asarray(_bucket_table(signed))[buckets].astype(jnp.int32)
    after = values[jnp.clip(below + 1, 0, 255)]
    codes = jnp.where((below < 255) & (normalized >= after), below + 1, below)
    codes = jnp.maximum(codes, 0)
    up = jnp.minimum(codes + 1, 255)
    low, high = values[codes], values[up]
    codes = jnp.where(normalized - low >= (high - low) * np.float32(0.5), up, codes)
    codes = jnp.where(jnp.isnan(normalized), 0, codes)
    return codes.astype(jnp.uint8)
