"""Which source line an operation belongs to, from the user's point of view.

An equation's traceback runs from the frame that traced it out to the program's
entry. The user's line is the innermost frame outside JAX, jaxscale, the Python
standard library and the libraries a model is built from (Flax, Optax, Equinox,
Haiku); the innermost frame inside one of those libraries (the layer's own code,
``flax/nnx/nn/linear.py:…``) is kept beside it.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from dataclasses import dataclass

_LIBRARIES = ("flax", "optax", "equinox", "haiku", "jmp", "chex")
_INTERNALS = ("jax", "jaxlib", "jaxscale", "numpy", "jaxtyping", "pytest", "_pytest", "pluggy")


@dataclass(frozen=True)
class Location:
    """``user``: ``file.py:LINE`` of the user's frame (``""`` if none); ``library``: the
    innermost frame inside a model library, ``package/…/file.py:LINE`` (or ``""``);
    ``path``: the user frame's full file path."""

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


def _library_dirs() -> dict[str, str]:
    return {d: name for name in _LIBRARIES if (d := _package_dir(name))}


def _internal_dirs() -> list[str]:
    return [d for name in _INTERNALS if (d := _package_dir(name))]


def location(frames: list[tuple[str, int, str]]) -> Location:
    """The :class:`Location` of a traceback given as ``(file, line, function)``, innermost first."""
    libraries, internals, stdlib = _library_dirs(), _internal_dirs(), _stdlib()
    library = ""
    for file, line, _ in frames:
        path = os.path.abspath(file)
        owner = next((name for d, name in libraries.items() if path.startswith(d)), None)
        if owner is not None:
            if not library:
                inside = path.split(os.sep + owner + os.sep, 1)[-1]
                library = f"{owner}/{inside}:{line}"
            continue
        if any(path.startswith(d) for d in internals) or path.startswith(stdlib):
            continue
        if file.startswith("<") and file not in ("<stdin>", "<string>"):
            continue  # frozen importlib and similar
        return Location(f"{os.path.basename(file)}:{line}", library, path)
    return Location("", library, "")
