"""A character-level transformer on Python's own documentation, trained in float16.

The corpus is the text of Python's built-in help topics (``pydoc_data.topics``),
which ships with every CPython, so nothing is downloaded. The model is written
in plain float32, as a PyTorch model would be; mixed precision is the two lines
of PyTorch's AMP loop: ``jaxscale.autocast`` runs the forward pass and the loss
with PyTorch's autocast policy (matmuls in float16; layer norms, softmax and the
loss in float32), and ``jaxscale.GradScaler`` scales the loss.

Why loss scaling matters here: in data-parallel training the loss is the mean
over the *global* batch, so every device back-propagates per-token gradients of
1 / (global tokens) and sums its partial weight gradients with the other
devices' afterwards. ``devices=D`` simulates one of D such devices: the loss is
divided by D (the float16 backward pass then carries exactly that device's
gradient magnitudes, where float16 underflows) and the unscaled float32
gradient is multiplied by D, standing in for the all-reduce. In float32 the
result equals ordinary single-device training.
"""

from __future__ import annotations

import dataclasses
import math
import pydoc_data.topics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale


def corpus() -> str:
    topics = pydoc_data.topics.topics
    return "\n".join(topics[name] for name in sorted(topics))


@dataclasses.dataclass(frozen=True)
class Dataset:
    train: np.ndarray
    val: np.ndarray
    chars: str

    @classmethod
    def load(cls, val_fraction: float = 0.1) -> Dataset:
        text = corpus()
        chars = "".join(sorted(set(text)))
        index = {c: i for i, c in enumerate(chars)}
        tokens = np.array([index[c] for c in text], np.int32)
        split = int(len(tokens) * (1 - val_fraction))
        return cls(tokens[:split], tokens[split:], chars)

    def batches(
        self, split: str, batch_size: int, seq_len: int, seed: int
    ) -> Iterator[tuple[jax.Array, jax.Array]]:
        data = self.train if split == "train" else self.val
        rng = np.random.default_rng(seed)
        while True:
            starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
            x = np.stack([data[s : s + seq_len] for s in starts])
            y = np.stack([data[s + 1 : s + seq_len + 1] for s in starts])
            yield jnp.asarray(x), jnp.asarray(y)

    def decode(self, tokens: np.ndarray) -> str:
        return "".join(self.chars[t] for t in tokens)


