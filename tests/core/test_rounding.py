"""multiply_as_double: float32(float64(x) * factor), bit for bit, without x64."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.core import multiply_as_double
from jaxscale.core._rounding import decompose_factor


def reference(x: np.ndarray, factor: float) -> np.ndarray:
    """What C++ ``static_cast<float>(x * factor)`` gives: a double product, rounded to float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (x.astype(np.float64) * factor).astype(np.float32)


def assert_bits_equal(got, expected):
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    same = got.view(np.uint32) == expected.view(np.uint32)
    same |= np.isnan(got) & np.isnan(expected)
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (
        f"{bad.size} mismatches, first: got {got.flat[bad[0]]!r} want {expected.flat[bad[0]]!r}"
    )


def batched(factor):
    return jax.jit(jax.vmap(lambda x: multiply_as_double(x, factor)))


@pytest.mark.parametrize(
    ("factor", "significand", "exponent"),
    [(2.0, 1, 1), (0.5, 1, -1), (1.5, 3, -1), (3.0, 3, 0), (0.3, 5404319552844595, -54)],
)
def test_decompose_factor(factor, significand, exponent):
    assert decompose_factor(factor) == (significand, exponent)
    assert significand * 2.0**exponent == factor


@pytest.mark.parametrize("factor", [0.0, -1.0, math.inf, math.nan])
def test_decompose_factor_rejects_non_positive_or_non_finite(factor):
    with pytest.raises(ValueError, match="factor must be positive and finite"):
        decompose_factor(factor)


def test_pytorch_example_from_the_design_brief():
    # growth 1.5 / backoff 0.3 from 1.0 over found_inf 0,0,1,0,1,1,0: PyTorch ends at
    # 0.1366875022649765; float32 arithmetic would end at 0.1366875171661377.
    x = jnp.float32(1.0)
    for found_inf in [0, 0, 1, 0, 1, 1, 0]:
        x = multiply_as_double(x, 0.3 if found_inf else 1.5)
    assert float(x) == 0.1366875022649765


FACTORS = [
    2.0,
    0.5,
    1.5,
    0.3,
    0.1,
    1.1,
    1 / 3,
    7.0,
    0.999,
    1 + 2**-52,
    1 - 2**-53,
    1e-30,
    1e30,
    1e-300,
    1e300,
    # powers of two: a shorter program, only the exponent moves
    1.0,
    4.0,
    0.25,
    2.0**-30,
    2.0**100,
    2.0**-149,
    2.0**-1074,
    2.0**1000,
]


@pytest.mark.parametrize("factor", FACTORS)
def test_random_bit_patterns_match_double_arithmetic(factor):
    rng = np.random.default_rng(abs(hash(factor)) % 2**32)
    every_float32 = (
        rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    )
    subnormals = rng.integers(0, 2**23, 10_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([every_float32, subnormals, -subnormals])
    assert_bits_equal(batched(factor)(jnp.asarray(x)), reference(x, factor))


def test_products_landing_on_float32_midpoints_round_twice_like_pytorch():
    """Factors chosen so the double product is (or is next to) a float32 rounding midpoint.

    Here rounding once from the exact product and rounding twice (to double, then to
    float32) disagree, and only the twice-rounded result equals PyTorch's.
    """
    rng = np.random.default_rng(7)
    exact_midpoints = 0
    for _ in range(12):
        x = (rng.uniform(0.5, 2.0, 64) * 2.0 ** rng.integers(-100, 100, 64)).astype(np.float32)
        # a float32 midpoint near x[0] * c, and the double factor that lands x[0] on it
        target = np.float32(x[0] * rng.uniform(0.2, 5.0))
        midpoint = np.float64(target) + np.float64(np.spacing(target)) / 2
        factor = float(midpoint / np.float64(x[0]))
        exact_midpoints += int(np.float64(x[0]) * factor == midpoint)
        for probe in [factor, np.nextafter(factor, 0.0), np.nextafter(factor, 10.0)]:
            probe = float(probe)
            assert_bits_equal(batched(probe)(jnp.asarray(x)), reference(x, probe))
    assert exact_midpoints > 0


def test_special_values_are_their_own_products():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
    assert_bits_equal(batched(0.3)(jnp.asarray(x)), x)


def test_overflow_gives_inf_and_underflow_gives_subnormals_then_zero():
    big = np.float32(3e38)
    assert float(multiply_as_double(jnp.float32(big), 2.0)) == math.inf
    tiny = np.float32(2.0**-126)
    assert_bits_equal(multiply_as_double(jnp.float32(tiny), 0.5), np.float32(2.0**-127))
    assert float(multiply_as_double(jnp.float32(2.0**-149), 0.5)) == 0.0  # tie rounds to even 0
    assert_bits_equal(multiply_as_double(jnp.float32(2.0**-149), 0.75), np.float32(2.0**-149))


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_power_of_two_factors_round_every_subnormal_result_to_nearest_even(factor):
    # every float32 whose product is or lands next to a subnormal, exhaustively
    bits = np.arange(0, 2**24 + 2**23, dtype=np.uint32)
    x = np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)
    assert_bits_equal(batched(factor)(jnp.asarray(x)), reference(x, factor))


def test_a_power_of_two_factor_compiles_to_a_much_shorter_program():
    def equations(factor):
        return len(jax.make_jaxpr(lambda x: multiply_as_double(x, factor))(jnp.float32(1)).eqns)

    assert equations(2.0) * 2 < equations(1.5)
    assert equations(0.5) == equations(2.0)


def test_eager_and_jit_agree():
    x = np.float32(0.1234567)
    eager = multiply_as_double(jnp.float32(x), 0.3)
    jitted = jax.jit(lambda v: multiply_as_double(v, 0.3))(jnp.float32(x))
    assert_bits_equal(eager, jitted)
    assert_bits_equal(eager, reference(np.array(x), 0.3))


@pytest.mark.parametrize("factor", [0.3, 1.5, 1 / 3, 1e-30, 1e30])
def test_the_eager_path_agrees_with_the_traced_emulation_bit_for_bit(factor):
    # outside jit a concrete scale is multiplied in NumPy; inside, by integer emulation
    rng = np.random.default_rng(11)
    x = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, x.view(np.uint32).__and__(0x807FFFFF).view(np.float32)])  # subnormals
    assert_bits_equal(multiply_as_double(jnp.asarray(x), factor), batched(factor)(jnp.asarray(x)))


def test_rejects_non_float32_input():
    with pytest.raises(TypeError, match="expects a float32 array, got float16"):
        multiply_as_double(jnp.float16(1.0), 2.0)
