"""jaxscale.precision_stats reports the ranges each matmul and convolution works in."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxscale

F16, F32 = jnp.float16, jnp.float32


def line_of(fn, marker="# <- measured"):
    lines, first = inspect.getsourcelines(fn)
    found = [first + i for i, text in enumerate(lines) if marker in text]
    assert len(found) == 1
    return f"test_precision_stats.py:{found[0]}"


def values(stats):
    return {key: {name: float(v) for name, v in figures.items()} for key, figures in stats.items()}


def projection(w, x):
    return x @ w  # <- measured


def test_operand_and_output_ranges_of_a_float16_matmul():
    w = jnp.array([[300.0, -2.0], [300.0, 1e-5]], F32)
    x = jnp.array([[1.0, 1.0], [1e-6, 0.0]], F32)
    out, stats = jax.jit(jaxscale.precision_stats(jaxscale.autocast(projection)))(w, x)
    np.testing.assert_array_equal(out, jax.jit(jaxscale.autocast(projection))(w, x))
    key = f"{line_of(projection)} dot_general forward (float16)"
    assert list(stats) == [key]
    figures = values(stats)[key]
    assert figures["lhs_amax"] == 1.0
    assert figures["rhs_amax"] == 300.0
    assert figures["out_amax"] == 600.0
    # outputs 600, -2, 3e-4 and -2e-6: the last below float16's smallest normal, 6.1e-5
    assert figures["underflow"] == 0.25
    assert figures["overflow"] == 0.0


def test_overflow_fraction_and_the_finite_amax():
    w = jnp.array([[4e4, 1.0], [4e4, 1.0]], F32)
    _, stats = jaxscale.precision_stats(jaxscale.autocast(projection))(w, jnp.ones((1, 2)))
    figures = values(stats)[f"{line_of(projection)} dot_general forward (float16)"]
    assert figures["overflow"] == 0.5  # 8e4 is inf in float16
    assert figures["out_amax"] == 2.0


def test_forward_and_backward_matmuls_are_apart_and_numbered():
    def loss(w, x):
        return jnp.sum(projection(w, x) ** 2)

    _, stats = jaxscale.precision_stats(jax.grad(loss, argnums=(0, 1)))(
        jnp.ones((3, 3)), jnp.ones((2, 3))
    )
    where = line_of(projection)
    assert sorted(stats) == [
        f"{where} dot_general backward (float32)",
        f"{where} dot_general backward (float32) #2",
        f"{where} dot_general forward (float32)",
    ]


def test_a_loop_accumulates_over_its_iterations():
    def unrolled_growth(w, x):
        def layer(h, _):
            return h @ w, None  # <- measured

        return lax.scan(layer, x, None, length=3)[0]

    _, stats = jax.jit(jaxscale.precision_stats(unrolled_growth))(
        2.0 * jnp.eye(2), jnp.ones((1, 2))
    )
    figures = values(stats)[f"{line_of(unrolled_growth)} dot_general forward (float32)"]
    assert figures["out_amax"] == 8.0  # the last iteration's 2 ** 3
    assert figures["lhs_amax"] == 4.0


def test_convolutions_are_measured():
    def conv(x, k):
        return lax.conv(x, k, (1, 1), "SAME")  # <- measured

    _, stats = jaxscale.precision_stats(conv)(jnp.ones((1, 1, 4, 4)), 0.5 * jnp.ones((1, 1, 3, 3)))
    figures = values(stats)[f"{line_of(conv)} conv_general_dilated forward (float32)"]
    assert figures["out_amax"] == 4.5
    assert figures["rhs_amax"] == 0.5


def test_bad_argument():
    with pytest.raises(TypeError, match="precision_stats expects a callable, got str 'f'"):
        jaxscale.precision_stats("f")
