"""Diagnosis inside loops: an origin in a loop's first iteration, statistics over every
iteration, and a forward loop under ``jax.grad`` told from the backward pass. Each test
fails with the one-line change named in it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import jaxscale

F16, F32 = jnp.float16, jnp.float32


def test_an_origin_in_iteration_0_says_so():
    # planted: describing the iteration only when it is above 0
    def grows(x):
        def body(h, _):
            h = h * F16(30000.0)  # inf at once: iteration 0
            return h, h

        _, ys = lax.scan(body, x, None, length=2)
        return jnp.sum(ys.astype(F32))

    _, report = jaxscale.locate_nonfinite(grows)(jnp.full(4, 3.0, F16))
    assert ", iteration 0: inf (float16)" in report.describe()


def test_precision_stats_count_every_iteration_of_a_loop():
    # planted: keeping the last iteration's figures. The first iteration's products are
    # 8.0, the second's underflow to zero in float16: half of all elements.
    def layers(x, w):
        def body(h, weights):
            return jaxscale.autocast(lambda a, b: a @ b)(h, weights).astype(F32), None

        h, _ = lax.scan(body, x, w)
        return h

    w = jnp.stack([jnp.ones((8, 8)), jnp.full((8, 8), 1e-9)])
    _, stats = jaxscale.precision_stats(layers)(jnp.ones((4, 8)), w)
    (figures,) = stats.values()
    assert float(figures["underflow"]) == 0.5
    assert float(figures["out_amax"]) == 8.0


def test_a_forward_loop_under_grad_is_forward():
    # planted: an equation backward when any (not every) use of its outputs is backward;
    # a forward scan's residuals are read by the backward pass only
    def loss(x):
        def body(h, _):
            h = h * h * F16(4.0)  # 3 -> 36 -> 5184 -> inf in iteration 2
            return h, jnp.sin(h)

        h, ys = lax.scan(body, x, None, length=3)
        return jnp.sum(ys.astype(F32)) + jnp.sum(h.astype(F32))

    _, report = jaxscale.locate_nonfinite(jax.grad(loss))(jnp.full(4, 3.0, F16))
    assert report.describe().startswith("forward mul at ")
    assert ", iteration 2: inf (float16)" in report.describe()
