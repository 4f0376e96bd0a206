"""Half-precision models trained end to end with the low-precision transforms.

apex's O2 in Flax NNX: a float16 (or bfloat16) model, float32 master weights in an
``nnx.Optimizer``, loss scaling by the ``GradScaler`` facade; and the Optax transform
around a Linen-style parameter tree with 8-bit Adam state. Each trains, keeps every
dtype, and a skipped step leaves the masters where they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support import third_party

import jaxscale


class MLP(nnx.Module):
    def __init__(self, dtype, rngs):
        self.up = nnx.Linear(16, 256, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(256, 1, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def batch(step):
    key = jax.random.key(step)
    x = jax.random.normal(key, (128, 16))
    return x, jnp.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2]


def loss_fn(model, x, y):
    prediction = model(x.astype(model.up.kernel.dtype)).astype(jnp.float32)
    return jnp.mean((prediction - y) ** 2)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_half_precision_model_trains_with_float32_masters_and_the_facade(dtype):
    model = MLP(dtype, nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, jaxscale.master_weights(third_party.optimizer(optax.adam(3e-3))), wrt=nnx.Param
    )
    scaler = jaxscale.GradScaler(init_scale=2.0**10)

    @nnx.jit
    def train_step(model, optimizer, scaler, x, y):
        def scaled_loss(model):
            return scaler.scale(loss_fn(model, x, y))

        loss, grads = nnx.value_and_grad(scaled_loss)(model)
        with third_party.standard_promotion():  # optax adds float32 updates in float32
            scaler.step(optimizer, model, grads)
        scaler.update()
        return loss / scaler.get_scale()

    first = float(loss_fn(model, *batch(0)))
    for step in range(150):
        train_step(model, optimizer, scaler, *batch(step))
    assert float(loss_fn(model, *batch(0))) < 0.5 * first
    assert model.up.kernel[...].dtype == dtype

    params = nnx.state(model, nnx.Param)
    masters = jaxscale.master_params(optimizer.opt_state, params)
    kernel = masters["up"]["kernel"]
    assert kernel.dtype == jnp.float32
    # the model holds its masters rounded to nearest
    np.testing.assert_array_equal(kernel.astype(dtype), model.up.kernel[...])

    # an overflowing step is skipped: the model and its masters are unchanged
    before = jax.tree.map(np.asarray, nnx.state(optimizer))
    x, y = batch(0)
    train_step(model, optimizer, scaler, x.at[0, 0].set(jnp.inf), y)
    assert bool(scaler.found_inf())
    after = jax.tree.map(np.asarray, nnx.state(optimizer))
    model_after = jax.tree.leaves(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(a, b)
    assert all(leaf.dtype == dtype for leaf in model_after)


def test_a_bfloat16_parameter_tree_trains_with_int8_adam_state_and_grad_scaler():
    model = MLP(jnp.bfloat16, nnx.Rngs(1))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda v: v, nnx.to_pure_dict(params))
    inner = jaxscale.stochastic_rounding(
        jaxscale.low_precision_state(third_party.optimizer(optax.adamw(3e-3)), "int8"),
        key=jax.random.key(0),
    )
    tx = jaxscale.grad_scaler(inner, init_scale=2.0**8)
    opt_state = tx.init(params)

    def loss(params, x, y):
        state = nnx.State(params)
        return loss_fn(nnx.merge(graphdef, state), x, y)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jaxscale.scale(loss(p, x, y), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        with third_party.standard_promotion():
            return optax.apply_updates(params, updates), opt_state

    first = float(loss(params, *batch(0)))
    for index in range(150):
        params, opt_state = step(params, opt_state, *batch(index))
    assert float(loss(params, *batch(0))) < 0.5 * first
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    mu = opt_state.inner_state.inner_state.inner_state[0].mu
    assert isinstance(mu["up"]["kernel"], jaxscale.BlockQuantized)  # 16 x 256 = 4,096
    assert mu["up"]["kernel"].codes.dtype == jnp.uint8
    # 256 elements: kept as the optimizer made it (bfloat16, the parameter's), as torchao does
    assert mu["down"]["kernel"].dtype == jnp.bfloat16
