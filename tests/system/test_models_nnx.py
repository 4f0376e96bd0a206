"""Flax NNX models, written as NNX users write them, trained under autocast and a scaler.

Each model is trained three ways on the same data: float32; float16 autocast with
``jaxscale.GradScaler``; bfloat16 autocast. The only change to the float32 loop is
the two AMP lines. Every matmul and convolution must run in the autocast dtype,
forward and backward, and the loss curves must follow float32's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from support import machine
from support.model_training import (
    PRECISIONS,
    assert_all_matmuls_in,
    assert_trains_like,
    equations,
    padded_tokens,
)
from support.sharded_mlp import sharded_mlp

import jaxscale

pytestmark = pytest.mark.usefixtures("under_standard_promotion")

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
VOCAB, LENGTH, WIDTH = 24, 8, 32


class Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.attention = nnx.MultiHeadAttention(
            num_heads=2,
            in_features=width,
            dropout_rate=0.1,
            decode=False,
            deterministic=False,
            rngs=rngs,
        )
        self.norm1, self.norm2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
        self.up, self.down = (
            nnx.Linear(width, 2 * width, rngs=rngs),
            nnx.Linear(2 * width, width, rngs=rngs),
        )
        self.dropout = nnx.Dropout(0.1)

    def __call__(self, x, mask, rngs):
        x = x + self.attention(self.norm1(x), mask=mask, rngs=rngs)
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))), rngs=rngs)


class TinyLM(nnx.Module):
    """Decoder-only LM with padding: padded query rows are fully masked."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(WIDTH, rngs) for _ in range(2)])
        self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens, rngs):
        mask = nnx.combine_masks(
            nnx.make_attention_mask(tokens > 0, tokens > 0), nnx.make_causal_mask(tokens)
        )
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask, rngs)
        return self.out(x)


def lm_loss(model, tokens, rngs):
    logits = model(tokens[:, :-1], rngs)
    targets, weights = tokens[:, 1:], (tokens[:, 1:] > 0).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * weights) / jnp.sum(weights)


def make_step(loss_fn, precision):
    """The NNX loop of a float32 user, plus the two AMP lines when ``precision`` is set."""

    def step(model, optimizer, scaler, batch, rngs):
        def scaled_loss(model, batch, rngs):
            if precision is None:
                loss = loss_fn(model, batch, rngs)
                return loss, loss
            loss = jaxscale.autocast(loss_fn, dtype=precision)(model, batch, rngs)
            return scaler.scale(loss), loss

        grads, loss = nnx.grad(scaled_loss, has_aux=True)(model, batch, rngs)
        scaler.step(optimizer, model, grads)
        scaler.update()
        return loss

    return step


