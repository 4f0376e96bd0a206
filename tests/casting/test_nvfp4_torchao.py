"""NVFP4 against torchao on the CPU, bit for bit: ``NVFP4Tensor.to_nvfp4`` (one and two
levels), and TransformerEngine's scale chain as torchao's NVFP4 training kernels follow
it, re-derived here in torch from its published formulas (``S_enc``, ``S_dec``,
``encode``) with torchao's own E2M1 encoder; the random Hadamard transform against
torch's bfloat16 matmul with TransformerEngine's default signs; stochastic rounding
statistically, as torchao tests it.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxscale
from jaxscale.casting._nvfp4 import DEFAULT_SIGNS

with warnings.catch_warnings():  # torchao's import warns about its optional GPU kernels
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor,
        per_tensor_amax_to_scale,
    )

BF16 = jnp.bfloat16


def heavy_tailed(rng, rows, cols, dtype=np.float32):
    """Blocks of 16 spanning 24 decades, with the edges the arithmetic meets: a zero
    block, one below 2**-6 of the largest, subnormal-sized values, E2M1 midpoints at
    the block's scale, and one element far above the rest of its block."""
    x = rng.standard_t(2, (rows, cols)) * 10.0 ** rng.uniform(-12, 12, (rows, cols // 16)).repeat(
        16, axis=1
    )
    x = x.astype(np.float32)
    x[0, :16] = 0.0
    x[1, :16] *= 1e-9 / np.abs(x[1, :16]).max()
    x[2, :16] = rng.uniform(-1, 1, 16) * 1e-40
    grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, np.float32)
    x[3, :16] = grid * np.where(np.arange(16) % 2, -1, 1)  # amax 6: codes at the midpoints
    x[4, :16] = np.linspace(-7, 7, 16)
    x[5, 0] = 1e6
    return x.astype(dtype)


def torchao_codes(packed: torch.Tensor) -> np.ndarray:
    """torchao's packed E2M1 (the even element in the low nibble) as one code per value."""
    return unpack_uint4(packed.contiguous().view(torch.uint8)).numpy()


def bits(array) -> np.ndarray:
    return np.asarray(array).view(np.uint8)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("two_level", [False, True])
def test_to_nvfp4_is_torchaos_bit_for_bit(dtype, two_level):
    rng = np.random.default_rng(int(two_level))
    x = heavy_tailed(rng, 64, 256)
    x_torch = torch.from_numpy(x)
    x_jax = jnp.asarray(x)
    if dtype == BF16:
        x_torch, x_jax = x_torch.bfloat16(), x_jax.astype(BF16)
    per_tensor = per_tensor_amax_to_scale(x_torch.float().abs().max()) if two_level else None
    theirs = NVFP4Tensor.to_nvfp4(x_torch, per_tensor_scale=per_tensor)
    ours = jax.jit(
        lambda x: jaxscale.quantize_nvfp4(
            x,
            arithmetic="to_nvfp4",
            per_tensor_scale=jaxscale.nvfp4_per_tensor_scale(jnp.max(jnp.abs(x)))
            if two_level
            else None,
        )
    )(x_jax)
    codes, scales, per_tensor_scale = ours
    np.testing.assert_array_equal(bits(codes), torchao_codes(theirs.qdata))
    np.testing.assert_array_equal(bits(scales), theirs.scale.view(torch.uint8).numpy())
    if two_level:
        assert float(per_tensor_scale) == float(per_tensor)
    expected = theirs.dequantize(torch.float32).numpy()
    back = jaxscale.dequantize_nvfp4(codes, scales, per_tensor_scale)
    np.testing.assert_array_equal(bits(np.asarray(back, np.float32)), expected.view(np.uint8))


