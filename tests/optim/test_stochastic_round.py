"""``stochastic_round`` and the block-wise quantizers: properties and errors, without PyTorch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxscale
from jaxscale._src.threefry import random_bits


def float16_neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x's float16 neighbours toward and away from zero, computed in float64 by NumPy."""
    magnitude = np.abs(x).astype(np.float64)
    with np.errstate(over="ignore"):  # past 65520 the nearest float16 is infinity
        nearest = np.abs(x.astype(np.float16))
        lower = np.where(magnitude < nearest, np.nextafter(nearest, np.float16(0)), nearest)
        upper = np.nextafter(lower, np.float16(np.inf))
    sign = np.where(np.signbit(x), -1, 1)
    return (sign * lower).astype(np.float16), (sign * upper).astype(np.float16)


def test_float16_is_always_one_of_the_two_neighbours():
    rng = np.random.default_rng(0)
    exponents = rng.uniform(-28, 17, 200_000)  # float16 subnormals up to past the maximum
    x = (rng.choice([-1, 1], x_size := exponents.size) * 2.0**exponents).astype(np.float32)
    assert x_size == 200_000
    draws = rng.integers(0, 1 << 16, x.shape)
    rounded = np.asarray(
        jax.jit(lambda x, b: jaxscale.stochastic_round(x, jnp.float16, bits=b))(x, draws)
    )
    lower, upper = float16_neighbours(x)
    assert np.all((rounded == lower) | (rounded == upper))
    assert np.isinf(rounded).any()
    assert (np.abs(rounded[np.isfinite(rounded)]) < 2.0**-14).any()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_rounding_is_unbiased(dtype):
    # 2**16 draws, every one: the mean of the rounded values is x itself (for float16
    # neighbours that are normal numbers the probability is exact)
    x = np.float32(1.0 + 2.0**-12 * 3)  # 3/8 of a float16 ulp, 3/64 of bfloat16's
    draws = np.arange(1 << 16)
    rounded = jaxscale.stochastic_round(np.full(draws.shape, x), dtype, bits=draws)
    assert np.mean(np.asarray(rounded, np.float64)) == pytest.approx(float(x), abs=0, rel=1e-12)


def test_a_key_draws_bits_and_the_result_depends_on_it():
    x = jnp.full(10_000, 1.0 + 2.0**-9, jnp.float32)  # a quarter of a bfloat16 ulp above 1
    first = jaxscale.stochastic_round(x, key=jax.random.key(0))
    again = jaxscale.stochastic_round(x, key=jax.random.key(0))
    other = jaxscale.stochastic_round(x, key=jax.random.key(1))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert np.mean(np.asarray(first, np.float32) > 1.0) == pytest.approx(0.25, abs=0.02)
    raw = jaxscale.stochastic_round(x, key=jax.random.PRNGKey(0))
    assert raw.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "key",
    [jax.random.key(0), jax.random.PRNGKey(7), jax.random.fold_in(jax.random.key(3), 49)],
    ids=["typed", "raw", "folded"],
)
@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 1000), (4096, 3)])
def test_a_keys_draws_are_the_low_half_of_jaxs_own_bits(key, shape):
    # what a user reproduces with JAX's public API, computed by jaxscale's own hash
    expected = np.asarray(jax.random.bits(key, shape, jnp.uint32)) & 0xFFFF
    for compute in (random_bits, jax.jit(random_bits, static_argnums=1)):
        np.testing.assert_array_equal(np.asarray(compute(key, shape)) & 0xFFFF, expected)
    x = np.full(shape, 1.0 + 2.0**-9, np.float32)
    np.testing.assert_array_equal(
        jaxscale.stochastic_round(x, key=key), jaxscale.stochastic_round(x, bits=expected)
    )


def test_keys_that_are_not_threefry_draw_with_jax():
    key = jax.random.key(0, impl="rbg")
    np.testing.assert_array_equal(random_bits(key, (3, 4)), jax.random.bits(key, (3, 4)))


def test_the_draws_are_hashed_where_they_are_read():
    # JAX lowers Threefry's rounds as a loop on the CPU, which writes each round's words;
    # as plain arithmetic they fuse into the rounding and nothing of the array's size is
    # written besides the result
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    rounding = jax.jit(lambda x: jaxscale.stochastic_round(x, key=jax.random.key(0)))
    temporaries = rounding.lower(x).compile().memory_analysis().temp_size_in_bytes
    assert temporaries < 1024 * 1024 // 4


def test_neighbouring_elements_draw_independently():
    # neighbours' decisions must be independent (the same draw for both would round
    # them together every time)
    x = jnp.full((1000, 1000), 1.0 + 2.0**-9, jnp.float32)  # up with probability 1/4
    up = np.asarray(jaxscale.stochastic_round(x, key=jax.random.key(3)), np.float32) > 1.0
    assert up.mean() == pytest.approx(0.25, abs=0.002)
    together = np.mean(up[:, 0::2] == up[:, 1::2])
    assert together == pytest.approx(0.25**2 + 0.75**2, abs=0.003)
    assert np.mean(up[:500] == up[500:]) == pytest.approx(0.625, abs=0.003)


def test_bits_of_any_integer_dtype_are_taken():
    x = np.full(6, 1.0 + 2.0**-9, np.float32)
    draws = np.array([0, 4, 16383, 16384, 65531, 65535])
    expected = jaxscale.stochastic_round(x, bits=draws.astype(np.int32))
    for dtype in (np.uint16, np.int64, np.uint32):
        np.testing.assert_array_equal(
            jaxscale.stochastic_round(x, bits=draws.astype(dtype)), expected
        )


