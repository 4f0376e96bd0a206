"""Real multi-process training: JAX's multi-controller runtime, as on several hosts.

``examples/multi_host.py --processes N`` starts N processes on this machine, each
with two CPU devices, joined by ``jax.distributed.initialize`` with gloo CPU
collectives: the same code path as N hosts. Each trains one model on a global
mesh; at step 5 an inf is put into the batch on one device of the last process.
Every process must skip that step and back off alike, and end with the same
scale, tracker and parameters; a checkpoint written by the job resumes
bit-identically; a process that dies makes the others stop with JAX's error.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

import numpy as np
import pytest
from support import paths

EXAMPLES = paths.EXAMPLES
POISON_STEP = 5
# PyTorch's rule from 1024 with growth_interval 3: grow after steps 2, 8, 11; back off at 5
EXPECTED_SCALES = [1024, 1024, 2048, 2048, 2048, 1024, 1024, 1024, 2048, 2048, 2048, 4096]


def _this_checkout_first() -> str:
    """``PYTHONPATH`` for the job's processes: they run from a temporary folder, and
    import the jaxscale under test (this checkout) whether or not it is installed."""
    return os.pathsep.join(filter(None, [str(paths.ROOT), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="module")
def multi_host():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("multi_host")
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture
def run(multi_host, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTI_HOST_OUT", str(tmp_path))
    # The job's processes are CPU hosts joined by gloo, whatever platform runs the suite.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", _this_checkout_first())
    monkeypatch.chdir(tmp_path)

    def run(*argv: str, timeout: float = 240.0):
        argv = list(argv)
        return multi_host.launch(multi_host.parse(argv), argv, timeout=timeout)

    return run


def single_process(multi_host, tmp_path, *argv: str) -> dict:
    """The same global job on one process with all four devices."""
    out = tmp_path / "single.json"
    import json
    import subprocess

    command = [sys.executable, str(EXAMPLES / "multi_host.py"), "--local-devices", "4",
               *argv, "--out", str(out)]  # fmt: skip
    # as the multi-process job's hosts
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _this_checkout_first()}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(out.read_text())


def assert_identical_everywhere(records):
    assert all(r["returncode"] == 0 for r in records), [r["stderr"][-1500:] for r in records]
    assert [r["process"] for r in records] == list(range(len(records)))
    first = records[0]
    for other in records[1:]:
        assert other["steps"] == first["steps"]
        assert other["params"] == first["params"]  # every replicated array, bit for bit


@pytest.mark.parametrize("interface", ["facade", "transform", "trainstate", "shard_map"])
def test_two_processes_skip_and_back_off_together(run, multi_host, tmp_path, interface):
    records = run("--processes", "2", "--interface", interface, "--poison-step", "5")
    assert_identical_everywhere(records)
    steps = records[0]["steps"]
    assert records[0]["devices"] == 4
    assert [s["found_inf"] for s in steps] == [i == POISON_STEP for i in range(12)]
    assert [s["scale"] for s in steps] == EXPECTED_SCALES
    # the same job on one process of four devices takes the same decisions
    alone = single_process(multi_host, tmp_path, "--interface", interface)
    assert alone["steps"] == steps
    np.testing.assert_allclose(alone["parameters"], records[0]["parameters"], rtol=1e-5)


def test_four_processes(run):
    records = run("--processes", "4", "--steps", "8", "--poison-process", "2")
    assert_identical_everywhere(records)
    assert records[0]["devices"] == 8
    assert [s["found_inf"] for s in records[0]["steps"]] == [i == POISON_STEP for i in range(8)]


def test_a_checkpoint_of_the_job_resumes_bit_identically(run, multi_host, tmp_path):
    straight = run("--processes", "2")
    assert_identical_everywhere(straight)
    first_half = run("--processes", "2", "--steps", "7", "--save-at", "6")
    assert_identical_everywhere(first_half)
    resumed = run("--processes", "2", "--restore", str(tmp_path / "ckpt" / "7"))
    assert_identical_everywhere(resumed)
    assert resumed[0]["params"] == straight[0]["params"]
    assert resumed[0]["steps"] == straight[0]["steps"][7:]
    # into a single process: the same decisions; the cross-device sums run in another
    # order (in-process rather than gloo), so parameters agree to float32 rounding
    alone = single_process(multi_host, tmp_path, "--restore", str(tmp_path / "ckpt" / "7"))
    assert alone["steps"] == straight[0]["steps"][7:]
    np.testing.assert_allclose(alone["parameters"], straight[0]["parameters"], rtol=1e-5)


def test_a_process_that_dies_stops_the_others_with_jaxs_error(run):
    start = time.monotonic()
    records = run("--processes", "2", "--die-at-step", "3", "--heartbeat-timeout", "5",
                  timeout=90)  # fmt: skip
    elapsed = time.monotonic() - start
    assert records[1]["returncode"] == 1  # the one that exited
    survivor = records[0]
    assert survivor["returncode"] != 0
    assert "another task died" in survivor["stderr"] or "heartbeat" in survivor["stderr"]
    assert elapsed < 60
