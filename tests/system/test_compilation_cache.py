"""The programs jaxscale builds are the same in every process.

A restarted job, the next run of a sweep and every host of a multi-host job trace
the step anew. JAX's persistent compilation cache then finds the compiled step by
the program's contents, and the hosts of one job must compile the same program. So
nothing jaxscale writes into a step may depend on the process: not the order of a
set or dict of names (Python salts the hash of a string per process), not an
object's ``id``, not a counter that grows with what the process did before.

Two processes with different hash seeds trace the same steps (the NNX facade under
autocast, the Optax transform with the overflow origin that ``locate_nonfinite``
reports, a float8 recipe) and share one cache folder: the first compiles and
writes, the second must write nothing new.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import paths

STEPS = r"""
import hashlib, json, sys
import jax, jax.numpy as jnp, optax
from flax import nnx
import jaxscale

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
        self.batch_norm = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        h = self.norm(x)
        x = x + self.attention(h, h)
        return self.out(self.batch_norm(x.reshape(-1, 16))).reshape(x.shape)


model = Block(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
scaler = jaxscale.GradScaler(record_overflow_origin=True)
x = jnp.linspace(-1.0, 1.0, 2 * 8 * 16).reshape(2, 8, 16)


def facade_step(model, optimizer, scaler, x):
    def scaled_loss(model):
        loss = jaxscale.autocast(lambda m: jnp.mean(m(x) ** 2))(model)
        return scaler.scale(loss)

    scaler.step(optimizer, model, nnx.grad(scaled_loss)(model))
    scaler.update()


params = {"w": jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8), "b": jnp.zeros(8)}
tx = jaxscale.grad_scaler(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), record_overflow_origin=True
)
opt_state = tx.init(params)


def loss_fn(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def transform_step(params, opt_state, x):
    def scaled_loss(params):
        return jaxscale.scale(jaxscale.autocast(loss_fn)(params, x), opt_state)

    grads, report = jaxscale.locate_nonfinite(jax.grad(scaled_loss))(params)
    updates, opt_state = tx.update(grads, opt_state, params, nonfinite_report=report)
    return optax.apply_updates(params, updates), opt_state


def float8_step(params, x):
    loss = lambda p: jaxscale.autocast(loss_fn, float8="tensorwise")(p, x)
    return jax.grad(loss)(params)


flat = x.reshape(-1, 16)
steps = {
    "facade": (nnx.jit(facade_step), (model, optimizer, scaler, x)),
    "transform": (jax.jit(transform_step), (params, opt_state, flat)),
    "float8": (jax.jit(float8_step), (params, flat)),
}
digests = {}
for name, (step, args) in steps.items():
    digests[name] = hashlib.sha256(step.lower(*args).as_text().encode()).hexdigest()
    jax.block_until_ready(step(*args))  # compiled, and written to the cache
print(json.dumps(digests))
"""


def _trace_and_compile(cache: str, hash_seed: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": paths.this_checkout_first()}
    result = subprocess.run(
        [sys.executable, "-c", STEPS, cache], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_traces_the_same_programs_and_compiles_none_of_them(tmp_path):
    cache = str(tmp_path / "cache")
    first = _trace_and_compile(cache, "1")
    written = sorted(os.listdir(cache))
    assert len(written) >= len(first)  # every step was compiled and cached
    second = _trace_and_compile(cache, "2")
    assert second == first  # the same StableHLO, step by step
    assert sorted(os.listdir(cache)) == written  # each step came from the cache
