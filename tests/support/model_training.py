"""Shared helpers for the real-model tests: what ran in which dtype, and training curves.

Each framework's test module trains a small model written in that framework's own
idiom three ways on the same data (float32; float16 autocast with a jaxscale
scaler; bfloat16 autocast) and compares the losses. The models run under JAX's
standard dtype promotion, as users' code does (the rest of the suite is strict).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex

from support.third_party import standard_promotion

MATMULS = ("dot_general", "conv_general_dilated")
# The bfloat16 twin of each real-model training is marked slow: the first CI stage runs
# both, the stages on other JAX versions the float16 one (the same re-binding, and the
# loss scaling besides).
PRECISIONS = [
    pytest.param(jnp.float16, id="float16"),
    pytest.param(jnp.bfloat16, id="bfloat16", marks=pytest.mark.slow),
]


@pytest.fixture
def under_standard_promotion() -> Iterator[None]:
    """JAX's standard dtype promotion, as the users' code the model tests imitate runs
    under: each model test module uses it for all its tests (``pytestmark``)."""
    with standard_promotion():
        yield


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs inside an equation's parameters (open ones, closed ones unwrapped)."""
    found = []
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else [param]:
            if isinstance(sub, jex.ClosedJaxpr):
                found.append(sub.jaxpr)
            elif isinstance(sub, jex.Jaxpr):
                found.append(sub)
    return found


def equations(jaxpr: Any) -> list[Any]:
    """Every equation of ``jaxpr`` (a closed or open jaxpr), inner jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for sub in sub_jaxprs(eqn):
            found.extend(equations(sub))
    return found


def matmul_dtypes(jaxpr: Any) -> collections.Counter:
    """``(input dtypes..., output dtype)`` of every matmul and convolution, inner jaxprs too."""
    return collections.Counter(
        tuple(str(v.aval.dtype) for v in [*eqn.invars, *eqn.outvars])
        for eqn in equations(jaxpr)
        if eqn.primitive.name in MATMULS
    )


def assert_all_matmuls_in(dtype: Any, jaxpr: Any) -> None:
    """Every matmul and convolution of ``jaxpr`` takes and gives ``dtype`` (and there is one)."""
    name = np.dtype(dtype).name
    found = matmul_dtypes(jaxpr)
    assert found, "no matmul or convolution in the program"
    assert set(found) == {(name, name, name)}, dict(found)


def assert_no_primitive(names: Sequence[str], jaxpr: Any) -> None:
    present = {eqn.primitive.name for eqn in equations(jaxpr)}
    assert not present & set(names), present & set(names)


def assert_trains_like(
    reference: Sequence[float], candidate: Sequence[float], *, rtol: float, label: str
) -> None:
    """Both curves finite, the same start and end to ``rtol``, and the candidate learning."""
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    assert np.all(np.isfinite(candidate)), f"{label}: non-finite loss {candidate}"
    np.testing.assert_allclose(candidate[0], reference[0], rtol=rtol, err_msg=f"{label}: start")
    np.testing.assert_allclose(candidate[-1], reference[-1], rtol=rtol, err_msg=f"{label}: end")
    assert candidate[-1] < 0.9 * candidate[0], f"{label}: did not learn {candidate}"


def padded_tokens(
    seed: int, batch: int, length: int, vocab: int, *, min_length: int = 3
) -> np.ndarray:
    """Token ids in ``[1, vocab)`` with a padded tail of zeros (at least one row padded).

    Each row counts up from a random start (wrapping past ``vocab - 1`` to 1), so
    that the next token is learnable.
    """
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab - 1, (batch, 1))
    tokens = (starts + np.arange(length)) % (vocab - 1) + 1
    lengths = rng.integers(min_length, length + 1, batch)
    lengths[0] = min_length
    return np.where(np.arange(length) < lengths[:, None], tokens, 0).astype(np.int32)


def run_steps(
    step: Callable[..., tuple[Any, jax.Array]], state: Any, batches: Sequence[Any]
) -> tuple[Any, list[float]]:
    """Run ``state, loss = step(state, batch)`` over ``batches``; the losses as floats."""
    losses = []
    for batch in batches:
        state, loss = step(state, batch)
        losses.append(float(jnp.asarray(loss, jnp.float32)))
    return state, losses


class SmallMLP(nnx.Module):
    """A two-layer NNX regression model, the facade tests' common subject."""

    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(4, 8, rngs=rngs)
        self.second = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.second(jnp.tanh(self.first(x)))


SMALL_X, SMALL_Y = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), jnp.ones((3, 2))


def small_mlp_loss(model: SmallMLP) -> jax.Array:
    return jnp.mean((model(SMALL_X) - SMALL_Y) ** 2)
