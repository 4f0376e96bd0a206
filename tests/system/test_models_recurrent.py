"""Recurrent models, each written in its framework's idiom, under autocast and a scaler.

An LSTM or GRU steps a cell through time inside a ``lax.scan`` (``nnx.RNN``,
``flax.linen.RNN``, ``hk.dynamic_unroll``, or a scan over an Equinox cell), and a
state-space layer runs a linear recurrence through ``lax.associative_scan``: every
matmul inside the loop must run in the autocast dtype, forward and backward, and the
model must train as it does in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.model_training import PRECISIONS, assert_all_matmuls_in, assert_trains_like

import jaxscale

pytestmark = pytest.mark.usefixtures("under_standard_promotion")

BATCH, TIME, FEATURES, HIDDEN = 4, 12, 8, 16
STEPS = 25
INIT_SCALE = 2.0**8
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(BATCH, TIME, FEATURES)), jnp.float32)
Y = 0.3 * jnp.cumsum(X[..., :1], axis=1)  # a running sum: needs the recurrence


def mse(prediction: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((prediction.astype(jnp.float32) - target) ** 2)


# -- the models: (initial parameters, loss(params, x, y)) ---------------------------------------


class NNXRecurrent(nnx.Module):
    """``zero_carry=True``: the RNN starts from zeros given to it and keeps no RNG stream
    of its own, so the model's state is its parameters (a pure function of them)."""

    def __init__(self, rngs: nnx.Rngs, zero_carry: bool = False):
        cell = nnx.LSTMCell(FEATURES, HIDDEN, rngs=rngs)
        self.rnn = nnx.RNN(cell, rngs=not zero_carry)
        self.head = nnx.Linear(HIDDEN, 1, rngs=rngs)
        self.zero_carry = zero_carry

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.zero_carry:
            return self.head(self.rnn(x))
        zeros = jnp.zeros((x.shape[0], HIDDEN), x.dtype)
        return self.head(self.rnn(x, initial_carry=(zeros, zeros)))


def nnx_lstm() -> tuple[Any, Callable[..., jax.Array]]:
    graphdef, params = nnx.split(NNXRecurrent(nnx.Rngs(0), zero_carry=True))

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return mse(nnx.merge(graphdef, params)(x), y)

    return params, loss


