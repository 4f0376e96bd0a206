"""The layers are folders, and imports only go down or sideways into core/.

The folders of ``jaxscale/`` are the layers. The rules are derived from them:

* a module of a layer imports jaxscale only from its own folder or from ``core/``;
  ``core/`` imports only from itself;
* every layer says which third-party libraries it may not import (``LIBRARIES_KEPT_OUT``
  must name every folder, so a new layer cannot arrive without a rule), and each
  of its modules imports in a fresh interpreter with those libraries blocked.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest
from support import paths

PACKAGE = paths.PACKAGE
CORE = "core"

# Which libraries each layer must do without. core/ is jax only.
LIBRARIES_KEPT_OUT = {
    "core": ("optax", "flax"),
    "transform": ("flax",),
    "facade": (),
    "casting": ("optax", "flax"),
    "diagnosis": ("optax", "flax"),
}


def layers() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def modules_of(layer: str) -> list[str]:
    return sorted(
        f"jaxscale.{layer}" + ("" if path.stem == "__init__" else f".{path.stem}")
        for path in (PACKAGE / layer).glob("*.py")
    )


def jaxscale_imports(layer: str) -> list[tuple[str, str]]:
    """(file, imported jaxscale module) for every import statement in ``layer``."""
    found = []
    for path in sorted((PACKAGE / layer).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                if node.module == "jaxscale":
                    names = [f"jaxscale.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [(path.name, n) for n in names if n.split(".")[0] == "jaxscale"]
    return found


def test_the_layers_are_the_design_folders():
    assert layers() == sorted(LIBRARIES_KEPT_OUT)
    assert CORE in layers()


@pytest.mark.parametrize("layer", layers())
def test_imports_go_only_sideways_or_into_core(layer):
    allowed = {layer, CORE}
    for filename, imported in jaxscale_imports(layer):
        parts = imported.split(".")
        target = parts[1] if len(parts) > 1 else None
        assert target in allowed, f"{layer}/{filename} imports {imported}"
        if layer == CORE:
            assert target == CORE


def test_the_scan_of_imports_sees_them():
    imported = {name for _, name in jaxscale_imports("facade")}
    assert "jaxscale.core" in imported
    assert "jaxscale.facade._iteration" in imported


def import_with_blocked(
    module: str, blocked: tuple[str, ...], *, alone: bool = True
) -> subprocess.CompletedProcess:
    """Import ``module`` in a fresh interpreter where importing ``blocked`` fails.

    ``alone``: the ``jaxscale`` package is stood in for by an empty package on the
    same path, so that only ``module``, its folder's ``__init__`` and what they
    import run, not the package's top-level re-exports of every layer.
    """
    code = textwrap.dedent(f"""
        import sys, types
        for name in {blocked!r}:
            sys.modules[name] = None  # any import of it now fails
        if {alone!r}:
            package = types.ModuleType("jaxscale")
            package.__path__ = [{str(PACKAGE)!r}]
            sys.modules["jaxscale"] = package
        import importlib
        importlib.import_module({module!r})
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.parametrize(
    ("module", "blocked"),
    [
        (module, LIBRARIES_KEPT_OUT[layer])
        for layer in layers()
        if LIBRARIES_KEPT_OUT[layer]
        for module in modules_of(layer)
    ],
)
def test_each_module_imports_without_the_libraries_its_layer_keeps_out(module, blocked):
    result = import_with_blocked(module, blocked)
    assert result.returncode == 0, result.stderr


def test_the_facade_needs_flax_and_the_layers_below_it_do_not():
    result = import_with_blocked("jaxscale.facade", ("flax",))
    assert result.returncode != 0
    assert "flax" in result.stderr
    assert import_with_blocked("jaxscale.transform", ("flax",)).returncode == 0


def test_blocking_a_library_is_noticed():
    # the check above can fail: the transform, which needs optax, fails without it
    result = import_with_blocked("jaxscale.transform", ("optax",))
    assert result.returncode != 0
    assert "optax" in result.stderr


@pytest.mark.parametrize("layer", [layer for layer in layers() if LIBRARIES_KEPT_OUT[layer]])
def test_no_import_statement_names_a_library_the_layer_keeps_out(layer):
    # also catches imports inside functions, which importing the module does not run
    for path in sorted((PACKAGE / layer).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in LIBRARIES_KEPT_OUT[layer], (
                    f"{layer}/{path.name} imports {name}"
                )
