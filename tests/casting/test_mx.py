"""MXFP8 without PyTorch: ``quantize_mx``'s contract and errors, which matmuls the recipes
take, and the CUDA lowering (what a sharded weight's all-gather carries:
``test_mx_gather.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale

BF16 = jnp.bfloat16


def test_scales_are_powers_of_two_that_fit_each_block():
    x = jax.random.normal(jax.random.key(0), (8, 256)) * 100
    data, scale = jaxscale.quantize_mx(x)
    assert data.dtype == jnp.float8_e4m3fn
    assert scale.shape == (8, 8)
    back = jaxscale.dequantize_mx(data, scale)
    blocks = np.abs(np.asarray(x)).reshape(8, 8, 32).max(-1)
    scales = np.asarray(scale.astype(jnp.float32))
    assert np.all(np.log2(scales) == np.round(np.log2(scales)))
    assert np.all(blocks / scales <= 448)  # RCEIL: the block's amax fits
    np.testing.assert_allclose(back, x, rtol=2**-3, atol=float(scales.max()) * 2**-9)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: jaxscale.quantize_mx(jnp.ones(40)), "does not split into blocks of 32"),
        (lambda: jaxscale.quantize_mx(jnp.ones(32, jnp.float16)), "float32 or bfloat16"),
        (lambda: jaxscale.quantize_mx(jnp.ones(32), jnp.int8), "float8_e4m3fn or float8_e5m2"),
        (lambda: jaxscale.quantize_mx(jnp.ones(32), scale_mode="even"), "'rceil' or 'floor'"),
        (lambda: jaxscale.quantize_mx(jnp.ones((32, 32)), axis=2), "axis 2 is out of range"),
        (lambda: jaxscale.quantize_mx(jnp.ones(32), block_size=0), "positive int"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("lhs", "rhs", "taken"),
    [((64, 64), (64, 96), True), ((48, 64), (64, 96), False), ((64, 64), (64, 80), False)],
)
def test_the_mx_recipes_take_matmuls_whose_sizes_are_multiples_of_32(lhs, rhs, taken):
    fn = jaxscale.autocast(lambda a, b: a @ b, dtype=BF16, float8="mxfp8")
    jaxpr = str(jax.make_jaxpr(fn)(jnp.ones(lhs), jnp.ones(rhs)))
    assert ("float8_e4m3fn" in jaxpr) == taken


def test_float8_takes_multiples_of_16_and_no_others():
    # (24, 64) @ (64, 48): 24 is a multiple of 8, not of 16
    fn = jaxscale.autocast(lambda a, b: a @ b, dtype=BF16, float8="tensorwise")
    assert "float8" not in str(jax.make_jaxpr(fn)(jnp.ones((24, 64)), jnp.ones((64, 48))))
    assert "float8" in str(jax.make_jaxpr(fn)(jnp.ones((32, 64)), jnp.ones((64, 48))))


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_wgrad_with_hp"])
def test_an_mx_train_step_lowers_for_cuda_without_host_synchronisation(recipe):
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w.T).astype(jnp.float32) ** 2)

    step = jax.grad(jaxscale.autocast(loss, dtype=BF16, float8=recipe), argnums=(0, 1))
    report = jaxscale.lowering_report(step, jnp.ones((96, 64)), jnp.ones((128, 64)))
    assert not report.syncs_with_host
    assert report.loops == 0
    # the operands are dequantized to bfloat16 and multiplied there (torchao's emulation)
    assert report.matmul_dtypes == {"bf16 x bf16 -> bf16": 3}


def test_a_weight_closed_over_by_a_jitted_function_is_quantized_as_an_argument_is():
    # XLA constant-folds the quantization and dequantization of a constant; without a
    # barrier between them the folded 64x32 weight took another block's scale
    weight = jnp.eye(64, 32) * 1e-3
    x = jax.random.normal(jax.random.key(0), (32, 64))

    def round_trip(w):
        data, scale = jaxscale.quantize_mx(w, block_size=32, axis=0)
        return jaxscale.dequantize_mx(data, scale, jnp.float32, axis=0)

    np.testing.assert_array_equal(
        jax.jit(lambda: round_trip(weight))(), jax.jit(round_trip)(weight)
    )
    layer = jaxscale.autocast(lambda x, w: x @ w, dtype=jnp.bfloat16, float8="mxfp8")
    np.testing.assert_array_equal(jax.jit(lambda x: layer(x, weight))(x), jax.jit(layer)(x, weight))


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_a_block_holding_a_nan_dequantizes_to_nan_everywhere(scale_mode):
    # its scale is the NaN byte, as torchao's: the whole block is NaN, not zeros and a NaN
    x = jnp.ones(64).at[3].set(jnp.nan)
    data, scale = jaxscale.quantize_mx(x, scale_mode=scale_mode)
    assert np.asarray(scale).view(np.uint8).tolist() == [255, 119]  # 2**-8: 1 is 256 in e4m3
    values = np.asarray(jaxscale.dequantize_mx(data, scale))
    assert np.isnan(values[:32]).all()
    np.testing.assert_array_equal(values[32:], 1.0)
