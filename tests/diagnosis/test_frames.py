"""The user's line is told from a library's by where the file lives.

jmp stands for any installed package jaxscale has never heard of (jraph, Diffrax,
transformers' Flax models): its frames are a library's because its files are under
``site-packages``, and the report names the user's file with a path that can be opened,
even when that file shares its name with the library's.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jax.numpy as jnp
import jmp
import pytest

import jaxscale
from jaxscale._src import frames as _frames


def test_an_unlisted_installed_package_is_a_library():
    root = next(r for r in _frames.installed_package_roots() if jmp.__file__.startswith(r))
    frames = [(jmp.__file__, 7, "scale"), (os.path.abspath(__file__), 42, "test")]
    where = _frames.location(frames)
    assert where.library == jmp.__file__[len(root) :].replace(os.sep, "/") + ":7"
    assert where.library.startswith("jmp/")
    assert where.user == f"{os.path.relpath(__file__)}:42"


def test_a_file_outside_the_working_directory_is_shown_in_full(tmp_path):
    outside = tmp_path / "model.py"
    where = _frames.location([(str(outside), 3, "f")])
    relative = os.path.relpath(outside)
    assert where.user == f"{outside if relative.startswith('..') else relative}:3"


@pytest.fixture
def installed_graphs_package(tmp_path, monkeypatch):
    """A package ``graphs`` installed in a ``site-packages`` folder (as jraph is), whose
    ``models.py`` embeds features with an overflowing float16 multiply; and the user's own
    ``models.py``, elsewhere, which calls it."""
    site_packages = tmp_path / "site-packages"
    (site_packages / "graphs").mkdir(parents=True)
    (site_packages / "graphs" / "__init__.py").write_text("")
    (site_packages / "graphs" / "models.py").write_text(
        "def embed(x):\n    return x * x  # line 2: overflows in float16\n"
    )
    user = tmp_path / "project"
    user.mkdir()
    (user / "models.py").write_text(
        "from graphs import models\n\ndef network(x):\n    return models.embed(x) + 1  # line 4\n"
    )
    monkeypatch.syspath_prepend(str(site_packages))
    _frames.installed_package_roots.cache_clear()
    spec = importlib.util.spec_from_file_location("user_models", user / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module, user / "models.py"
    sys.modules.pop("graphs", None)
    sys.modules.pop("graphs.models", None)
    _frames.installed_package_roots.cache_clear()


def test_locate_nonfinite_names_the_users_file_and_the_library_beside_it(installed_graphs_package):
    module, source = installed_graphs_package
    _, report = jaxscale.locate_nonfinite(module.network)(jnp.full(4, 300.0, jnp.float16))
    shown = os.path.relpath(source)
    shown = str(source) if shown.startswith("..") else shown
    assert report.describe() == (
        f"forward mul at {shown}:4 (in graphs/models.py:2): inf (float16)"
    ), report.describe()