def te_reference(x: torch.Tensor, amax: torch.Tensor, block_rows: int):
    """TransformerEngine's chain (``core_nvfp4.cuh``), transcribed from its formulas:
    ``(codes, scales)`` with the scales repeated on each tile's rows."""
    xf = x.float()
    rows, cols = xf.shape
    s_enc = torch.full_like(amax, 448.0 * 6.0) / amax
    s_enc = s_enc.clamp(max=torch.finfo(torch.float32).max)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    tiles = xf.abs().reshape(rows // block_rows, block_rows, cols // 16, 16)
    block_amax = tiles.amax(dim=(1, 3))
    scale = (block_amax * (s_enc * (1.0 / 6.0))).clamp(max=448.0).to(torch.float8_e4m3fn)
    denominator = scale.to(torch.float32) * (1.0 / s_enc)
    encode = (1.0 / denominator).clamp(max=torch.finfo(torch.float32).max)
    expanded = encode.repeat_interleave(block_rows, 0).repeat_interleave(16, 1)
    scaled = (xf * expanded).clamp(-6.0, 6.0)
    return f32_to_f4_unpacked(scaled.contiguous()).numpy(), scale.repeat_interleave(block_rows, 0)


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_the_te_chain_is_transformer_engines_bit_for_bit(block, dtype):
    rng = np.random.default_rng(block[0])
    x = heavy_tailed(rng, 64, 256)
    x_torch, x_jax = torch.from_numpy(x), jnp.asarray(x)
    if dtype == BF16:
        x_torch, x_jax = x_torch.bfloat16(), x_jax.astype(BF16)
    amax = x_torch.float().abs().max()
    codes, scales = te_reference(x_torch, amax, block[0])
    ours_codes, ours_scales, decode = jax.jit(lambda x: jaxscale.quantize_nvfp4(x, block=block))(
        x_jax
    )
    np.testing.assert_array_equal(bits(ours_codes), codes)
    np.testing.assert_array_equal(bits(ours_scales), scales.view(torch.uint8).numpy())
    s_enc = float(torch.full_like(amax, 2688.0) / amax)
    assert float(decode) == float(np.float32(1.0) / np.float32(s_enc))
    if block == (1, 16):  # a zero block and one that underflows E4M3: scale zero, codes zero
        assert not bits(ours_scales)[0, 0]
        assert not bits(ours_codes)[0, :16].any()
        assert not bits(ours_scales)[1, 0]


def test_the_te_chain_takes_an_amax_and_guards_zero():
    x = jnp.zeros((16, 32))
    codes, scales, decode = jaxscale.quantize_nvfp4(x)
    assert float(decode) == 1.0  # S_enc of a zero tensor is 1
    assert not bits(scales).any()
    assert not bits(codes).any()
    x = jnp.ones((16, 32))
    _, scales, decode = jaxscale.quantize_nvfp4(x, amax=jnp.float32(2.0))
    assert float(decode) == float(np.float32(1.0) / np.float32(2688.0 / 2.0))
    assert float(scales.astype(jnp.float32)[0, 0]) == 224.0  # 1 * (1344 / 6), in E4M3


def test_the_two_arithmetics_differ_where_to_nvfp4_floors_a_block_scale():
    # Cauchy-distributed values: an amax far above most blocks. to_nvfp4 floors a block
    # scale at 2**-6 (E4M3's smallest normal); TransformerEngine rounds it down into
    # E4M3's subnormals or to zero. Above the floor the two agree here (they can differ
    # by rounding once or twice, which these blocks never meet).
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_t(1, (1024, 1024)).astype(np.float32))
    amax = jnp.max(jnp.abs(x))
    _, te_scales, _ = jaxscale.quantize_nvfp4(x)
    _, ao_scales, _ = jaxscale.quantize_nvfp4(
        x, arithmetic="to_nvfp4", per_tensor_scale=jaxscale.nvfp4_per_tensor_scale(amax)
    )
    te = np.asarray(te_scales.astype(jnp.float32))
    ao = np.asarray(ao_scales.astype(jnp.float32))
    differ = te != ao
    assert differ.mean() == pytest.approx(0.425, abs=0.01)
    assert np.all(te[differ] < 2.0**-6)
    assert np.all(ao[differ] == 2.0**-6)


def test_the_random_hadamard_transform_is_torchs_bfloat16_product():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 128)).astype(np.float32)
    a_torch = torch.from_numpy(a).bfloat16()
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < 16:
        hadamard = torch.cat(
            [torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)]
        )
    matrix = torch.diag(torch.tensor(DEFAULT_SIGNS, dtype=torch.float32)) @ hadamard * 0.25
    matrix = matrix.bfloat16()
    # torchao's reference_rht(A): RHT of A.t() in blocks of 16, bfloat16 out
    expected = (a_torch.t().reshape(-1, 16) @ matrix).reshape(128, 64).to(torch.bfloat16)
    ours = jaxscale.random_hadamard_transform(jnp.asarray(a, BF16).T)
    np.testing.assert_array_equal(bits(ours), expected.view(torch.uint16).numpy().view(np.uint8))
    # orthogonal: transforming both operands leaves their product
    b = rng.standard_normal((64, 32)).astype(np.float32)
    product = jnp.asarray(a).T @ jnp.asarray(b)
    transformed = (
        jaxscale.random_hadamard_transform(jnp.asarray(a, jnp.float32).T).astype(jnp.float32)
        @ jaxscale.random_hadamard_transform(jnp.asarray(b).T).astype(jnp.float32).T
    )
    np.testing.assert_allclose(transformed, product, rtol=0.05, atol=0.2)