def train(model_fn, loss_fn, precision, batches, lr=3e-3):
    model = model_fn(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(enabled=precision == F16, init_scale=2.0**12)
    rngs = nnx.Rngs(dropout=1)
    step = nnx.jit(make_step(loss_fn, precision))
    losses = [float(step(model, optimizer, scaler, batch, rngs)) for batch in batches]
    return losses, (model, optimizer, scaler, rngs)


def traced_step(model_fn, loss_fn, precision, batch):
    """The jaxpr of one training step (forward, backward, update), NNX state made explicit."""
    objects = (model_fn(nnx.Rngs(0)), None, None, nnx.Rngs(dropout=1))
    model = objects[0]
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(enabled=precision == F16)
    graphdef, state = nnx.split((model, optimizer, scaler, objects[3]))

    def pure(state, batch):
        model, optimizer, scaler, rngs = nnx.merge(graphdef, state)
        loss = make_step(loss_fn, precision)(model, optimizer, scaler, batch, rngs)
        return loss, nnx.state((model, optimizer, scaler, rngs))

    return jax.make_jaxpr(pure)(state, batch)


LM_BATCHES = [jnp.asarray(padded_tokens(seed, 4, LENGTH + 1, VOCAB)) for seed in range(12)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_padded_transformer_lm_trains_like_float32(precision):
    reference, _ = train(TinyLM, lm_loss, None, LM_BATCHES)
    losses, (_, _, scaler, _) = train(TinyLM, lm_loss, precision, LM_BATCHES)
    assert_trains_like(reference, losses, rtol=0.05, label=np.dtype(precision).name)
    if precision == F16:
        assert int(scaler.skipped_steps()) == 0  # a fully masked padding row is no NaN
    assert_all_matmuls_in(precision, traced_step(TinyLM, lm_loss, precision, LM_BATCHES[0]))


def test_a_fully_masked_attention_row_is_uniform_not_nan():
    # the padding query row sees no key: PyTorch's masked_fill(finfo(scores.dtype).min)
    # gives uniform weights there, and so must the float32 mask constant narrowed to float16
    attention = nnx.MultiHeadAttention(
        num_heads=1, in_features=8, decode=False, deterministic=True, rngs=nnx.Rngs(0)
    )
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 8)), F32)
    valid = jnp.array([[True, True, False]])
    mask = nnx.make_attention_mask(valid, valid)
    for dtype in (F16, BF16):
        out = jaxscale.autocast(attention, dtype=dtype)(x, mask=mask)
        assert np.all(np.isfinite(np.asarray(out, np.float32))), dtype
        np.testing.assert_allclose(
            np.asarray(out, np.float32), attention(x, mask=mask), rtol=0.05, atol=0.05
        )


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(checkpoint_name(self.linear(x), "hidden")) + x


