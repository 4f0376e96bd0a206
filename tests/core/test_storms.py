"""Overflow storms and the kinds of non-finite gradient, against PyTorch's own behaviour.

A storm is a long run of steps whose gradients all hold an inf. Every one must be
skipped with parameters and optimizer state bitwise unchanged, and the scale must
follow PyTorch's trajectory bit for bit: halving through float32's subnormals to
exactly 0.0. What PyTorch does next (NaN parameters) is reproduced and documented;
``min_scale`` is the cure, and training recovers with it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from support import third_party, torch_reference

import jaxscale
from jaxscale import GradScaler

STORM = 1000
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.array([0.5, -0.25, 0.0])}
X = jnp.linspace(0.0, 1.0, 8).reshape(2, 4)


def loss_fn(params):
    return jnp.mean((X @ params["w"] + params["b"][None, :]) ** 2)


def bits(tree):
    return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


@functools.partial(jax.jit, static_argnums=0)
def train(tx, params, opt_state, poison):
    """One step per element of ``poison``; a poisoned step's gradients are all +inf."""

    def step(carry, poisoned):
        params, opt_state = carry
        grads = jax.grad(lambda p: jaxscale.scale(loss_fn(p), opt_state))(params)
        grads = jax.tree.map(lambda g: jnp.where(poisoned, jnp.inf, g), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), (jaxscale.get_scale(opt_state), jaxscale.found_inf(opt_state))

    (params, opt_state), (scales, found) = jax.lax.scan(step, (params, opt_state), poison)
    return params, opt_state, scales, found


def warmed_up(tx):
    """Parameters and state after five finite steps, so Adam's moments are not zero."""
    params, opt_state, _, _ = train(tx, PARAMS, tx.init(PARAMS), jnp.zeros(5, bool))
    return params, opt_state


def test_storm_changes_nothing_and_the_scale_follows_pytorch_to_zero():
    tx = jaxscale.grad_scaler(third_party.optimizer(optax.adam(1e-2)), growth_interval=3)
    params, opt_state = warmed_up(tx)
    after, after_state, scales, found = train(tx, params, opt_state, jnp.ones(STORM, bool))

    assert bool(found.all())
    assert bits(after) == bits(params)
    assert bits(after_state.inner_state) == bits(opt_state.inner_state)
    assert int(jaxscale.skipped_steps(after_state)) == STORM
    expected, _ = torch_reference.update_scale_trajectory(
        float(jaxscale.get_scale(opt_state)), [1.0] * STORM, 2.0, 0.5, 3
    )
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint32), expected.view(np.uint32))
    # Grown once in the warm-up to 2**17, it halves to the smallest subnormal, 2**-149,
    # in 166 steps and to 0.0 on the 167th.
    assert float(jaxscale.get_scale(opt_state)) == 2.0**17
    assert float(scales[165]) == 2.0**-149
    assert int(np.argmax(np.asarray(scales) == 0.0)) == 166
    assert float(scales[-1]) == 0.0


def test_after_the_scale_reaches_zero_parameters_turn_nan_as_in_pytorch():
    """Zero scale: the scaled gradients are finite zeros, so the step runs, and 0 * (1/0)
    is NaN. PyTorch does the same (checked here); ``min_scale`` prevents it."""
    tx = jaxscale.grad_scaler(third_party.optimizer(optax.sgd(0.1)))
    params, opt_state, _, _ = train(tx, PARAMS, tx.init(PARAMS), jnp.ones(200, bool))
    assert float(jaxscale.get_scale(opt_state)) == 0.0
    params, opt_state, _, found = train(tx, params, opt_state, jnp.zeros(1, bool))
    assert not bool(found[0])
    assert all(bool(jnp.isnan(p).all()) for p in jax.tree.leaves(params))

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for poisoned in [True] * 200 + [False]:
        optimizer.zero_grad()
        scaler.scale((weight * (np.inf if poisoned else 2.0)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() == 0.0
    assert bool(torch.isnan(weight).all())


def test_min_scale_stops_the_storm_and_training_recovers():
    tx = jaxscale.grad_scaler(
        third_party.optimizer(optax.adam(1e-2)), growth_interval=10, min_scale=1.0
    )
    params, opt_state = warmed_up(tx)
    stormed, stormed_state, scales, _ = train(tx, params, opt_state, jnp.ones(STORM, bool))
    assert float(scales.min()) == 1.0
    assert bits(stormed) == bits(params)
    assert bits(stormed_state.inner_state) == bits(opt_state.inner_state)

    recovered, _, scales, found = train(tx, stormed, stormed_state, jnp.zeros(50, bool))
    assert not bool(found.any())
    assert float(scales[-1]) == 2.0**5  # grown once per 10 finite steps
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(recovered))
    assert float(loss_fn(recovered)) < float(loss_fn(stormed))


class Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.linspace(-1.0, 1.0, 3))


@nnx.jit
def facade_step(model, optimizer, scaler, poisoned):
    def loss(model):
        value = jnp.sum(model.w[...] * jnp.where(poisoned, jnp.inf, 2.0))
        return scaler.scale(value)

    scaler.step(optimizer, model, nnx.grad(loss)(model))
    scaler.update()


