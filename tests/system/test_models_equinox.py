"""Equinox models, written as Equinox users write them, trained under autocast and a scaler.

An Equinox loop filters the model into arrays and the rest, vmaps a per-example
model over the batch, and passes the whole model to Optax as ``params`` (as
Equinox's own examples do); the scaler is the transform ``jaxscale.grad_scaler``.
"""

from __future__ import annotations

import collections

import equinox as eqx
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


@eqx.filter_custom_vjp
def damped_gradient(x, factor):
    """Identity forward; the backward pass multiplies the cotangent by ``factor``."""
    return x


@damped_gradient.def_fwd
def _damped_fwd(perturbed, x, factor):
    del perturbed
    return x, None


@damped_gradient.def_bwd
def _damped_bwd(residuals, grad, perturbed, x, factor):
    del residuals, perturbed, x
    return grad * factor


class Encoder(eqx.Module):
    """A per-example transformer encoder (one sequence in, one label out)."""

    embed: eqx.nn.Embedding
    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    dropout: eqx.nn.Dropout
    head: eqx.nn.Linear
    gradient_factor: float = eqx.field(static=True, default=0.5)

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
        self.attention = eqx.nn.MultiheadAttention(2, WIDTH, key=keys[1])
        self.norm1, self.norm2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 64, 1, activation=jax.nn.gelu, key=keys[2])
        self.dropout = eqx.nn.Dropout(0.1)
        self.head = eqx.nn.Linear(WIDTH, 2, key=keys[3])

    def __call__(self, tokens, *, key):
        valid = tokens > 0
        mask = valid[:, None] & valid[None, :]  # padding queries see nothing at all
        x = jax.vmap(self.embed)(tokens)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        x = damped_gradient(x, self.gradient_factor)
        x = x + self.dropout(jax.vmap(self.mlp)(jax.vmap(self.norm2)(x)), key=key)
        pooled = jnp.sum(jnp.where(valid[:, None], x, 0.0), 0) / jnp.sum(valid)
        return self.head(pooled)


def classification_loss(model, batch, key):
    tokens, labels = batch
    keys = jax.random.split(key, tokens.shape[0])
    logits = jax.vmap(model)(tokens, key=keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_step(optimizer, precision):
    @eqx.filter_jit
    def step(carry, batch):
        model, opt_state, key = carry
        key, dropout_key = jax.random.split(key)

        def scaled_loss(model):
            if precision is None:
                loss = classification_loss(model, batch, dropout_key)
                return loss, loss
            loss = jaxscale.autocast(classification_loss, dtype=precision)(
                model, batch, dropout_key
            )
            return jaxscale.scale(loss, opt_state), loss

        grads, loss = eqx.filter_grad(scaled_loss, has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)  # the whole model
        return (eqx.apply_updates(model, updates), opt_state, key), loss

    return step


def _batch(seed):
    tokens = padded_tokens(seed, 8, LENGTH, VOCAB)
    labels = (tokens[:, 0] > VOCAB // 2).astype(np.int32)  # the first token decides the label
    return jnp.asarray(tokens), jnp.asarray(labels)


BATCHES = [_batch(seed) for seed in range(15)]


def train(precision):
    model = Encoder(jax.random.key(0))
    optimizer = optax.adam(3e-3)
    if precision is not None:
        optimizer = jaxscale.grad_scaler(optimizer, init_scale=2.0**12, enabled=precision == F16)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_step(optimizer, precision)
    carry, losses = run_steps(step, (model, opt_state, jax.random.key(1)), BATCHES)
    return carry, losses, step


@pytest.mark.parametrize("precision", PRECISIONS)
def test_padded_encoder_with_a_custom_vjp_trains_like_float32(precision):
    _, reference, _ = train(None)
    (model, opt_state, key), losses, step = train(precision)
    assert_trains_like(reference, losses, rtol=0.1, label=np.dtype(precision).name)
    if precision == F16:
        assert int(jaxscale.skipped_steps(opt_state)) == 0
    jaxpr = eqx.filter_make_jaxpr(step)((model, opt_state, key), BATCHES[0])[0]
    assert_all_matmuls_in(precision, jaxpr)


def test_filter_custom_vjp_runs_its_rules_only_when_differentiated():
    x = jnp.asarray(np.linspace(-3, 3, 8), F32)

    def fn(x):
        return jnp.sum(damped_gradient(x * 4.0, 0.25) ** 2)

    # forward alone: the rules are never traced
    assert jaxscale.autocast(fn)(x).dtype == F32
    grad = jax.grad(jaxscale.autocast(fn))(x)
    np.testing.assert_allclose(grad, jax.grad(fn)(x), rtol=1e-2)
    np.testing.assert_allclose(grad, 0.25 * 2 * 16 * x, rtol=1e-2)  # the user's rule ran


def test_a_checkpointed_while_loop_differentiates_under_autocast():
    # Diffrax and Optimistix differentiate through Equinox's checkpointed while loop,
    # whose backward rule reads its perturbation flags as Python booleans
    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)) * 0.3, F32)
    x = jnp.ones((2, 4), F32)

    def solve(w, x):
        def body(carry):
            step, y = carry
            return step + 1, jnp.tanh(y @ w)

        final = eqx.internal.while_loop(
            lambda carry: carry[0] < 3, body, (0, x), max_steps=5, kind="checkpointed"
        )
        return jnp.sum(final[1])

    grad = jax.grad(jaxscale.autocast(solve))(w, x)
    assert grad.dtype == F32
    np.testing.assert_allclose(grad, jax.grad(solve)(w, x), rtol=2e-2, atol=2e-2)


