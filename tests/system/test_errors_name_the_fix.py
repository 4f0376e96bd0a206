"""Mistakes a new user makes at the API's edge, each answered with the fix, and the
idiomatic Equinox step that works as written."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support import third_party

import jaxscale

PARAMS = {"w": jnp.ones(3)}


def test_an_optimizer_factory_passed_uncalled():
    with pytest.raises(TypeError, match=r"got the function adam: call it first, e\.g\."):
        jaxscale.grad_scaler(optax.adam)


def test_the_state_of_another_transform():
    tx = jaxscale.grad_scaler(optax.adam(1e-3))
    with pytest.raises(TypeError, match=r"was given a tuple, not the state its init returns"):
        tx.update(PARAMS, optax.adam(1e-3).init(PARAMS), PARAMS)


def test_a_state_built_for_other_parameters():
    tx = jaxscale.grad_scaler(third_party.optimizer(optax.adam(1e-3)))
    state = tx.init(PARAMS)
    other = {"v": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"built by init for parameters of another structure"):
        tx.update(other, state, other)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_dtype_where_the_function_goes(dtype):
    name = jnp.dtype(dtype).name
    expected = rf"got the dtype {name}: write jaxscale\.autocast\(fn, dtype=jnp\.{name}\)"
    with pytest.raises(TypeError, match=expected):
        jaxscale.autocast(dtype)


def test_a_string_where_the_function_goes():
    with pytest.raises(TypeError, match=r"got the string 'loss_fn': pass the function itself"):
        jaxscale.autocast("loss_fn")
    with pytest.raises(TypeError, match=r'jaxscale\.autocast\(fn, device_type="cpu"\)'):
        jaxscale.autocast("cpu")


def test_a_number_or_an_optimizer_given_to_gradscaler():
    with pytest.raises(TypeError, match=r"write GradScaler\(init_scale=65536\.0\)"):
        jaxscale.GradScaler(2.0**16)
    with pytest.raises(TypeError, match=r"GradScaler takes no optimizer: .*jaxscale\.grad_scaler"):
        jaxscale.GradScaler(optax.adam(1e-3))


def test_a_scaler_closed_over_by_an_nnx_jit_function():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    scaler = jaxscale.GradScaler()

    @nnx.jit
    def train_step(model, optimizer, x):
        grads = nnx.grad(lambda m: scaler.scale(jnp.sum(m(x))))(model)
        with third_party.standard_promotion():
            scaler.step(optimizer, model, grads)
        scaler.update()

    with pytest.raises(RuntimeError, match=r"train_step\(model, optimizer, scaler, x, y\)"):
        train_step(model, optimizer, jnp.ones((1, 2)))


def test_an_equinox_model_steps_whole():
    # Equinox's idiom: the model itself as the parameters, gradients from filter_grad
    # (None at the activation function); the step updates the arrays and keeps the rest
    model = eqx.nn.MLP(4, 1, 16, 2, key=jax.random.key(0))
    tx = third_party.optimizer(optax.adam(1e-2))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    scaler = jaxscale.GradScaler(init_scale=2.0**8)
    x = jax.random.normal(jax.random.key(1), (32, 4))
    y = jnp.sum(x, axis=1, keepdims=True)

    def loss(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    first = float(loss(model))
    for _ in range(20):
        grads = eqx.filter_grad(lambda m: scaler.scale(loss(m)))(model)
        model, opt_state = scaler.step(tx, grads, opt_state, model)
        scaler.update()
    assert isinstance(model, eqx.nn.MLP)
    assert model.activation is jax.nn.relu
    assert float(loss(model)) < 0.5 * first
