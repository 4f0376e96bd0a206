"""Gradient clipping with loss scaling, two ways.

Clipping must see the *true* gradients: clipped scaled gradients would be clipped
at ``max_norm * scale``. With the PyTorch-style facade, call ``scaler.unscale_``
first, exactly as in PyTorch's AMP recipe; ``step`` then uses the inf/NaN check
that ``unscale_`` recorded. With the Optax transform, put the clipping inside the
wrapped optimizer: ``grad_scaler`` unscales before anything inside it runs.

    python examples/clip_gradients.py --steps 200
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax.numpy as jnp
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree
from tqdm import tqdm

import jaxscale

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import char_lm

MAX_NORM = 0.5


def clip_by_global_norm(grads, max_norm):
    """Optax's clipping applied to a gradient tree; returns the clipped gradients and the
    norm before clipping (as ``torch.nn.utils.clip_grad_norm_`` does)."""
    clipped, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    return clipped, global_norm(grads)


def global_norm(grads):
    return jnp.linalg.norm(ravel_pytree(grads)[0])


def train(config, data, use_facade: bool) -> tuple[float, float]:
    model = char_lm.CharTransformer(len(data.chars), config.seq_len, 64, 1, 4, nnx.Rngs(0))
    loss_fn = jaxscale.autocast(char_lm.loss_fn)  # float16 matmuls, float32 loss
    if use_facade:
        optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        scaler = jaxscale.GradScaler(growth_interval=50)
    else:
        tx = jaxscale.grad_scaler(
            optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(3e-3)), growth_interval=50
        )
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        scaler = None

    @nnx.jit
    def facade_step(model, optimizer, scaler, x, y):
        grads = nnx.grad(lambda m: scaler.scale(loss_fn(m, x, y)))(model)
        grads = scaler.unscale_(optimizer, grads)  # true gradients from here on
        grads, norm = clip_by_global_norm(grads, MAX_NORM)
        scaler.step(optimizer, model, grads)  # uses the inf/NaN check made by unscale_
        scaler.update()
        return norm

    @nnx.jit
    def transform_step(model, optimizer, x, y):
        def scaled_loss(m):
            return jaxscale.scale(loss_fn(m, x, y), optimizer.opt_state)

        grads = nnx.grad(scaled_loss)(model)
        true_norm = global_norm(grads) / jaxscale.get_scale(optimizer.opt_state)
        optimizer.update(model, grads)  # unscale, clip, Adam; or skip
        return true_norm

    stream = data.batches("train", config.batch_size, config.seq_len, seed=0)
    clipped = 0
    label = "GradScaler" if use_facade else "grad_scaler"
    for _ in tqdm(range(config.steps), desc=f"  {label}", unit="step", leave=False):
        x, y = next(stream)
        norm = (
            facade_step(model, optimizer, scaler, x, y)
            if use_facade
            else transform_step(model, optimizer, x, y)
        )
        clipped += int(norm > MAX_NORM)
    val_loss, _ = char_lm.evaluate(model, data, config, batches=5)
    return val_loss, clipped / config.steps


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    config = char_lm.Config(steps=args.steps)
    data = char_lm.Dataset.load()
    results = {}
    for name, use_facade in [
        ("GradScaler: unscale_, clip, step", True),
        ("grad_scaler(chain(clip, adam))", False),
    ]:
        val_loss, clipped = train(config, data, use_facade)
        results[name] = val_loss
        print(
            f"{name:34s} validation loss {val_loss:.3f}; "
            f"clipping was active on {clipped:.0%} of steps"
        )
    return results


if __name__ == "__main__":
    main()
