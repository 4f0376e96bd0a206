"""PyTorch habits that would be silent in JAX: each one raises, before anything changes.

In PyTorch ``scaler.unscale_(optimizer)`` divides ``.grad`` in place, so its result
is never used. Ported literally, ``scaler.unscale_(optimizer, grads)`` drops the
unscaled gradients and ``step`` would apply the scaled ones, a step thousands of
times too large. ``step`` recognises the gradients ``unscale_`` was given and
refuses them, eagerly and at trace time under ``nnx.jit``/``jax.jit``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from support import third_party

from jaxscale import GradScaler

X, Y = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2), jnp.ones((4, 2))
STILL_SCALED = re.escape(
    "step() was given the gradients that unscale_() was given for this optimizer; "
    "they are still scaled."
)


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def mse(prediction):
    return jnp.mean((prediction - Y) ** 2)


def scaler_bits(scaler):
    return bits(nnx.state(scaler)), scaler._iteration.optimizers.copy()


# -- nnx.Optimizer --------------------------------------------------------------------------------


def nnx_world():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.sgd(0.1)), wrt=nnx.Param)
    return model, optimizer, GradScaler(init_scale=1024.0)


def nnx_iteration(model, optimizer, scaler, use_result: bool):
    grads = nnx.grad(lambda m: scaler.scale(mse(m(X))))(model)
    unscaled = scaler.unscale_(optimizer, grads)
    scaler.step(optimizer, model, unscaled if use_result else grads)
    scaler.update()


@pytest.mark.parametrize("mode", ["eager", "nnx.jit"])
def test_nnx_step_refuses_the_gradients_unscale_was_given(mode):
    model, optimizer, scaler = nnx_world()
    run = nnx.jit(nnx_iteration, static_argnums=3) if mode == "nnx.jit" else nnx_iteration
    before = bits(nnx.state((model, optimizer))), bits(nnx.state(scaler))
    with pytest.raises(RuntimeError, match=STILL_SCALED):
        run(model, optimizer, scaler, False)
    assert (bits(nnx.state((model, optimizer))), bits(nnx.state(scaler))) == before
    # the same loop with the returned gradients trains: one ordinary SGD step
    model2, optimizer2, scaler2 = nnx_world()
    run(model2, optimizer2, scaler2, True)
    reference, _ = nnx_world()[:2]
    grads = nnx.grad(lambda m: mse(m(X)))(reference)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(reference, nnx.Param), grads)
    for got, want in zip(
        jax.tree.leaves(nnx.state(model2, nnx.Param)), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_the_eager_refusal_leaves_the_iteration_open_for_the_right_call():
    model, optimizer, scaler = nnx_world()
    grads = nnx.grad(lambda m: scaler.scale(mse(m(X))))(model)
    unscaled = scaler.unscale_(optimizer, grads)
    with pytest.raises(RuntimeError, match=STILL_SCALED):
        scaler.step(optimizer, model, grads)
    scaler.step(optimizer, model, unscaled)  # still allowed: nothing was recorded
    scaler.update()
    assert scaler.get_scale() == 1024.0


def test_partly_replaced_gradients_are_refused_too():
    # clipping one subtree of the unscaled result but passing the other still scaled
    model, optimizer, scaler = nnx_world()
    grads = nnx.grad(lambda m: scaler.scale(mse(m(X))))(model)
    unscaled = scaler.unscale_(optimizer, grads)
    mixed = jax.tree.map(lambda leaf: leaf, unscaled)
    mixed["bias"] = grads["bias"]
    with pytest.raises(RuntimeError, match=STILL_SCALED):
        scaler.step(optimizer, model, mixed)


# -- Linen TrainState and the Optax triple ------------------------------------------------------


def linear(params, x):
    return x @ params["w"] + params["b"][None, :]


PARAMS = {"w": jnp.eye(2), "b": jnp.zeros(2)}


def test_train_state_step_refuses_the_gradients_unscale_was_given():
    state = train_state.TrainState.create(
        apply_fn=linear, params=PARAMS, tx=third_party.optimizer(optax.sgd(0.1))
    )
    scaler = GradScaler(init_scale=1024.0)

    @jax.jit
    def iteration(state, scaler):
        grads = jax.grad(lambda p: scaler.scale(mse(linear(p, X))))(state.params)
        scaler.unscale_(state, grads)
        state = scaler.step(state, grads=grads)
        scaler.update()
        return state, scaler

    before = bits(state), bits(nnx.state(scaler))
    with pytest.raises(RuntimeError, match=STILL_SCALED):
        iteration(state, scaler)
    assert (bits(state), bits(nnx.state(scaler))) == before


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_optax_step_refuses_the_gradients_unscale_was_given(mode):
    tx = third_party.optimizer(optax.sgd(0.1))
    scaler = GradScaler(init_scale=1024.0)
    params, opt_state = PARAMS, tx.init(PARAMS)

    def iteration(params, opt_state, scaler):
        grads = jax.grad(lambda p: scaler.scale(mse(linear(p, X))))(params)
        scaler.unscale_(tx, grads)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    run = jax.jit(iteration) if mode == "jit" else iteration
    before = bits((params, opt_state)), bits(nnx.state(scaler))
    with pytest.raises(RuntimeError, match=STILL_SCALED):
        run(params, opt_state, scaler)
    assert (bits((params, opt_state)), bits(nnx.state(scaler))) == before


def test_a_disabled_scaler_never_refuses():
    # unscale_ of a disabled scaler returns its input: passing either is the same
    model, optimizer, _ = nnx_world()
    scaler = GradScaler(enabled=False)
    grads = nnx.grad(lambda m: scaler.scale(mse(m(X))))(model)
    scaler.unscale_(optimizer, grads)
    scaler.step(optimizer, model, grads)
    scaler.update()


def test_a_scaler_closed_over_by_jax_jit_is_refused_in_jaxscale_terms_and_stays_usable():
    # Closed over, not passed in: the jitted function cannot write the scaler's state.
    # Flax's own error names trace levels; jaxscale's names the remedy. Passed in
    # afterwards, the same scaler trains as a fresh one does.
    params = {"w": jnp.ones(3)}
    tx = optax.sgd(0.1)
    scaler, fresh = GradScaler(init_scale=4.0), GradScaler(init_scale=4.0)
    before = scaler_bits(scaler)

    @jax.jit
    def closed_over(params, opt_state):
        grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] ** 2)))(params)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state

    with (
        third_party.standard_promotion(),
        pytest.raises(
            RuntimeError, match=re.escape("Pass the scaler to the jitted function and return it")
        ),
    ):
        closed_over(params, tx.init(params))
    assert scaler_bits(scaler) == before

    @jax.jit
    def passed_in(params, opt_state, scaler):
        grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] ** 2)))(params)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    with third_party.standard_promotion():
        ours = passed_in(params, tx.init(params), scaler)
        theirs = passed_in(params, tx.init(params), fresh)
    assert bits(ours) == bits(theirs)
