"""A parameter writer's own step, handed down to the slice loop of the optimizer it wraps.

``master_weights(inner)`` adds ``inner``'s float32 update to each master and rounds the
master to the parameter's dtype. Where ``inner`` updates its state a slice at a time
(``low_precision_state``: :mod:`jaxscale.optim._in_place`), that addition computed
after ``inner`` returns reads the update on whole arrays, which the loop then cannot
write into the gradient's buffer (a float32 update does not fit a bfloat16 gradient's),
so XLA keeps a copy of the old state for it. Handed down, the writer's step runs in the
loop itself: each slice of the new parameter is written into its gradient's buffer and
each slice of the new master into the master's, and nothing reads the old state after.

The wrapper calls ``inner.update`` inside :func:`finishing`; the first slice loop that
runs inside claims the step (:func:`claim`), computes it with its own update, and
records what it wrote. The wrapper uses that only if ``inner`` returned the loop's
updates as they are (:meth:`FinishedStep.finished`); anything ``inner`` did to them
after (another transform chained after the state's) makes it compute its step itself,
from those updates, as it would without a loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax


@dataclasses.dataclass
class FinishedStep:
    """A writer's step: ``finish(inner's updates, beside) -> (written, new beside)``,
    elementwise, where ``beside`` is the writer's own state it reads and writes (the
    masters), kept as it is. After a loop claimed it: the updates the loop returned
    (``updates``, its leaves as returned), what ``finish`` wrote, and the new
    ``beside``."""

    finish: Callable[[Any, Any], tuple[Any, Any]]
    beside: Any
    claimed: bool = False
    updates: list[Any] | None = None
    written: Any = None
    new_beside: Any = None

    def finished(self, inner_updates: Any) -> bool:
        """Whether ``inner_updates`` are the claiming loop's updates, leaf for leaf, so that
        its ``written`` and ``new_beside`` are the step's."""
        if self.updates is None:
            return False
        leaves = jax.tree.leaves(inner_updates)
        return len(leaves) == len(self.updates) and all(
            a is b for a, b in zip(leaves, self.updates, strict=True)
        )


_PENDING: contextvars.ContextVar[FinishedStep | None] = contextvars.ContextVar(
    "jaxscale_finished_step", default=None
)


@contextlib.contextmanager
def finishing(step: FinishedStep) -> Iterator[FinishedStep]:
    """Within the block, the first slice loop to run may claim ``step``."""
    token = _PENDING.set(step)
    try:
        yield step
    finally:
        _PENDING.reset(token)


def claim() -> FinishedStep | None:
    """The step handed down and not yet claimed, now claimed; ``None`` where there is none
    (so that a loop nested in the claiming one's update does not take it too)."""
    step = _PENDING.get()
    if step is None or step.claimed:
        return None
    step.claimed = True
    return step
