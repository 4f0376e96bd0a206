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
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxscale.casting._policy import validated_device_type

DEFAULT_DTYPES = {"cuda": np.dtype(jnp.float16), "cpu": np.dtype(jnp.bfloat16)}
"""Each device type's autocast dtype when none is given, as in PyTorch."""


@dataclasses.dataclass(frozen=True)
class _Region:
    enabled: bool
    dtype: np.dtype
    device_type: str


_OUTSIDE = _Region(False, DEFAULT_DTYPES["cuda"], "cuda")
_STATE: contextvars.ContextVar[_Region] = contextvars.ContextVar(
    "jaxscale_autocast", default=_OUTSIDE
)


@contextlib.contextmanager
def autocast_state(enabled: bool, dtype: Any, device_type: str = "cuda") -> Iterator[None]:
    """Code run inside sees ``enabled``, ``dtype`` and ``device_type`` (a disabled region
    keeps the enclosing region's dtype and device type, as PyTorch's
    ``autocast(enabled=False)`` does)."""
    outer = _STATE.get()
    region = (
        _Region(True, np.dtype(dtype), device_type)
        if enabled
        else _Region(False, outer.dtype, outer.device_type)
    )
    token = _STATE.set(region)
    try:
        yield
    finally:
        _STATE.reset(token)


def is_autocast_enabled(device_type: str | None = None) -> bool:
    """Whether the code calling it is being traced by an enabled ``jaxscale.autocast``.

    PyTorch's ``torch.is_autocast_enabled()`` and ``torch.is_autocast_enabled(device_type)``.
    True inside ``jaxscale.autocast(fn)`` (while ``fn`` is traced, eagerly or under
    ``jit``), False outside and inside a nested ``autocast(g, enabled=False)``; with
    ``device_type`` (``"cuda"`` or ``"cpu"``), True only inside a region of that device
    type's policy. A function jitted on its own is traced once: its answer is the one of
    its first trace.

    >>> import jaxscale
    >>> seen = []
    >>> def layer(x):
    ...     seen.append((jaxscale.is_autocast_enabled(), jaxscale.is_autocast_enabled("cpu")))
    ...     return x * 2
    >>> _ = layer(1.0), jaxscale.autocast(layer)(1.0)
    >>> seen
    [(False, False), (True, False)]
    """
    region = _STATE.get()
    if device_type is None:
        return region.enabled
    return region.device_type == validated_device_type(device_type) and region.enabled


def get_autocast_dtype(device_type: str | None = None) -> np.dtype:
    """The dtype of the enclosing ``jaxscale.autocast`` region.

    PyTorch's ``torch.get_autocast_dtype(device_type)``: outside a region of that
    device type, its default (float16 for ``"cuda"``, bfloat16 for ``"cpu"``); without
    ``device_type``, the enclosing region's device type (``"cuda"`` outside any).

    >>> import jax.numpy as jnp, jaxscale
    >>> seen = []
    >>> _ = jaxscale.autocast(lambda x: seen.append(jaxscale.get_autocast_dtype()) or x,
    ...                       dtype=jnp.bfloat16)(1.0)
    >>> seen, jaxscale.get_autocast_dtype("cpu")
    ([dtype(bfloat16)], dtype(bfloat16))
    """
    region = _STATE.get()
    if device_type is None or validated_device_type(device_type) == region.device_type:
        return region.dtype
    return DEFAULT_DTYPES[device_type]