def test_stochastic_rounding_of_the_codes_is_unbiased_and_one_step_from_nearest():
    # every E2M1 midpoint at the scale 1 (amax 6 makes S_dec 448 * ... : use to_nvfp4's
    # one level, whose block scale is amax / 6 = 1), each 62,500 times: 10**6 draws
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, np.float32)
    midpoints[8:] *= -1
    x = jnp.tile(jnp.asarray(midpoints), (62_500, 1))
    codes, scales, _ = jaxscale.quantize_nvfp4(x, arithmetic="to_nvfp4", key=jax.random.key(0))
    assert float(scales.astype(jnp.float32).max()) == 1.0
    values = np.asarray(codes.astype(jnp.float32))
    nearest = np.asarray(x.astype(jnp.float4_e2m1fn).astype(jnp.float32))
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    index = np.searchsorted(grid, np.abs(values))
    nearest_index = np.searchsorted(grid, np.abs(nearest))
    assert np.abs(index - nearest_index).max() <= 1
    for column in range(7):  # the midpoints below 6 go either way, 50% +- 1% each
        up = np.mean(np.abs(values[:, column]) > np.abs(midpoints[column]))
        assert up == pytest.approx(0.5, abs=0.01), column
    assert np.all(np.abs(values[:, 7]) == 6.0)
    np.testing.assert_allclose(values.mean(axis=0), midpoints, atol=0.01)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arithmetic": "mx"}, "arithmetic must be 'te' or 'to_nvfp4'"),
        ({"block": (16, 8)}, r"block must be \(1, 16\) or \(16, 16\)"),
        ({"block": (16, 16), "arithmetic": "to_nvfp4"}, "16x16 blocks are TransformerEngine"),
        ({"per_tensor_scale": 1.0}, "per_tensor_scale is to_nvfp4's"),
        ({"arithmetic": "to_nvfp4", "amax": 1.0}, "amax is the 'te' arithmetic's"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jaxscale.quantize_nvfp4(jnp.ones((16, 32)), **kwargs)
    with pytest.raises(ValueError, match="a multiple of 16"):
        jaxscale.quantize_nvfp4(jnp.ones((16, 24)))


# -- the training recipe: autocast(..., float8="nvfp4") ------------------------------------

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def te_dequantized(x: torch.Tensor, block_rows: int) -> torch.Tensor:
    """``x`` through TransformerEngine's chain (scale from its own amax) and back, in
    bfloat16: the operand an emulated NVFP4 matmul multiplies."""
    xf = x.float()
    amax = xf.abs().max()
    codes, scales = te_reference(x, amax, block_rows)
    s_enc = torch.full_like(amax, 448.0 * 6.0) / amax
    s_enc = torch.where(amax == 0, torch.ones_like(s_enc), s_enc)
    decode = torch.ones_like(s_enc) / s_enc
    magnitude = torch.from_numpy(E2M1_VALUES[codes & 7])
    values = torch.where(torch.from_numpy((codes & 8) > 0), -magnitude, magnitude)
    factor = (decode * scales.float()).repeat_interleave(16, 1)
    return (values * factor).bfloat16()


def torch_rht(a: torch.Tensor) -> torch.Tensor:
    """Each block of 16 along ``a``'s last axis times TransformerEngine's default
    random Hadamard matrix, bfloat16 in and out."""
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < 16:
        hadamard = torch.cat(
            [torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)]
        )
    matrix = torch.diag(torch.tensor(DEFAULT_SIGNS, dtype=torch.float32)) @ hadamard * 0.25
    blocks = a.bfloat16().float().reshape(-1, 16)
    return (blocks @ matrix).reshape(a.shape).bfloat16()


def assert_products_agree(ours, a: torch.Tensor, b: torch.Tensor):
    """``ours`` (bfloat16) is the product of the bfloat16 operands ``a @ b``: equal to
    the exact product rounded once to bfloat16, but where a float32 sum in another
    order lands on the other side of a rounding boundary (one bfloat16 step), or
    cancels (float32's error on the sum of the terms' magnitudes)."""
    exact = (a.double() @ b.double()).float().bfloat16().float().numpy()
    magnitudes = (a.double().abs() @ b.double().abs()).numpy()
    ours = np.asarray(ours, np.float32)
    bound = np.abs(exact) * 2.0**-7 + magnitudes * 2.0**-16
    assert np.all(np.abs(ours - exact) <= bound)
    assert np.mean(ours == exact) > 0.98


