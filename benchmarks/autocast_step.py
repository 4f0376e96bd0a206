"""What jaxscale.autocast costs: the main example's train step, autocast vs hand-set dtypes.

Two versions of the character transformer of ``examples/char_lm.py``, with the
same weights and the same batch:

* **hand-set float16**: every layer built with ``dtype=float16,
  param_dtype=float32``, layer norms and the softmax cast to float32 by hand
  (the way mixed precision is written in Flax without autocast);
* **jaxscale.autocast**: the plain float32 model, the loss wrapped in
  ``jaxscale.autocast``.

Both train steps (forward, backward, Adam; parameters and optimizer state
donated) are timed in one process, interleaved, and the ratio of medians is
reported. The rewrite happens while ``jit`` traces, so at run time the two should
cost the same; the trace-and-compile time of each is reported as well. A
float32 step is included for scale.

    python -m benchmarks.autocast_step
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale
from benchmarks.harness import JaxStepper, Result, measure, table

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import char_lm

F16, F32 = jnp.float16, jnp.float32


class HandSetAttention(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(width, 3 * width, dtype=F16, param_dtype=F32, rngs=rngs)
        self.out = nnx.Linear(width, width, dtype=F16, param_dtype=F32, rngs=rngs)
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        head_width = width // self.heads
        qkv = self.qkv(x).reshape(batch, length, 3, self.heads, head_width)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) / math.sqrt(head_width)
        causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(F16)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width))


class HandSetBlock(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attention = HandSetAttention(width, heads, rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, dtype=F16, param_dtype=F32, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, dtype=F16, param_dtype=F32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x.astype(F32)).astype(F16))
        hidden = jax.nn.gelu(self.up(self.norm2(x.astype(F32)).astype(F16)), approximate=False)
        return x + self.down(hidden)


class HandSetTransformer(nnx.Module):
    """``char_lm.CharTransformer`` with float16 compute set by hand on every layer."""

    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, heads: int,
                 rngs: nnx.Rngs):  # fmt: skip
        self.embed = nnx.Embed(vocab, width, dtype=F16, param_dtype=F32, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, width)))
        self.blocks = nnx.List([HandSetBlock(width, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, dtype=F16, param_dtype=F32, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[...][: tokens.shape[1]].astype(F16)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x.astype(F32)).astype(F16))


def hand_set_loss(model: HandSetTransformer, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = model(x).astype(F32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


VARIANTS: dict[str, tuple[Any, Any]] = {
    "hand-set float16 dtypes (baseline)": (HandSetTransformer, hand_set_loss),
    "jaxscale.autocast": (char_lm.CharTransformer, jaxscale.autocast(char_lm.loss_fn)),
    "float32 (no mixed precision)": (char_lm.CharTransformer, char_lm.loss_fn),
}


def build(kind: str, width: int, layers: int, batch: int, seq_len: int):
    """``(step, params, opt_state, x, y)`` for one variant; every variant has the same weights."""
    model_class, loss_fn = VARIANTS[kind]
    model = model_class(96, seq_len, width, layers, 8, rngs=nnx.Rngs(0))
    reference = char_lm.CharTransformer(96, seq_len, width, layers, 8, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(reference, nnx.Param))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 96, (batch, seq_len)), jnp.int32)
    y = jnp.asarray(rng.integers(0, 96, (batch, seq_len)), jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, params, tx.init(params), x, y


def compile_seconds(kind: str, sizes: tuple[int, int, int, int], repeats: int) -> float:
    """Median time to trace, lower and compile the train step afresh."""
    times = []
    for _ in range(repeats):
        step, params, opt_state, x, y = build(kind, *sizes)
        start = time.perf_counter()
        step.lower(params, opt_state, x, y).compile()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, list[Result]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    sizes = (args.width, args.layers, args.batch, args.seq_len)

    def stepper(kind: str) -> JaxStepper:
        step, params, opt_state, x, y = build(kind, *sizes)
        return JaxStepper(step, (params, opt_state), (x, y))

    baseline = "hand-set float16 dtypes (baseline)"
    run = measure(
        {kind: (lambda kind=kind: stepper(kind)) for kind in VARIANTS},
        baseline,
        repeats=args.repeats,
    )
    compile_repeats = max(3, args.repeats // 3)
    seconds = {kind: compile_seconds(kind, sizes, compile_repeats) for kind in VARIANTS}
    compiled = [Result(kind, s, s / seconds[baseline], []) for kind, s in seconds.items()]
    print(f"transformer {args.width} wide, {args.layers} layers, batch {args.batch}x{args.seq_len}")
    print(f"\n### train step run time\n\n{table(run)}")
    print(f"\n### trace + compile time of the step\n\n{table(compiled, per='compile')}", flush=True)
    return {"run time": run, "trace + compile": compiled}


if __name__ == "__main__":
    main()
