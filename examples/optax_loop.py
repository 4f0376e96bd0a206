"""Train a small regression model with float16 compute in a plain Optax loop.

The parameters stay float32; the forward and backward passes run in float16.
``jaxscale.grad_scaler`` wraps Adam: it unscales the gradients, skips any step
whose gradients overflowed, and adapts the loss scale, all inside ``jax.jit``.

    python examples/optax_loop.py --steps 300
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import jaxscale


def make_data(key: jax.Array, n: int = 4096) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(key, (n, 32))
    true_w = jnp.linspace(-1.0, 1.0, 32)[:, None]
    return x, jnp.sin(x @ true_w)


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (32, 64)) / jnp.sqrt(32.0),
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 1)) / jnp.sqrt(64.0),
    }


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    hidden = jax.nn.gelu(x.astype(jnp.float16) @ half["w1"] + half["b1"][None, :])
    prediction = (hidden @ half["w2"]).astype(jnp.float32)  # the loss in float32
    return jnp.mean((prediction - y) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()

    x, y = make_data(jax.random.key(0))
    params = init_params(jax.random.key(1))
    tx = jaxscale.grad_scaler(optax.adam(3e-3))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, xb, yb):
        def scaled_loss(p):
            loss = loss_fn(p, xb, yb)
            return jaxscale.scale(loss, opt_state), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batches = x.shape[0] // args.batch_size
    for step in range(args.steps):
        i = step % batches
        xb = x[i * args.batch_size : (i + 1) * args.batch_size]
        yb = y[i * args.batch_size : (i + 1) * args.batch_size]
        params, opt_state, loss = train_step(params, opt_state, xb, yb)
        if step % 50 == 0 or step == args.steps - 1:
            scale = float(jaxscale.get_scale(opt_state))
            skipped = int(jaxscale.skipped_steps(opt_state))
            print(f"step {step:4d}  loss {float(loss):.5f}  scale {scale:>8.0f}  skipped {skipped}")


if __name__ == "__main__":
    main()
