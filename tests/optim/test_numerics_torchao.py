"""The low-precision numerics against torchao on the CPU, bit for bit.

torchao's ``_fp32_to_bf16_sr`` (fed the same random draws), ``quantize_fp8``,
``scale_tensor`` + ``quantize_8bit_with_qmap``, ``dequant_with_qmap`` and
``create_dynamic_map`` are the references for ``jaxscale.stochastic_round``,
``quantize_blockwise`` and ``dequantize_blockwise``, on more than 100,000 values
each, with the edge cases their arithmetic meets.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxscale
from jaxscale.optim import _blockwise, _dynamic_maps

with warnings.catch_warnings():  # torchao's import warns about its optional GPU kernels
    warnings.simplefilter("ignore")
    from torchao.optim import quant_utils
    from torchao.optim.subclass_4bit import OptimState4bit, get_qmap_signed, get_qmap_unsigned
    from torchao.optim.subclass_fp8 import quantize_fp8

SIZE = 1 << 17  # 131,072 values


def float32_edge_cases() -> np.ndarray:
    """Every sign of: zero, the smallest subnormal and normal, the largest finite float32,
    values whose low 16 bits are 0, 1, 0x8000 and 0xFFFF, and infinity."""
    patterns = []
    for high in (0x0000, 0x0080, 0x3F80, 0x4780, 0x7F7F, 0x7F80):
        for low in (0x0000, 0x0001, 0x8000, 0xFFFF):
            if high == 0x7F80 and low:  # NaNs: compared separately
                continue
            for sign in (0, 0x8000_0000):
                patterns.append(sign | (high << 16) | low)
    return np.array(patterns, np.uint32).view(np.float32)


def random_float32(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random bit patterns over the whole finite range, then uniform magnitudes."""
    bits = rng.integers(0, 1 << 32, size, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    spread = (rng.standard_normal(size) * 10.0 ** rng.uniform(-30, 30, size)).astype(np.float32)
    return np.concatenate([float32_edge_cases(), values, spread])[:size]


def torchao_stochastic_round(x: np.ndarray, draws: np.ndarray, monkeypatch) -> np.ndarray:
    """``_fp32_to_bf16_sr(x)`` with ``torch.randint`` returning ``draws``."""
    monkeypatch.setattr(torch, "randint", lambda low, high, shape, **kw: torch.from_numpy(draws))
    result = quant_utils._fp32_to_bf16_sr(torch.from_numpy(x))
    monkeypatch.undo()
    return result.view(torch.int16).numpy().view(np.uint16)


def test_stochastic_round_to_bfloat16_is_torchaos_bit_for_bit(monkeypatch):
    rng = np.random.default_rng(0)
    x = random_float32(rng, SIZE)
    draws = rng.integers(0, 1 << 16, x.shape).astype(np.int32)
    draws[:64] = np.arange(64) % 2 * 0xFFFF  # the extremes of the draws on the edge cases
    expected = torchao_stochastic_round(x, draws, monkeypatch)
    eager = np.asarray(jaxscale.stochastic_round(x, bits=draws)).view(np.uint16)
    jitted = jax.jit(lambda x, b: jaxscale.stochastic_round(x, bits=b))(x, draws)
    assert x.size == SIZE
    np.testing.assert_array_equal(eager, expected)
    np.testing.assert_array_equal(np.asarray(jitted).view(np.uint16), expected)


def test_a_nan_stays_a_nan_where_torchao_can_make_it_infinite_or_zero(monkeypatch):
    # NaN bit patterns whose payload lies only in the low 16 bits: torchao's truncation
    # gives +-inf (rounded toward zero) or, for the all-ones pattern, +0 (rounded away,
    # the add overflowing into the sign bit); jaxscale keeps them NaN
    nans = np.array([0x7F80_0001, 0xFF80_FFFF, 0xFFFF_FFFF, 0x7FC0_0000], np.uint32)
    draws = np.array([0xFFFF, 0xFFFF, 0, 0], np.int32)
    expected = torchao_stochastic_round(nans.view(np.float32), draws, monkeypatch)
    assert expected[:3].tolist() == [0x7F80, 0xFF80, 0x0000]  # inf, -inf, +0
    assert np.isnan(expected[3:].view(jnp.bfloat16).astype(np.float32)).all()
    ours = np.asarray(jaxscale.stochastic_round(nans.view(np.float32), bits=draws))
    assert np.isnan(ours.astype(np.float32)).all()
    assert (ours.view(np.uint16) >> 15).tolist() == [0, 1, 1, 0]  # signs kept


def blocks_with_edges(rng: np.random.Generator, block_size: int) -> np.ndarray:
    """Random blocks spanning 60 decades, plus an all-zero block, a block below the 1e-12
    floor, one of subnormals, one at the float32 maximum, and blocks of one sign."""
    count = SIZE // block_size
    scales = 10.0 ** rng.uniform(-30, 30, (count, 1))
    x = (rng.standard_normal((count, block_size)) * scales).astype(np.float32)
    x[0] = 0.0
    x[1] *= np.float32(1e-20) / np.abs(x[1]).max()
    x[2] = rng.uniform(-1, 1, block_size).astype(np.float32) * np.float32(1e-40)
    x[3] = rng.uniform(-1, 1, block_size).astype(np.float32) * np.finfo(np.float32).max
    x[4] = np.abs(x[4])
    x[5] = -np.abs(x[5])
    x[6] = np.float32(0.5)  # every value at the block's amax
    return x.reshape(-1)


@pytest.mark.parametrize("block_size", [256, 128])
def test_float8_blocks_are_torchaos_quantize_fp8(block_size):
    x = blocks_with_edges(np.random.default_rng(block_size), block_size)
    codes, scale = quantize_fp8(torch.from_numpy(x), block_size)
    ours_codes, ours_scale = jax.jit(
        lambda x: jaxscale.quantize_blockwise(x, jnp.float8_e4m3fn, block_size=block_size)
    )(x)
    np.testing.assert_array_equal(np.asarray(ours_codes).view(np.uint8), codes.view(torch.uint8))
    np.testing.assert_array_equal(
        np.asarray(ours_scale).view(np.uint32), scale.numpy().view(np.uint32)
    )
    # and back: torchao's OptimStateFp8.dequantize, float32(codes) * scale per block
    expected = (codes.float().view(-1, block_size) * scale.view(-1, 1)).view(-1).numpy()
    ours = jaxscale.dequantize_blockwise(ours_codes, ours_scale, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(ours).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("signed", [True, False])
def test_int8_blocks_are_torchaos_dynamic_map_quantization(signed):
    x = blocks_with_edges(np.random.default_rng(int(signed)), 256)
    if not signed:
        x = np.abs(x)
    table = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    normalized, scale = quant_utils.scale_tensor(torch.from_numpy(x), 256)
    codes = quant_utils.quantize_8bit_with_qmap(normalized, table)
    ours_codes, ours_scale = jax.jit(
        lambda x: jaxscale.quantize_blockwise(x, "int8", signed=signed)
    )(x)
    assert ours_codes.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(ours_codes), codes.numpy())
    np.testing.assert_array_equal(
        np.asarray(ours_scale).view(np.uint32), scale.numpy().view(np.uint32)
    )
    expected = quant_utils.dequant_with_qmap(codes, table, scale).numpy()
    ours = jaxscale.dequantize_blockwise(ours_codes, ours_scale, "int8", signed=signed)
    np.testing.assert_array_equal(np.asarray(ours).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("signed", [True, False])
def test_int4_blocks_are_torchaos_optim_state_4bit(signed):
    # OptimState4bit's copy_: scale_tensor in blocks of 128, quantize_4bit_with_qmap,
    # and two codes per byte, the first in the high nibble
    x = blocks_with_edges(np.random.default_rng(4 + signed), 128)
    if not signed:
        x = np.abs(x)
    table = torch.tensor(get_qmap_signed() if signed else get_qmap_unsigned())
    normalized, scale = quant_utils.scale_tensor(torch.from_numpy(x), 128)
    codes = quant_utils.quantize_4bit_with_qmap(normalized, table)
    packed = (codes[::2] << 4) | codes[1::2]
    ours_codes, ours_scale = jax.jit(
        lambda x: jaxscale.quantize_blockwise(x.reshape(-1, 256), "int4", signed=signed)
    )(x)
    assert ours_codes.dtype == jnp.uint8
    assert ours_codes.shape == (x.size // 256, 128)
    np.testing.assert_array_equal(np.asarray(ours_codes).reshape(-1), packed.numpy())
    np.testing.assert_array_equal(
        np.asarray(ours_scale).reshape(-1).view(np.uint32), scale.numpy().view(np.uint32)
    )
    state = OptimState4bit(packed, scale, table, signed, torch.Size([x.size]))
    expected = state.dequantize().numpy()
    ours = jaxscale.dequantize_blockwise(ours_codes, ours_scale, "int4", signed=signed)
    np.testing.assert_array_equal(
        np.asarray(ours).reshape(-1).view(np.uint32), expected.view(np.uint32)
    )


@pytest.mark.parametrize("signed", [True, False])
def test_the_4_bit_maps_are_torchaos_bit_for_bit(signed):
    expected = torch.tensor(get_qmap_signed() if signed else get_qmap_unsigned())
    table = _dynamic_maps.SIGNED_4BIT if signed else _dynamic_maps.UNSIGNED_4BIT
    np.testing.assert_array_equal(table.view(np.uint32), expected.numpy().view(np.uint32))


@pytest.mark.parametrize("signed", [True, False])
def test_the_nearest_4_bit_entry_is_torchaos_at_every_entry_midpoint_and_edge(signed):
    table = (_dynamic_maps.SIGNED_4BIT if signed else _dynamic_maps.UNSIGNED_4BIT).astype(
        np.float32
    )
    midpoints = (table[:-1] + (table[1:] - table[:-1]) * np.float32(0.5)).astype(np.float32)
    points = np.concatenate([table, midpoints])
    edges = np.array([-0.0, 0.0, np.inf, -np.inf, np.nan, 1.5, -1.5, 2.0**-140], np.float32)
    x = np.concatenate([
        points, np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(-np.inf)),
        edges,
    ]).astype(np.float32)  # fmt: skip
    expected = quant_utils.quantize_4bit_with_qmap(torch.from_numpy(x), torch.from_numpy(table))
    ours = jax.jit(lambda v: _blockwise._nearest_in_map(v, table, signed))(x)
    np.testing.assert_array_equal(np.asarray(ours), expected.numpy())


@pytest.mark.parametrize("signed", [True, False])
def test_the_nearest_entry_is_torchaos_at_every_entry_midpoint_and_edge(signed):
    # quantize_8bit_with_qmap on normalized values directly: each map entry, each midpoint
    # between neighbours, the floats on either side of both, beyond the ends, signed
    # zeros, infinities and NaN
    table = (_dynamic_maps.SIGNED if signed else _dynamic_maps.UNSIGNED).astype(np.float32)
    midpoints = (table[:-1] + (table[1:] - table[:-1]) * np.float32(0.5)).astype(np.float32)
    points = np.concatenate([table, midpoints])
    edges = np.array([-0.0, 0.0, np.inf, -np.inf, np.nan, 1.5, -1.5, 2.0**-140], np.float32)
    x = np.concatenate([
        points, np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(-np.inf)),
        edges,
    ]).astype(np.float32)  # fmt: skip
    expected = quant_utils.quantize_8bit_with_qmap(torch.from_numpy(x), torch.from_numpy(table))
    ours = jax.jit(lambda v: _blockwise._nearest_in_map(v, table, signed))(x)
    np.testing.assert_array_equal(np.asarray(ours), expected.numpy())


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_maps_are_torchaos_bit_for_bit(signed):
    expected = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    table = _dynamic_maps.SIGNED if signed else _dynamic_maps.UNSIGNED
    np.testing.assert_array_equal(table.view(np.uint32), expected.numpy().view(np.uint32))


def test_a_division_by_a_broadcast_scale_would_be_off_by_an_ulp():
    # Why the quantizers divide behind a barrier: XLA rewrites x / broadcast(s) into
    # x * broadcast(1 / s), and then a third of the quotients differ from torch's.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 256)).astype(np.float32)
    s = np.abs(x).max(axis=1)
    expected = (torch.from_numpy(x) / torch.from_numpy(s).view(-1, 1)).numpy()
    rewritten = np.asarray(jax.jit(lambda x, s: x / s[:, None])(x, s))
    assert np.mean(rewritten != expected) > 0.1
    normalized, _ = quant_utils.scale_tensor(torch.from_numpy(x), 256)
    np.testing.assert_array_equal(normalized.numpy(), expected)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "int4"])
