"""Checkpoints: a run stopped, saved, restored into fresh objects and resumed is bit-identical.

The scaler's state travels three ways: Orbax (``orbax-checkpoint``), Flax's
``flax.serialization`` (msgpack bytes), and PyTorch's ``state_dict`` format through
``torch.save``/``torch.load``. For the ``GradScaler`` facade and for the
``grad_scaler`` Optax transform, a run interrupted at step k and resumed from a
checkpoint must end with exactly the parameters, optimizer state, scale and growth
tracker of the uninterrupted run, overflows included.
"""

from __future__ import annotations

import io
import pathlib
import tempfile

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import third_party

import jaxscale
from jaxscale import GradScaler

X = jnp.linspace(-1.0, 1.0, 24).reshape(6, 4)
Y = jnp.cos(X[:, :2])
METHODS = ["orbax", "flax.serialization", "state_dict"]
# PyTorch's own torch.save and torch.load carry the state_dict
NEEDS_TORCH = {"state_dict"}


def bits(tree):
    return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def overflow_plan(length: int, seed: int) -> list[bool]:
    rng = np.random.default_rng(seed)
    return [bool(b) for b in rng.random(length) < 0.15]


# -- the facade: nnx model, optimizer and GradScaler -----------------------------------------------


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(4, 8, rngs=rngs)
        self.second = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


def fresh_facade():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.adam(1e-2)), wrt=nnx.Param)
    scaler = GradScaler(init_scale=2.0**8, growth_interval=3, backoff_factor=0.375)
    return model, optimizer, scaler


@nnx.jit
def facade_step(model, optimizer, scaler, poisoned):
    def loss_fn(model):
        loss = jnp.mean((model(X) - Y) ** 2)
        return scaler.scale(loss * jnp.where(poisoned, jnp.inf, 1.0))  # inf/NaN gradients

    scaler.step(optimizer, model, nnx.grad(loss_fn)(model))
    scaler.update()


def run_facade(objects, plan):
    for poisoned in plan:
        facade_step(*objects, jnp.asarray(poisoned))
    return objects


def facade_fingerprint(objects):
    model, optimizer, scaler = objects
    return bits(nnx.state((model, optimizer))), scaler.state_dict()


def save_and_restore_facade(objects, method: str, directory: pathlib.Path):
    """Save ``objects`` by ``method`` and return fresh objects restored from the checkpoint."""
    restored = fresh_facade()
    if method == "orbax":
        path = directory / "orbax"
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, nnx.state(objects))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(restored))
        with ocp.StandardCheckpointer() as checkpointer:
            nnx.update(restored, checkpointer.restore(path, abstract))
    elif method == "flax.serialization":
        data = flax.serialization.to_bytes(nnx.to_pure_dict(nnx.state(objects)))
        state = nnx.state(restored)
        pure = flax.serialization.from_bytes(nnx.to_pure_dict(state), data)
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(restored, state)
    else:
        # PyTorch's format for the scaler, saved and loaded by torch itself; the model
        # and optimizer go through flax.serialization.
        import torch

        model, optimizer, scaler = objects
        buffer = io.BytesIO()
        torch.save({"scaler": scaler.state_dict()}, buffer)
        data = flax.serialization.to_bytes(nnx.to_pure_dict(nnx.state((model, optimizer))))
        buffer.seek(0)
        restored[2].load_state_dict(torch.load(buffer)["scaler"])
        state = nnx.state(restored[:2])
        nnx.replace_by_pure_dict(
            state, flax.serialization.from_bytes(nnx.to_pure_dict(state), data)
        )
        nnx.update(restored[:2], state)
    return restored


@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=[pytest.mark.torch] if m in NEEDS_TORCH else []) for m in METHODS],
)
def test_facade_resumes_bit_identically_over_200_steps(method, tmp_path):
    plan = overflow_plan(200, seed=1)
    assert 15 <= sum(plan) <= 45
    straight = facade_fingerprint(run_facade(fresh_facade(), plan))

    first = run_facade(fresh_facade(), plan[:83])
    resumed = run_facade(save_and_restore_facade(first, method, tmp_path), plan[83:])
    assert facade_fingerprint(resumed) == straight
    assert straight[1]["scale"] not in (2.0**8, 0.0)  # the scale moved both ways


@pytest.mark.randomized
@pytest.mark.torch  # draws every method, PyTorch's among them
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    length=st.integers(1, 40),
    cut=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    overflow_rate=st.sampled_from([0.0, 0.3, 1.0]),
    method=st.sampled_from(METHODS),
)
def test_any_interruption_resumes_bit_identically(
    length, cut, seed, overflow_rate, method, tmp_path
):
    rng = np.random.default_rng(seed)
    plan = [bool(b) for b in rng.random(length) < overflow_rate]
    k = int(cut * length)
    straight = facade_fingerprint(run_facade(fresh_facade(), plan))
    directory = pathlib.Path(tempfile.mkdtemp(dir=tmp_path))
    restored = save_and_restore_facade(run_facade(fresh_facade(), plan[:k]), method, directory)
    assert facade_fingerprint(run_facade(restored, plan[k:])) == straight


# -- the Optax transform ---------------------------------------------------------------------------

TX = jaxscale.grad_scaler(
    third_party.optimizer(optax.adam(1e-2)), init_scale=2.0**8, growth_interval=3
)
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 8).reshape(4, 2), "b": jnp.zeros(2)}


@jax.jit
def transform_step(params, opt_state, poisoned):
    def loss_fn(p):
        loss = jnp.mean((X @ p["w"] + p["b"][None, :] - Y) ** 2)
        return jaxscale.scale(loss * jnp.where(poisoned, jnp.inf, 1.0), opt_state)

    updates, opt_state = TX.update(jax.grad(loss_fn)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def run_transform(carry, plan):
    for poisoned in plan:
        carry = transform_step(*carry, jnp.asarray(poisoned))
    return carry


@pytest.mark.parametrize("method", ["orbax", "flax.serialization"])
def test_transform_resumes_bit_identically_over_200_steps(method, tmp_path):
    plan = overflow_plan(200, seed=2)
    start = (PARAMS, TX.init(PARAMS))
    straight = run_transform(start, plan)
    first = run_transform(start, plan[:117])
    if method == "orbax":
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "ckpt", first)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, start)
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    else:
        restored = flax.serialization.from_bytes(start, flax.serialization.to_bytes(first))
    restored = jax.tree.unflatten(jax.tree.structure(start), jax.tree.leaves(restored))
    resumed = run_transform(restored, plan[117:])
    assert bits(resumed) == bits(straight)
    assert int(jaxscale.skipped_steps(straight[1])) == sum(plan)
