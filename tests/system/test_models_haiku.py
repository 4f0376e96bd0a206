"""Haiku models, written as Haiku users write them, trained under autocast and a scaler.

A Haiku model is a function turned pure by ``hk.transform_with_state``; autocast
wraps the loss that calls its ``apply``, and the scaler is ``jaxscale.grad_scaler``.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.model_training import (
    PRECISIONS,
    assert_all_matmuls_in,
    assert_trains_like,
    equations,
    padded_tokens,
    run_steps,
)

import jaxscale

pytestmark = pytest.mark.usefixtures("under_standard_promotion")

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
VOCAB, LENGTH, WIDTH = 20, 8, 32


def language_model(tokens, is_training):
    """A decoder block with a padding + causal mask, and a BatchNorm'd convolution."""
    valid = tokens > 0
    mask = (valid[:, None, :, None] & valid[:, None, None, :]) & jnp.tril(
        jnp.ones((LENGTH, LENGTH), bool)
    )
    x = hk.Embed(VOCAB, WIDTH)(tokens)
    x = hk.Conv1D(WIDTH, 3)(x)
    x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(x, is_training)
    h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
    x = x + hk.MultiHeadAttention(
        num_heads=2, key_size=16, w_init=hk.initializers.VarianceScaling(1.0)
    )(h, h, h, mask=mask)
    if is_training:
        x = hk.dropout(hk.next_rng_key(), 0.1, x)
    x = x + hk.nets.MLP([64, WIDTH], activation=jax.nn.gelu)(x)
    return hk.Linear(VOCAB)(x)


MODEL = hk.transform_with_state(language_model)


def lm_loss(params, state, rng, tokens):
    logits, state = MODEL.apply(params, state, rng, tokens[:, :-1], is_training=True)
    weights = (tokens[:, 1:] > 0).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(losses * weights) / jnp.sum(weights), state


def make_step(optimizer, precision):
    def step(carry, tokens):
        params, state, opt_state, rng = carry
        rng, dropout_rng = jax.random.split(rng)

        def scaled_loss(params):
            if precision is None:
                loss, new_state = lm_loss(params, state, dropout_rng, tokens)
                return loss, (loss, new_state)
            loss, new_state = jaxscale.autocast(lm_loss, dtype=precision)(
                params, state, dropout_rng, tokens
            )
            return jaxscale.scale(loss, opt_state), (loss, new_state)

        grads, (loss, state) = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), state, opt_state, rng), loss

    return step


BATCHES = [jnp.asarray(padded_tokens(seed, 4, LENGTH + 1, VOCAB)) for seed in range(12)]


def train(precision):
    params, state = MODEL.init(jax.random.key(0), BATCHES[0][:, :-1], is_training=True)
    optimizer = optax.adam(3e-3)
    if precision is not None:
        optimizer = jaxscale.grad_scaler(optimizer, init_scale=2.0**12, enabled=precision == F16)
    carry = (params, state, optimizer.init(params), jax.random.key(1))
    step = make_step(optimizer, precision)
    carry, losses = run_steps(jax.jit(step), carry, BATCHES)
    return carry, losses, step


@pytest.mark.parametrize("precision", PRECISIONS)
def test_padded_attention_lm_with_batchnorm_trains_like_float32(precision):
    (_, ref_state, _, _), reference, _ = train(None)
    carry, losses, step = train(precision)
    assert_trains_like(reference, losses, rtol=0.05, label=np.dtype(precision).name)
    _, state, opt_state, _ = carry
    if precision == F16:
        assert int(jaxscale.skipped_steps(opt_state)) == 0
    # BatchNorm's moving averages come back in the dtype Haiku keeps them
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=0.1, atol=0.05)
    assert_all_matmuls_in(precision, jax.make_jaxpr(step)(carry, BATCHES[0]))


def test_autocast_inside_hk_transform_raises_naming_the_remedy():
    def forward(x):
        return jaxscale.autocast(hk.Linear(4))(x)

    with pytest.raises(RuntimeError) as error:
        hk.transform(forward).init(jax.random.key(0), jnp.ones((2, 3)))
    message = str(error.value)
    assert "jaxscale.autocast(Linear) was called inside hk.transform" in message
    assert "jaxscale.autocast(transformed.apply)(params, rng, x)" in message


DEPTH = 4


def stacked_residual_mlp(x):
    """Residual MLP blocks stacked by ``hk.experimental.layer_stack`` (one scan over
    parameters with a leading layer axis), each block's MLP under ``hk.remat``."""
    x = hk.Linear(WIDTH)(x)

    @hk.experimental.layer_stack(DEPTH)
    def block(h):
        r = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
        return h + hk.remat(hk.nets.MLP([2 * WIDTH, WIDTH], activation=jax.nn.gelu))(r)

    return hk.Linear(1)(block(x))[..., 0]


