"""How the suite adapts to the machine it runs on (``tests/support/machine.py``).

On the CPU the suite has its 8 simulated devices and never skips a test for want of
one; on a GPU machine the tests of several devices run when there are enough and say
why not when there are not, and the tests of the CPU's compiled program run on the CPU
device when JAX has loaded one.
"""

from __future__ import annotations

import jax
import pytest
from support import machine


def test_the_cpu_run_has_its_simulated_devices():
    if machine.PLATFORM != "cpu":
        pytest.skip(f"runs on the CPU; this is a {machine.PLATFORM} run")
    assert len(machine.every_device()) == machine.SIMULATED_CPU_DEVICES
    assert machine.devices(4) == jax.devices()[:4]
    assert machine.mesh((2, 2), ("a", "b")).devices.size == 4


def test_too_few_devices_fail_on_the_cpu(monkeypatch):
    monkeypatch.setattr(machine, "PLATFORM", "cpu")
    monkeypatch.setattr(jax, "devices", lambda backend=None: ["only"])
    with pytest.raises(pytest.fail.Exception, match=r"needs 8 devices; this cpu machine has 1"):
        machine.devices(8)


def test_too_few_devices_skip_on_a_gpu(monkeypatch):
    monkeypatch.setattr(machine, "PLATFORM", "gpu")
    monkeypatch.setattr(jax, "devices", lambda backend=None: ["only"])
    with pytest.raises(pytest.skip.Exception, match=r"needs 2 devices; this gpu machine has 1"):
        machine.devices(2)
    assert machine.every_device() == ["only"]


def test_a_cpu_program_test_says_how_to_run_it_without_the_cpu_backend(monkeypatch):
    def without_cpu(backend=None):
        raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")

    monkeypatch.setattr(machine, "PLATFORM", "gpu")
    monkeypatch.setattr(jax, "devices", without_cpu)
    with pytest.raises(pytest.skip.Exception, match=r"JAX_PLATFORMS=gpu,cpu runs it"):
        machine.cpu_device()


def test_on_cpu_makes_the_cpu_device_the_default():
    with machine.on_cpu() as cpu:
        assert jax.numpy.ones(3).devices() == {cpu}
        assert cpu.platform == "cpu"


def test_a_platform_jax_did_not_load_is_absent():
    assert machine.has_platform(machine.PLATFORM)
    assert not machine.has_platform("no_such_platform")
