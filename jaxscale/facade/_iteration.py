"""PyTorch GradScaler's per-iteration bookkeeping: which optimizers were unscaled or stepped.

Between two ``update()`` calls PyTorch tracks, for every optimizer, a stage
(ready, unscaled, stepped) and the ``found_inf`` recorded by ``unscale_``. The
misuse errors (a second ``unscale_``, ``unscale_`` after ``step`` ...) come from
these stages, so they are Python state checked at trace time. It also tracks
whether ``scale()`` was ever called (PyTorch's lazily created ``_scale``).

A :class:`GradScaler` holds one :class:`Iteration` by reference, so ``nnx.jit``
and ``jax.jit`` traces of the scaler share it. Records made inside a trace hold
that trace's values, so they belong to it: when a later call runs in another
trace (the traced function returned, or raised, without ``update()``), the
records are dropped as stale, and ``update()`` explains what happened.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.extend


def _current_trace() -> object:
    return jax.extend.core.get_opaque_trace_state(convention="jaxscale")


class Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class OptimizerRecord:
    """One optimizer's progress through the current iteration.

    ``found_inf`` is None until its gradients are checked, and stays None when
    they held no floating leaf (PyTorch's empty ``found_inf_per_device``).
    ``scaled_leaves`` are the floating leaves ``unscale_`` was given, kept until
    ``step`` so that ``step`` can refuse them: they are still scaled.
    """

    stage: Stage = Stage.READY
    found_inf: jax.Array | None = None
    scaled_leaves: tuple[Any, ...] = ()


class Iteration:
    """Bookkeeping shared by every copy of one GradScaler; compared by identity."""

    def __init__(self) -> None:
        self.scale_called = False
        self._optimizers: dict[int, OptimizerRecord] = {}
        self._trace: object = None
        self.dropped_stale = False
        # The iteration ended by the last update(): which optimizers it checked, and
        # their flags while still in the trace that computed them.
        self.finished_ids: frozenset[int] = frozenset()
        self._finished_flags: dict[int, jax.Array | None] = {}
        self._finished_trace: object = None
        # To notice a scaler whose traced update() never came back: the state's arrays
        # when last seen outside a trace, and whether update() was traced since.
        self.seen_state: tuple[Any, ...] = ()
        self.traced_update = False

    @property
    def optimizers(self) -> dict[int, OptimizerRecord]:
        """The records of the current trace; records left by another trace are dropped."""
        if self._optimizers and self._trace != _current_trace():
            self._optimizers = {}
            self.dropped_stale = True
        return self._optimizers

    def record(self, optimizer: object) -> OptimizerRecord:
        """The record for ``optimizer`` (keyed by ``id``, as PyTorch does); not stored yet."""
        return self.optimizers.get(id(optimizer), OptimizerRecord())

    def store(self, optimizer: object, record: OptimizerRecord) -> None:
        if not self.optimizers:
            self._trace = _current_trace()
        self._optimizers[id(optimizer)] = record
        self.dropped_stale = False

    def finished_flag(self, optimizer: object) -> tuple[bool, jax.Array | None]:
        """``(known, found_inf)`` of ``optimizer`` in the iteration the last update() ended,
        when that update ran in the current trace."""
        if self._finished_trace != _current_trace() or id(optimizer) not in self._finished_flags:
            return False, None
        return True, self._finished_flags[id(optimizer)]

    def finish(self) -> None:
        """End the iteration (``update()``), keeping what ``found_inf(optimizer)`` reports."""
        records = self.optimizers
        self.finished_ids = frozenset(records)
        self._finished_flags = {key: record.found_inf for key, record in records.items()}
        self._finished_trace = _current_trace()
        self.clear()

    def clear(self) -> None:
        self._optimizers = {}
        self.dropped_stale = False
