"""Behaviours a mutation run found no test holding, and the complex matmuls of an S5
state-space model: each test fails with the one-line change named in it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import third_party

import jaxscale
from jaxscale.casting._interpreter import widest

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


def test_custom_fwd_casts_keyword_arguments_too():
    # planted: casting ``args`` alone, not ``(args, kwargs)``
    @jaxscale.custom_fwd(cast_inputs=F32)
    def exact(x):
        return x * 2

    def model(h):
        return exact(x=h), exact(h)

    by_name, by_position = jaxscale.autocast(model)(jnp.ones((2, 4), F16))
    assert by_name.dtype == F32
    assert by_position.dtype == F32


@pytest.mark.parametrize(("a", "b"), [(F16, BF16), (BF16, F16)])
def test_float16_with_bfloat16_is_float32_in_either_order(a, b):
    # planted: returning the first operand's dtype for the pair
    assert widest(a, b) == np.dtype(F32)


def complex_dot_operands(jaxpr) -> list[list[str]]:
    return [
        [v.aval.dtype.name for v in eqn.invars]
        for eqn in jaxpr.jaxpr.eqns
        if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.dtype == jnp.complex64
    ]


def test_a_complex_matmul_keeps_its_traced_dtypes():
    # An S5-style layer: a float16 activation (under autocast) into a complex64 matmul,
    # written as JAX allows under its standard promotion, a float32 x complex64 product.
    # PyTorch's autocast leaves complex matmuls alone: the real operand goes back to its
    # traced float32, never float16 x complex64.
    def layer(x, weights):
        h = jnp.tanh(x @ jnp.ones((8, 8)))
        return jnp.real(h @ weights)

    x, weights = jnp.ones((4, 8)), jnp.full((8, 8), 0.5 + 0.25j, jnp.complex64)
    with third_party.standard_promotion():
        jaxpr = jax.make_jaxpr(jaxscale.autocast(layer))(x, weights)
        grads = jax.grad(lambda x, w: jaxscale.autocast(layer)(x, w).sum(), argnums=(0, 1))
        report = jaxscale.lowering_report(grads, x, weights)
        ours, expected = jaxscale.autocast(layer)(x, weights), layer(x, weights)
    assert complex_dot_operands(jaxpr) == [["float32", "complex64"]]
    assert not any("f16" in k and "complex" in k for k in report.matmul_dtypes), report
    assert report.matmul_dtypes["f16 x f16 -> f16"] == 2
    np.testing.assert_allclose(ours, expected, rtol=1e-3)


def test_a_real_value_converted_to_complex_by_the_user_is_converted_as_written():
    # the conversion the user wrote converts the float16 activation: complex64 operands
    def layer(x, weights):
        h = jnp.tanh(x @ jnp.ones((8, 8)))
        return jnp.real(h.astype(jnp.complex64) @ weights)

    x, weights = jnp.ones((4, 8)), jnp.full((8, 8), 0.5 + 0.25j, jnp.complex64)
    jaxpr = jax.make_jaxpr(jaxscale.autocast(layer))(x, weights)
    assert complex_dot_operands(jaxpr) == [["complex64", "complex64"]]
