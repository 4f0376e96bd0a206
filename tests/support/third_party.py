"""Run third-party code (optax optimizers, flax layers) under JAX's standard promotion.

The suite runs with strict dtype promotion and rank-promotion errors so that any
implicit promotion inside jaxscale fails loudly. Some optax optimizers promote on
purpose (Adam's bias correction raises a float to an int32 power); wrapping them
here keeps the strict checks on jaxscale's own code, which runs outside the wrapper.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import optax


@contextlib.contextmanager
def standard_promotion() -> Iterator[None]:
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def lenient(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with standard_promotion():
            return fn(*args, **kwargs)

    return wrapped


def optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` with init and update traced under standard promotion."""
    tx = optax.with_extra_args_support(tx)
    return optax.GradientTransformationExtraArgs(lenient(tx.init), lenient(tx.update))