@pytest.mark.parametrize("blocks_2d", [True, False])
def test_the_nvfp4_recipe_is_transformer_engines_three_matmuls(blocks_2d):
    # stochastic rounding off, so the reference is deterministic; the recipe is then
    # TransformerEngine's: x 1x16 along K, the weight in 16x16 tiles (or 1x16 along each
    # matmul's K), dy 1x16 along N, and the weight gradient from the Hadamard transforms
    # of x.T and dy.T along M
    recipe = jaxscale.casting.NVFP4Recipe(stochastic_rounding=False, weight_blocks_2d=blocks_2d)
    rng = np.random.default_rng(11)
    m, k, n = 64, 96, 48
    x = heavy_tailed(rng, m, k) * 1e-3
    x = np.clip(x, -1e3, 1e3).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    dy = jnp.asarray(rng.standard_t(3, (m, n)), BF16)
    layer = jaxscale.autocast(lambda x, w: x @ w, dtype=BF16, float8=recipe)
    out, pullback = jax.vjp(layer, jnp.asarray(x), jnp.asarray(w))
    grad_x, grad_w = pullback(dy)
    assert out.dtype == BF16

    x_t, w_t, dy_t = (
        torch.from_numpy(x).bfloat16(),
        torch.from_numpy(w),
        torch.from_numpy(np.asarray(dy, np.float32)).bfloat16(),
    )
    if blocks_2d:
        w_fwd = w_bwd = te_dequantized(w_t, 16)
    else:
        w_fwd = te_dequantized(w_t.t().contiguous(), 1).t()  # 1x16 along K
        w_bwd = te_dequantized(w_t, 1)  # 1x16 along N
    assert_products_agree(out, te_dequantized(x_t, 1), w_fwd)
    assert_products_agree(grad_x, te_dequantized(dy_t, 1), w_bwd.t())
    x_rht = torch_rht(x_t.t().contiguous())  # (K, M), transformed along M
    dy_rht = torch_rht(dy_t.t().contiguous())  # (N, M)
    assert_products_agree(grad_w, te_dequantized(x_rht, 1), te_dequantized(dy_rht, 1).t())


def test_the_nvfp4_recipe_rounds_output_gradients_stochastically_from_the_key():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((32, 32)), BF16)

    def grads(key):
        layer = jaxscale.autocast(lambda x, w: x @ w, dtype=BF16, float8="nvfp4", key=key)
        out, pullback = jax.vjp(layer, x, w)
        return out, pullback(dy)

    out_a, (gx_a, gw_a) = grads(jax.random.key(0))
    out_b, (gx_b, gw_b) = grads(jax.random.key(1))
    _out_c, (gx_c, gw_c) = grads(jax.random.key(0))
    np.testing.assert_array_equal(out_a, out_b)  # the forward rounds to nearest
    assert not np.array_equal(gx_a, gx_b)
    assert not np.array_equal(gw_a, gw_b)
    np.testing.assert_array_equal(gx_a, gx_c)
    np.testing.assert_array_equal(gw_a, gw_c)
    # unbiased: averaged over keys, the input gradient approaches the nearest-rounding one
    nearest_layer = jaxscale.autocast(
        lambda x, w: x @ w, dtype=BF16,
        float8=jaxscale.casting.NVFP4Recipe(stochastic_rounding=False),
    )  # fmt: skip
    # what the rounding of dy leaves: dy times the weight as the matmul sees it (16x16)
    w_tiles = np.asarray(jaxscale.dequantize_nvfp4(*jaxscale.quantize_nvfp4(w, block=(16, 16))))
    exact = np.asarray(dy, np.float32) @ w_tiles.T
    mean = np.mean(
        [np.asarray(grads(jax.random.key(i))[1][0], np.float32) for i in range(64)], axis=0
    )
    nearest = np.asarray(jax.vjp(nearest_layer, x, w)[1](dy)[0], np.float32)
    assert np.linalg.norm(mean - exact) < 0.5 * np.linalg.norm(nearest - exact)


def test_the_nvfp4_recipe_asks_for_a_key_and_no_other_recipe_takes_one():
    with pytest.raises(ValueError, match="needs a key"):
        jaxscale.autocast(lambda x, w: x @ w, dtype=BF16, float8="nvfp4")
    with pytest.raises(ValueError, match="key is drawn from only by"):
        jaxscale.autocast(lambda x, w: x @ w, dtype=BF16, float8="rowwise", key=jax.random.key(0))
    with pytest.raises(TypeError, match="key must be a JAX PRNG key"):
        jaxscale.autocast(lambda x, w: x @ w, dtype=BF16, float8="nvfp4", key=0)


def test_the_nvfp4_recipe_leaves_matmuls_not_multiples_of_16_in_bfloat16():
    x, w = jnp.ones((8, 64)), jnp.ones((64, 32))  # 8 rows: not a multiple of 16
    layer = jaxscale.autocast(lambda x, w: x @ w, dtype=BF16, float8="nvfp4",
                              key=jax.random.key(0))  # fmt: skip
    plain = jaxscale.autocast(lambda x, w: x @ w, dtype=BF16)
    np.testing.assert_array_equal(layer(x, w), plain(x, w))
