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
import importlib.metadata
import os
import re
import sys
import time

import numpy as np
import pytest
from support import paths

EXAMPLES = paths.EXAMPLES
POISON_STEP = 5
JAX_VERSION = tuple(int(part) for part in re.findall(r"\d+", importlib.metadata.version("jax"))[:3])
# PyTorch's rule from 1024 with growth_interval 3: grow after steps 2, 8, 11; back off at 5
EXPECTED_SCALES = [1024, 1024, 2048, 2048, 2048, 1024, 1024, 1024, 2048, 2048, 2048, 4096]


@pytest.fixture(scope="module")
def multi_host():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("multi_host")
    finally:
        sys.path.remove(str(EXAMPLES))


def compile_afresh_where_cached_jobs_hang(monkeypatch):
    """On JAX 0.12.1 a multi-process CPU job (gloo) whose executables come from the
    persistent compilation cache never finishes (measured: two processes, one jitted
    sum over a global mesh, run twice on one cache: the second run hangs; JAX 0.12.0.1
    finishes both), so its processes compile afresh there."""
    if JAX_VERSION >= (0, 12, 1):
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)


@pytest.fixture
def run(multi_host, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTI_HOST_OUT", str(tmp_path))
    compile_afresh_where_cached_jobs_hang(monkeypatch)
    # The job's processes are CPU hosts joined by gloo, whatever platform runs the suite.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", paths.this_checkout_first())
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
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": paths.this_checkout_first()}
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
        for interface, run in first["runs"].items():
            assert other["runs"][interface]["steps"] == run["steps"], interface
            # every replicated array, bit for bit
            assert other["runs"][interface]["params"] == run["params"], interface


def test_two_processes_skip_and_back_off_together(run, multi_host, tmp_path):
    # Every interface in one job (and one reference job), trained one after the other
    # in the same processes: a process and its collectives are started once.
    interfaces = list(multi_host.INTERFACES)
    records = run("--processes", "2", "--interface", *interfaces, "--poison-step", "5")
    assert_identical_everywhere(records)
    assert records[0]["devices"] == 4
    assert list(records[0]["runs"]) == interfaces
    # the same job on one process of four devices takes the same decisions
    alone = single_process(multi_host, tmp_path, "--interface", *interfaces)
    for interface in interfaces:
        steps = records[0]["runs"][interface]["steps"]
        found_inf = [s["found_inf"] for s in steps]
        assert found_inf == [i == POISON_STEP for i in range(12)], interface
        assert [s["scale"] for s in steps] == EXPECTED_SCALES, interface
        assert alone["runs"][interface]["steps"] == steps, interface
        np.testing.assert_allclose(
            alone["runs"][interface]["parameters"],
            records[0]["runs"][interface]["parameters"],
            rtol=1e-5,
            err_msg=interface,
        )


def test_four_processes(run):
    records = run("--processes", "4", "--steps", "8", "--poison-process", "2")
    assert_identical_everywhere(records)
    assert records[0]["devices"] == 8
    steps = records[0]["runs"]["facade"]["steps"]
    assert [s["found_inf"] for s in steps] == [i == POISON_STEP for i in range(8)]


def test_a_checkpoint_of_the_job_resumes_bit_identically(run, multi_host, tmp_path):
    # One straight run of twelve steps writes the checkpoint after step 6 on its way.
    straight = run("--processes", "2", "--save-at", "6")
    assert_identical_everywhere(straight)
    resumed = run("--processes", "2", "--restore", str(tmp_path / "ckpt" / "7"))
    assert_identical_everywhere(resumed)
    straight_run, resumed_run = straight[0]["runs"]["facade"], resumed[0]["runs"]["facade"]
    assert resumed_run["params"] == straight_run["params"]
    assert resumed_run["steps"] == straight_run["steps"][7:]
    # into a single process: the same decisions; the cross-device sums run in another
    # order (in-process rather than gloo), so parameters agree to float32 rounding
    alone = single_process(multi_host, tmp_path, "--restore", str(tmp_path / "ckpt" / "7"))
    alone_run = alone["runs"]["facade"]
    assert alone_run["steps"] == straight_run["steps"][7:]
    np.testing.assert_allclose(alone_run["parameters"], straight_run["parameters"], rtol=1e-5)


def test_save_and_restore_take_one_interface(multi_host, capsys):
    for option in (["--save-at", "3"], ["--restore", "ckpt/4"]):
        with pytest.raises(SystemExit):
            multi_host.parse(["--interface", "facade", "transform", *option])
        assert "take one --interface" in capsys.readouterr().err


def test_the_launcher_forwards_every_option_but_the_process_count(multi_host):
    argv = ["--processes", "2", "--poison-process", "2", "--steps", "2"]
    assert multi_host.without_option(argv, "--processes") == argv[2:]
    assert multi_host.without_option(["--processes=4", "--steps", "4"], "--processes") == [
        "--steps",
        "4",
    ]


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


@pytest.mark.parametrize("axes", ["automatic", "explicit"])
def test_8_bit_state_sharded_over_two_processes_steps_as_on_one(axes, tmp_path, monkeypatch):
    # examples/fsdp_low_precision.py: parameters and their 8-bit Adam state sharded along
    # the first axis over 4 devices, as two processes of two devices and as one of four
    # (on automatic axes); the two processes' mesh with automatic or explicit axes
    sys.path.insert(0, str(EXAMPLES))
    try:
        fsdp = importlib.import_module("fsdp_low_precision")
    finally:
        sys.path.remove(str(EXAMPLES))
    monkeypatch.setenv("FSDP_OUT", str(tmp_path))
    compile_afresh_where_cached_jobs_hang(monkeypatch)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", paths.this_checkout_first())
    records = fsdp.launch(fsdp.parse(["--processes", "2", "--axes", axes]))
    assert [r["returncode"] for r in records] == [0, 0], [r["stderr"] for r in records]
    command = [sys.executable, str(EXAMPLES / "fsdp_low_precision.py"), "--local-devices", "4"]
    import json
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": paths.this_checkout_first()}
    alone = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert alone.returncode == 0, alone.stderr[-2000:]
    single = json.loads(alone.stdout.strip().splitlines()[-1])
    for record in records:
        assert record["devices"] == single["devices"] == 4
        assert record["digest"] == single["digest"]  # parameters and state, bit for bit
        assert record["collectives"] == single["collectives"] == 0
        # each process holds half the state; one process of four devices holds all of it
        assert record["state_bytes_here"] == pytest.approx(single["state_bytes"] / 2, rel=0.01)
