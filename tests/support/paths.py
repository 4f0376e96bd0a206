"""The repository's folders, and the examples importable as modules."""

from __future__ import annotations

import importlib
import os
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxscale"
EXAMPLES = ROOT / "examples"
NOTEBOOKS = ROOT / "notebooks"


def example(name: str) -> ModuleType:
    """The module ``examples/<name>.py`` (the examples import one another by name)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def this_checkout_first() -> str:
    """``PYTHONPATH`` for a child process: this checkout first, so that it imports the
    jaxscale under test whether or not it is installed, and from any folder."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
