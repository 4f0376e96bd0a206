"""A Flax Linen model in a TrainState, with jaxscale.grad_scaler as its optimizer.

The Optax transform needs no other change to a Linen training loop: build the
TrainState with ``tx=jaxscale.grad_scaler(optax.adamw(...))``, multiply the loss
by ``jaxscale.scale(loss, state.opt_state)``, and ``state.apply_gradients`` does
the rest (unscale, skip on inf/NaN, adapt the scale). The model predicts the next
character of Python's documentation from the previous 16, in float16.

    python examples/linen_train_state.py --steps 400
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import jaxscale

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from char_lm import Dataset

CONTEXT = 16


class NextCharMLP(nn.Module):
    vocab: int
    width: int = 256

    @nn.compact
    def __call__(self, context: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, 32, dtype=jnp.float16)(context).reshape(context.shape[0], -1)
        x = nn.gelu(nn.Dense(self.width, dtype=jnp.float16)(x))
        x = nn.gelu(nn.Dense(self.width, dtype=jnp.float16)(x))
        return nn.Dense(self.vocab, dtype=jnp.float16)(x)


def windows(
    tokens: np.ndarray, batch: int, rng: np.random.Generator
) -> tuple[jax.Array, jax.Array]:
    starts = rng.integers(0, len(tokens) - CONTEXT - 1, batch)
    x = np.stack([tokens[s : s + CONTEXT] for s in starts])
    return jnp.asarray(x), jnp.asarray(tokens[starts + CONTEXT])


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)

    data = Dataset.load()
    model = NextCharMLP(vocab=len(data.chars))
    rng = np.random.default_rng(0)
    x0, _ = windows(data.train, args.batch_size, rng)
    state = train_state.TrainState.create(
        apply_fn=model.apply,
        params=model.init(jax.random.key(0), x0),
        tx=jaxscale.grad_scaler(optax.adamw(2e-3), growth_interval=100),
    )

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            logits = state.apply_fn(params, x).astype(jnp.float32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return jaxscale.scale(loss, state.opt_state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss

    for step in range(1, args.steps + 1):
        state, loss = train_step(state, *windows(data.train, args.batch_size, rng))
        if step % 100 == 0 or step == args.steps:
            print(
                f"step {step:4d}  loss {float(loss):.3f}  "
                f"scale {float(jaxscale.get_scale(state.opt_state)):g}  "
                f"skipped {int(jaxscale.skipped_steps(state.opt_state))}"
            )
    x, y = windows(data.val, 4096, np.random.default_rng(1))
    accuracy = float(jnp.mean(state.apply_fn(state.params, x).argmax(-1) == y))
    print(f"validation accuracy {accuracy:.1%} (next character from the previous {CONTEXT})")
    return {
        "loss": float(loss),
        "accuracy": accuracy,
        "scale": float(jaxscale.get_scale(state.opt_state)),
    }


if __name__ == "__main__":
    main()
