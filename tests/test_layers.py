"""The layers depend only downwards: the core and the Optax transform import without flax."""

import subprocess
import sys
import textwrap

import pytest

CORE_AND_TRANSFORM = [
    "jaxscale._rounding",
    "jaxscale._state",
    "jaxscale._finite",
    "jaxscale._unscale",
    "jaxscale._scaling",
    "jaxscale._update_rule",
    "jaxscale._skip",
    "jaxscale._transform",
    "jaxscale._lookup",
]


def import_without_flax(module):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["flax"] = None  # any import of flax now fails
        import importlib
        importlib.import_module({module!r})
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.parametrize("module", CORE_AND_TRANSFORM)
def test_core_and_transform_import_without_flax(module):
    result = import_without_flax(module)
    assert result.returncode == 0, result.stderr


def test_the_facade_does_need_flax():
    result = import_without_flax("jaxscale._facade")
    assert result.returncode != 0
    assert "flax" in result.stderr