def test_float16_edges():
    # zero stays zero (a float16 of magnitude above |x| is never below it)
    zeros = np.array([0.0, -0.0], np.float32)
    rounded = np.asarray(jaxscale.stochastic_round(zeros, jnp.float16, bits=np.full(2, 65535)))
    assert rounded.tolist() == [0.0, 0.0]
    assert np.signbit(rounded).tolist() == [False, True]
    # past the largest float16, the gap to infinity is 32 (65504 + 32 = 65536 rounds to
    # inf): a quarter of the way rounds away a quarter of the time, either sign
    draws = np.arange(1 << 16)
    for sign in (1.0, -1.0):
        x = np.full(draws.shape, sign * (65504.0 + 8.0), np.float32)
        rounded = np.asarray(jaxscale.stochastic_round(x, jnp.float16, bits=draws))
        assert np.mean(np.isinf(rounded)) == 0.25
        assert set(np.unique(rounded).tolist()) == {sign * 65504.0, sign * np.inf}


def test_bfloat16_keeps_subnormals_and_infinities():
    # built from the bits, never through a float conversion that flushes subnormals
    subnormals = [0x0008_0001, 0x8000_0003]  # 2**-130 and -(3 * 2**-149), plus a little
    x = np.array([*subnormals, 0x7F80_0000, 0xFF80_0000], np.uint32).view(np.float32)
    rounded = jaxscale.stochastic_round(x, bits=np.zeros(4, np.int32))
    assert np.asarray(rounded).view(np.uint16).tolist() == [0x0009, 0x8001, 0x7F80, 0xFF80]


def test_float16_keeps_infinities_and_nans():
    x = np.array([np.inf, -np.inf, np.nan, 70000.0, 65504.0], np.float32)
    rounded = np.asarray(jaxscale.stochastic_round(x, jnp.float16, bits=np.zeros(5, np.int32)))
    assert rounded[:2].tolist() == [np.inf, -np.inf]
    assert np.isnan(rounded[2])
    assert rounded[3:].tolist() == [np.inf, 65504.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"x": np.ones(3, np.float16)}, "expects a float32 x, got float16"),
        ({"dtype": jnp.float32}, "rounds to bfloat16 or float16, got dtype=float32"),
        ({"bits": None}, "exactly one of key= .* got neither"),
        ({"key": jax.random.key(0)}, "exactly one of key= .* got both"),
        ({"bits": np.zeros(4, np.int32)}, r"bits must be an integer array of x's shape \(3,\)"),
        ({"bits": np.zeros(3, np.float32)}, "bits must be an integer array"),
        ({"bits": np.array([0, 1, 1 << 16])}, r"bits must lie in \[0, 2\*\*16\), .* to 65536"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    arguments = {"x": np.ones(3, np.float32), "dtype": jnp.bfloat16, "bits": np.zeros(3, np.int32)}
    arguments.update(kwargs)
    x = arguments.pop("x")
    with pytest.raises(ValueError, match=message):
        jaxscale.stochastic_round(x, **arguments)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: jaxscale.quantize_blockwise(jnp.ones(300), "int8"), "300 elements does not split"),
        (
            lambda: jaxscale.quantize_blockwise(jnp.ones(256), jnp.float16),
            r"'int8', 'int4' or 'float8_e4m3fn' \(the strings or jnp.int8, .*got <class",
        ),
        (lambda: jaxscale.quantize_blockwise(jnp.ones(256), "uint8"), "got 'uint8'"),
        (lambda: jaxscale.quantize_blockwise(jnp.ones(256, int), "int8"), "floating array"),
        (lambda: jaxscale.quantize_blockwise(jnp.ones(8), "int8", block_size=1), "at least 2"),
        (lambda: jaxscale.quantize_blockwise(jnp.ones(8), "int4", block_size=3), "must be even"),
        (lambda: jaxscale.quantize_blockwise(jnp.ones((4, 3)), "int4", block_size=4), "is odd"),
        (
            lambda: jaxscale.dequantize_blockwise(jnp.zeros(8, jnp.uint8), jnp.ones(1), "int8"),
            r"needs signed= for int8 codes: signed=True for a signed state",
        ),
        (
            lambda: jaxscale.dequantize_blockwise(
                jnp.zeros(8, jnp.uint8), jnp.ones(3), "int8", signed=True
            ),
            "one value per block",
        ),
        (
            lambda: jaxscale.dequantize_blockwise(
                jnp.zeros(512, jnp.float32), jnp.ones(2), "int8", signed=True
            ),
            "int8 codes are uint8, as quantize_blockwise returns them; got float32 codes",
        ),
        (
            lambda: jaxscale.dequantize_blockwise(
                jnp.zeros(512, jnp.uint8), jnp.ones(2), jnp.float8_e4m3fn
            ),
            "float8_e4m3fn codes are float8_e4m3fn, .* got uint8 codes",
        ),
    ],
)
def test_blockwise_errors_name_the_bad_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_float8_blocks_round_trip_within_the_format():
    x = jax.random.normal(jax.random.key(0), (64, 64)) * 3.0
    codes, scale = jaxscale.quantize_blockwise(x, jnp.float8_e4m3fn, block_size=64)
    assert codes.dtype == jnp.float8_e4m3fn
    assert scale.shape == (64, 1)  # the leading axis, then one block per row
    back = jaxscale.dequantize_blockwise(codes, scale, jnp.float8_e4m3fn)
    # e4m3 keeps 3 fraction bits: within 2**-4 of each value, relative
    np.testing.assert_allclose(back, x, rtol=2.0**-4, atol=float(jnp.max(scale)) * 2.0**-6)
    assert ml_dtypes.finfo(jnp.float8_e4m3fn).max == 448
