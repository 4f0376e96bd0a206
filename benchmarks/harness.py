"""Timing harness: interleaved repeats in one process, medians, ratios to a baseline.

The machines these run on are shared and noisy, so a variant is never timed
alone: every variant is built first, warmed up (compiled and run), and then the
repeats are interleaved (baseline, A, B, baseline, A, B, ...) so that a slow
moment of the machine affects all variants alike. Each repeat times ``inner``
consecutive steps and ends by blocking on the result; the figure reported is the
median over repeats of the time per step.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


class Stepper:
    """One benchmark variant: owns its state and advances it one step at a time."""

    def step(self) -> None:
        raise NotImplementedError

    def block(self) -> None:
        """Wait until all dispatched work has finished."""
        raise NotImplementedError


class JaxStepper(Stepper):
    """Calls ``fn(*state) -> state`` repeatedly; state is donated where ``fn`` donates."""

    def __init__(self, fn: Callable[..., Any], state: tuple[Any, ...], extra: tuple[Any, ...] = ()):
        self.fn, self.state, self.extra = fn, state, extra

    def step(self) -> None:
        self.state = self.fn(*self.state, *self.extra)

    def block(self) -> None:
        jax.block_until_ready(self.state)


@dataclasses.dataclass
class Result:
    name: str
    seconds: float  # median time per step
    ratio: float | None  # to the baseline of the same group
    samples: list[float]
    # median time per step for the calls to return, before waiting for the device: the
    # host's share (where it is near ``seconds``, the step is bound by dispatch)
    returned: float | None = None


def measure(
    variants: dict[str, Callable[[], Stepper]],
    baseline: str,
    *,
    warmup: int = 3,
    repeats: int = 9,
    inner: int = 5,
) -> list[Result]:
    """Build every variant, warm them up, then time interleaved repeats.

    ``variants`` maps a name to a factory, so that a variant's memory is only
    allocated when the benchmark starts. Returns one :class:`Result` per variant,
    with its ratio to ``baseline``.
    """
    steppers = {name: make() for name, make in variants.items()}
    for stepper in steppers.values():
        for _ in range(warmup):
            stepper.step()
        stepper.block()
    samples: dict[str, list[float]] = {name: [] for name in steppers}
    returned: dict[str, list[float]] = {name: [] for name in steppers}
    for repeat in range(repeats):
        order = list(steppers)
        if repeat % 2:  # alternate the order so no variant always runs right after another
            order.reverse()
        for name in order:
            stepper = steppers[name]
            start = time.perf_counter()
            for _ in range(inner):
                stepper.step()
            returned[name].append((time.perf_counter() - start) / inner)
            stepper.block()
            samples[name].append((time.perf_counter() - start) / inner)
    base = statistics.median(samples[baseline])
    return [
        Result(
            name,
            statistics.median(s),
            statistics.median(s) / base,
            s,
            statistics.median(returned[name]),
        )
        for name, s in samples.items()
    ]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str]:
    """The machine and software the figures were measured on."""
    device = jax.devices()[0]
    return {
        "cpu": f"{_cpu_model()}, {os.cpu_count()} cores",
        "jax device": f"{device.platform}: {device.device_kind}",
        "python": platform.python_version(),
        **{name: _version(name) for name in ["jax", "jaxlib", "optax", "flax", "torch", "jmp"]},
    }


def table(results: list[Result], unit: str = "ms", per: str = "step") -> str:
    """A markdown table of ``results``; with the time the calls took to return where
    every result has it (the host's share of a step)."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    host = all(r.returned is not None for r in results)
    header = f"| variant | median {unit}/{per} | ratio to baseline |"
    lines = [header + " returned after |" if host else header]
    lines.append("|---|---|---|---|" if host else "|---|---|---|")
    for r in results:
        ratio = "1 (baseline)" if r.ratio == 1.0 else f"{r.ratio:.3f}"
        line = f"| {r.name} | {r.seconds * scale:.2f} | {ratio} |"
        lines.append(line + f" {r.returned * scale:.2f} |" if host else line)
    return "\n".join(lines)
