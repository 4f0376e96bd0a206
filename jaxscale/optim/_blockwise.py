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
* ``"int4"`` (torchao's ``OptimState4bit``, after Li et al. 2023): as ``"int8"`` with
  16-entry maps (the signed dynamic map of 3 exponent bits; ``linspace(0, 1, 17)[1:]``
  for second moments, which has no zero) in blocks of 128, two codes per byte (the
  first of each pair in the high nibble).

Layout. The codes keep the tensor's shape (``"int4"``: its last axis halved, which
must be even). The scales keep the tensor's leading axes: ``shape[:k] +
(blocks,)`` for the largest ``k`` whose trailing axes ``shape[k:]`` hold a whole number
of blocks, so a tensor sharded along a leading axis has its scales sharded with it and
the layout does not depend on the mesh. In row-major order they are torchao's flat
scales. A tensor whose size is not a multiple of the block (which torchao leaves in
float32) may be quantized with ``partial_blocks=True``: along its trailing axes
``shape[k:]`` (the fewest that hold a block), each row of them cut into blocks, the
last one shorter, scales of shape ``shape[:k] + (blocks per row,)``. Computed, a block
is read in the tensor's own axes where it spans whole rows of its trailing axes
(:func:`block_shape`), so that a tensor sharded along those axes keeps its shards.

Arithmetic. Every quotient is one correctly rounded float32 division, as in torch.
XLA's algebraic simplifier turns a division by a constant or by a broadcast value into
a multiplication by its reciprocal, which lands one ulp off in about a third of cases:
a scale is divided out of a block through a select the simplifier cannot see through
(a NaN divides by one, which keeps it NaN), and a block's scale is computed from a
constant held behind an optimization barrier. The nearest map entry is found from
exact float32 decision thresholds, computed here once from torchao's rounding rule
(``residual >= (up - down) * 0.5``), in place of torchao's binary search.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.exact import divide_by_constant, divide_exactly
from jaxscale._src.explicit_axes import also_on_explicit_axes
from jaxscale._src.validation import dtype_choice
from jaxscale.optim import _dynamic_maps

INT8 = "int8"
INT4 = "int4"
FLOAT8 = "float8_e4m3fn"
_EPS = np.float32(1e-12)
_FLOAT8_MAX = np.float32(448.0)


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-wise format: its name, torchao's block size, and its bits per value."""

    name: str
    block_size: int
    bits: int

    @property
    def code_dtype(self) -> Any:
        return jnp.float8_e4m3fn if self.name == FLOAT8 else jnp.uint8

    def table(self, signed: bool) -> np.ndarray:
        """The map of an integer format, as float32."""
        if self.name == INT8:
            return _dynamic_maps.SIGNED if signed else _dynamic_maps.UNSIGNED
        return _dynamic_maps.SIGNED_4BIT if signed else _dynamic_maps.UNSIGNED_4BIT


FORMATS = {
    INT8: BlockFormat(INT8, 256, 8),
    FLOAT8: BlockFormat(FLOAT8, 256, 8),
    INT4: BlockFormat(INT4, 128, 4),
}
# the names of the formats (the dtypes jnp.int8, jnp.int4 and jnp.float8_e4m3fn have them)
_NAMES = {INT8: INT8, FLOAT8: FLOAT8, INT4: INT4}


def format_of(dtype: Any, name: str = "dtype") -> BlockFormat:
    """The block format ``dtype`` names: ``"int8"``, ``"int4"`` or ``"float8_e4m3fn"``, as a
    string or as a dtype (``jnp.int8``, ``jnp.int4``, ``jnp.float8_e4m3fn``); a
    ``ValueError`` that lists them for anything else."""
    key = dtype_choice(dtype, _NAMES)
    if key is None:
        raise ValueError(
            f"{name} must be one of the block-wise formats 'int8', 'int4' or 'float8_e4m3fn' "
            f"(the strings or jnp.int8, jnp.int4, jnp.float8_e4m3fn), got {dtype!r}"
        )
    return FORMATS[key]