class ScannedMLP(nnx.Module):
    """Layers created with nnx.vmap and run with nnx.scan, each rematerialised with a
    policy that saves only the named hidden activation."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(4, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):
            return Layer(rngs)

        self.layers = make_layers(rngs)
        self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        policy = jax.checkpoint_policies.save_only_these_names("hidden")

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat(policy=policy)
        def run(x, layer):
            return layer(x)

        return self.out(run(self.inp(x), self.layers))


def regression_loss(model, batch, rngs):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


REGRESSION = [
    (jnp.asarray(x, F32), jnp.asarray(np.sin(x.sum(-1, keepdims=True)), F32))
    for x in (np.random.default_rng(seed).normal(size=(16, 4)) for seed in range(12))
]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_scan_over_layers_with_a_named_remat_policy(precision):
    reference, _ = train(ScannedMLP, regression_loss, None, REGRESSION, lr=1e-2)
    losses, _ = train(ScannedMLP, regression_loss, precision, REGRESSION, lr=1e-2)
    assert_trains_like(reference, losses, rtol=0.1, label=np.dtype(precision).name)
    jaxpr = traced_step(ScannedMLP, regression_loss, precision, REGRESSION[0])
    assert_all_matmuls_in(precision, jaxpr)
    # the saved residual is the float16 activation: checkpoint_name keeps its dtype
    named = [e for e in equations(jaxpr) if e.primitive.name == "name"]
    assert named
    assert {str(e.outvars[0].aval.dtype) for e in named} == {np.dtype(precision).name}


class ConvNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
        self.dropout = nnx.Dropout(0.1)
        self.head = nnx.Linear(8 * 4 * 4, 3, rngs=rngs)

    def __call__(self, x, rngs):
        x = nnx.avg_pool(nnx.relu(self.norm(self.conv1(x))), (2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
        return self.head(self.dropout(x.reshape(x.shape[0], -1), rngs=rngs))


def classification_loss(model, batch, rngs):
    images, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(images, rngs), labels).mean()


def _images(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, 16)
    images = rng.normal(size=(16, 16, 16, 1)) * 0.5 + labels[:, None, None, None]
    return jnp.asarray(images, F32), jnp.asarray(labels, jnp.int32)


IMAGES = [_images(seed) for seed in range(12)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_batchnorm_cnn_with_dropout_trains_and_keeps_its_statistics(precision):
    reference, (ref_model, *_) = train(ConvNet, classification_loss, None, IMAGES)
    losses, (model, *_) = train(ConvNet, classification_loss, precision, IMAGES)
    assert_trains_like(reference, losses, rtol=0.1, label=np.dtype(precision).name)
    assert model.norm.mean[...].dtype == F32  # the module's own dtype
    np.testing.assert_allclose(model.norm.mean[...], ref_model.norm.mean[...], atol=0.05)
    assert_all_matmuls_in(
        precision, traced_step(ConvNet, classification_loss, precision, IMAGES[0])
    )


class ResidualBlock(nnx.Module):
    """A diffusion UNet's block: GroupNorm, SiLU, convolutions, and the time embedding
    added over every pixel."""

    def __init__(self, channels_in: int, channels: int, time_width: int, rngs: nnx.Rngs):
        self.norm1 = nnx.GroupNorm(channels_in, num_groups=4, rngs=rngs)
        self.conv1 = nnx.Conv(channels_in, channels, (3, 3), rngs=rngs)
        self.time = nnx.Linear(time_width, channels, rngs=rngs)
        self.norm2 = nnx.GroupNorm(channels, num_groups=4, rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)
        self.skip = nnx.Conv(channels_in, channels, (1, 1), rngs=rngs)

    def __call__(self, x, time):
        h = self.conv1(nnx.silu(self.norm1(x)))
        h = h + self.time(nnx.silu(time))[:, None, None, :]
        return self.conv2(nnx.silu(self.norm2(h))) + self.skip(x)


class TinyUNet(nnx.Module):
    """Down by a strided convolution, self-attention at the lowest resolution, up by a
    transposed convolution and a nearest-neighbour resize, a skip connection across."""

    def __init__(self, rngs: nnx.Rngs):
        self.time = nnx.Linear(16, 16, rngs=rngs)
        self.inp = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.down_block = ResidualBlock(8, 8, 16, rngs)
        self.down = nnx.Conv(8, 16, (3, 3), strides=(2, 2), rngs=rngs)
        self.middle = ResidualBlock(16, 16, 16, rngs)
        self.attention_norm = nnx.GroupNorm(16, num_groups=4, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=16, decode=False, rngs=rngs
        )
        self.up = nnx.ConvTranspose(16, 8, (2, 2), strides=(2, 2), rngs=rngs)
        self.up_block = ResidualBlock(16, 8, 16, rngs)
        self.out = nnx.Conv(8, 1, (3, 3), rngs=rngs)

    def __call__(self, x, t):
        frequencies = jnp.exp(-np.log(1000.0) * jnp.arange(8) / 8)
        angles = t[:, None] * frequencies
        time = self.time(jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1))
        skip = self.down_block(self.inp(x), time)
        h = self.middle(self.down(skip), time)
        batch, height, width, channels = h.shape
        tokens = self.attention_norm(h).reshape(batch, height * width, channels)
        h = h + self.attention(tokens).reshape(h.shape)
        up = self.up(h) + jax.image.resize(h, (*skip.shape[:3], channels), "nearest")[..., :8]
        return self.out(self.up_block(jnp.concatenate([up, skip], -1), time))


def denoising_loss(model, batch, rngs):
    clean, t, noise = batch
    keep = jnp.cos(t / 100 * np.pi / 2)[:, None, None, None]
    noisy = keep * clean + jnp.sqrt(1 - keep**2) * noise
    return jnp.mean((model(noisy, t) - noise) ** 2)


def _noisy_squares(seed):
    rng = np.random.default_rng(seed)
    clean = np.zeros((8, 8, 8, 1))
    clean[:, 2:6, 2:6] = rng.uniform(0.5, 1.5, (8, 1, 1, 1))
    t, noise = rng.uniform(0, 100, 8), rng.normal(size=clean.shape)
    return tuple(jnp.asarray(a, F32) for a in (clean, t, noise))


SQUARES = [_noisy_squares(seed) for seed in range(16)]


@functools.cache
def _unet_float32_losses():
    return train(TinyUNet, denoising_loss, None, SQUARES)[0]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_diffusion_unet_trains_like_float32(precision):
    losses, (_, _, scaler, _) = train(TinyUNet, denoising_loss, precision, SQUARES)
    assert_trains_like(_unet_float32_losses(), losses, rtol=0.02, label=np.dtype(precision).name)
    if precision == F16:
        assert int(scaler.skipped_steps()) == 0

    def step(state, batch):
        model, optimizer, scaler, rngs = nnx.merge(graphdef, state)
        make_step(denoising_loss, precision)(model, optimizer, scaler, batch, rngs)
        return nnx.state((model, optimizer, scaler, rngs))

    model = TinyUNet(nnx.Rngs(0))
    objects = (model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    graphdef, state = nnx.split(
        (*objects, jaxscale.GradScaler(enabled=precision == F16), nnx.Rngs(dropout=1))
    )
    report = jaxscale.lowering_report(step, state, SQUARES[0])
    # the convolutions, the transposed one and attention's matmuls: 23 forward, 44
    # backward (the first two layers' inputs are data, which needs no gradient)
    half = {F16: "f16", BF16: "bf16"}[precision]
    assert report.matmul_dtypes == {f"{half} x {half} -> {half}": 67}, report.matmul_dtypes
    # each bias's gradient and the time embedding's, summed over the pixels: float32
    assert set(report.sum_dtypes) == {"f32"}, report.sum_dtypes


def test_explicit_sharding_mesh_as_in_the_nnx_tutorials():
    # jax.make_mesh's axes are Explicit: every re-bound operation must keep the mesh
    # context it was traced under (an out_sharding gather runs under an Auto one)
    mesh = machine.mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        embed = nnx.Embed(VOCAB, WIDTH, rngs=nnx.Rngs(0))
        head = nnx.Linear(WIDTH, VOCAB, rngs=nnx.Rngs(1))
        tokens = jax.device_put(jnp.asarray(padded_tokens(0, 4, LENGTH, VOCAB)), P("data"))

        def forward(embed, head, tokens):
            x = embed(tokens, out_sharding=P("data", None, None))
            return head(x)

        expected = jax.jit(forward)(embed, head, tokens)
        got = jax.jit(jaxscale.autocast(forward))(embed, head, tokens)
        assert got.dtype == F16
        assert got.sharding == expected.sharding
        assert isinstance(got.sharding, NamedSharding)
        np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=0.02, atol=0.02)
        grads = jax.jit(
            nnx.grad(lambda e, h, t: jnp.mean(jaxscale.autocast(forward)(e, h, t) ** 2))
        )(embed, head, tokens)
        assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_a_scaled_step_under_an_explicit_sharding_mesh_skips_bitwise():
    # The skip joins the step as one call of its own program: the call, and the
    # selects written into it, must carry the mesh and the shardings of an explicit mesh.
    mesh = machine.mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        model = nnx.Linear(WIDTH, VOCAB, rngs=nnx.Rngs(0))
        model.kernel.set_value(jax.device_put(model.kernel[...], P(None, "model")))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        scaler = jaxscale.GradScaler(init_scale=2.0**8)
        data = np.ones((4, WIDTH), np.float32)
        x = jax.device_put(data, P("data", None))

        @nnx.jit
        def step(model, optimizer, scaler, x):
            loss_fn = lambda m: scaler.scale(jnp.mean(m(x) ** 2))  # noqa: E731
            scaler.step(optimizer, model, nnx.grad(loss_fn)(model))
            scaler.update()

        before = np.asarray(model.kernel[...])
        step(model, optimizer, scaler, x)
        assert model.kernel[...].sharding.spec == P(None, "model")
        assert not np.array_equal(np.asarray(model.kernel[...]), before)
        stepped = np.asarray(model.kernel[...]).tobytes()
        data[0, 0] = np.inf
        step(model, optimizer, scaler, jax.device_put(data, P("data", None)))
        assert np.asarray(model.kernel[...]).tobytes() == stepped
        assert float(scaler.get_scale()) == 2.0**7


def _sharded_mlp_trained(kind, make_tx, steps=2):
    with sharded_mlp(kind, batch=8) as (model, x):
        optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
        y = jnp.cos(x)

        @nnx.jit
        def step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        losses = [float(step(model, optimizer, x, y)) for _ in range(steps)]
        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        opt_state = jax.tree.leaves(nnx.state(optimizer, nnx.OptState))
    return losses, params, opt_state


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_low_precision_state_in_nnx_optimizer_on_an_explicit_sharding_mesh(fmt):
    # Flax's sharding guide on jax.make_mesh's default axes: the state's slice loop raised
    # JAX's sharding type errors there. Trained as on automatic axes, bit for bit, with
    # every state leaf of a parameter sharded as on automatic axes.
    def make_tx():
        return jaxscale.low_precision_state(optax.adamw(1e-3), fmt)

    explicit = _sharded_mlp_trained(AxisType.Explicit, make_tx)
    automatic = _sharded_mlp_trained(AxisType.Auto, make_tx)
    assert explicit[0] == automatic[0]
    for a, b in zip(automatic[1] + automatic[2], explicit[1] + explicit[2], strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        trimmed = [tuple(x.sharding.spec) for x in (a, b)]
        trimmed = [t[: max((i + 1 for i, n in enumerate(t) if n), default=0)] for t in trimmed]
        assert trimmed[0] == trimmed[1]
    assert any("model" in tuple(leaf.sharding.spec) for leaf in explicit[2])


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_a_quantized_state_whose_blocks_its_devices_do_not_divide_is_placed(kind):
    # A 256 x 512 layer with its columns over 4 devices holds 2 blocks of 256 per row: its
    # scales (256 x 2) were named as the columns, and Flax, placing each variable by its
    # names, raised an IndivisibleError while nnx.Optimizer was being built
    with sharded_mlp(kind) as (model, _):
        optimizer = nnx.Optimizer(
            model, jaxscale.low_precision_state(optax.adamw(1e-3), "int8"), wrt=nnx.Param
        )
        mu = optimizer.opt_state.inner_state[0].mu
        up, down = mu["up"], mu["down"]
        assert up.scale.get_metadata()["out_sharding"] == (None, None)
        assert up.codes.get_metadata()["out_sharding"] == (None, "model")
        assert up.codes[...].sharding.spec == P(None, "model")
        # (the second layer's rows, sharded, each hold their own blocks)
        assert down.scale.get_metadata()["out_sharding"] == ("model", None)


@functools.cache
def _state_lookup_case():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxscale.grad_scaler(optax.adam(1e-3)), wrt=nnx.Param)
    return model, optimizer


def test_helpers_read_the_state_an_nnx_split_loop_holds():
    model, optimizer = _state_lookup_case()
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        opt_state = nnx.state(optimizer)["opt_state"]
        grads = nnx.grad(lambda m: jaxscale.scale(jnp.sum(m(x) ** 2), opt_state))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    state = step(state, jnp.ones((1, 2)))
    opt_state = state[1]["opt_state"]  # an nnx.State, not the optimizer's own tree
    assert float(jaxscale.get_scale(opt_state)) == 65536.0
    assert not bool(jaxscale.found_inf(opt_state))
    assert int(jaxscale.skipped_steps(opt_state)) == 0
    assert float(jaxscale.metrics(opt_state)["scale"]) == 65536.0
    assert float(jaxscale.scale(jnp.float32(0.5), opt_state)) == 32768.0


class LoRALM(nnx.Module):
    """A pretrained-looking language model fine-tuned by low-rank adapters: ``nnx.LoRA``
    around a frozen ``nnx.Linear``, and an output layer tied to the embedding
    (``Embed.attend``), as NNX's LoRA guide and weight-tied models write them."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        base = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.adapted = nnx.LoRA(WIDTH, 4, WIDTH, base_module=base, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens)
        h = h + jax.nn.gelu(self.adapted(self.norm(h)))
        return self.embed.attend(h)


