"""The same small transformer, same weights, under torch.autocast and under jaxscale.autocast.

PyTorch runs on the CPU, whose autocast lists differ from CUDA's (on the CPU it
keeps softmax, layer norm and sums in float16); jaxscale follows the CUDA lists.
So dtypes of intermediate results differ by design, and the comparison is on
values: logits and loss agree to float16 accuracy, and both are far closer to
each other than float16 is to float32 on its own.
"""

from __future__ import annotations

import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import third_party
import torch
from flax import nnx

import jaxscale

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def char_lm():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import char_lm

        yield char_lm
    finally:
        sys.path.remove(str(EXAMPLES))


class TorchBlock(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width, eps=1e-6)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width, eps=1e-6)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.heads = heads

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        head_width = width // self.heads
        qkv = self.qkv(x).reshape(batch, length, 3, self.heads, head_width)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_width)
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
        weights = torch.softmax(scores.masked_fill(~causal, -1e4), dim=-1)
        mixed = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
        return self.out(mixed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TorchTransformer(torch.nn.Module):
    """PyTorch's twin of ``char_lm.CharTransformer``."""

    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, heads: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.zeros(seq_len, width))
        self.blocks = torch.nn.ModuleList([TorchBlock(width, heads) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(width, eps=1e-6)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def copy_weights(model, twin: TorchTransformer) -> None:
    """Load the NNX model's weights into the torch twin (torch Linear weights are (out, in))."""

    def linear(ours, theirs):
        theirs.weight.data = torch.from_numpy(np.asarray(ours.kernel[...]).T.copy())
        theirs.bias.data = torch.from_numpy(np.asarray(ours.bias[...]).copy())

    def norm(ours, theirs):
        theirs.weight.data = torch.from_numpy(np.asarray(ours.scale[...]).copy())
        theirs.bias.data = torch.from_numpy(np.asarray(ours.bias[...]).copy())

    twin.embed.weight.data = torch.from_numpy(np.asarray(model.embed.embedding[...]).copy())
    twin.position.data = torch.from_numpy(np.asarray(model.position[...]).copy())
    for ours, theirs in zip(model.blocks, twin.blocks, strict=True):
        norm(ours.norm1, theirs.norm1)
        norm(ours.norm2, theirs.norm2)
        linear(ours.attention.qkv, theirs.qkv)
        linear(ours.attention.out, theirs.out)
        linear(ours.up, theirs.up)
        linear(ours.down, theirs.down)
    norm(model.norm, twin.norm)
    linear(model.head, twin.head)


def test_same_transformer_under_both_autocasts_agrees_to_float16_accuracy(char_lm):
    dataset = char_lm.Dataset.load()
    config = char_lm.Config(width=64, layers=2, heads=4, seq_len=32)
    model = char_lm.CharTransformer(
        len(dataset.chars), config.seq_len, config.width, config.layers, config.heads,
        nnx.Rngs(0),
    )  # fmt: skip
    twin = TorchTransformer(len(dataset.chars), config.seq_len, config.width, 2, 4)
    copy_weights(model, twin)
    x, y = next(dataset.batches("train", 4, config.seq_len, seed=3))

    with third_party.standard_promotion():
        logits32 = np.asarray(model(x))
        logits16 = np.asarray(jaxscale.autocast(model)(x), np.float32)
        loss16 = float(jaxscale.autocast(char_lm.loss_fn)(model, x, y))
        loss32 = float(char_lm.loss_fn(model, x, y))
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
    with third_party.standard_promotion():
        grads16 = nnx.grad(jaxscale.autocast(char_lm.loss_fn))(model, x, y)
        grads32 = nnx.grad(char_lm.loss_fn)(model, x, y)
    for g16, g32 in zip(jax.tree.leaves(grads16), jax.tree.leaves(grads32), strict=True):
        assert g16.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(g32))) + 1e-12
        assert float(jnp.max(jnp.abs(g16 - g32))) / scale < 2e-2
