"""Flax Linen models, written as Linen users write them, trained under autocast and a scaler.

A Linen loop keeps its parameters in a ``TrainState`` and its optimizer is Optax's,
so the scaler is the transform ``jaxscale.grad_scaler``; autocast wraps the loss
that calls ``model.apply``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from support.model_training import (
    PRECISIONS,
    assert_all_matmuls_in,
    assert_trains_like,
    padded_tokens,
    run_steps,
)

import jaxscale

pytestmark = pytest.mark.usefixtures("under_standard_promotion")

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
VOCAB, LENGTH, WIDTH = 20, 8, 32


class EncoderDecoder(nn.Module):
    """A translation-style model: padded source, padded target, self- and cross-attention."""

    @nn.compact
    def __call__(self, source, target, *, train: bool):
        embed = nn.Embed(VOCAB, WIDTH)
        source_mask = nn.make_attention_mask(source > 0, source > 0)
        encoded = embed(source)
        normed = nn.LayerNorm()(encoded)
        encoded = encoded + nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1)(
            normed, normed, mask=source_mask, deterministic=not train
        )
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(target > 0, target > 0), nn.make_causal_mask(target)
        )
        cross_mask = nn.make_attention_mask(target > 0, source > 0)
        x = embed(target)
        normed = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(normed, normed, mask=decoder_mask)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(
            nn.LayerNorm()(x), encoded, mask=cross_mask
        )
        x = x + nn.Dropout(0.1, deterministic=not train)(nn.Dense(WIDTH)(nn.relu(nn.Dense(64)(x))))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


MODEL = EncoderDecoder()


def seq2seq_loss(params, batch, dropout_key):
    source, target = batch
    logits = MODEL.apply(
        {"params": params}, source, target[:, :-1], train=True, rngs={"dropout": dropout_key}
    )
    weights = (target[:, 1:] > 0).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, target[:, 1:])
    return jnp.sum(losses * weights) / jnp.sum(weights)


def make_step(loss_fn, precision):
    def step(state, batch):
        dropout_key = jax.random.fold_in(jax.random.key(1), state.step)

        def scaled_loss(params):
            if precision is None:
                loss = loss_fn(params, batch, dropout_key)
                return loss, loss
            loss = jaxscale.autocast(loss_fn, dtype=precision)(params, batch, dropout_key)
            return jaxscale.scale(loss, state.opt_state), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def new_state(params, precision, lr=3e-3):
    tx = optax.adam(lr)
    if precision is not None:
        tx = jaxscale.grad_scaler(tx, init_scale=2.0**12, enabled=precision == F16)
    return train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)


def _seq2seq_batch(seed):
    return (
        jnp.asarray(padded_tokens(seed, 4, LENGTH, VOCAB)),
        jnp.asarray(padded_tokens(seed + 100, 4, LENGTH + 1, VOCAB)),
    )


SEQ2SEQ = [_seq2seq_batch(seed) for seed in range(12)]


# Initialised when a test first asks, not when the module is collected: collecting it
# (in every test process, whichever tests it runs) then costs no compilation.
@functools.cache
def encoder_decoder_params():
    return MODEL.init(jax.random.key(0), *SEQ2SEQ[0], train=False)["params"]


@functools.cache
def _encoder_decoder_float32_losses():
    params = encoder_decoder_params()
    return run_steps(jax.jit(make_step(seq2seq_loss, None)), new_state(params, None), SEQ2SEQ)[1]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_encoder_decoder_with_padded_cross_attention_trains_like_float32(precision):
    params = encoder_decoder_params()
    state, losses = run_steps(
        jax.jit(make_step(seq2seq_loss, precision)), new_state(params, precision), SEQ2SEQ
    )
    assert_trains_like(
        _encoder_decoder_float32_losses(), losses, rtol=0.05, label=np.dtype(precision).name
    )
    if precision == F16:
        assert int(jaxscale.skipped_steps(state.opt_state)) == 0
    jaxpr = jax.make_jaxpr(make_step(seq2seq_loss, precision))(
        new_state(params, precision), SEQ2SEQ[0]
    )
    assert_all_matmuls_in(precision, jaxpr)


class ScannedResidualStack(nn.Module):
    """Layers stacked with nn.scan, each rematerialised with nn.remat."""

    @nn.compact
    def __call__(self, x):
        class Layer(nn.Module):
            @nn.compact
            def __call__(self, carry, _):
                return carry + jnp.tanh(nn.Dense(WIDTH)(carry)), None

        stack = nn.scan(
            nn.remat(Layer),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        x, _ = stack()(nn.Dense(WIDTH)(x), None)
        return nn.Dense(1)(x)


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def test_scan_over_remat_layers_trains_in_float16():
    model = ScannedResidualStack()
    data = [
        (jnp.asarray(x, F32), jnp.asarray(np.sin(x.sum(-1, keepdims=True)), F32))
        for x in (np.random.default_rng(seed).normal(size=(16, 4)) for seed in range(12))
    ]

    def loss_fn(params, batch, _):
        x, y = batch
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    params = model.init(jax.random.key(0), data[0][0])["params"]
    _, reference = run_steps(jax.jit(make_step(loss_fn, None)), new_state(params, None, 1e-2), data)
    state, losses = run_steps(jax.jit(make_step(loss_fn, F16)), new_state(params, F16, 1e-2), data)
    assert_trains_like(reference, losses, rtol=0.1, label="float16")
    assert_all_matmuls_in(F16, jax.make_jaxpr(make_step(loss_fn, F16))(state, data[0]))


def test_batchnorm_statistics_come_back_through_mutable_collections():
    model = BatchNormNet()
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(8, 8, 8, 1)), F32)
    variables = model.init(jax.random.key(0), images, train=False)

    def forward(variables, images):
        return model.apply(variables, images, train=True, mutable=["batch_stats"])

    logits, updates = jax.jit(jaxscale.autocast(forward))(variables, images)
    ref_logits, ref_updates = forward(variables, images)
    assert logits.dtype == F16
    stats = updates["batch_stats"]["BatchNorm_0"]
    assert stats["mean"].dtype == F32  # as the module keeps them
    np.testing.assert_allclose(
        stats["mean"], ref_updates["batch_stats"]["BatchNorm_0"]["mean"], atol=2e-3
    )
    np.testing.assert_allclose(np.asarray(logits, np.float32), ref_logits, rtol=0.05, atol=0.05)


def test_autocast_inside_a_linen_module_raises_naming_the_remedy():
    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jaxscale.autocast(nn.Dense(4))(x)

    with pytest.raises(RuntimeError) as error:
        Inner().init(jax.random.key(0), jnp.ones((2, 3)))
    message = str(error.value)
    assert "jaxscale.autocast(Dense) was called inside a Flax Linen module method" in message
    assert "jaxscale.autocast(model.apply)(variables, x)" in message


def test_a_disabled_region_inside_a_linen_module_is_allowed():
    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jaxscale.autocast(nn.Dense(4), enabled=False)(x)

    model = Inner()
    variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
    out = jaxscale.autocast(model.apply)(variables, jnp.ones((2, 3)))
    assert out.dtype == F32


class SpectralCritic(nn.Module):
    """A GAN critic held to Lipschitz 1 by ``nn.SpectralNorm``: each layer's power
    iteration keeps ``u`` and its estimate ``sigma`` in the ``batch_stats`` collection."""

    @nn.compact
    def __call__(self, x, *, train: bool):
        for width in (32, 32):
            x = nn.leaky_relu(nn.SpectralNorm(nn.Dense(width))(x, update_stats=train))
        self.sow("intermediates", "features", x)
        return nn.SpectralNorm(nn.Dense(1))(x, update_stats=train)


def test_spectral_norm_statistics_keep_their_dtype_so_a_scanned_loop_keeps_its_carry():
    # sigma is a matmul's result, float16 under autocast. PyTorch updates a buffer in
    # place, in its own dtype; here the updated collection comes back float32 too, so
    # the statistics neither change dtype after a step nor break a lax.scan's carry.
    # What the call sows is its own result, in float16.
    model = SpectralCritic()
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(16, 6)), F32)
    y = jnp.tanh(x[:, 0])
    variables = model.init(jax.random.key(0), x, train=False)

    def loss_fn(params, stats):
        scores, updates = model.apply(
            {"params": params, "batch_stats": stats},
            x,
            train=True,
            mutable=["batch_stats", "intermediates"],
        )
        return jnp.mean((scores[:, 0] - y) ** 2), updates

    autocast_loss = jaxscale.autocast(loss_fn)
    _, updates = autocast_loss(variables["params"], variables["batch_stats"])
    _, reference = loss_fn(variables["params"], variables["batch_stats"])
    assert [leaf.dtype for leaf in jax.tree.leaves(updates["batch_stats"])] == [F32] * 6
    assert updates["intermediates"]["features"][0].dtype == F16
    sigmas = {
        (layer, key): value
        for layer, values in updates["batch_stats"].items()
        for key, value in values.items()
        if key.endswith("/sigma")
    }
    assert len(sigmas) == 3
    for (layer, key), got in sigmas.items():
        np.testing.assert_allclose(got, reference["batch_stats"][layer][key], rtol=1e-2)

    tx = jaxscale.grad_scaler(optax.adam(3e-3), init_scale=2.0**10)

    def step(carry, _):
        params, stats, opt_state = carry

        def scaled(params):
            loss, updates = autocast_loss(params, stats)
            return jaxscale.scale(loss, opt_state), (loss, updates["batch_stats"])

        grads, (loss, stats) = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), stats, opt_state), loss

    carry = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    (_, stats, opt_state), losses = jax.jit(lambda c: jax.lax.scan(step, c, length=40))(carry)
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(stats))
    assert int(jaxscale.skipped_steps(opt_state)) == 0
    assert float(losses[-1]) < 0.5 * float(losses[0])
    assert not np.allclose(jax.tree.leaves(stats)[0], jax.tree.leaves(variables["batch_stats"])[0])
