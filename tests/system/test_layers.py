"""The layers are folders, and imports only go down into core/ or sideways into _src/.

The folders of ``jaxscale/`` are the layers. The rules are derived from them:

* a module of a layer imports jaxscale only from its own folder, from ``_src/`` (the
  JAX machinery every layer shares) or from ``core/``; ``core/`` only from itself and
  ``_src/``; ``_src/`` only from itself;
* no module imports another folder's private modules (``jaxscale.core._rule``): only
  its package or its public modules (``jaxscale.core.shared``);
* every layer says which third-party libraries it may not import (``LIBRARIES_KEPT_OUT``
  must name every folder, so a new layer cannot arrive without a rule), and each
  of its modules imports with those libraries blocked, from no jaxscale module at all.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
from support import paths

PACKAGE = paths.PACKAGE
CORE = "core"
SHARED = "_src"

# Which libraries each layer must do without. core/ and _src/ are jax only.
LIBRARIES_KEPT_OUT = {
    "_src": ("optax", "flax"),
    "core": ("optax", "flax"),
    "transform": ("flax",),
    "facade": (),
    "casting": ("optax", "flax"),
    "diagnosis": ("optax", "flax"),
    "optim": ("flax",),
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


def allowed_targets(layer: str) -> set[str]:
    if layer == SHARED:
        return {SHARED}
    if layer == CORE:
        return {CORE, SHARED}
    return {layer, CORE, SHARED}


def import_violation(layer: str, imported: str) -> str | None:
    """Why ``layer`` may not import ``imported``, or None where it may."""
    parts = imported.split(".")
    target = parts[1] if len(parts) > 1 else None
    if target not in allowed_targets(layer):
        return f"{layer} may import only from {sorted(allowed_targets(layer))}"
    private = [part for part in parts[2:] if part.startswith("_")]
    if target != layer and target != SHARED and private:
        return f"{private[0]} is private to {target}/"
    return None


@pytest.mark.parametrize("layer", layers())
def test_imports_go_only_into_core_or_sideways_into_src(layer):
    for filename, imported in jaxscale_imports(layer):
        violation = import_violation(layer, imported)
        assert violation is None, f"{layer}/{filename} imports {imported}: {violation}"


@pytest.mark.parametrize(
    ("layer", "imported", "allowed"),
    [
        ("transform", "jaxscale.core", True),
        ("transform", "jaxscale.core.shared", True),
        ("transform", "jaxscale._src.jaxprs", True),
        ("transform", "jaxscale.core._rule", False),  # another layer's private module
        ("transform", "jaxscale.facade", False),  # a layer above
        ("core", "jaxscale.transform", False),
        ("core", "jaxscale.core._rule", True),
        ("_src", "jaxscale.core", False),  # the shared machinery is below every layer
        ("_src", "jaxscale._src.jaxprs", True),
    ],
)
def test_the_import_rule_refuses_what_it_should(layer, imported, allowed):
    assert (import_violation(layer, imported) is None) == allowed


def test_the_scan_of_imports_sees_them():
    imported = {name for _, name in jaxscale_imports("facade")}
    assert "jaxscale.core" in imported
    assert "jaxscale.facade._iteration" in imported


# Run in a fresh interpreter: imports JAX and NumPy, which no layer keeps out and which
# take most of an interpreter's start, then forks one child per (module, blocked) pair.
# Each child blocks its libraries, stands in an empty package for ``jaxscale`` (so that
# only the module, its folder's ``__init__`` and what they import run, not the package's
# re-exports of every layer) and imports the module: each import starts from no jaxscale
# module at all, as in an interpreter of its own. Prints {index: traceback or ""}.
_IMPORT_EACH = """
import importlib, json, os, sys, traceback, types
import jax, numpy

package_path, cases = sys.argv[1], json.loads(sys.argv[2])
assert not any(name.startswith("jaxscale") for name in sys.modules)
results = {}
for index, (module, blocked) in enumerate(cases):
    for name in blocked:
        assert name not in sys.modules, f"{name} was imported before it was blocked"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            for name in blocked:
                sys.modules[name] = None  # any import of it now fails
            package = types.ModuleType("jaxscale")
            package.__path__ = [package_path]
            sys.modules["jaxscale"] = package
            importlib.import_module(module)
            message = ""
        except BaseException:
            message = traceback.format_exc()
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        results[index] = pipe.read().decode()
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


def imports_with_blocked(cases: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """For each ``(module, blocked)``: the traceback of importing ``module`` where importing
    any of ``blocked`` fails ("" where it imported), each from no jaxscale module at all."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, str(PACKAGE), json.dumps(cases)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    return [found[str(index)] for index in range(len(cases))]


BLOCKED_PER_MODULE = [
    (module, LIBRARIES_KEPT_OUT[layer])
    for layer in layers()
    if LIBRARIES_KEPT_OUT[layer]
    for module in modules_of(layer)
]


# the cases that show the check can fail, and that each import starts afresh
CHECKS_OF_THE_CHECK = [
    ("jaxscale.facade", ("flax",)),
    ("jaxscale.transform", ()),
    ("jaxscale.transform", ("optax",)),
]


@pytest.fixture(scope="module")
def import_failures() -> dict[tuple[str, tuple[str, ...]], str]:
    """The traceback of each import above ("" where it imported), from one interpreter."""
    cases = BLOCKED_PER_MODULE + CHECKS_OF_THE_CHECK
    return dict(zip(cases, imports_with_blocked(cases), strict=True))


@pytest.mark.parametrize(("module", "blocked"), BLOCKED_PER_MODULE)
def test_each_module_imports_without_the_libraries_its_layer_keeps_out(
    module, blocked, import_failures
):
    assert import_failures[module, blocked] == ""


def test_the_facade_needs_flax_and_the_layers_below_it_do_not(import_failures):
    last_line = import_failures["jaxscale.facade", ("flax",)].splitlines()[-1]
    assert last_line.startswith("ModuleNotFoundError")
    assert "flax" in last_line
    assert import_failures["jaxscale.transform", ("flax",)] == ""


def test_blocking_a_library_is_noticed(import_failures):
    # the check above can fail: the transform, which needs optax, fails without it, and
    # each import starts afresh: the transform imported before does not hide it
    assert import_failures["jaxscale.transform", ()] == ""
    last_line = import_failures["jaxscale.transform", ("optax",)].splitlines()[-1]
    assert last_line.startswith("ModuleNotFoundError")
    assert "optax" in last_line


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
