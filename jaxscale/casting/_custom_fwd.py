"""``custom_fwd``: PyTorch's ``torch.amp.custom_fwd`` for a user's own function.

A function that must run in a precision of its own under autocast (a numerically
delicate block, a Pallas kernel, a foreign function written for float32) is
decorated; inside an autocast region its floating inputs are cast to
``cast_inputs`` and its body runs with autocast disabled, so every operation in it,
and the backward pass JAX derives from them, runs as written. Outside autocast, or
without ``cast_inputs``, it runs as written and autocast's policy applies as
everywhere (PyTorch's ``custom_bwd`` has no counterpart to write: JAX derives the
backward pass from the forward operations, in the same precision).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.casting._autocast import autocast
from jaxscale.casting._region import is_autocast_enabled

F = TypeVar("F", bound=Callable[..., Any])


def custom_fwd(fn: F | None = None, *, cast_inputs: Any = None) -> Any:
    """Give a function a precision of its own under autocast: ``torch.amp.custom_fwd``.

    With ``cast_inputs`` (a floating dtype), inside ``jaxscale.autocast`` the function's
    floating array inputs are cast to it and its body runs with autocast disabled,
    forward and backward. Outside autocast, or with ``cast_inputs=None``, the
    function runs as written (under the enclosing autocast's policy, if any).

    Args:
      fn: the function; omit it to get a decorator.
      cast_inputs: the dtype its floating inputs take inside autocast, or ``None``.

    Raises:
      TypeError: for ``fn`` not callable or ``cast_inputs`` not a floating dtype.

    >>> import jax.numpy as jnp, jaxscale
    >>> @jaxscale.custom_fwd(cast_inputs=jnp.float32)
    ... def delicate(a, b):
    ...     return a @ b  # stays float32 under autocast
    >>> jaxscale.autocast(lambda a: (a @ a, delicate(a, a)))(jnp.ones((2, 2)))[1].dtype
    dtype('float32')
    """
    target = _floating_dtype(cast_inputs)
    if fn is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)
    if not callable(fn):
        raise TypeError(f"custom_fwd expects a callable, got {type(fn).__name__} {fn!r}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if target is None or not is_autocast_enabled():
            return fn(*args, **kwargs)
        args, kwargs = jax.tree.map(lambda leaf: _cast(leaf, target), (args, kwargs))
        return autocast(fn, enabled=False)(*args, **kwargs)

    return wrapper


def _floating_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"cast_inputs must be a floating dtype or None, got {dtype!r}") from None
    if not jnp.issubdtype(resolved, jnp.floating):
        raise TypeError(f"cast_inputs must be a floating dtype or None, got {resolved.name}")
    return resolved


def _cast(leaf: Any, dtype: np.dtype) -> Any:
    floating = isinstance(leaf, jax.Array | np.ndarray) and jnp.issubdtype(leaf.dtype, jnp.floating)
    return leaf.astype(dtype) if floating else leaf
