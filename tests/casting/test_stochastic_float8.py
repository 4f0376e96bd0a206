"""Stochastic rounding to float8 (``quantize_float8``/``quantize_mx`` with a key, and the
recipes' ``stochastic_gradients``), tested as torchao tests its stochastic rounding: a
midpoint goes each way 50 +- 1% over 10**6 draws, every result is one of the two
neighbours, and the mean is unbiased."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale
from jaxscale._src.threefry import random_uniform
from jaxscale.casting import MX_RECIPES, RECIPES
from jaxscale.casting._stochastic_float8 import stochastic_to_float8

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DRAWS = 1_000_000


def neighbours(value: float, dtype) -> tuple[float, float]:
    """The float8 values just below and above ``value`` (positive, not a float8 value)."""
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)))
    grid = grid[np.isfinite(grid)]
    below = grid[grid < value].max()
    return float(below), float(grid[grid > value].min())


@pytest.mark.parametrize(("dtype", "largest"), [(E4M3, 448.0), (E5M2, 57344.0)])
@pytest.mark.parametrize("quantizer", ["float8", "mx"])
def test_a_midpoint_goes_each_way_half_the_time(dtype, largest, quantizer):
    # 1.0625 is halfway between e4m3's 1 and 1.125; 1.125 between e5m2's 1 and 1.25
    midpoint = 1.0625 if dtype == E4M3 else 1.125
    x = jnp.full(DRAWS, midpoint, jnp.float32).at[::32].set(largest)  # scale 1 everywhere
    key = jax.random.key(0)
    if quantizer == "float8":
        data, scale = jaxscale.quantize_float8(x, dtype, key=key)
        assert float(scale) == 1.0
    else:
        data, scale = jaxscale.quantize_mx(x.reshape(-1, 32), dtype, key=key)
        assert set(np.unique(np.asarray(scale.astype(jnp.float32)))) == {1.0}
    values = np.asarray(data.astype(jnp.float32)).reshape(-1)
    values = values[np.asarray(x) == midpoint]
    low, high = neighbours(midpoint, dtype)
    assert set(np.unique(values)) == {low, high}
    assert np.mean(values == high) == pytest.approx(0.5, abs=0.01)
    assert np.mean(values) == pytest.approx(midpoint, rel=1e-3)
    # the largest value is a float8 value: it stays
    assert set(np.asarray(data.astype(jnp.float32)).reshape(-1)[::32]) == {largest}


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_every_result_is_a_neighbour_and_the_mean_is_unbiased(dtype):
    rng = np.random.default_rng(1)
    values = rng.uniform(-3.0, 3.0, 64).astype(np.float32)
    values[0] = 3.0  # the amax of every copy: one scale for all
    x = jnp.asarray(np.tile(values, DRAWS // 64 // 4))
    data, scale = jaxscale.quantize_float8(x, dtype, key=jax.random.key(2))
    scaled = values * np.float32(scale)  # what was rounded
    rounded = np.asarray(data.astype(jnp.float32)).reshape(-1, 64)
    for column in range(1, 64):
        low, high = neighbours(abs(float(scaled[column])), dtype)
        sign = np.sign(scaled[column])
        got = rounded[:, column]
        assert set(np.unique(got)) <= {np.float32(sign * low), np.float32(sign * high)}
        # unbiased: within 4 standard errors of the value rounded
        standard_error = (high - low) / 2 / np.sqrt(len(got))
        assert abs(got.mean() - scaled[column]) < 4 * standard_error, column


def test_float8_values_infinities_and_nans_are_kept():
    x = jnp.asarray([0.0, -0.0, 1.0, -448.0, 0.001953125, np.inf, np.nan], jnp.float32)
    out = np.asarray(stochastic_to_float8(x, E4M3, jax.random.key(3)).astype(jnp.float32))
    np.testing.assert_array_equal(out[:5], [0.0, 0.0, 1.0, -448.0, 0.001953125])
    assert np.isnan(out[5])  # float8_e4m3fn has no infinity: cast, it is NaN
    assert np.isnan(out[6])


RECIPE_NAMES = ["tensorwise", "rowwise", "mxfp8"]


def stochastic(name):
    recipe = RECIPES.get(name) or MX_RECIPES[name]
    return dataclasses.replace(recipe, name=f"{name}+sr", stochastic_gradients=True)


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_the_recipes_round_the_output_gradient_stochastically_from_the_key(name):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16)

    def run(recipe, key=None):
        layer = jaxscale.autocast(lambda x, w: x @ w, dtype=jnp.bfloat16, float8=recipe, key=key)
        out, pullback = jax.vjp(layer, x, w)
        return (out, *pullback(dy))

    nearest = run(RECIPES.get(name) or MX_RECIPES[name])
    first, second, again = (run(stochastic(name), jax.random.key(k)) for k in (0, 1, 0))
    np.testing.assert_array_equal(first[0], nearest[0])  # the forward rounds to nearest
    for got, other, same in zip(first[1:], second[1:], again[1:], strict=True):
        assert not np.array_equal(got, other)
        np.testing.assert_array_equal(got, same)
    # unbiased: averaged over keys, the input gradient is nearer the exact one
    exact = np.asarray(run(None)[1], np.float32)  # bfloat16, no recipe
    mean = np.mean([np.asarray(run(stochastic(name), jax.random.key(k))[1], np.float32)
                    for k in range(32)], axis=0)  # fmt: skip
    error_nearest = np.linalg.norm(np.asarray(nearest[1], np.float32) - exact)
    assert np.linalg.norm(mean - exact) < error_nearest


def test_a_stochastic_recipe_asks_for_a_key():
    with pytest.raises(ValueError, match="stochastic_gradients=True\\) and needs a key"):
        jaxscale.autocast(lambda x, w: x @ w, dtype=jnp.bfloat16, float8=stochastic("rowwise"))


def test_the_cuda_lowering_of_stochastic_gradients_waits_on_nothing():
    x, w = jnp.ones((32, 64)), jnp.ones((64, 32))

    def step(x, w, key):
        layer = jaxscale.autocast(lambda x, w: x @ w, dtype=jnp.bfloat16,
                                  float8=stochastic("mxfp8"), key=key)  # fmt: skip
        return jax.grad(lambda w: jnp.sum(layer(x, w).astype(jnp.float32)))(w)

    report = jaxscale.lowering_report(jax.jit(step), x, w, jax.random.key(0), platform="cuda")
    assert report.loops == 0
    assert report.data_conditionals == 0
    assert report.host_transfers == 0


@pytest.mark.parametrize(
    "key",
    [jax.random.key(0), jax.random.PRNGKey(7), jax.random.fold_in(jax.random.key(3), 49),
     jax.random.key(0, impl="rbg")],
    ids=["typed", "raw", "folded", "rbg"],
)  # fmt: skip
@pytest.mark.parametrize("shape", [(5,), (2, 3, 100), (3, 3, 2, 4)])
def test_the_draws_are_jaxs_own_uniform_floats(key, shape):
    # what a user reproduces with jax.random.uniform, computed by jaxscale's own hash
    expected = np.asarray(jax.random.uniform(key, shape, jnp.float32))
    for compute in (random_uniform, jax.jit(random_uniform, static_argnums=1)):
        got = np.asarray(compute(key, shape))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    x = np.full(shape, 1.0 + 2.0**-5, np.float32)  # between e4m3's 1 and 1.125
    np.testing.assert_array_equal(
        stochastic_to_float8(x, E4M3, key).astype(jnp.float32),
        np.where(expected < 0.25, 1.125, 1.0).astype(np.float32),
    )


@pytest.mark.parametrize(
    "rounding",
    [lambda x, key: stochastic_to_float8(x, E4M3, key),
     lambda x, key: jaxscale.quantize_nvfp4(x, key=key)[0]],
    ids=["float8", "nvfp4"],
)  # fmt: skip
def test_the_draws_are_hashed_where_they_are_read_not_in_jaxs_loop(rounding):
    # JAX lowers Threefry's twenty rounds as a loop on the CPU: its words were 16 bytes
    # per element of temporaries in both roundings, and its compile time grows with the
    # draw's rank (1.35 s for one (3, 3, 8, 16) draw); as arithmetic they fuse into the
    # rounding
    x = jax.ShapeDtypeStruct((8, 128, 512), jnp.float32)
    lowered = jax.jit(rounding).lower(x, jax.random.key(0))
    assert "stablehlo.while" not in lowered.as_text()
    assert "threefry" not in lowered.as_text()


def test_a_stochastic_float8_rounding_writes_nothing_but_its_result():
    # (NVFP4's block arithmetic has temporaries of its own, which vary with XLA's version)
    x = jax.ShapeDtypeStruct((8, 128, 512), jnp.float32)
    rounding = jax.jit(lambda x, key: stochastic_to_float8(x, E4M3, key))
    assert rounding.lower(x, jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes == 0
