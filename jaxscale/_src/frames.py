"""Which source line an operation belongs to, from the user's point of view.

An equation's traceback runs from the frame that traced it out to the program's
entry. Frames are told apart by where their files live, not by a list of names:

* JAX's, jaxlib's, NumPy's and jaxscale's own frames are the tools: skipped;
* the Python standard library's frames: skipped;
* frames of any installed package (a file under one of the interpreter's
  ``site-packages`` or ``dist-packages`` folders: Flax, Optax, Equinox, Haiku, jraph,
  Diffrax, transformers' Flax models, ...) are a library's: the innermost one is
  kept, as ``package/…/file.py:LINE``;
* the innermost other frame is the user's line, shown with a path the user can
  open: relative to the working directory when the file is under it, else absolute.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
from dataclasses import dataclass

# the tools a traceback passes through on the way to the user's code
_INTERNALS = ("jax", "jaxlib", "jaxscale", "numpy")


@dataclass(frozen=True)
class Location:
    """``user``: ``path/to/file.py:LINE`` of the user's frame (``""`` if none);
    ``library``: the innermost frame inside an installed package,
    ``package/…/file.py:LINE`` (or ``""``); ``path``: the user frame's absolute path."""

    user: str
    library: str
    path: str

    def text(self) -> str:
        if not self.user:
            return self.library or "an unknown line"
        return f"{self.user} (in {self.library})" if self.library else self.user


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(origin)) + os.sep if origin else None


@functools.cache
def _stdlib() -> str:
    return os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


@functools.cache
def installed_package_roots() -> tuple[str, ...]:
    """The folders installed distributions live in: the interpreter's ``purelib`` and
    ``platlib``, ``site``'s global and user folders, and every ``site-packages`` or
    ``dist-packages`` folder on ``sys.path`` (a virtual environment's among them)."""
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    roots.update(getattr(site, "getsitepackages", list)())
    user = getattr(site, "getusersitepackages", lambda: None)()
    if isinstance(user, str):
        roots.add(user)
    roots.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return tuple(sorted({os.path.abspath(r) + os.sep for r in roots if r}, key=len, reverse=True))


def _internal_dirs() -> list[str]:
    return [d for name in _INTERNALS if (d := _package_dir(name))]


def _shown_path(path: str) -> str:
    """``path`` relative to the working directory when under it, else as given."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith(os.pardir + os.sep) or relative == os.pardir else relative


def location(frames: list[tuple[str, int, str]]) -> Location:
    """The :class:`Location` of a traceback given as ``(file, line, function)``, innermost first."""
    roots, internals, stdlib = installed_package_roots(), _internal_dirs(), _stdlib()
    library = ""
    for file, line, _ in frames:
        if file.startswith("<") and file not in ("<stdin>", "<string>"):
            continue  # frozen importlib and similar
        path = os.path.abspath(file)
        if any(path.startswith(d) for d in internals):
            continue
        root = next((r for r in roots if path.startswith(r)), None)
        if root is not None:
            if not library:
                library = f"{path[len(root) :].replace(os.sep, '/')}:{line}"
            continue
        if path.startswith(stdlib):
            continue
        return Location(f"{_shown_path(path)}:{line}", library, path)
    return Location("", library, "")