def next_token_loss(model: LoRALM, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def lora_training(precision):
    """``(model, optimizer, scaler, step)``: only the ``nnx.LoRAParam``s are trained."""
    model = LoRALM(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    scaler = jaxscale.GradScaler(enabled=precision == F16, init_scale=2.0**12)
    loss_fn = (
        next_token_loss
        if precision is None
        else jaxscale.autocast(next_token_loss, dtype=precision)
    )

    @nnx.jit
    def step(model, optimizer, scaler, tokens):
        def scaled_loss(model, tokens):
            loss = loss_fn(model, tokens)
            return scaler.scale(loss), loss

        adapters = nnx.DiffState(0, nnx.LoRAParam)
        grads, loss = nnx.grad(scaled_loss, argnums=adapters, has_aux=True)(model, tokens)
        scaler.step(optimizer, model, grads)
        scaler.update()
        return loss

    return model, optimizer, scaler, step


def state_bytes(*trees):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(trees)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lora_fine_tuning_trains_the_adapters_only_like_float32(precision):
    batches = [jnp.asarray(padded_tokens(0, 8, LENGTH + 1, VOCAB))] * 15  # one fine-tuning set
    curves = {}
    for name, setting in [("float32", None), ("amp", precision)]:
        model, optimizer, scaler, step = lora_training(setting)
        frozen = state_bytes(nnx.state(model, FROZEN))
        curves[name] = [float(step(model, optimizer, scaler, tokens)) for tokens in batches]
        assert state_bytes(nnx.state(model, FROZEN)) == frozen  # the base model untouched
    assert_trains_like(curves["float32"], curves["amp"], rtol=0.05, label=str(precision))
    if precision == F16:
        assert int(scaler.skipped_steps()) == 0
    graphdef, state = nnx.split((model, optimizer, scaler))

    def pure(state, tokens):
        objects = nnx.merge(graphdef, state)
        return step(*objects, tokens)

    assert_all_matmuls_in(precision, jax.make_jaxpr(pure)(state, batches[0]))


def test_a_lora_step_that_overflows_is_skipped_bitwise_and_backs_off():
    model, optimizer, scaler, step = lora_training(F16)
    tokens = jnp.asarray(padded_tokens(0, 4, LENGTH + 1, VOCAB))
    step(model, optimizer, scaler, tokens)
    before = state_bytes(nnx.state(model), nnx.state(optimizer))
    model.adapted.lora_a[...] = model.adapted.lora_a[...] * 1e30  # float16 overflows
    poisoned = state_bytes(nnx.state(model), nnx.state(optimizer))
    step(model, optimizer, scaler, tokens)
    assert state_bytes(nnx.state(model), nnx.state(optimizer)) == poisoned  # nothing moved
    assert poisoned != before
    assert int(scaler.skipped_steps()) == 1
    assert float(scaler.get_scale()) == 2.0**11


# A decoder in the style of Gemma 2 and 3: grouped-query attention with RMS-normalised
# queries and keys, rotary positions, soft-capped attention and output logits, local
# (sliding-window) and global layers, a gated GELU feed-forward, pre- and post-norms, an
# embedding scaled by sqrt(width) and tied to the output, and a float32 KV cache.
HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 1, 8, 4
MASKED = -2.3819763e38  # Gemma's mask fill: close to float32's lowest, beyond float16's


class ZeroCenteredRMSNorm(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros(width))

    def __call__(self, x):
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(variance + 1e-6) * (1 + self.scale)


def rotary(x, positions, base=10_000.0):
    half = x.shape[-1] // 2
    angles = positions[..., None, None] * base ** (-jnp.arange(half) / half)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate(
        [first * jnp.cos(angles) - second * jnp.sin(angles),
         second * jnp.cos(angles) + first * jnp.sin(angles)], axis=-1)  # fmt: skip


def soft_cap(x, cap):
    return jnp.tanh(x / cap) * cap


class GroupedQueryAttention(nnx.Module):
    def __init__(self, width: int, window: int | None, rngs: nnx.Rngs):
        self.query = nnx.Einsum("btd,dnh->btnh", (width, HEADS, HEAD_DIM), rngs=rngs)
        self.key = nnx.Einsum("btd,dkh->btkh", (width, KV_HEADS, HEAD_DIM), rngs=rngs)
        self.value = nnx.Einsum("btd,dkh->btkh", (width, KV_HEADS, HEAD_DIM), rngs=rngs)
        self.out = nnx.Einsum("btnh,nhd->btd", (HEADS, HEAD_DIM, width), rngs=rngs)
        self.query_norm = ZeroCenteredRMSNorm(HEAD_DIM, rngs)
        self.key_norm = ZeroCenteredRMSNorm(HEAD_DIM, rngs)
        self.window = window

    def __call__(self, x, positions, cache=None):
        """``cache``: ``(keys, values, end)`` of earlier positions; returns it updated."""
        q = rotary(self.query_norm(self.query(x)), positions) * HEAD_DIM**-0.5
        k, v = rotary(self.key_norm(self.key(x)), positions), self.value(x)
        if cache is not None:
            keys, values, end = cache
            keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), end, 1)
            values = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), end, 1)
            k, v, cache = keys, values, (keys, values, end + x.shape[1])
        batch, length = q.shape[:2]
        grouped = q.reshape(batch, length, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        logits = soft_cap(jnp.einsum("btkgh,bskh->bkgts", grouped, k), 50.0)
        query_at, key_at = positions[:, None, None, :, None], jnp.arange(k.shape[1])
        visible = key_at <= query_at
        if self.window is not None:
            visible &= key_at > query_at - self.window
        probs = jax.nn.softmax(jnp.where(visible, logits, MASKED), axis=-1).astype(v.dtype)
        encoded = jnp.einsum("bkgts,bskh->btkgh", probs, v)
        return self.out(encoded.reshape(batch, length, HEADS, HEAD_DIM)), cache


class GemmaStyleBlock(nnx.Module):
    def __init__(self, width: int, window: int | None, rngs: nnx.Rngs):
        self.attention = GroupedQueryAttention(width, window, rngs)
        self.gate = nnx.Linear(width, 2 * width, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, use_bias=False, rngs=rngs)
        self.norms = nnx.List([ZeroCenteredRMSNorm(width, rngs) for _ in range(4)])

    def __call__(self, x, positions, cache=None):
        attended, cache = self.attention(self.norms[0](x), positions, cache)
        x = x + self.norms[1](attended)
        h = self.norms[2](x)
        return x + self.norms[3](self.down(jax.nn.gelu(self.gate(h)) * self.up(h))), cache


class GemmaStyleLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List(
            [GemmaStyleBlock(WIDTH, WINDOW, rngs), GemmaStyleBlock(WIDTH, None, rngs)]
        )
        self.final_norm = ZeroCenteredRMSNorm(WIDTH, rngs)

    def __call__(self, tokens, positions, caches=None):
        x = self.embed(tokens) * jnp.sqrt(float(WIDTH))
        new_caches = []
        for i, block in enumerate(self.blocks):
            x, cache = block(x, positions, None if caches is None else caches[i])
            new_caches.append(cache)
        logits = soft_cap(self.embed.attend(self.final_norm(x)), 30.0)
        return logits, (None if caches is None else new_caches)


def gemma_style_loss(model, tokens, rngs):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    logits, _ = model(inputs, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


COUNTING = [
    jnp.asarray(padded_tokens(seed, 8, LENGTH + 1, VOCAB, min_length=LENGTH + 1))
    for seed in range(20)
]


@functools.cache
def _gemma_style_float32():
    return train(GemmaStyleLM, gemma_style_loss, None, COUNTING)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_gemma_style_decoder_trains_like_float32_and_decodes_from_a_float32_cache(precision):
    reference, _ = _gemma_style_float32()
    losses, (model, _, scaler, _) = train(GemmaStyleLM, gemma_style_loss, precision, COUNTING)
    assert_trains_like(reference, losses, rtol=0.01, label=np.dtype(precision).name)
    if precision == F16:
        assert int(scaler.skipped_steps()) == 0
    step_jaxpr = traced_step(GemmaStyleLM, gemma_style_loss, precision, COUNTING[0])
    assert_all_matmuls_in(precision, step_jaxpr)

    # decoding token by token from a float32 cache gives what the whole sequence gives
    tokens = COUNTING[0][:, :LENGTH]
    batch = tokens.shape[0]
    positions = jnp.broadcast_to(jnp.arange(LENGTH), tokens.shape)

    @nnx.jit
    def whole(model, tokens):
        return jaxscale.autocast(model, dtype=precision)(tokens, positions)[0]

    @nnx.jit
    def one_step(model, token, position, caches):
        return jaxscale.autocast(model, dtype=precision)(token, position, caches)

    empty = jnp.zeros((batch, LENGTH, KV_HEADS, HEAD_DIM), F32)
    caches = [(empty, empty, jnp.int32(0)) for _ in model.blocks]
    stepped = []
    for t in range(LENGTH):
        logits, caches = one_step(model, tokens[:, t : t + 1], positions[:, t : t + 1], caches)
        stepped.append(logits)
    assert {c.dtype for cache in caches for c in cache[:2]} == {np.dtype(F32)}
    expected = whole(model, tokens)
    assert expected.dtype == precision  # the tied output matmul's dtype, soft-capped
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(stepped, axis=1), np.float32),
        np.asarray(expected, np.float32),
        # a few steps of the autocast dtype: the two programs round in different places
        **({"rtol": 2**-6, "atol": 2**-6} if precision == BF16 else {"rtol": 2**-8, "atol": 2**-8}),
    )


