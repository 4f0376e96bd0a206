"""The autocast state a function's code can ask about while it is traced.

``jaxscale.autocast`` traces the function it wraps; while it does, the code inside
can ask whether autocast is on and in which dtype, as PyTorch code asks
``torch.is_autocast_enabled()``. The state is a context variable set around the
trace (and around the trace of a custom rule autocast runs when JAX differentiates),
so the answer is known when the code runs: at trace time, which is when JAX code
decides such things.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

_DEFAULT_DTYPE = np.dtype(jnp.float16)
_STATE: contextvars.ContextVar[tuple[bool, np.dtype]] = contextvars.ContextVar(
    "jaxscale_autocast", default=(False, _DEFAULT_DTYPE)
)


@contextlib.contextmanager
def autocast_state(enabled: bool, dtype: Any) -> Iterator[None]:
    """Code run inside sees ``enabled`` and ``dtype`` (a disabled region keeps the
    enclosing region's dtype, as PyTorch's ``autocast(enabled=False)`` does)."""
    token = _STATE.set((enabled, np.dtype(dtype) if enabled else _STATE.get()[1]))
    try:
        yield
    finally:
        _STATE.reset(token)


def is_autocast_enabled() -> bool:
    """Whether the code calling it is being traced by an enabled ``jaxscale.autocast``.

    PyTorch's ``torch.is_autocast_enabled()``. True inside ``jaxscale.autocast(fn)``
    (while ``fn`` is traced, eagerly or under ``jit``), False outside and inside a
    nested ``autocast(g, enabled=False)``. A function jitted on its own is traced once:
    its answer is the one of its first trace.

    >>> import jaxscale
    >>> seen = []
    >>> def layer(x):
    ...     seen.append(jaxscale.is_autocast_enabled())
    ...     return x * 2
    >>> _ = layer(1.0), jaxscale.autocast(layer)(1.0)
    >>> seen
    [False, True]
    """
    return _STATE.get()[0]


def get_autocast_dtype() -> np.dtype:
    """The dtype of the enclosing ``jaxscale.autocast`` region (float16 outside any).

    PyTorch's ``torch.get_autocast_dtype("cuda")``, whose default is float16 too.

    >>> import jax.numpy as jnp, jaxscale
    >>> seen = []
    >>> _ = jaxscale.autocast(lambda x: seen.append(jaxscale.get_autocast_dtype()) or x,
    ...                       dtype=jnp.bfloat16)(1.0)
    >>> seen
    [dtype(bfloat16)]
    """
    return _STATE.get()[1]
