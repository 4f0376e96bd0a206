"""Evaluating jaxprs again: the one place that touches JAX's jaxpr internals.

jaxscale re-evaluates traced programs twice over: autocast binds each equation
anew with its inputs cast, and the skip of a step binds an update's equations
with its outputs selected. Both need the same few facts about JAX's jaxpr data
structures (literals, variables, sub-jaxprs, the protocol that re-binds a
higher-order equation) and the same care when binding: an equation is bound
again inside its own context, as ``jax.core.eval_jaxpr`` does, so that

* its source information (the user's file and line) is what errors and the
  compiled program's metadata name, not jaxscale's;
* its name stack (``jax.named_scope``, ``nnx`` module paths) reaches profiles;
* its ``ctx`` (the abstract mesh of explicit sharding, compute types) is the
  one it was traced under.

Everything here uses ``jax.extend``, JAX's interface for libraries that
transform jaxprs, and nothing else from JAX's internals.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex
from jax.extend import source_info_util

# jaxscale's frames are not the user's: the operations autocast creates, and errors
# raised while it binds them, name the user's line instead.
source_info_util.register_exclusion(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr


def is_literal(atom: Any) -> bool:
    """Whether an equation's input is a literal (a constant written into the jaxpr)."""
    return isinstance(atom, jex.Literal)


def is_variable(atom: Any) -> bool:
    """Whether ``atom`` is a variable (not a literal, not a dropped output)."""
    return isinstance(atom, jex.Var) and not isinstance(atom, jex.DropVar)


def literal_value(atom: Any) -> np.ndarray:
    """A literal's value, as a NumPy array of the dtype the jaxpr gives it."""
    return np.asarray(atom.val, dtype=atom.aval.dtype)


def contains_jaxpr(value: Any) -> bool:
    """Whether an equation parameter holds a jaxpr (directly or in a tuple or list)."""
    if isinstance(value, (Jaxpr, ClosedJaxpr)):
        return True
    return isinstance(value, (tuple, list)) and any(contains_jaxpr(v) for v in value)


_JAX_SOURCE = os.path.dirname(os.path.abspath(jax.__file__))


def jit_source(eqn: Any) -> str:
    """Where the function a ``jit`` equation calls is defined (``"norm at /.../linalg.py:1152"``),
    or ``""`` when JAX did not record it."""
    closed = eqn.params.get("jaxpr")
    debug_info = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    return getattr(debug_info, "func_src_info", None) or ""


def jit_defined_in_jax(eqn: Any) -> str | None:
    """The name of the function a ``jit`` equation calls, when JAX itself defines it
    (``jnp.linalg.norm`` is a jitted function named ``norm``); else ``None``."""
    if _JAX_SOURCE not in jit_source(eqn):
        return None
    return str(eqn.params.get("name"))


def equation_frames(eqn: Any) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of the Python stack that traced ``eqn``, innermost first."""
    traceback = eqn.source_info.traceback
    if traceback is None:
        return []
    return [(f.file_name, f.line_num, f.function_name) for f in traceback.frames]


def name_stack_text(eqn: Any) -> str:
    """The equation's name stack (``jax.named_scope`` and transform names) as text."""
    return str(eqn.source_info.name_stack)


@contextlib.contextmanager
def equation_context(eqn: Any) -> Iterator[None]:
    """Operations traced inside take ``eqn``'s source info, name stack and context.

    The name stack is the current one followed by the equation's own, as in
    ``jax.core.eval_jaxpr``, so that a scope entered around the evaluation is kept.
    """
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        yield


def bind_protocol(eqn: Any, params: dict[str, Any] | None = None) -> tuple[tuple[Any, ...], dict]:
    """``(subfuns, params)`` by JAX's own protocol for binding a traced equation again.

    ``get_bind_params`` turns a higher-order primitive's inner jaxprs back into the
    functions its ``bind`` takes (each call returns fresh ones). JAX before 0.7
    returned the pair; later versions one dict holding them under ``"subfuns"``.
    """
    result = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    if isinstance(result, tuple):
        return tuple(result[0]), dict(result[1])
    result = dict(result)
    return tuple(result.pop("subfuns", ())), result


def bind_equation(
    eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None
) -> list[Any]:
    """Bind ``eqn``'s primitive anew on ``invals`` (with ``params`` replacing its own),
    inside :func:`equation_context`. Returns the list of results."""
    with equation_context(eqn):
        return bind_in_context(eqn, invals, params)


def bind_in_context(
    eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None
) -> list[Any]:
    """:func:`bind_equation` for a caller that has entered :func:`equation_context` itself."""
    result = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    if isinstance(result, tuple):  # (subfuns, params), before JAX 0.7
        out = eqn.primitive.bind(*result[0], *invals, **result[1])
    else:  # recent JAX: the functions travel among the params, under "subfuns"
        out = eqn.primitive.bind(*invals, **result)
    return list(out) if eqn.primitive.multiple_results else [out]