class ConvNet(eqx.Module):
    """A per-example CNN with ``eqx.nn.BatchNorm``: its running statistics live in an
    ``eqx.nn.State`` threaded through the call, synchronised over the vmapped batch
    axis by name, as Equinox's stateful-layer example writes it."""

    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        conv_key, head_key = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 8, 3, padding=1, key=conv_key)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(8, 4, key=head_key)

    def __call__(self, image, state):
        h, state = self.norm(self.conv(image), state)
        return self.head(jax.nn.relu(h).mean(axis=(1, 2))), state


def image_loss(model, state, images, labels):
    per_example = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    logits, state = per_example(images, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state


IMAGES = jnp.asarray(np.random.default_rng(5).normal(size=(16, 3, 8, 8)), F32)
IMAGE_LABELS = jnp.asarray(np.arange(16) % 4, jnp.int32)


def train_conv_net(precision, steps=25):
    model, state = eqx.nn.make_with_state(ConvNet)(jax.random.key(0))
    optimizer = optax.adam(1e-2)
    loss_fn = image_loss
    if precision is not None:
        optimizer = jaxscale.grad_scaler(optimizer, init_scale=2.0**12, enabled=precision == F16)
        loss_fn = jaxscale.autocast(image_loss, dtype=precision)

    @eqx.filter_jit
    def step(carry, batch):
        model, state, opt_state = carry

        def scaled_loss(model):
            loss, new_state = loss_fn(model, state, *batch)
            scaled = loss if precision is None else jaxscale.scale(loss, opt_state)
            return scaled, (loss, new_state)

        grads, (loss, state) = eqx.filter_grad(scaled_loss, has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return (eqx.apply_updates(model, updates), state, opt_state), loss

    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    (model, state, opt_state), losses = run_steps(
        step, (model, state, opt_state), [(IMAGES, IMAGE_LABELS)] * steps
    )
    return model, state, opt_state, losses


@pytest.mark.parametrize("precision", PRECISIONS)
def test_batchnorm_state_threads_through_autocast_and_the_scaler(precision):
    *_, reference = train_conv_net(None)
    model, state, opt_state, losses = train_conv_net(precision)
    assert_trains_like(reference, losses, rtol=0.05, label=np.dtype(precision).name)
    if precision == F16:
        assert int(jaxscale.skipped_steps(opt_state)) == 0
    # the running statistics come back in the model's float32, and moved
    _, fresh = eqx.nn.make_with_state(ConvNet)(jax.random.key(0))
    statistics = [
        leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    assert [leaf.dtype for leaf in statistics] == [F32, F32]
    initial = [leaf for leaf in jax.tree.leaves(fresh) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    assert not np.allclose(np.asarray(statistics[0]), np.asarray(initial[0]))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    autocast_loss = jaxscale.autocast(image_loss, dtype=precision)

    def loss_of_params(params):
        return autocast_loss(eqx.combine(params, static), fresh, IMAGES, IMAGE_LABELS)[0]

    jaxpr = jax.make_jaxpr(jax.grad(loss_of_params))(params)
    assert_all_matmuls_in(precision, jaxpr)


@pytest.mark.parametrize("precision", [F16, BF16], ids=["float16", "bfloat16"])
def test_a_model_autocast_per_example_and_vmapped_casts_as_the_vmapped_model(precision):
    # jax.vmap(jaxscale.autocast(model)): autocast traces one example, where each
    # layer's weight @ x and its bias have one shape; they are still a linear layer's
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 8))
    per_example = jax.vmap(jaxscale.autocast(mlp, dtype=precision))
    whole = jaxscale.autocast(jax.vmap(mlp), dtype=precision)
    assert per_example(x).dtype == whole(x).dtype == precision
    half = np.dtype(precision).name
    additions = collections.Counter(
        tuple(str(v.aval.dtype) for v in e.invars)
        for e in equations(jax.make_jaxpr(per_example)(x))
        if e.primitive.name == "add"
    )
    # the three biases, added in the half dtype (on the CPU, and inside the float32
    # derivative's custom_jvp elsewhere), so that vmap's sums of their gradients are
    # float32 wherever JAX or the platform asks for it
    assert additions == {(half, half): 6}, additions
    params, static = eqx.partition(mlp, eqx.is_array)

    def loss(params):
        model = jaxscale.autocast(eqx.combine(params, static), dtype=precision)
        return jnp.sum(jax.vmap(model)(x).astype(F32))

    with jax.allow_f16_reductions(False):
        jax.jit(jax.grad(loss))(params)
    report = jaxscale.lowering_report(jax.grad(loss), params)
    assert set(report.sum_dtypes) == {"f32"}, report.sum_dtypes
    np.testing.assert_allclose(
        np.asarray(per_example(x), F32), np.asarray(whole(x), F32), rtol=2**-8, atol=2**-8
    )


class TokenwiseMLP(eqx.Module):
    """One sequence's tokens through an MLP, vmapped inside the model (as Equinox's
    attention applies its projections): a bias broadcast over the tokens here, and
    over the batch by a vmap outside."""

    mlp: eqx.nn.MLP

    def __call__(self, tokens):
        return jax.vmap(self.mlp)(tokens)


PER_EXAMPLE_MODELS = {
    "an MLP on one example": (lambda key: eqx.nn.MLP(8, 4, 16, 2, key=key), (64, 8)),
    "an MLP on each token of one sequence": (
        lambda key: TokenwiseMLP(eqx.nn.MLP(8, 4, 16, 2, key=key)),
        (16, 5, 8),
    ),
}


@pytest.mark.parametrize("precision", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(PER_EXAMPLE_MODELS))
def test_bias_gradients_of_a_model_autocast_per_example_are_summed_over_the_batch_in_float32(
    name, precision
):
    # vmap adds the batch axis after autocast: a bias, broadcast over one example's
    # product or not at all when traced, is broadcast over the batch by vmap, and its
    # gradient is vmap's sum over the batch. On an accelerator that sum is float32, as
    # with autocast outside the vmap and as PyTorch's; on the CPU it is the half
    # dtype's in both (README).
    make, shape = PER_EXAMPLE_MODELS[name]
    model = make(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), shape)
    params, static = eqx.partition(model, eqx.is_array)
    half = {F16: "f16", BF16: "bf16"}[precision]

    def loss_of(batched_model):
        def loss(params):
            model = eqx.combine(params, static)
            return jnp.sum(batched_model(model)(x).astype(F32) ** 2)

        return jax.grad(loss)

    per_example = loss_of(lambda m: jax.vmap(jaxscale.autocast(m, dtype=precision)))
    whole = loss_of(lambda m: jaxscale.autocast(jax.vmap(m), dtype=precision))
    reports = {}
    for grads in (per_example, whole):
        cuda = jaxscale.lowering_report(grads, params, platform="cuda")
        cpu = jaxscale.lowering_report(grads, params, platform="cpu")
        reports[grads] = cuda.sum_dtypes
        assert set(cuda.sum_dtypes) == {"f32"}, cuda.sum_dtypes  # the three biases'
        assert cuda.data_conditionals == 0  # the platform's choice is folded away
        assert set(cpu.sum_dtypes) == {half}, cpu.sum_dtypes
    assert reports[per_example] == reports[whole]
    linears = [_linears(model), _linears(per_example(params)), _linears(whole(params))]
    assert len(linears[0]) == 3
    for layer, a, b in zip(*linears, strict=True):
        assert a.bias.dtype == b.bias.dtype == layer.bias.dtype == F32
        scale = float(jnp.max(jnp.abs(b.bias)))
        np.testing.assert_allclose(a.bias, b.bias, rtol=2**-6, atol=2**-6 * scale)


def _linears(tree):
    is_linear = lambda node: isinstance(node, eqx.nn.Linear)  # noqa: E731
    return [node for node in jax.tree.leaves(tree, is_leaf=is_linear) if is_linear(node)]


class SpectralCritic(eqx.Module):
    """A GAN critic held to Lipschitz 1 by ``eqx.nn.SpectralNorm``: each layer's power
    iteration keeps its vectors in an ``eqx.nn.State``, updated on every call."""

    layers: list

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        sizes = [(6, 32), (32, 32), (32, 1)]
        self.layers = [
            eqx.nn.SpectralNorm(eqx.nn.Linear(a, b, key=k), "weight", key=k)
            for (a, b), k in zip(sizes, keys, strict=True)
        ]

    def __call__(self, x, state):
        for layer in self.layers[:-1]:
            x, state = layer(x, state)
            x = jax.nn.leaky_relu(x)
        return self.layers[-1](x, state)


def critic_loss(critic, state, x, y):
    per_example = jax.vmap(critic, in_axes=(0, None), out_axes=(0, None))
    scores, state = per_example(x, state)
    return jnp.mean((scores[:, 0] - y) ** 2), state


def test_spectral_norm_state_keeps_its_dtype_through_autocast_steps_scanned():
    # The power iteration's vectors are matmul results (float16 under autocast). State
    # is updated as PyTorch updates a buffer, in place: it comes back float32, as
    # Equinox's State.set requires, so a lax.scan over steps keeps its carry's type.
    critic, state = eqx.nn.make_with_state(SpectralCritic)(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(16, 6)), F32)
    y = jnp.tanh(x[:, 0])
    loss_fn = jaxscale.autocast(critic_loss)
    _, once = loss_fn(critic, state, x, y)
    assert [leaf.dtype for leaf in jax.tree.leaves(once)] == [F32] * 6
    params, static = eqx.partition(critic, eqx.is_inexact_array)
    optimizer = jaxscale.grad_scaler(optax.adam(3e-3), init_scale=2.0**10)

    def step(carry, _):
        params, state, opt_state = carry

        def scaled(params):
            loss, new_state = loss_fn(eqx.combine(params, static), state, x, y)
            return jaxscale.scale(loss, opt_state), (loss, new_state)

        grads, (loss, state) = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), state, opt_state), loss

    carry = (params, state, optimizer.init(params))
    (params, state, opt_state), losses = jax.jit(
        lambda carry: jax.lax.scan(step, carry, length=40)
    )(carry)
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(state))
    assert int(jaxscale.skipped_steps(opt_state)) == 0
    assert float(losses[-1]) < 0.5 * float(losses[0])
    # the state moved: each layer's vectors are another power-iteration step on
    u, v = jax.tree.leaves(state)[:2]
    u0, v0 = jax.tree.leaves(eqx.nn.make_with_state(SpectralCritic)(jax.random.key(0))[1])[:2]
    assert not np.allclose(u, u0)
    assert not np.allclose(v, v0)