class LinenRecurrent(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.RNN(nn.GRUCell(HIDDEN))(x)
        h = nn.RNN(nn.OptimizedLSTMCell(HIDDEN))(h)
        return nn.Dense(1)(h)


def linen_gru_lstm() -> tuple[Any, Callable[..., jax.Array]]:
    model = LinenRecurrent()
    params = model.init(jax.random.key(0), X)

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return mse(model.apply(params, x), y)

    return params, loss


def _haiku_forward(x: jax.Array) -> jax.Array:
    core = hk.LSTM(HIDDEN)
    time_major = jnp.swapaxes(x, 0, 1)
    outputs, _ = hk.dynamic_unroll(core, time_major, core.initial_state(x.shape[0]))
    return hk.Linear(1)(jnp.swapaxes(outputs, 0, 1))


def haiku_lstm() -> tuple[Any, Callable[..., jax.Array]]:
    model = hk.without_apply_rng(hk.transform(_haiku_forward))
    params = model.init(jax.random.key(0), X)

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return mse(model.apply(params, x), y)

    return params, loss


class EquinoxRecurrent(eqx.Module):
    cell: eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        cell_key, head_key = jax.random.split(key)
        self.cell = eqx.nn.LSTMCell(FEATURES, HIDDEN, key=cell_key)
        self.head = eqx.nn.Linear(HIDDEN, 1, key=head_key)

    def __call__(self, xs: jax.Array) -> jax.Array:  # one sequence, (TIME, FEATURES)
        def step(state, x):
            state = self.cell(x, state)
            return state, self.head(state[0])

        start = (jnp.zeros(HIDDEN), jnp.zeros(HIDDEN))
        return jax.lax.scan(step, start, xs)[1]


def equinox_lstm() -> tuple[Any, Callable[..., jax.Array]]:
    params, static = eqx.partition(EquinoxRecurrent(jax.random.key(0)), eqx.is_array)

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        return mse(jax.vmap(model)(x), y)

    return params, loss


def state_space() -> tuple[Any, Callable[..., jax.Array]]:
    """A diagonal linear recurrence ``h[t] = a * h[t-1] + x[t] @ B``, read out by ``C``,
    computed in parallel over time by ``lax.associative_scan``."""
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "decay_logit": jnp.full((HIDDEN,), 2.0),
        "B": jax.random.normal(keys[0], (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "C": jax.random.normal(keys[1], (HIDDEN, 1)) / np.sqrt(HIDDEN),
    }

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        inputs = x @ params["B"]
        decay = jnp.broadcast_to(jax.nn.sigmoid(params["decay_logit"]), inputs.shape)

        def combine(earlier, later):
            return earlier[0] * later[0], later[0] * earlier[1] + later[1]

        _, hidden = jax.lax.associative_scan(combine, (decay, inputs), axis=1)
        return mse(hidden @ params["C"], y)

    return params, loss


MODELS = {
    "nnx.RNN(LSTMCell)": nnx_lstm,
    "linen RNN(GRUCell), RNN(OptimizedLSTMCell)": linen_gru_lstm,
    "haiku LSTM, dynamic_unroll": haiku_lstm,
    "equinox LSTMCell in lax.scan": equinox_lstm,
    "lax.associative_scan state space": state_space,
}


def train(params: Any, loss: Callable[..., jax.Array], dtype: Any | None) -> list[float]:
    """Adam for ``STEPS`` steps: in float32, or under autocast with ``grad_scaler``."""
    if dtype is None:
        tx = optax.adam(1e-2)
        objective = loss
    else:
        # a scale the recurrences' gradients do not overflow: no step is skipped, so
        # both runs take the same steps
        tx = jaxscale.grad_scaler(optax.adam(1e-2), init_scale=INIT_SCALE)
        objective = jaxscale.autocast(loss, dtype=dtype)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        def scaled(params):
            value = objective(params, X, Y)
            return (value if dtype is None else jaxscale.scale(value, opt_state)), value

        grads, value = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for _ in range(STEPS):
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
    if dtype is not None:
        assert int(jaxscale.skipped_steps(opt_state)) == 0
    return losses


@pytest.mark.parametrize("dtype", PRECISIONS)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_matmul_of_the_recurrence_runs_in_the_autocast_dtype(name, dtype):
    params, loss = MODELS[name]()
    autocast_loss = jaxscale.autocast(loss, dtype=dtype)
    assert_all_matmuls_in(dtype, jax.make_jaxpr(autocast_loss)(params, X, Y))
    grads = jax.jit(jax.grad(autocast_loss))(params, X, Y)
    # the backward matmuls too; the gradients come back in the parameters' dtype
    assert_all_matmuls_in(dtype, jax.make_jaxpr(jax.grad(autocast_loss))(params, X, Y))
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("dtype", PRECISIONS)
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_like_float32(name, dtype):
    params, loss = MODELS[name]()
    reference = train(params, loss, None)
    candidate = train(params, loss, dtype)
    rtol = 0.05 if dtype == jnp.float16 else 0.15
    assert_trains_like(reference, candidate, rtol=rtol, label=f"{name} {jnp.dtype(dtype).name}")


def test_nnx_rnn_with_its_rng_stream_trains_under_the_facade():
    # As the README writes a step: nnx.jit, nnx.grad, nnx.Optimizer and GradScaler. The
    # RNN's own RNG stream (for a random initial carry) is state the call mutates.
    def loss_fn(model, x, y):
        return mse(model(x), y)

    def make():
        model = NNXRecurrent(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def reference_step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model, X, Y)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def scaled_step(model, optimizer, scaler):
        def scaled_loss(model):
            loss = jaxscale.autocast(loss_fn)(model, X, Y)
            return scaler.scale(loss), loss

        grads, loss = nnx.grad(scaled_loss, has_aux=True)(model)
        scaler.step(optimizer, model, grads)
        scaler.update()
        return loss

    model, optimizer = make()
    reference = [float(reference_step(model, optimizer)) for _ in range(STEPS)]
    model, optimizer = make()
    scaler = jaxscale.GradScaler(init_scale=INIT_SCALE)
    candidate = [float(scaled_step(model, optimizer, scaler)) for _ in range(STEPS)]
    assert_trains_like(reference, candidate, rtol=0.05, label="nnx.RNN under the facade")
    assert scaler.get_scale() == INIT_SCALE  # nothing overflowed