# -- layout -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """How a tensor of ``shape`` is cut into blocks.

    The tensor is read as ``rows`` rows of ``row_length`` elements (row-major), each row
    cut into ``blocks_per_row`` blocks of ``block_size`` (its last one shorter when
    ``row_length`` is not a multiple). The scales are stored as ``scale_shape`` and read
    as ``(rows, blocks_per_row)``.
    """

    shape: tuple[int, ...]
    block_size: int
    rows: int
    row_length: int
    blocks_per_row: int
    scale_shape: tuple[int, ...]

    @property
    def padded(self) -> bool:
        return self.row_length != self.blocks_per_row * self.block_size


def block_layout(
    shape: tuple[int, ...], block_size: int, *, partial_blocks: bool = False
) -> BlockLayout | None:
    """The layout of a tensor of ``shape`` in blocks of ``block_size`` (see the module's
    notes); ``None`` when its size is not a multiple of the block and ``partial_blocks``
    is false, or when it is empty."""
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if size == 0:
        return None
    if size % block_size == 0:
        k = max(k for k in range(len(shape) or 1) if math.prod(shape[k:]) % block_size == 0)
        blocks = size // block_size
        return BlockLayout(
            shape,
            block_size,
            blocks,
            block_size,
            1,
            (*shape[:k], math.prod(shape[k:]) // block_size),
        )
    if not partial_blocks:
        return None
    candidates = [k for k in range(len(shape)) if math.prod(shape[k:]) >= block_size]
    k = max(candidates) if candidates else 0
    row_length = math.prod(shape[k:])
    per_row = -(-row_length // block_size)
    return BlockLayout(
        shape, block_size, math.prod(shape[:k]), row_length, per_row, (*shape[:k], per_row)
    )


def by_leading_axes(layout: BlockLayout, longest: int) -> BlockLayout:
    """The same blocks read as rows of the tensor's leading axes (the axes its scales
    keep), each row its trailing axes' blocks, where that gives two rows or more of at
    most ``longest`` elements; else ``layout`` (a row per block). Row-major, the two
    readings hold the same blocks in the same order; a loop over rows of the leading axes
    keeps a tensor sharded along any of its trailing axes sharded as it is (a row per
    block would cut across its shards), and one sharded along its first axis too."""
    if layout.blocks_per_row != 1 or layout.row_length != layout.block_size:
        return layout  # (already rows of the leading axes: partial blocks)
    leading = len(layout.scale_shape) - 1
    rows = math.prod(layout.shape[:leading])
    row_length = math.prod(layout.shape[leading:])
    if rows < 2 or row_length > longest:
        return layout
    return dataclasses.replace(
        layout, rows=rows, row_length=row_length, blocks_per_row=row_length // layout.block_size
    )


def row_view(layout: BlockLayout) -> tuple[int, int]:
    """The rows of ``layout`` as ``(layers, rows per layer)``: the tensor's first axis
    apart where its rows are read from two leading axes or more (a stack of layers,
    ``(layers, rows, ...)``, as a scan over layers keeps them), else ``(1, rows)``.
    Merged into one axis of rows, a stack sharded along its second axis (FSDP of a
    stacked weight) would be gathered whole to be read as rows; reshaped to this view
    and its row length, either axis may be sharded."""
    shape, rows = layout.shape, layout.rows
    stacked = (
        len(shape) >= 3
        and shape[0] < rows
        and rows % shape[0] == 0
        and (rows // shape[0]) * layout.row_length == math.prod(shape[1:])
    )
    layers = shape[0] if stacked else 1
    return layers, rows // layers


def block_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """The shape a block of a tensor of ``shape`` is read as: ``m`` whole rows of the
    trailing axes ``shape[j:]``, ``(m, *shape[j:])`` (``shape[j:]`` alone where ``m`` is
    1), for the most trailing axes whose size divides the block; else ``(block_size,)``
    (a run of the last axis, or blocks that cut across its rows). Blocks start at
    multiples of their size, so every block of the tensor has this shape. Read so, a
    tensor sharded along any of those trailing axes (a layer's columns under FSDP, where
    a row is shorter than a block) keeps its shards in place: merged into one run, the
    shards would form the minor part of an axis, which no sharding describes."""
    for j in range(len(shape)):
        trailing = math.prod(shape[j:])
        if block_size % trailing == 0:
            m = block_size // trailing
            return (m, *shape[j:]) if m > 1 else tuple(shape[j:])
    return (block_size,)


def row_shape(layout: BlockLayout) -> tuple[int, ...]:
    """The shape each row of ``layout`` is read as: its blocks, each as
    :func:`block_shape` says, ``(blocks_per_row, *block)``; a row of partial blocks
    (the last one shorter) as one axis of ``row_length``."""
    if layout.padded:
        return (layout.row_length,)
    block = block_shape(layout.shape, layout.block_size)
    return block if layout.blocks_per_row == 1 else (layout.blocks_per_row, *block)


def codes_row_shape(layout: BlockLayout, fmt: BlockFormat) -> tuple[int, ...]:
    """The shape a row of stored codes is read as: :func:`row_shape` (``"int4"``: its last
    axis halved, two codes a byte)."""
    return codes_shape(row_shape(layout), fmt)


def rows_of(x: jax.Array, layout: BlockLayout) -> jax.Array:
    """A tensor of ``layout`` read as rows: ``(*row_view(layout), *row_shape(layout))``."""
    return x.reshape(*row_view(layout), *row_shape(layout))


def codes_shape(shape: tuple[int, ...], fmt: BlockFormat) -> tuple[int, ...]:
    """The stored codes' shape: the tensor's (``"int4"``: its last axis halved)."""
    if fmt.bits == 8:
        return tuple(shape)
    return (*shape[:-1], shape[-1] // 2)


def value_shape(codes_shape: tuple[int, ...], fmt: BlockFormat) -> tuple[int, ...]:
    """The tensor's shape, from its stored codes' shape."""
    if fmt.bits == 8:
        return tuple(codes_shape)
    return (*codes_shape[:-1], 2 * codes_shape[-1])


def quantizable(layout: BlockLayout | None, fmt: BlockFormat) -> bool:
    """Whether ``fmt`` can store a tensor of ``layout``: ``"int4"`` packs neighbours along
    the last axis in pairs, so that axis must be even (torchao packs the flattened
    tensor, across rows where it is odd; jaxscale keeps such a tensor in float32)."""
    if layout is None:
        return False
    return fmt.bits == 8 or (bool(layout.shape) and layout.shape[-1] % 2 == 0)


# -- the arithmetic, on rows --------------------------------------------------------------------


def scale_of(amax: jax.Array, fmt: BlockFormat) -> jax.Array:
    """torchao's block scale from a block's largest magnitude."""
    clipped = jnp.maximum(amax, _EPS)
    return divide_by_constant(clipped, _FLOAT8_MAX) if fmt.name == FLOAT8 else clipped


def quantize_rows(
    rows: jax.Array, layout: BlockLayout, fmt: BlockFormat, signed: bool
) -> tuple[jax.Array, jax.Array]:
    """Rows of a tensor (float32, ``(..., *row_shape(layout))``; any leading axes) to
    ``(codes, scale)`` of shapes ``(..., *codes_row_shape(layout, fmt))`` and
    ``(..., layout.blocks_per_row)``."""
    leading = rows.shape[: rows.ndim - len(row_shape(layout))]
    if layout.padded:
        blocks = _as_blocks(rows, layout)
    else:  # (..., blocks_per_row, *block)
        blocks = rows.reshape(
            *leading, layout.blocks_per_row, *block_shape(layout.shape, layout.block_size)
        )
    within = tuple(range(len(leading) + 1, blocks.ndim))  # (each block's own axes)
    scale = scale_of(jnp.max(jnp.abs(blocks), axis=within), fmt)
    normalized = divide_exactly(blocks, lax.expand_dims(scale, within))
    codes = _encode(normalized, fmt, signed)
    if layout.padded:
        codes = codes.reshape(*leading, -1)[..., : layout.row_length]
    else:
        codes = codes.reshape(rows.shape)
    return _pack(codes, fmt), scale


def dequantize_rows(
    codes: jax.Array, scale: jax.Array, layout: BlockLayout, fmt: BlockFormat, signed: bool
) -> jax.Array:
    """:func:`quantize_rows` undone: float32 rows of ``row_shape(layout)`` (the codes'
    leading axes kept)."""
    values = _decode(_unpack(codes, fmt), fmt, signed)
    if layout.padded:
        leading = values.shape[:-1]
        scale = jnp.broadcast_to(scale[..., None], (*scale.shape, layout.block_size))
        scale = scale.reshape(*leading, -1)[..., : layout.row_length]
        return values * scale
    block = block_shape(layout.shape, layout.block_size)
    blocks = values.reshape(*scale.shape, *block) * lax.expand_dims(
        scale, tuple(range(scale.ndim, scale.ndim + len(block)))
    )
    return blocks.reshape(values.shape)


def _as_blocks(rows: jax.Array, layout: BlockLayout) -> jax.Array:
    """Rows of partial blocks padded to whole blocks, ``(..., blocks_per_row, block_size)``."""
    padding = layout.blocks_per_row * layout.block_size - layout.row_length
    rows = jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, padding)])
    return rows.reshape(*rows.shape[:-1], layout.blocks_per_row, layout.block_size)


def _encode(normalized: jax.Array, fmt: BlockFormat, signed: bool) -> jax.Array:
    if fmt.name == FLOAT8:
        return normalized.astype(jnp.float8_e4m3fn)
    return _nearest_in_map(normalized, fmt.table(signed), signed)


def _decode(codes: jax.Array, fmt: BlockFormat, signed: bool) -> jax.Array:
    if fmt.name == FLOAT8:
        return _float8_to_float32(codes)
    return _lookup(fmt.table(signed), codes.astype(jnp.int32))


def _float8_to_float32(codes: jax.Array) -> jax.Array:
    """``float8_e4m3fn`` codes to float32, bit for bit what a conversion gives, in integer
    arithmetic: elementwise, so it fuses with what reads it (a table lookup is a gather,
    which XLA's CPU backend writes out with its indices), and opaque to XLA's
    simplifier, which may drop a float32 -> float8 -> float32 round trip of a conversion
    (``xla_allow_excess_precision``) and, inside a loop, hoists the conversion of a whole
    loop-invariant array out (a widened copy of the state)."""
    bits = lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.uint32)
    magnitude = bits & 0x7F
    # a normal number's exponent (bias 7) and mantissa moved into float32's (bias 127)
    normal = lax.bitcast_convert_type((magnitude << 20) + jnp.uint32(120 << 23), jnp.float32)
    subnormal = magnitude.astype(jnp.float32) * jnp.float32(2.0**-9)  # exact: m * 2**-9
    value = jnp.where(magnitude >= 8, normal, subnormal)
    value = jnp.where(magnitude == 0x7F, jnp.float32(np.nan), value)  # e4m3fn's one NaN
    return jnp.where((bits & 0x80) != 0, -value, value)


def _lookup(table: np.ndarray, indices: jax.Array) -> jax.Array:
    """``table[indices]`` for indices known to be in range (codes index their whole map),
    which XLA then reads without clamping them."""
    return jnp.asarray(table).at[indices].get(mode="promise_in_bounds")


def _pack(codes: jax.Array, fmt: BlockFormat) -> jax.Array:
    """4-bit codes two per byte, torchao's ``(codes[::2] << 4) | codes[1::2]``."""
    if fmt.bits == 8:
        return codes
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def _unpack(codes: jax.Array, fmt: BlockFormat) -> jax.Array:
    """:func:`_pack` undone, each code from its byte by a shift that depends on its
    position: elementwise, so it fuses with what reads it (a stack of the two halves
    is a concatenation, which XLA's GPU backend writes out whole)."""
    if fmt.bits == 8:
        return codes
    *leading, width = codes.shape
    doubled = jnp.broadcast_to(codes[..., None], (*leading, width, 2))
    doubled = doubled.reshape(*leading, 2 * width)
    second = lax.broadcasted_iota(jnp.uint8, doubled.shape, doubled.ndim - 1) & np.uint8(1)
    return (doubled >> ((np.uint8(1) - second) * np.uint8(4))) & np.uint8(0xF)


# -- the nearest map entry ----------------------------------------------------------------------


def _ordered_keys(bits: Any) -> Any:
    """float32 bit patterns (uint32, NumPy or JAX) -> keys in the floats' order: the sign
    bit set for positive numbers, every bit flipped for negative ones."""
    sign = bits >> 31  # 1 for negative numbers
    return bits ^ (np.uint32(0x8000_0000) | (np.uint32(0x7FFF_FFFF) * sign))


def _from_key(key: int) -> np.float32:
    bits = key ^ 0x8000_0000 if key >= 0x8000_0000 else key ^ 0xFFFF_FFFF
    return np.float32(np.array(bits, np.uint32).view(np.float32).item())


@functools.cache
def decision_thresholds(signed: bool, bits: int = 8) -> np.ndarray:
    """For each pair of neighbouring map entries ``(v[k], v[k+1])``, the smallest float32
    ``x`` that torchao's rounding sends to ``k + 1``: the least ``x >= v[k]`` with
    ``float32(x - v[k]) >= float32(v[k+1] - v[k]) * 0.5``, found by bisection on the
    floats in between (the test is monotone in ``x``). torchao's code for ``x`` is the
    number of thresholds at or below it (0 below the map, and for NaN)."""
    table = FORMATS[INT8 if bits == 8 else INT4].table(signed)
    keys = _ordered_keys(table.view(np.uint32)).astype(np.int64)
    found = []
    for k in range(table.size - 1):
        low, high = table[k], table[k + 1]
        half = np.float32(np.float32(high - low) * np.float32(0.5))
        first, last = int(keys[k]), int(keys[k + 1])
        while first < last:
            middle = (first + last) // 2
            if np.float32(_from_key(middle) - low) >= half:
                last = middle
            else:
                first = middle + 1
        found.append(_from_key(first))
    thresholds = np.array(found, np.float32)
    assert np.all(np.diff(thresholds) > 0)
    thresholds.setflags(write=False)
    return thresholds


@functools.cache
def _bucket_table(signed: bool) -> np.ndarray:
    """For each of the 2**16 buckets of float32 values sharing their key's top 16 bits:
    the number of thresholds below the bucket (low 8 bits) and the low 16 bits of the
    key of the one threshold inside it (bits 8 to 24; 2**16 where there is none). A
    bucket spans 2**16 consecutive floats, 2**-8 to 2**-7 of their magnitude, and holds
    at most one threshold of either map (checked here), so one comparison finishes."""
    keys = _ordered_keys(decision_thresholds(signed).view(np.uint32)).astype(np.int64)
    starts = np.arange(1 << 16, dtype=np.int64) << 16
    below = np.searchsorted(keys, starts, side="left")
    inside = np.searchsorted(keys, starts + (1 << 16), side="left") - below
    assert inside.max() <= 1, "two thresholds in one bucket"
    low_bits = np.full(1 << 16, 1 << 16, np.int64)
    buckets = keys >> 16
    low_bits[buckets] = keys & 0xFFFF
    table = below | (low_bits << 8)
    return table.astype(np.int32)


def _nearest_in_map(normalized: jax.Array, table: np.ndarray, signed: bool) -> jax.Array:
    """torchao's ``quantize_8bit_with_qmap`` (or ``quantize_4bit_with_qmap`` for a
    16-entry ``table``): the last entry ``<= normalized`` (entry 0 below the first, and
    for NaN), then one step up where ``normalized`` is at least halfway to the next.
    Computed as the number of :func:`decision_thresholds` at or below the value: for the
    8-bit maps from the value's bucket (:func:`_bucket_table`) and one comparison, for
    the 4-bit maps by comparing with all 15."""
    if table.size == 16:
        normalized = jnp.where(normalized == 0, np.float32(0.0), normalized)  # -0.0 is 0.0
        thresholds = decision_thresholds(signed, 4)
        codes = sum(
            (normalized >= threshold).astype(jnp.uint8) for threshold in thresholds.tolist()
        )
        return jnp.where(jnp.isnan(normalized), 0, codes).astype(jnp.uint8)
    # On the bits alone, so that the value is read once: XLA's CPU backend, fusing a
    # division that feeds both a table lookup and float tests, computes it far slower.
    bits = lax.bitcast_convert_type(normalized, jnp.uint32)
    magnitude = bits & np.uint32(0x7FFF_FFFF)
    bits = jnp.where(magnitude == 0, np.uint32(0), bits)  # -0.0 is 0.0
    keys = _ordered_keys(bits)
    entry = _lookup(_bucket_table(signed), (keys >> 16).astype(jnp.int32))
    inside = (keys & 0xFFFF).astype(jnp.int32) >= (entry >> 8)
    codes = (entry & 0xFF) + inside.astype(jnp.int32)
    codes = jnp.where(magnitude > np.uint32(0x7F80_0000), 0, codes)  # NaN
    return codes.astype(jnp.uint8)


# -- the public functions -----------------------------------------------------------------------


@also_on_explicit_axes
def quantize_blockwise(
    x: jax.Array,
    dtype: Any,
    *,
    block_size: int | None = None,
    signed: bool = True,
    partial_blocks: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``x`` as block-wise quantized codes and one float32 scale per block: torchao's
    ``quantize_fp8`` (``dtype=jnp.float8_e4m3fn``), or ``scale_tensor`` followed by
    ``quantize_8bit_with_qmap`` (``"int8"``) or ``quantize_4bit_with_qmap`` and its
    packing (``"int4"``), bit for bit.

    ``x`` is read as float32 and cut into blocks of ``block_size`` consecutive
    elements in row-major order. Each block's scale is ``max(amax, 1e-12) / 448``
    (float8) or ``max(amax, 1e-12)`` (8 and 4 bits); float8 codes are
    ``float8_e4m3fn(x / scale)``; integer codes index torchao's map (``signed``: for
    signed state such as Adam's first moment; unsigned for second moments), the entry
    nearest ``x / scale``, ties to the larger.

    Args:
      x: a floating array whose size is a multiple of ``block_size`` (or any size, with
        ``partial_blocks``).
      dtype: ``"int8"``, ``"int4"`` or ``"float8_e4m3fn"`` (or ``jnp.int8``, ``jnp.int4``,
        ``jnp.float8_e4m3fn``).
      block_size: elements per block; torchao's by default (256; 128 for ``"int4"``).
      signed: for the integer formats, which map (ignored for float8, which has a sign bit).
      partial_blocks: cut a tensor whose size is not a multiple of ``block_size`` along
        its trailing axes, each row's last block shorter (see the module's notes).

    Returns:
      ``(codes, scale)``: ``codes`` of ``x``'s shape (``float8_e4m3fn``, or ``uint8``
      indices; for ``"int4"`` two per byte along ``x``'s last axis, which must be
      even), ``scale`` float32
      of ``x``'s leading axes followed by the blocks (``(x.size // block_size,)`` for a
      vector).

    Raises:
      ValueError: for another ``dtype``, a size that is not a multiple of
        ``block_size``, or ``x`` not floating.

    >>> import jax.numpy as jnp, jaxscale
    >>> codes, scale = jaxscale.quantize_blockwise(
    ...     jnp.array([0.5, -1.0, 0.25, 0.0]), "int8", block_size=4)
    >>> codes.tolist(), scale.tolist()
    ([219, 0, 201, 127], [1.0])
    >>> back = jaxscale.dequantize_blockwise(codes, scale, "int8", signed=True)
    >>> [round(v, 4) for v in back.tolist()]
    [0.5008, -0.993, 0.2477, 0.0]
    """
    fmt = format_of(dtype)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize_blockwise expects a floating array, got {x.dtype}")
    block_size = _checked_block_size(block_size, fmt)
    layout = block_layout(x.shape, block_size, partial_blocks=partial_blocks)
    if layout is None:
        raise ValueError(
            f"an array of {x.size} elements does not split into blocks of {block_size}: pass a "
            "block_size that divides its size, or partial_blocks=True"
        )
    if not quantizable(layout, fmt):
        raise ValueError(
            f"int4 packs neighbouring values along the last axis two per byte, and the last "
            f"axis of an array of shape {x.shape} is odd"
        )
    codes, scale = quantize_rows(rows_of(x.astype(jnp.float32), layout), layout, fmt, signed)
    return codes.reshape(codes_shape(x.shape, fmt)), scale.reshape(layout.scale_shape)


@also_on_explicit_axes
def dequantize_blockwise(
    codes: jax.Array,
    scale: jax.Array,
    dtype: Any,
    *,
    signed: bool | None = None,
    block_size: int | None = None,
) -> jax.Array:
    """The float32 values :func:`quantize_blockwise` stored: torchao's ``dequantize``.

    ``float32(codes) * scale`` for float8, ``map[codes] * scale`` for the integer
    formats, each block with its own scale.

    Args:
      codes, scale: what :func:`quantize_blockwise` returned.
      dtype: the format they were stored in.
      signed: the map they were stored with, for the integer formats: required, since
        codes read with the other map are other numbers (nothing in the codes tells).
      block_size: the block size; needed only for ``partial_blocks`` (the scales' shape
        gives it otherwise).

    Raises:
      ValueError: for another ``dtype``, codes of another dtype than the format's, a
        ``scale`` that does not fit ``codes``, or no ``signed`` for an integer format.
    """
    fmt = format_of(dtype)
    if signed is None:
        if fmt.name != FLOAT8:
            raise ValueError(
                f"dequantize_blockwise needs signed= for {fmt.name} codes: signed=True for a "
                "signed state (Adam's first moment), signed=False for an unsigned one (its second "
                "moment), as quantize_blockwise stored them"
            )
        signed = True
    codes, scale = jnp.asarray(codes), jnp.asarray(scale)
    if codes.dtype != np.dtype(fmt.code_dtype):
        # (float codes would be read as map indices, uint8 as float8 numbers: other values)
        raise ValueError(
            f"{fmt.name} codes are {np.dtype(fmt.code_dtype).name}, as quantize_blockwise "
            f"returns them; got {codes.dtype.name} codes"
        )
    shape = value_shape(codes.shape, fmt)
    layout = _layout_for(shape, scale, fmt, block_size)
    if layout is None or tuple(codes.shape) != codes_shape(shape, fmt):
        raise ValueError(
            f"scale must hold one value per block of codes: codes of shape {tuple(codes.shape)} "
            f"and scale of shape {tuple(scale.shape)} are not what quantize_blockwise returns "
            f"for an array of shape {shape}"
            + ("" if block_size else " (partial blocks need their block_size)")
        )
    view = row_view(layout)
    rows = dequantize_rows(
        codes.reshape(*view, *codes_row_shape(layout, fmt)),
        scale.reshape(*view, layout.blocks_per_row),
        layout,
        fmt,
        signed,
    )
    return rows.reshape(shape)


def _layout_for(
    shape: tuple[int, ...], scale: jax.Array, fmt: BlockFormat, block_size: int | None
) -> BlockLayout | None:
    """The layout whose scales have ``scale``'s shape: blocks of ``block_size``, or, where
    it is not given, of the size that divides the array into ``scale.size`` blocks."""
    size = math.prod(shape)
    if not scale.size or size == 0:
        return None
    if block_size is None:
        if size % scale.size:
            return None
        layout = block_layout(shape, size // scale.size)
    else:
        layout = block_layout(shape, block_size, partial_blocks=True)
    if layout is None or layout.scale_shape != tuple(scale.shape) or not quantizable(layout, fmt):
        return None
    return layout


def _checked_block_size(block_size: Any, fmt: BlockFormat) -> int:
    if block_size is None:
        return fmt.block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"block_size must be an int of at least 2, got {block_size!r} (a block of one "
            "element stores a float32 scale per value, more than the value itself)"
        )
    if fmt.bits == 4 and block_size % 2:
        raise ValueError(f"int4 packs values in pairs: block_size must be even, got {block_size}")
    return block_size
