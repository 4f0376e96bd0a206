"""A PyTorch twin of the example's ``char_lm.CharTransformer``, and the copy of its weights.

The two compute the same function in float32 (the tests check it), so under the two
frameworks' autocasts their results differ only by what each autocast casts.
"""

from __future__ import annotations

import math

import numpy as np
import torch


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


def small_twins(char_lm, seed: int = 0):
    """A small ``char_lm.CharTransformer`` (width 64, two layers, four heads, 32 characters),
    its torch twin with the same weights, and a batch of 4: ``(model, twin, x, y)``."""
    from flax import nnx

    dataset = char_lm.Dataset.load()
    config = char_lm.Config(width=64, layers=2, heads=4, seq_len=32)
    model = char_lm.CharTransformer(
        len(dataset.chars), config.seq_len, config.width, config.layers, config.heads,
        nnx.Rngs(seed),
    )  # fmt: skip
    twin = TorchTransformer(len(dataset.chars), config.seq_len, config.width, 2, 4)
    copy_weights(model, twin)
    x, y = next(dataset.batches("train", 4, config.seq_len, seed=3))
    return model, twin, x, y