class CachedDecoder(nnx.Module):
    """A decoder block on Flax's own attention cache (``decode=True``), with biases."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=WIDTH, decode=False, rngs=rngs
        )
        self.up, self.down = nnx.Linear(WIDTH, 64, rngs=rngs), nnx.Linear(64, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens, decode=False):
        x = self.embed(tokens)
        mask = None if decode else nnx.make_causal_mask(tokens)
        x = x + self.attention(self.norm(x), mask=mask, decode=decode)
        x = x + self.down(jax.nn.relu(self.up(x)))
        return self.head(x)


@pytest.mark.parametrize("precision", [F16, BF16], ids=["float16", "bfloat16"])
def test_decoding_one_sequence_token_by_token_keeps_the_autocast_dtype(precision):
    # One sequence, one token a step: every layer's product and its bias have the shape
    # (1, 1, features), nothing is broadcast, and the bias is still the layer's own
    model = CachedDecoder(nnx.Rngs(0))
    tokens = jnp.asarray(padded_tokens(3, 1, LENGTH, VOCAB, min_length=LENGTH))
    whole = nnx.jit(jaxscale.autocast(lambda m, t: m(t), dtype=precision))(model, tokens)
    model.attention.init_cache((1, LENGTH, WIDTH), dtype=F32)

    @nnx.jit
    def one_step(model, token):
        return jaxscale.autocast(lambda m, t: m(t, decode=True), dtype=precision)(model, token)

    stepped = [one_step(model, tokens[:, t : t + 1]) for t in range(LENGTH)]
    assert whole.dtype == precision
    assert {s.dtype for s in stepped} == {np.dtype(precision)}  # was float32 at batch one
    assert {c.dtype for c in jax.tree.leaves(nnx.state(model, nnx.Cache))} == {
        np.dtype(jnp.int32),
        np.dtype(F32),
    }
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(stepped, axis=1), np.float32),
        np.asarray(whole, np.float32),
        **({"rtol": 2**-6, "atol": 2**-6} if precision == BF16 else {"rtol": 2**-8, "atol": 2**-8}),
    )
