"""The repository's folders, and the examples importable as modules."""

from __future__ import annotations

import importlib
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
