"""The machine the suite runs on: its platform and its devices.

By default the suite runs on the CPU with 8 simulated devices (``tests/conftest.py``).
With ``JAX_PLATFORMS=cuda`` it runs on a GPU, where a machine may have a single
device, and a test asks here for what it needs:

* :func:`devices` for a test of several devices: on a GPU machine with fewer, the
  test is skipped and says how many it needed; on the CPU too few devices is a broken
  set-up (the simulated devices were not configured) and fails, so a CPU run never
  skips one of these tests.
* :func:`compiled_on_cpu` for a test of the program XLA's CPU backend compiles (its fusions,
  copies, reductions): it runs on the CPU device whatever the default platform is,
  and is skipped, saying so, only where the CPU backend is not loaded
  (``JAX_PLATFORMS=cuda``; ``JAX_PLATFORMS=cuda,cpu`` runs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jax
import pytest

PLATFORM = jax.default_backend()
SIMULATED_CPU_DEVICES = 8  # what conftest asks XLA for


def devices(count: int) -> list[Any]:
    """The first ``count`` devices of the default platform."""
    found = jax.devices()
    if len(found) >= count:
        return found[:count]
    needs = f"needs {count} devices; this {PLATFORM} machine has {len(found)}"
    if PLATFORM == "cpu":
        pytest.fail(
            f"{needs}: the suite asks XLA for {SIMULATED_CPU_DEVICES} simulated CPU devices "
            "(tests/conftest.py); does XLA_FLAGS set another count?"
        )
    pytest.skip(needs)


def every_device() -> list[Any]:
    """Every device of the default platform: the simulated ones on the CPU (where fewer
    fails, as in :func:`devices`), the machine's own elsewhere."""
    return devices(SIMULATED_CPU_DEVICES) if PLATFORM == "cpu" else jax.devices()


def mesh(shape: tuple[int, ...], names: tuple[str, ...], **kwargs: Any) -> jax.sharding.Mesh:
    """``jax.make_mesh(shape, names, **kwargs)`` over :func:`devices` of the needed count."""
    count = 1
    for size in shape:
        count *= size
    return jax.make_mesh(shape, names, devices=devices(count), **kwargs)


def keeps_every_rounding() -> bool:
    """Whether XLA keeps every float16/bfloat16 rounding a program writes: on the CPU,
    and elsewhere with ``XLA_FLAGS=--xla_allow_excess_precision=false``. A GPU's XLA
    otherwise drops a rounding between operations it fuses, and two programs that
    fuse differently (one that also reads an intermediate value) then differ by it."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return PLATFORM == "cpu" or "--xla_allow_excess_precision=false" in flags


def has_platform(platform: str) -> bool:
    """Whether JAX has loaded ``platform`` (``"gpu"``, ``"tpu"``, ``"cpu"``) here."""
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # JAX's answer for a platform it did not load
        return False


def cpu_device(needs: str = "asserts what XLA's CPU backend compiles") -> Any:
    """The first CPU device, or a skip saying what the test ``needs`` it for."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        pytest.skip(
            f"{needs}, and the CPU backend is not loaded (default platform {PLATFORM}); "
            f"JAX_PLATFORMS={PLATFORM},cpu runs it"
        )


# Compiler options for a program a test compiles only to read it (its HLO, its
# collectives, its memory analysis) and never runs: they turn down LLVM's optimization
# of the machine code, which comes after XLA's HLO passes and buffer assignment, so the
# HLO and the memory figures are the same (checked on the 8-bit, stochastic-rounding and
# Kahan steps of 10M parameters) and the compile takes about half the CPU time. Not
# for a program that runs: there the figures it computes could change.
INSPECTION_ONLY = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
INSPECTION_ONLY_FLAGS = " ".join(f"--{name}={str(value).lower()}"
                                 for name, value in INSPECTION_ONLY.items())  # fmt: skip


def compiled_to_inspect(lowered: Any) -> Any:
    """``lowered.compile()`` with :data:`INSPECTION_ONLY`: for reading, never running."""
    return lowered.compile(compiler_options=INSPECTION_ONLY)


def compiled_on_cpu(jitted: Any, *args: Any) -> Any:
    """``jitted`` lowered and compiled for the CPU device (see :func:`cpu_device`), its
    arguments placed there: the program XLA's CPU backend makes of it."""
    with on_cpu() as cpu:
        return jitted.lower(*jax.device_put(args, cpu)).compile()


@contextlib.contextmanager
def on_cpu(needs: str = "asserts what XLA's CPU backend compiles") -> Iterator[Any]:
    """Run the body with the CPU device as JAX's default device (see :func:`cpu_device`):
    arrays it creates, and programs compiled for them, are the CPU's."""
    device = cpu_device(needs)
    with jax.default_device(device):
        yield device


def census(script: str) -> Any:
    """The JSON that ``script`` prints last, run in a process of its own: one that
    compiles programs to read their HLO from XLA's dumps (its dump flags are read when
    the process starts; ``sys.argv[1]`` holds :data:`INSPECTION_ONLY_FLAGS`). Without
    the persistent cache: a program loaded from it is not compiled, and XLA dumps
    nothing."""
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    result = subprocess.run(
        [sys.executable, "-c", script, INSPECTION_ONLY_FLAGS],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])