@pytest.mark.parametrize("rows", [(128,), (4, 16), (512,), (8, 2, 32)])
def test_blocks_of_a_tensor_of_short_rows_are_those_of_its_flattened_values(fmt, rows):
    # a block spanning whole rows (two rows of 128, four of 4 × 16) is read in the
    # tensor's own axes, several blocks in a row of 512 as (2, 256): the same blocks as
    # the flattened tensor's, which the tests above hold to torchao's
    block = 128 if fmt == "int4" else 256
    x = blocks_with_edges(np.random.default_rng(7), block)
    shaped = x.reshape(-1, *rows)
    flat_codes, flat_scale = jax.jit(lambda x: jaxscale.quantize_blockwise(x, fmt))(x)
    codes, scale = jax.jit(lambda x: jaxscale.quantize_blockwise(x, fmt))(shaped)
    assert codes.shape == (shaped.shape if fmt != "int4" else (*shaped.shape[:-1], rows[-1] // 2))
    as_bytes = lambda a: np.asarray(a).reshape(-1).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(as_bytes(codes), as_bytes(flat_codes))
    np.testing.assert_array_equal(as_bytes(scale), as_bytes(flat_scale))
    signed = {} if fmt == "float8_e4m3fn" else {"signed": True}
    back = jaxscale.dequantize_blockwise(codes, scale, fmt, **signed)
    flat_back = jaxscale.dequantize_blockwise(flat_codes, flat_scale, fmt, **signed)
    np.testing.assert_array_equal(as_bytes(back), as_bytes(flat_back))