STACKED = hk.without_apply_rng(hk.transform(stacked_residual_mlp))
REGRESSION_X = jnp.linspace(-1.0, 1.0, 64 * 16, dtype=jnp.float32).reshape(64, 16)
REGRESSION_Y = jnp.sin(3.0 * REGRESSION_X.sum(-1))


def train_stacked(precision):
    params = STACKED.init(jax.random.key(0), REGRESSION_X)
    optimizer = optax.adam(3e-3)
    if precision is not None:
        optimizer = jaxscale.grad_scaler(optimizer, init_scale=2.0**10, enabled=precision == F16)

    def loss_fn(params):
        return jnp.mean(jnp.square(STACKED.apply(params, REGRESSION_X) - REGRESSION_Y))

    def step(carry, _):
        params, opt_state = carry
        if precision is None:
            loss, grads = jax.value_and_grad(loss_fn)(params)
        else:
            cast_loss = jaxscale.autocast(loss_fn, dtype=precision)
            grads, loss = jax.grad(
                lambda p: (jaxscale.scale(cast_loss(p), opt_state), cast_loss(p)), has_aux=True
            )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    carry = (params, optimizer.init(params))
    carry, losses = run_steps(jax.jit(step), carry, [None] * 30)
    return params, carry, losses, step


@pytest.mark.parametrize("precision", PRECISIONS)
def test_layer_stack_of_remat_blocks_trains_like_float32(precision):
    _, _, reference, _ = train_stacked(None)
    params, carry, losses, step = train_stacked(precision)
    assert_trains_like(reference, losses, rtol=0.05, label=np.dtype(precision).name)
    # the stacked parameters keep their leading layer axis and float32
    stacked = params["__layer_stack_no_per_layer/mlp/~/linear_0"]["w"]
    assert stacked.shape == (DEPTH, WIDTH, 2 * WIDTH)
    assert stacked.dtype == F32
    if precision == F16:
        assert int(jaxscale.skipped_steps(carry[1])) == 0
    jaxpr = jax.make_jaxpr(step)(carry, None)
    assert_all_matmuls_in(precision, jaxpr)
    primitives = {eqn.primitive.name for eqn in equations(jaxpr)}
    assert {"scan", "remat2"} <= primitives  # the layers' scan, each block's jax.checkpoint


def spectral_critic(x):
    """A GAN critic whose weights ``hk.SpectralNorm`` normalises: the power iteration
    keeps ``u0`` and its estimate ``sigma`` in Haiku's state (``hk.set_state``)."""
    for width in (32, 32, 1):
        w = hk.get_parameter(
            f"w{width}_{x.shape[-1]}", (x.shape[-1], width), init=hk.initializers.VarianceScaling()
        )
        x = x @ hk.SpectralNorm(name=f"spectral_{width}_{x.shape[-1]}")(w)
        if width > 1:
            x = jax.nn.leaky_relu(x)
    return x[:, 0]


def test_spectral_norm_state_keeps_its_dtype_so_a_scanned_loop_keeps_its_carry():
    # sigma is a matmul's result (float16 under autocast); set as state, it comes back
    # in its float32, as PyTorch updates a buffer in place, so the state fits a
    # lax.scan's carry over training steps
    model = hk.without_apply_rng(hk.transform_with_state(spectral_critic))
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(16, 6)), F32)
    y = jnp.tanh(x[:, 0])
    params, state = model.init(jax.random.key(0), x)

    def loss_fn(params, state):
        scores, state = model.apply(params, state, x)
        return jnp.mean((scores - y) ** 2), state

    autocast_loss = jaxscale.autocast(loss_fn)
    _, once = autocast_loss(params, state)
    _, reference = loss_fn(params, state)
    assert [leaf.dtype for leaf in jax.tree.leaves(once)] == [F32] * 6
    for name, values in once.items():
        np.testing.assert_allclose(values["sigma"], reference[name]["sigma"], rtol=1e-2)

    tx = jaxscale.grad_scaler(optax.adam(3e-3), init_scale=2.0**10)

    def step(carry, _):
        params, state, opt_state = carry

        def scaled(params):
            loss, new_state = autocast_loss(params, state)
            return jaxscale.scale(loss, opt_state), (loss, new_state)

        grads, (loss, state) = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), state, opt_state), loss

    carry = (params, state, tx.init(params))
    (_, trained, opt_state), losses = jax.jit(lambda c: jax.lax.scan(step, c, length=40))(carry)
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(trained))
    assert int(jaxscale.skipped_steps(opt_state)) == 0
    assert float(losses[-1]) < 0.5 * float(losses[0])
    assert not np.allclose(jax.tree.leaves(trained)[0], jax.tree.leaves(state)[0])
