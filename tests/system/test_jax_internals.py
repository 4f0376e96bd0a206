"""One module knows JAX's internals: ``jaxscale/_src/jaxprs.py``.

Every read of a primitive's parameters (``eqn.params``) and every import from
``jax._src`` lives there; rules elsewhere take an equation's parameters as keyword
arguments or ask that module for a fact by name. So a JAX release that renames or
regroups a parameter changes one file. The scan below reads each module's syntax tree,
so a comment or a docstring that mentions ``eqn.params`` does not count, and any other
attribute named ``params`` (an ``nnx.Optimizer``'s) is not an equation's.
"""

from __future__ import annotations

import ast

import pytest
from support import paths

THE_MODULE = paths.PACKAGE / "_src" / "jaxprs.py"


def internals_read(source: str) -> list[str]:
    """What a module's code reads of JAX's internals: ``<x>.params`` where ``x`` is an
    equation (a name or attribute containing ``eqn``, or subscripted or iterated as a
    parameter dict), and any ``jax._src`` import or attribute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "params":
            owner = ast.unparse(node.value)
            if "eqn" in owner or owner == "call" or owner.endswith("equation"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "params"
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names]
            found += [f"line {node.lineno}: import {n}" for n in names if n.startswith("jax._src")]
        if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("jax._src"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def modules():
    return sorted(p for p in paths.PACKAGE.rglob("*.py") if p != THE_MODULE)


@pytest.mark.parametrize("module", modules(), ids=lambda p: str(p.relative_to(paths.PACKAGE)))
def test_no_module_but_jaxprs_reads_jax_internals(module):
    assert internals_read(module.read_text()) == []


def test_the_one_module_does_read_them():
    assert internals_read(THE_MODULE.read_text())


@pytest.mark.parametrize(
    "line",
    [
        "x = eqn.params['jaxpr']",
        "x = eqn.params.get('name')",
        "p = dict(eqn.params)",
        "x = call.params['name']",
        "x = self.params_of['a'].params['jaxpr']",
        "from jax._src import core",
        "import jax._src.core",
        "x = jax._src.core.Primitive",
    ],
)
def test_the_scan_sees_a_planted_read(line):
    assert internals_read(line)


@pytest.mark.parametrize("line", ["p = optimizer.params", "p = self.params(optimizer)"])
def test_other_params_attributes_are_not_reads(line):
    assert internals_read(line) == []
