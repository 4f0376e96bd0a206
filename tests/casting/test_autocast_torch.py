"""The same small transformer, same weights, under torch.autocast and under jaxscale.autocast.

PyTorch runs on the CPU, whose autocast lists differ from CUDA's (on the CPU it
keeps softmax, layer norm and sums in float16); jaxscale follows the CUDA lists.
So dtypes of intermediate results differ by design, and the comparison is on
values: logits and loss agree to float16 accuracy, and both are far closer to
each other than float16 is to float32 on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax import lax
from support import third_party
from support.torch_transformer import small_twins

import jaxscale


def test_same_transformer_under_both_autocasts_agrees_to_float16_accuracy(char_lm):
    model, twin, x, y = small_twins(char_lm)

    with third_party.standard_promotion():
        logits32 = np.asarray(nnx.jit(lambda m, x: m(x))(model, x))
        logits16 = np.asarray(nnx.jit(lambda m, x: jaxscale.autocast(m)(x))(model, x), np.float32)
        loss16 = float(nnx.jit(jaxscale.autocast(char_lm.loss_fn))(model, x, y))
        loss32 = float(nnx.jit(char_lm.loss_fn)(model, x, y))
    tokens = torch.from_numpy(np.array(x)).long()
    with torch.no_grad():
        torch32 = twin(tokens).numpy()
        with torch.autocast("cpu", dtype=torch.float16):
            torch_logits = twin(tokens)
            torch_loss = torch.nn.functional.cross_entropy(
                torch_logits.float().reshape(-1, torch_logits.shape[-1]),
                torch.from_numpy(np.array(y)).long().reshape(-1),
            )
    assert torch_logits.dtype == torch.float16  # the head ran in float16 in both
    np.testing.assert_allclose(torch32, logits32, rtol=1e-4, atol=1e-4)  # the twins are twins
    np.testing.assert_allclose(logits16, torch_logits.float().numpy(), rtol=2e-2, atol=2e-2)
    assert abs(loss16 - float(torch_loss)) < 5e-3
    assert abs(loss16 - loss32) < 5e-3
    # float16 really was used: the autocast logits are not the float32 ones
    assert np.max(np.abs(logits16 - logits32)) > 1e-4


def test_gradients_under_autocast_follow_float32_ones(char_lm):
    dataset = char_lm.Dataset.load()
    config = char_lm.Config(width=32, layers=1, heads=2, seq_len=16)
    model = char_lm.CharTransformer(
        len(dataset.chars), config.seq_len, config.width, config.layers, config.heads,
        nnx.Rngs(1),
    )  # fmt: skip
    x, y = next(dataset.batches("train", 4, config.seq_len, seed=5))
    with third_party.standard_promotion():  # (eager autocast is compared in the test above)
        grads16 = nnx.jit(nnx.grad(jaxscale.autocast(char_lm.loss_fn)))(model, x, y)
        grads32 = nnx.jit(nnx.grad(char_lm.loss_fn))(model, x, y)
    for g16, g32 in zip(jax.tree.leaves(grads16), jax.tree.leaves(grads32), strict=True):
        assert g16.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(g32))) + 1e-12
        assert float(jnp.max(jnp.abs(g16 - g32))) / scale < 2e-2


def _sixteenths(rng, shape):
    """Multiples of 1/16 in [-4, 4]: exact in float16, and sums of thousands of them
    exact in float32, so that summation order cannot matter."""
    return rng.integers(-64, 65, shape).astype(np.float32) / 16


def test_bias_gradients_are_pytorchs_bit_for_bit_on_an_accelerator_and_close_on_the_cpu():
    # Under autocast a layer's bias runs in float16 and its gradient is the sum of the
    # output's gradient over the batch (and the pixels): PyTorch accumulates that sum in
    # float32 and rounds once, and so does jaxscale on an accelerator. On the CPU the
    # sum is XLA's float16 one, whose partial sums are rounded to float16: here two of
    # the six sums land 2 float16 steps (0.13%) away from PyTorch's.
    rng = np.random.default_rng(0)
    x, cotangent = rng.normal(size=(4096, 8)).astype(np.float32), _sixteenths(rng, (4096, 6))
    images = rng.normal(size=(16, 3, 16, 16)).astype(np.float32)
    image_cotangent = _sixteenths(rng, (16, 5, 16, 16))

    linear, conv = torch.nn.Linear(8, 6), torch.nn.Conv2d(3, 5, 3, padding=1)
    with torch.autocast("cpu", dtype=torch.float16):
        out = linear(torch.from_numpy(x))
        image_out = conv(torch.from_numpy(images))
    assert out.dtype == image_out.dtype == torch.float16
    loss = (out.float() * torch.from_numpy(cotangent)).sum()
    loss = loss + (image_out.float() * torch.from_numpy(image_cotangent)).sum()
    loss.backward()

    def jax_loss(biases):
        w = jnp.asarray(linear.weight.detach().numpy().T)
        k = jnp.asarray(conv.weight.detach().numpy())
        dense = jnp.asarray(x) @ w + biases[0]
        conv_out = (
            lax.conv_general_dilated(jnp.asarray(images), k, (1, 1), ((1, 1), (1, 1)))
            + biases[1][:, None, None]
        )
        return jnp.sum(dense.astype(jnp.float32) * cotangent) + jnp.sum(
            conv_out.astype(jnp.float32) * image_cotangent
        )

    biases = (jnp.asarray(linear.bias.detach().numpy()), jnp.asarray(conv.bias.detach().numpy()))
    with third_party.standard_promotion():
        grads = jax.grad(jaxscale.autocast(jax_loss))(biases)
    for ours, theirs in zip(grads, (linear.bias.grad, conv.bias.grad), strict=True):
        assert ours.dtype == jnp.float32
        if jax.default_backend() == "cpu":
            np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=2**-8)
        else:
            np.testing.assert_array_equal(np.asarray(ours), theirs.numpy())
    # the float32 sums were not representable in float16: the one rounding mattered
    exact = cotangent.sum(0)
    assert not np.array_equal(exact.astype(np.float16).astype(np.float32), exact)


def _addition_cases():
    """(name, jax function, torch function, inputs): a product plus an addend, as layers
    write a bias and as attention writes a bias or a mask."""
    rng = np.random.default_rng(1)

    def arr(*shape):
        return rng.normal(size=shape).astype(np.float32)

    q, k, x, w, b = arr(2, 4, 8), arr(2, 4, 8), arr(5, 8), arr(6, 8), arr(6)
    images, kernel, channels = arr(2, 3, 8, 8), arr(5, 3, 3, 3), arr(5)
    conv = (lambda i, f: lax.conv_general_dilated(i, f, (1, 1), "SAME"),
            lambda i, f: torch.nn.functional.conv2d(i, f, padding=1))  # fmt: skip
    return [
        ("a linear layer's bias",
         lambda x, w, b: x @ w.T + b, torch.nn.functional.linear, (x, w, b)),
        ("a linear layer's bias, the layer vmapped over examples (weight @ x + bias)",
         jax.vmap(lambda x, w, b: w @ x + b, in_axes=(0, None, None)),
         torch.nn.functional.linear, (x, w, b)),
        # on one example the bias and the product have one shape: nothing is broadcast
        ("a linear layer's bias on a batch of one, reshaped to (1, features) as Flax's is",
         lambda x, w, b: x @ w.T + b.reshape(1, -1), torch.nn.functional.linear,
         (arr(1, 8), w, b)),
        ("a linear layer's bias on a batch of one, broadcast to the output as Haiku's is",
         lambda x, w, b: x @ w.T + jnp.broadcast_to(b, (1, 1, 6)), torch.nn.functional.linear,
         (arr(1, 1, 8), w, b)),
        ("a linear layer's bias on one unbatched example (weight @ x + bias, as Equinox's)",
         lambda x, w, b: w @ x + b, torch.nn.functional.linear, (arr(8), w, b)),
        ("a linear layer's bias, the layer vmapped over a batch of one",
         jax.vmap(lambda x, w, b: w @ x + b, in_axes=(0, None, None)),
         torch.nn.functional.linear, (arr(1, 8), w, b)),
        ("a residual the function is given, over a batch of one",
         lambda x, w: x + x @ w.T, lambda x, w: x + torch.nn.functional.linear(x, w),
         (arr(1, 8), arr(8, 8))),
        # where jaxscale differs: an argument of a matrix-vector product's shape is
        # added as a layer's bias, since an unbatched layer's program is the same
        ("an offset per example added to a matrix-vector product",
         lambda x, v, offset: x @ v + offset,
         lambda x, v, offset: (torch.nn.functional.linear(x, v[None]) + offset[:, None])[:, 0]
         .half(),
         (arr(5, 8), arr(8), arr(5))),
        ("a residual the function computes, over a batch of one",
         lambda x, w: jnp.tanh(x) + x @ w.T,
         lambda x, w: torch.tanh(x) + torch.nn.functional.linear(x, w),
         (arr(1, 8), arr(8, 8))),
        ("a convolution's bias",
         lambda i, f, c: conv[0](i, f) + c[:, None, None],
         lambda i, f, c: torch.nn.functional.conv2d(i, f, c, padding=1),
         (images, kernel, channels)),
        ("an attention bias over query and key positions",
         lambda q, k, bias: jnp.einsum("bqd,bkd->bqk", q, k) + bias,
         lambda q, k, bias: q @ k.mT + bias, (q, k, arr(4, 4))),
        ("a per-example padding mask",
         lambda q, k, mask: jnp.einsum("bqd,bkd->bqk", q, k) + mask,
         lambda q, k, mask: q @ k.mT + mask, (q, k, arr(2, 1, 4))),
        ("a learned position embedding over a projection's output",
         lambda x, w, pos: x @ w.T + pos,
         lambda x, w, pos: torch.nn.functional.linear(x, w) + pos, (arr(2, 5, 8), w, arr(5, 6))),
        ("a per-example embedding over a convolution's output",
         lambda i, f, e: conv[0](i, f) + e, lambda i, f, e: conv[1](i, f) + e,
         (images, kernel, arr(2, 5, 1, 1))),
    ]  # fmt: skip


ADDITIONS = _addition_cases()


@pytest.mark.parametrize(
    ("name", "ours", "theirs", "inputs"), ADDITIONS, ids=[c[0] for c in ADDITIONS]
)
def test_an_addend_is_a_layers_bias_or_promotes_as_pytorchs_plus_does(name, ours, theirs, inputs):
    # PyTorch's linear and conv include their bias, so it is added in float16; an
    # addend that `+` adds to a matmul's float16 output promotes the sum to float32
    with torch.autocast("cpu", dtype=torch.float16):
        expected = theirs(*(torch.from_numpy(a) for a in inputs))
    with third_party.standard_promotion():
        got = jaxscale.autocast(ours, dtype=jnp.float16)(*inputs)
    assert str(got.dtype) == str(expected.dtype).removeprefix("torch.")
    np.testing.assert_allclose(
        np.asarray(got, np.float32), expected.float().numpy(), rtol=2**-9, atol=2**-9
    )