@pytest.mark.parametrize("min_scale", [None, 1.0])
def test_facade_storm_matches_pytorch_step_by_step(min_scale):
    model = Linear()
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.adam(1e-2)), wrt=nnx.Param)
    scaler = GradScaler(growth_interval=4, min_scale=min_scale)
    weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 3))
    torch_optimizer = torch.optim.Adam([weight], lr=1e-2)
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=4)

    plan = [False] * 3 + [True] * STORM + ([False] * 9 if min_scale else [])
    before_storm = None
    for i, poisoned in enumerate(plan):
        if i == 3:
            before_storm = bits(nnx.state((model, optimizer)))
        facade_step(model, optimizer, scaler, jnp.asarray(poisoned))
        if min_scale is None or not poisoned:
            # With min_scale PyTorch has no counterpart, so it runs without the storm:
            # a storm the scaler skips entirely must leave training as if it never came.
            torch_optimizer.zero_grad()
            torch_scaler.scale((weight * (np.inf if poisoned else 2.0)).sum()).backward()
            torch_scaler.step(torch_optimizer)
            torch_scaler.update()
        if min_scale is None:
            assert scaler.get_scale() == torch_scaler.get_scale(), i
        if i == 3 + STORM - 1:
            assert bits(nnx.state((model, optimizer))) == before_storm
    if min_scale is None:
        assert scaler.get_scale() == 0.0
    else:
        assert scaler.get_scale() == 4.0  # floored at 1.0, then grown after 4 and 8 steps
        np.testing.assert_allclose(model.w[...], weight.detach().numpy(), rtol=1e-6, atol=1e-6)


# -- the kinds of non-finite gradient ---------------------------------------------------------


def test_nan_in_the_loss_is_found_and_skipped_as_pytorch():
    model = Linear()
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.sgd(0.1)), wrt=nnx.Param)
    scaler = GradScaler(init_scale=8.0)
    grads = nnx.grad(lambda m: scaler.scale(jnp.sum(m.w[...]) * jnp.float32(np.nan)))(model)
    scaler.step(optimizer, model, grads)
    scaler.update()

    weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 3))
    torch_optimizer = torch.optim.SGD([weight], lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    torch_scaler.scale(weight.sum() * float("nan")).backward()
    torch_scaler.step(torch_optimizer)
    torch_scaler.update()

    assert scaler.get_scale() == torch_scaler.get_scale() == 4.0
    np.testing.assert_array_equal(model.w[...], weight.detach().numpy())


def test_inf_in_one_leaf_skips_that_optimizer_and_backs_off_once():
    """Two optimizers, inf only in the first one's gradients: PyTorch's multiple-optimizer
    rule — the first skips, the second steps, and update() backs off once."""
    first, second = Linear(), Linear()
    opt_first = nnx.Optimizer(first, third_party.optimizer(optax.sgd(0.1)), wrt=nnx.Param)
    opt_second = nnx.Optimizer(second, third_party.optimizer(optax.sgd(0.1)), wrt=nnx.Param)
    scaler = GradScaler(init_scale=8.0)
    loss = lambda m: scaler.scale(jnp.sum(m.w[...] ** 2))  # noqa: E731
    grads_first = nnx.grad(loss)(first)
    grads_first["w"] = nnx.Param(grads_first["w"][...].at[1].set(jnp.inf))
    grads_second = nnx.grad(loss)(second)
    scaler.step(opt_first, first, grads_first)
    scaler.step(opt_second, second, grads_second)
    scaler.update()
    initial = np.linspace(-1.0, 1.0, 3, dtype=np.float32)
    np.testing.assert_array_equal(first.w[...], initial)
    assert not np.array_equal(second.w[...], initial)
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_nan_in_a_low_precision_leaf_is_found_as_pytorch(dtype):
    grads = [np.array([1.0, np.nan, -2.0], dtype=jnp.dtype(dtype)), np.ones(2, np.float32)]
    expected, expected_found = torch_reference.unscale(grads, np.float32(2.0))
    unscaled, found = jaxscale.unscale_and_check([jnp.asarray(g) for g in grads], 2.0)
    assert bool(found) is expected_found is True
    for got, want in zip(unscaled, expected, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(np.float32))


def test_float16_overflow_after_unscaling_is_not_found_exactly_as_pytorch():
    """Scale 0.5: 40000 is finite in float16 but 80000 is not. The check runs on the scaled
    values, so neither library finds it, and both hand an inf to the optimizer."""
    grads = [np.array([40000.0, 1.0], np.float16)]
    expected, expected_found = torch_reference.unscale(grads, np.float32(0.5))
    unscaled, found = jaxscale.unscale_and_check([jnp.asarray(grads[0])], 0.5)
    assert bool(found) is expected_found is False
    np.testing.assert_array_equal(np.asarray(unscaled[0]), expected[0])
    assert np.isinf(expected[0][0])
