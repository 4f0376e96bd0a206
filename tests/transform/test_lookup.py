"""scale / get_scale / found_inf / skipped_steps find the scaler inside nested states."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from support import third_party

import jaxscale

PARAMS = {"w": jnp.ones((2, 2))}


def sgd(learning_rate=0.1):
    return third_party.optimizer(optax.sgd(learning_rate))


# (transform, number of update calls after which the scaler has run once)
NESTINGS = {
    "bare": lambda: (jaxscale.grad_scaler(sgd(), init_scale=32.0), 1),
    "chain": lambda: (
        optax.chain(jaxscale.grad_scaler(sgd(), init_scale=32.0), optax.scale(1.0)),
        1,
    ),
    "inject_hyperparams": lambda: (
        optax.inject_hyperparams(
            lambda learning_rate: jaxscale.grad_scaler(sgd(learning_rate), init_scale=32.0)
        )(learning_rate=0.1),
        1,
    ),
    "MultiSteps": lambda: (
        third_party.optimizer(
            optax.MultiSteps(jaxscale.grad_scaler(sgd(), init_scale=32.0), every_k_schedule=2)
        ),
        2,
    ),
}


@pytest.mark.parametrize("nesting", list(NESTINGS))
def test_helpers_find_the_state_in_nested_optax_states(nesting):
    tx, calls_per_scaler_step = NESTINGS[nesting]()
    opt_state = tx.init(PARAMS)
    assert float(jaxscale.get_scale(opt_state)) == 32.0
    assert float(jaxscale.scale(jnp.float32(0.5), opt_state)) == 16.0
    assert not bool(jaxscale.found_inf(opt_state))
    assert int(jaxscale.skipped_steps(opt_state)) == 0

    @jax.jit
    def step(opt_state):
        grads = {"w": jnp.full((2, 2), jnp.inf)}
        return tx.update(grads, opt_state, PARAMS)[1]

    for _ in range(calls_per_scaler_step):
        opt_state = step(opt_state)
    assert float(jaxscale.get_scale(opt_state)) == 16.0
    assert bool(jaxscale.found_inf(opt_state))
    assert int(jaxscale.skipped_steps(opt_state)) == 1


def test_no_scaler_state_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"expected one grad_scaler state in the tuple given, found none; "
        r"pass the state of an optimizer built with jaxscale.grad_scaler",
    ):
        jaxscale.get_scale(optax.adam(1e-3).init(PARAMS))


@pytest.mark.parametrize("helper", ["get_scale", "found_inf", "skipped_steps", "metrics"])
def test_the_pytorch_style_scaler_given_to_a_helper_names_its_own_methods(helper):
    # jaxscale.skipped_steps(scaler) is a natural guess for a GradScaler user
    scaler = jaxscale.GradScaler()
    with pytest.raises(
        ValueError,
        match=r"found none; a jaxscale.GradScaler answers this with its own methods: "
        r"scaler.get_scale\(\), scaler.found_inf\(\), scaler.skipped_steps\(\), "
        r"scaler.metrics\(\)$",
    ):
        getattr(jaxscale, helper)(scaler)
    assert float(scaler.get_scale()) == 65536.0
    assert int(scaler.skipped_steps()) == 0


def test_two_scaler_states_are_ambiguous():
    tx = optax.multi_transform(
        {"a": jaxscale.grad_scaler(sgd()), "b": jaxscale.grad_scaler(sgd())}, {"w": "a", "v": "b"}
    )
    opt_state = tx.init({"w": jnp.ones(2), "v": jnp.ones(2)})
    with pytest.raises(
        ValueError, match=r"found 2; pass the sub-state that holds the one you mean"
    ):
        jaxscale.get_scale(opt_state)
    assert float(jaxscale.get_scale(opt_state.inner_states["a"])) == 65536.0


class Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


@pytest.mark.parametrize("mode", ["eager", "nnx.jit"])
def test_helpers_read_a_flax_nnx_optimizer(mode):
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxscale.grad_scaler(sgd(), init_scale=1024.0), wrt=nnx.Param)
    x = jnp.ones((4, 3))

    def train_step(model, optimizer, poison):
        def loss_fn(model):
            return jaxscale.scale(jnp.mean(model(x) ** 2), optimizer.opt_state)

        grads = nnx.grad(loss_fn)(model)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.full_like(g, jnp.nan), g), grads)
        optimizer.update(model, grads)

    step = nnx.jit(train_step) if mode == "nnx.jit" else train_step
    kernel = np.asarray(model.linear.kernel[...]).copy()
    step(model, optimizer, jnp.asarray(True))
    np.testing.assert_array_equal(np.asarray(model.linear.kernel[...]), kernel)
    assert float(jaxscale.get_scale(optimizer.opt_state)) == 512.0
    assert bool(jaxscale.found_inf(optimizer.opt_state))
    step(model, optimizer, jnp.asarray(False))
    assert not np.array_equal(np.asarray(model.linear.kernel[...]), kernel)
    assert int(jaxscale.skipped_steps(optimizer.opt_state)) == 1


def test_helpers_read_a_linen_train_state():
    state = train_state.TrainState.create(
        apply_fn=None, params=PARAMS, tx=jaxscale.grad_scaler(sgd(), init_scale=64.0)
    )
    grads = jax.grad(lambda p: jaxscale.scale(jnp.sum(p["w"]), state.opt_state))(state.params)
    np.testing.assert_array_equal(np.asarray(grads["w"]), np.full((2, 2), 64.0, np.float32))
    state = state.apply_gradients(grads=grads)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.full((2, 2), 0.9, np.float32))
    assert float(jaxscale.get_scale(state.opt_state)) == 64.0