class CausalSelfAttention(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.out = nnx.Linear(width, width, rngs=rngs)
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        head_width = width // self.heads
        qkv = self.qkv(x).reshape(batch, length, 3, self.heads, head_width)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_width)
        causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width))


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attention = CausalSelfAttention(width, heads, rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        # exact gelu, PyTorch's default (the tanh form computes x ** 3, a float32 pow)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x)), approximate=False))


class CharTransformer(nnx.Module):
    """A small GPT-style model, written in float32 (no dtype anywhere)."""

    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, heads: int,
                 rngs: nnx.Rngs):  # fmt: skip
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, width)))
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model: CharTransformer, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy (float32 under autocast too: a loss is on its list)."""
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


PRECISIONS = (
    "float32",
    "float16",
    "bfloat16",
    "float8-tensorwise",
    "float8-rowwise",
    "float8-rowwise_with_gw_hp",
    "float8-mxfp8",
    "float8-mxfp8_wgrad_with_hp",
    "float8-nvfp4",
)


def autocast_options(
    precision: str, float8_filter: Callable[..., bool] | None = None, key: Any = None
) -> dict[str, Any] | None:
    """``jaxscale.autocast``'s arguments for a precision (None: plain float32).

    The float8 settings are torchao's recipes: the linear layers' matmuls in float8,
    everything else in bfloat16, as torchao's float8 training runs; ``"float8-nvfp4"``
    is NVIDIA's NVFP4 recipe, whose stochastic rounding draws from ``key``.
    ``float8_filter`` chooses the matmuls that run in the recipe.
    """
    if precision == "float32":
        return None
    if precision.startswith("float8-"):
        options: dict[str, Any] = {
            "dtype": jnp.bfloat16, "float8": precision.removeprefix("float8-"),
            "float8_filter": float8_filter,
        }  # fmt: skip
        if precision == "float8-nvfp4":
            options["key"] = jax.random.key(0) if key is None else key
        return options
    return {"dtype": jnp.dtype(precision)}


@dataclasses.dataclass(frozen=True)
class Config:
    precision: str = "float16"  # one of PRECISIONS
    scaler: bool = True
    steps: int = 800
    batch_size: int = 32
    seq_len: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4
    learning_rate: float = 3e-3
    devices: int = 256
    init_scale: float = 2.0**16
    growth_interval: int = 50
    seed: int = 0
    locate: bool = False  # say where each skipped step's inf or NaN was born
    grad_dtype: str | None = None  # "float32": weight gradients out of their matmuls in float32
    # which matmuls run in the float8 recipe (None: every one it can take)
    float8_filter: Callable[..., bool] | None = None
    float8_filter_label: str = ""

    @property
    def label(self) -> str:
        gradients = f", {self.grad_dtype} gradients" if self.grad_dtype else ""
        if self.float8_filter_label:
            gradients += f", {self.float8_filter_label}"
        if self.precision != "float16":
            return self.precision + gradients
        return ("float16 + jaxscale" if self.scaler else "float16, no loss scaling") + gradients

    @property
    def forward(self) -> Callable[..., jax.Array]:
        """The loss as the training step computes it: under autocast unless float32."""
        return self.forward_with_key(None)

    def forward_with_key(self, key: Any) -> Callable[..., jax.Array]:
        """:attr:`forward`, its stochastic rounding (NVFP4's) drawn from ``key``."""
        options = autocast_options(self.precision, self.float8_filter, key)
        if options is None:
            return loss_fn
        if self.grad_dtype is not None:
            options["grad_dtype"] = jnp.dtype(self.grad_dtype)
        return jaxscale.autocast(loss_fn, **options)


def build(
    config: Config, dataset: Dataset | int
) -> tuple[CharTransformer, nnx.Optimizer, jaxscale.GradScaler]:
    """The model, optimizer and scaler, for ``dataset``'s characters (or a vocabulary size)."""
    vocab = dataset if isinstance(dataset, int) else len(dataset.chars)
    model = CharTransformer(
        vocab, config.seq_len, config.width, config.layers, config.heads, nnx.Rngs(config.seed)
    )
    optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(
        init_scale=config.init_scale,
        growth_interval=config.growth_interval,
        enabled=config.scaler and config.precision == "float16",
    )
    return model, optimizer, scaler


def split_step(config: Config, vocab: int = 96) -> tuple[Any, Any, Callable[..., Any], jax.Array]:
    """The train step in parts a pure function is made of, on random tokens.

    Returns ``(graphdef, state, body, tokens)``: ``nnx.merge(graphdef, state)`` gives
    the model, optimizer and scaler, ``body`` runs one step on them
    (:func:`train_step_body`), and ``tokens`` is a batch of ``vocab`` random characters,
    for a benchmark or a lowering that needs no dataset.
    """
    graphdef, state = nnx.split(build(config, vocab))
    rng = np.random.default_rng(config.seed)
    tokens = jnp.asarray(rng.integers(0, vocab, (config.batch_size, config.seq_len)), jnp.int32)
    return graphdef, state, train_step_body(config), tokens


def train_step_body(config: Config) -> Callable[..., tuple[Any, ...]]:
    """One PyTorch-style AMP iteration on the model, optimizer and scaler (not yet jitted)."""
    devices = config.devices
    keyed = config.precision == "float8-nvfp4"

    locate = config.locate and config.scaler and config.precision == "float16"

    def train_step(model, optimizer, scaler, x, y):
        # a key of its own for each step's stochastic rounding
        key = (
            jax.random.fold_in(jax.random.key(config.seed), optimizer.step[...]) if keyed else None
        )
        forward = config.forward_with_key(key)

        def scaled_loss(model, x, y):
            loss = forward(model, x, y)  # PyTorch: with torch.autocast("cuda"): loss = ...
            return scaler.scale(loss / devices), loss  # this device's share of the global mean

        gradient = nnx.grad(scaled_loss, has_aux=True)
        report = None
        if locate:  # where an inf or NaN is born, forward or backward, in which layer
            (grads, loss), report = jaxscale.locate_nonfinite(gradient)(model, x, y)
        else:
            grads, loss = gradient(model, x, y)
        grads = scaler.unscale_(optimizer, grads)
        grads = jax.tree.map(lambda g: g * devices, grads)  # stands in for the all-reduce
        scaler.step(optimizer, model, grads)
        scaler.update()
        # the scale for the next step, and whether this one was skipped (inf/NaN gradients)
        scale = jnp.asarray(scaler.get_scale(), jnp.float32)
        return loss, scale, jnp.asarray(scaler.found_inf()), report

    return train_step


def make_train_step(config: Config) -> Callable[..., tuple[Any, ...]]:
    # Donating the model, optimizer and scaler lets XLA update them in place.
    return nnx.jit(train_step_body(config), donate_argnums=(0, 1, 2))


@nnx.jit(static_argnums=(3, 4))
def evaluate_batch(
    model: CharTransformer, x: jax.Array, y: jax.Array, precision: str,
    float8_filter: Callable[..., bool] | None = None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    options = autocast_options(precision, float8_filter)
    apply = model if options is None else jaxscale.autocast(model, **options)
    logits = apply(x).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(logits.argmax(-1) == y)


def evaluate(
    model: CharTransformer, dataset: Dataset, config: Config, batches: int = 20
) -> tuple[float, float]:
    """Validation loss and next-character accuracy on held-out text."""
    stream = dataset.batches("val", 64, config.seq_len, seed=1234)
    results = [
        evaluate_batch(model, *next(stream), config.precision, config.float8_filter)
        for _ in range(batches)
    ]
    return float(np.mean([r[0] for r in results])), float(np.mean([r[1] for r in results]))


@dataclasses.dataclass
class History:
    loss: list[float] = dataclasses.field(default_factory=list)
    scale: list[float] = dataclasses.field(default_factory=list)
    skipped: list[bool] = dataclasses.field(default_factory=list)
    # step (1-based) of each skipped step -> where its inf or NaN was born
    origins: dict[int, str] = dataclasses.field(default_factory=dict)


def train(
    config: Config,
    dataset: Dataset | None = None,
    on_step: Callable[[int, History], None] | None = None,
) -> tuple[CharTransformer, History, dict[str, float]]:
    """Train one configuration; returns the model, its history and a summary."""
    dataset = dataset or Dataset.load()
    model, optimizer, scaler = build(config, dataset)
    train_step = make_train_step(config)
    stream = dataset.batches("train", config.batch_size, config.seq_len, seed=config.seed)
    history = History()
    pending: list[tuple[Any, ...]] = []
    start = time.perf_counter()
    for step in range(config.steps):
        pending.append(train_step(model, optimizer, scaler, *next(stream)))
        # read results back in small groups: one host sync per group, not per step
        if len(pending) == 10 or step == config.steps - 1:
            for loss, scale, skipped, report in jax.device_get(pending):
                history.loss.append(float(loss))
                history.scale.append(float(scale))
                history.skipped.append(bool(skipped))
                if skipped and report is not None:
                    history.origins[len(history.loss)] = report.describe()
            pending = []
            if on_step is not None:
                on_step(step + 1, history)
    seconds = time.perf_counter() - start
    val_loss, val_accuracy = evaluate(model, dataset, config)
    summary = {
        "train_loss": float(np.mean(history.loss[-50:])),
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "final_scale": history.scale[-1],
        "skipped_steps": float(sum(history.skipped)),
        "seconds": seconds,
    }
    return model, history, summary


def sample(
    model: CharTransformer, dataset: Dataset, prompt: str, length: int, seq_len: int, seed: int = 0
) -> str:
    """Sample ``length`` characters after ``prompt`` (temperature 0.8), under autocast."""
    index = {c: i for i, c in enumerate(dataset.chars)}
    tokens = [index[c] for c in prompt if c in index]
    key = jax.random.key(seed)

    @nnx.jit
    def next_logits(model, window):
        return jaxscale.autocast(model)(window)[0, -1].astype(jnp.float32)

    for _ in range(length):
        window = np.array(tokens[-seq_len:], np.int32)
        window = np.pad(window, (seq_len - len(window), 0))  # left padding keeps shapes fixed
        key, subkey = jax.random.split(key)
        tokens.append(
            int(jax.random.categorical(subkey, next_logits(model, jnp.asarray(window)[None]) / 0.8))
        )
    return dataset.decode(np.array(tokens))


def underflow_fractions(
    model: CharTransformer, config: Config, dataset: Dataset, scale: float
) -> dict[str, float]:
    """The share of gradient elements that float16 flushes to zero, unscaled and scaled.

    Takes the gradient of this device's share of the loss (``loss / devices``) on
    one batch, in float32 and under autocast (whose backward matmuls run in
    float16). An element counts as underflowed when the float32 gradient is
    nonzero and the autocast gradient is exactly zero.
    """
    x, y = next(dataset.batches("train", config.batch_size, config.seq_len, seed=999))

    def grads_in(forward: Callable[..., jax.Array], loss_scale: float) -> list[np.ndarray]:
        # compiled as one program, not run operation by operation
        gradient = nnx.jit(nnx.grad(lambda m: forward(m, x, y) / config.devices * loss_scale))
        return [np.asarray(g) for g in jax.tree.leaves(gradient(model))]

    reference = grads_in(loss_fn, 1.0)
    nonzero = sum(int((g != 0).sum()) for g in reference)

    def fraction(grads: list[np.ndarray]) -> float:
        flushed = sum(
            int(((r != 0) & (g == 0)).sum()) for r, g in zip(reference, grads, strict=True)
        )
        return flushed / nonzero

    return {
        "underflow_unscaled": fraction(grads_in(jaxscale.autocast(loss_fn), 1.0)),
        "underflow_scaled": fraction(grads_in(jaxscale.autocast(loss_fn), scale)),
    }
