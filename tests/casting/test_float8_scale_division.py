"""The float8 scale's division, ``float32(fmax / float64(amax))``, exact on any platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxscale.casting import _float8
from jaxscale.core import _scaling

NUMERATORS = [448.0, 57344.0, 3.0, 1.0, float(2**24 - 1)]


def random_normal_floats(seed: int, count: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    patterns = np.concatenate([
        rng.integers(0x00800000, 0x7F800000, count, dtype=np.uint32),
        # significands next to 1 and 2, where a quotient is nearest to a power of two
        rng.integers(0x3F800000, 0x3F800040, 64, dtype=np.uint32),
        rng.integers(0x3FFFFFC0, 0x40000000, 64, dtype=np.uint32),
        np.uint32([0x43E00000, 0x43E00001, 0x43DFFFFF, 0x7F7FFFFF]),
    ])  # fmt: skip
    return patterns.view(np.float32)


def assert_divides_as_float64(numerator: float, x: np.ndarray) -> None:
    with np.errstate(over="ignore", under="ignore"):
        want = (np.float64(numerator) / x.astype(np.float64)).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: _float8.divide_correctly_rounded(numerator, v))(x))
    normal = np.isfinite(want) & (want >= np.finfo(np.float32).tiny)
    assert normal.sum() > 0.9 * x.size
    np.testing.assert_array_equal(got.view(np.uint32)[normal], want.view(np.uint32)[normal])


@pytest.mark.parametrize("numerator", NUMERATORS)
def test_the_quotient_is_the_float64_quotient_rounded_once(numerator):
    assert_divides_as_float64(numerator, random_normal_floats(int(numerator) % 1000, 300_000))


@pytest.mark.parametrize("error", [1, 2, 3])
def test_a_float_division_off_by_a_few_ulps_is_corrected(monkeypatch, error):
    # XLA's float32 division is correctly rounded on the CPU; a GPU's may be an ulp or
    # two off. Here every estimate of the quotient is off by up to `error` ulps either
    # way, and every estimate of the remainder's ratio to the divisor by 0.45, which
    # makes it round the wrong way.
    def off(numerator, denominator):
        exact = numerator / denominator
        pattern = lax.bitcast_convert_type(denominator, jnp.uint32)
        ulps = (pattern % (2 * error + 1)).astype(jnp.float32) - error
        ulp = jnp.where(jnp.abs(exact) >= 2.0**25, 4.0, 2.0)  # the quotient is 2**24 to 2**26
        fraction = jnp.where(pattern % 2 == 0, 0.45, -0.45)
        return exact + jnp.where(jnp.abs(exact) > 2.0**22, ulps * ulp, fraction)

    monkeypatch.setattr(_scaling, "_float_quotient", off)
    for numerator in (448.0, 57344.0):
        assert_divides_as_float64(numerator, random_normal_floats(error, 100_000))


def primitives(jaxpr):
    """The primitive of every equation, those of nested calls (``jnp.where``'s) included."""
    for eqn in jaxpr.eqns:
        inner = [p for p in eqn.params.values() if isinstance(p, jax.extend.core.ClosedJaxpr)]
        if inner:
            for closed in inner:
                yield from primitives(closed.jaxpr)
        else:
            yield eqn.primitive


def test_the_division_is_a_short_computation():
    # A bit-by-bit long division (26 dependent steps of compare and select: 233
    # operations, 32 selects) took XLA 0.12's CPU compiler over 15 minutes in one rowwise
    # float8 gradient: LLVM's loop vectorizer walks such a chain in time exponential in
    # its length.
    jaxpr = jax.make_jaxpr(lambda v: _float8.divide_correctly_rounded(448.0, v))(
        jnp.ones((4, 1), jnp.float32)
    )
    found = list(primitives(jaxpr.jaxpr))
    assert len(found) <= 100
    assert found.count(lax.select_n_p) <= 10
