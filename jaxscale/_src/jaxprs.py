"""Evaluating and rewriting jaxprs: the one place that touches JAX's jaxpr internals.

jaxscale works on traced programs in two ways. Autocast evaluates a program anew,
binding each equation with its inputs cast; the skip of a step rewrites an
update's program with a select after each value it returns and binds the result
as one call. Both need the same few facts about JAX's jaxpr data structures
(literals, variables, sub-jaxprs, the protocol that re-binds a higher-order
equation, how a ``jit`` call is written) and the same care when binding: an
equation is bound again inside its own context, as ``jax.core.eval_jaxpr`` does,
so that

* its source information (the user's file and line) is what errors and the
  compiled program's metadata name, not jaxscale's;
* its name stack (``jax.named_scope``, ``nnx`` module paths) reaches profiles;
* its ``ctx`` (the abstract mesh of explicit sharding, compute types) is the
  one it was traced under.

Everything here uses ``jax.extend``, JAX's interface for libraries that
transform jaxprs, and the rule tables of ``jax.interpreters`` (for the one
primitive jaxscale defines, an identity that marks a value), and nothing else
from JAX's internals but two names: JAX 0.10.0 defines ``compute_on``'s function
form without exporting it, and only the tracer of a staged function
(``DynamicJaxprTracer``) tells an argument of the function from a value computed in it
(:func:`is_staged_argument`). The test for a traced value
(``jax.core.Tracer``), which every layer asks before reading a number or checking an
argument, is here too, so that one module follows where JAX keeps it."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jex
from jax.extend import source_info_util
from jax.interpreters import ad, batching, mlir

# jaxscale's frames are not the user's: the operations autocast creates, and errors
# raised while it binds them, name the user's line instead.
source_info_util.register_exclusion(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr


def is_traced(value: Any) -> bool:
    """Whether ``value`` is a tracer: known only when the traced function runs, so
    neither readable as a Python number nor checkable before then."""
    return isinstance(value, jax.core.Tracer)


# ids of values that stand for staged arguments (see arguments_retyped)
_STANDING_FOR_ARGUMENTS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "jaxscale_standing_for_arguments", default=frozenset()
)


@contextlib.contextmanager
def arguments_retyped(pairs: Sequence[tuple[Any, Any]]) -> Iterator[None]:
    """Within the block, the second value of each ``(original, retyped)`` pair counts as
    a staged argument (:func:`is_staged_argument`) where the first is one: the same
    array in another type (retyped for a mesh whose axes a computation made automatic),
    whose buffer is still the caller's."""
    ids = {id(new) for old, new in pairs if is_staged_argument(old)}
    token = _STANDING_FOR_ARGUMENTS.set(_STANDING_FOR_ARGUMENTS.get() | ids)
    try:
        yield
    finally:
        _STANDING_FOR_ARGUMENTS.reset(token)


def is_staged_argument(value: Any) -> bool:
    """Whether XLA will receive ``value`` as an argument of the program being compiled:
    a concrete array, or an argument of the function ``jax.jit`` is tracing (rather
    than a value computed in it). An argument's buffer is the caller's (or, donated,
    an output's), so a program that writes into it writes into a copy first; a value
    computed in the program has a buffer of its own. Where JAX's tracer cannot be read
    (another kind of tracer, or a JAX that keeps it otherwise), ``False``."""
    if not is_traced(value) or id(value) in _STANDING_FOR_ARGUMENTS.get():
        return True
    try:
        from jax._src.interpreters.partial_eval import DynamicJaxprTracer
    except ImportError:  # pragma: no cover - a JAX that moved it
        return False
    if not isinstance(value, DynamicJaxprTracer):
        return False
    try:
        invars = value._trace.frame.invars
        return value.parent is None and any(var is value.val for var in invars)
    except AttributeError:  # pragma: no cover - a JAX that keeps them otherwise
        return False


def is_ref(value: Any) -> bool:
    """Whether ``value`` is a mutable array reference (``jax.new_ref``), concrete or
    traced: a traced function reads and writes it in place and may not return it."""
    return isinstance(value, jax.Ref)


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


def called_program(eqn: Any) -> tuple[Any, Sequence[Any]]:
    """``(jaxpr, consts)``: the program a call-like equation runs (``jit``, ``closed_call``,
    ``composite``). Its parameter is ``jaxpr`` or ``call_jaxpr`` by primitive and JAX
    version (a composite's: a closed ``jaxpr`` in JAX 0.10, an open ``call_jaxpr`` from
    0.11), and the program closed or open."""
    params = eqn.params
    program = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
    if isinstance(program, ClosedJaxpr):
        return program.jaxpr, program.consts
    return program, ()


def parameters(eqn: Any) -> Mapping[str, Any]:
    """An equation's parameters by name, read-only: what a rule takes as keyword arguments."""
    return MappingProxyType(eqn.params)


def parameters_to_bind(eqn: Any, **changes: Any) -> dict[str, Any]:
    """A copy of an equation's parameters with ``changes``, to bind it again with."""
    return {**eqn.params, **changes}


def scan_operand_groups(
    params: Mapping[str, Any], values: Sequence[Any]
) -> tuple[list[Any], list[Any], list[Any]]:
    """A scan's operands (or its body's inputs, or anything in their order) split as
    ``(consts, carry, xs)`` by the scan's ``params``.

    JAX up to 0.11 records the group sizes as ``num_consts``/``num_carry``; later
    versions record a flat tree, ``ft_in``, that splits them.
    """
    if "ft_in" in params:
        consts, carry, xs = params["ft_in"].update(list(values)).unpack()
        return list(consts), list(carry), list(xs)
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    values = list(values)
    return (
        values[:num_consts],
        values[num_consts : num_consts + num_carry],
        values[num_consts + num_carry :],
    )


def shard_map_manual_axes(params: Mapping[str, Any]) -> set[Any]:
    """The mesh axes a ``shard_map`` equation makes manual, under the name its JAX
    version records them by (``newly_manual_axes``, ``manual_axes`` or ``axis_names``)."""
    key = next(k for k in ("newly_manual_axes", "manual_axes", "axis_names") if k in params)
    return set(params[key])


def shard_map_checks_varying(params: Mapping[str, Any]) -> bool:
    """Whether a ``shard_map`` equation checks which values vary across devices
    (``check_vma``; ``check_rep`` in JAX before 0.7)."""
    return bool(params.get("check_vma", params.get("check_rep", True)))


def dot_dimension_numbers(eqn: Any) -> Any:
    """A ``dot_general``'s ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``."""
    return eqn.params["dimension_numbers"]


def preferred_element_type(eqn: Any) -> Any:
    """The result dtype a ``dot_general`` or convolution was asked for, or ``None``."""
    return eqn.params.get("preferred_element_type")


def convolution_output_feature_axis(eqn: Any) -> int:
    """The output axis of a ``conv_general_dilated`` that holds its features."""
    numbers = eqn.params.get("dimension_numbers")
    return 1 if numbers is None else int(numbers.out_spec[1])


def broadcast_dimensions(eqn: Any) -> tuple[int, ...]:
    """The output axes a ``broadcast_in_dim``'s operand axes become, in order."""
    return tuple(eqn.params["broadcast_dimensions"])


def transpose_permutation(eqn: Any) -> tuple[int, ...]:
    """A ``transpose``'s permutation: output axis ``i`` is operand axis ``permutation[i]``."""
    return tuple(eqn.params["permutation"])


def squeezed_dimensions(eqn: Any) -> tuple[int, ...]:
    """The operand axes a ``squeeze`` drops."""
    return tuple(eqn.params["dimensions"])


def reshape_keeps_order(eqn: Any) -> bool:
    """Whether a ``reshape`` reads its operand in row-major order (no ``dimensions``
    permutation first)."""
    return eqn.params.get("dimensions") is None


def call_name(eqn: Any) -> str | None:
    """The name a ``jit`` equation records for the function it calls."""
    name = eqn.params.get("name")
    return None if name is None else str(name)


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
    return str(call_name(eqn))


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


# --- Building a jaxpr from another and binding it as one call ----------------------


def fresh_variable(aval: Any) -> Any:
    """A new variable of abstract value ``aval``."""
    return jex.Var(aval)


def substituted(atom: Any, substitution: dict[Any, Any]) -> Any:
    """``atom`` as ``substitution`` renames it (literals and unnamed variables unchanged)."""
    return substitution.get(atom, atom) if is_variable(atom) else atom


def inlined_equations(jaxpr: Any, substitution: dict[Any, Any]) -> list[Any]:
    """``jaxpr``'s equations with every ``jit`` call replaced by the equations it calls.

    Each equation's inputs are renamed by ``substitution``, and each output gets a
    fresh variable, recorded in ``substitution`` (a ``jit``'s outputs map to what its
    program returns): JAX shares one traced program between the calls of a function,
    so its variables are renamed at each call. A ``jit`` whose program holds
    constants of its own is kept as one equation.
    """
    equations = []
    for eqn in jaxpr.eqns:
        invars = [substituted(var, substitution) for var in eqn.invars]
        inner = eqn.params.get("jaxpr") if eqn.primitive.name == "jit" else None
        if inner is not None and not inner.consts:
            inner_substitution = dict(zip(inner.jaxpr.invars, invars, strict=True))
            equations += inlined_equations(inner.jaxpr, inner_substitution)
            for outer, returned in zip(eqn.outvars, inner.jaxpr.outvars, strict=True):
                if is_variable(outer):
                    substitution[outer] = substituted(returned, inner_substitution)
            continue
        outvars = []
        for var in eqn.outvars:
            if is_variable(var):
                substitution[var] = fresh_variable(var.aval)
                var = substitution[var]
            outvars.append(var)
        equations.append(eqn.replace(invars=invars, outvars=outvars))
    return equations


# primitives that change an array's sharding (or its type's) and nothing of its values
_SHARDING_ONLY = ("reshard", "sharding_constraint", "mesh_cast")


def sharding_only(eqn: Any) -> bool:
    """Whether ``eqn`` changes nothing of its operand's values, only how it is sharded
    (or how its type names the sharding)."""
    return eqn.primitive.name in _SHARDING_ONLY


def select_equation(which: Any, cases: Sequence[Any], out: Any, like: Any | None = None) -> Any:
    """``out = select_n(which, *cases)``, with ``like``'s source info and context when given."""
    return jex.new_jaxpr_eqn(
        [which, *cases],
        [out],
        jex.primitives.select_n_p,
        {},
        jex.no_effects,
        None if like is None else like.source_info,
        None if like is None else like.ctx,
    )


def call_jaxpr(
    like: Any, invars: Sequence[Any], outvars: Sequence[Any], equations: Sequence[Any]
) -> Any:
    """A closed jaxpr of these parts without constants, with ``like``'s effects (argument
    and result names are not carried over: the parts need not match ``like``'s)."""
    jaxpr = Jaxpr(
        [], list(invars), list(outvars), list(equations), like.jaxpr.effects,
        like.jaxpr.debug_info.with_unknown_names(),
    )  # fmt: skip
    return ClosedJaxpr(jaxpr, [])


def bind_as_call(closed: Any, args: Sequence[Any], name: str) -> list[Any]:
    """Bind ``closed`` on ``args`` as one ``jit`` equation named ``name``.

    The trace in progress records a single equation, where evaluating ``closed``
    would bind each of its equations anew; XLA inlines the call when it compiles.
    The ``jit`` parameters other than the program and its name are those JAX gives
    a ``jit`` of as many inputs and outputs, so they follow the running version.
    """
    counts = (len(closed.jaxpr.invars), len(closed.jaxpr.outvars))
    params = _call_params(*counts, jax.sharding.get_abstract_mesh())
    return list(jex.primitives.jit_p.bind(*args, **params, jaxpr=closed, name=name))


@functools.lru_cache(maxsize=64)
def _call_params(n_in: int, n_out: int, mesh: Any) -> dict[str, Any]:
    """The parameters of a ``jit`` equation with ``n_in`` inputs and ``n_out`` outputs,
    traced under ``mesh`` (the abstract mesh in context), less its program and name."""
    del mesh  # part of the cache's key: the parameters record the mesh in context
    scalar = jax.ShapeDtypeStruct((), np.float32)

    # An output computed, not an input passed through, which jit would forward outside.
    def template(*xs: Any) -> list[Any]:
        return [lax.neg(xs[0])] * n_out

    traced = jax.make_jaxpr(jax.jit(template))(*[scalar] * n_in)
    (call,) = [eqn for eqn in traced.jaxpr.eqns if eqn.primitive.name == "jit"]
    return {key: value for key, value in call.params.items() if key not in ("jaxpr", "name")}


# --- A program flattened to primitives, to evaluate on values of other shapes ---------


def flattened_program(
    closed: Any, *, conds_as_selects: bool = False
) -> tuple[list[Any], list[Any], list[Any], dict[Any, Any]]:
    """``(invars, outvars, equations, constants)``: ``closed`` with every call inlined.

    The programs of ``jit`` and ``closed_call`` equations, and the primal programs of
    ``custom_jvp_call`` and ``custom_vjp_call`` (what they compute, which is all an
    evaluation needs), are spliced in, their variables renamed; ``constants`` maps each
    constant variable (``closed``'s own and those of the programs inlined) to its value.
    With ``conds_as_selects``, a ``cond`` on a scalar index without effects becomes
    its branches' equations, every branch computed, and a ``select_n`` of their
    results by the index (the same values: a branch is a pure function of its
    operands).
    """
    constants: dict[Any, Any] = {}
    substitution: dict[Any, Any] = {}
    for var, value in zip(closed.jaxpr.constvars, closed.consts, strict=True):
        substitution[var] = fresh_variable(var.aval)
        constants[substitution[var]] = value
    invars = []
    for var in closed.jaxpr.invars:
        substitution[var] = fresh_variable(var.aval)
        invars.append(substitution[var])
    equations = _flattened_equations(closed.jaxpr, substitution, constants, conds_as_selects)
    outvars = [substituted(var, substitution) for var in closed.jaxpr.outvars]
    return invars, outvars, equations, constants


def _inlined_program(eqn: Any) -> Any:
    """The program a call-like equation runs, to splice in; ``None`` for other equations."""
    name = eqn.primitive.name
    if name == "jit":
        return eqn.params["jaxpr"]
    if name in ("closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"):
        return eqn.params["call_jaxpr"]
    return None


def _flattened_equations(
    jaxpr: Any, substitution: dict[Any, Any], constants: dict[Any, Any], selects: bool = False
) -> list[Any]:
    equations = []
    for eqn in jaxpr.eqns:
        invars = [substituted(var, substitution) for var in eqn.invars]
        if selects and _is_pure_scalar_cond(eqn):
            branch_outputs = []
            for branch in eqn.params["branches"]:
                renamed = dict(zip(branch.jaxpr.invars, invars[1:], strict=True))
                for var, value in zip(branch.jaxpr.constvars, branch.consts, strict=True):
                    renamed[var] = fresh_variable(var.aval)
                    constants[renamed[var]] = value
                equations += _flattened_equations(branch.jaxpr, renamed, constants, selects)
                branch_outputs.append([substituted(var, renamed) for var in branch.jaxpr.outvars])
            for position, outer in enumerate(eqn.outvars):
                if is_variable(outer):
                    substitution[outer] = fresh_variable(outer.aval)
                    cases = [outputs[position] for outputs in branch_outputs]
                    equations.append(select_equation(invars[0], cases, substitution[outer], eqn))
            continue
        program = _inlined_program(eqn)
        if program is not None:
            inner, consts = (
                (program.jaxpr, program.consts)
                if isinstance(program, ClosedJaxpr)
                else (program, ())
            )
            inner_substitution: dict[Any, Any] = dict(zip(inner.invars, invars, strict=True))
            for var, value in zip(inner.constvars, consts, strict=True):
                inner_substitution[var] = fresh_variable(var.aval)
                constants[inner_substitution[var]] = value
            equations += _flattened_equations(inner, inner_substitution, constants, selects)
            for outer, returned in zip(eqn.outvars, inner.outvars, strict=True):
                if is_variable(outer):
                    substitution[outer] = substituted(returned, inner_substitution)
            continue
        outvars = []
        for var in eqn.outvars:
            if is_variable(var):
                substitution[var] = fresh_variable(var.aval)
                var = substitution[var]
            outvars.append(var)
        equations.append(eqn.replace(invars=invars, outvars=outvars))
    return equations


def _is_pure_scalar_cond(eqn: Any) -> bool:
    return (
        eqn.primitive.name == "cond"
        and not eqn.effects
        and not np.shape(eqn.invars[0].aval)
        and all(not branch.jaxpr.effects for branch in eqn.params["branches"])
    )


def parameters_for_shape(eqn: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    """An elementwise equation's parameters to bind it on operands of ``shape``: a
    broadcast of a scalar broadcasts to ``shape``, and no sharding is kept (it names the
    traced shape's axes)."""
    changes: dict[str, Any] = {
        key: None for key in ("sharding", "out_sharding") if key in eqn.params
    }
    if eqn.primitive.name == "broadcast_in_dim":
        changes.update(shape=tuple(shape), broadcast_dimensions=())
    return parameters_to_bind(eqn, **changes)


def iota_parameters(eqn: Any) -> tuple[int, tuple[int, ...], np.dtype] | None:
    """``(dimension, shape, dtype)`` of an ``iota`` equation (each element's index along
    ``dimension`` of ``shape``); ``None`` for any other equation."""
    if eqn.primitive.name != "iota":
        return None
    params = eqn.params
    shape = tuple(int(d) for d in params["shape"])
    return int(params["dimension"]), shape, np.dtype(params["dtype"])


def initial_values(
    invars: Sequence[Any], outvars: Sequence[Any], equations: Sequence[Any]
) -> list[tuple[np.ndarray | None, bool]]:
    """For each of ``outvars`` of a flattened program (an optimizer's ``init``): the one
    value every element holds when the program makes it by broadcasting (and converting)
    a literal, as ``jnp.zeros`` and ``jnp.full`` do, else ``None``; and whether it is one
    of ``invars``, as it is or through conversions and copies (a state that starts as
    the parameters themselves)."""
    producers = {out: eqn for eqn in equations for out in eqn.outvars if is_variable(out)}
    inputs = set(invars)
    return [
        (_filled_value(producers, var), _passed_through(producers, var, inputs))
        if is_variable(var)
        else (None, False)
        for var in outvars
    ]


_COPIES = ("convert_element_type", "copy", "copy_p")


def _filled_value(producers: Mapping[Any, Any], var: Any) -> np.ndarray | None:
    atom = var
    conversions = []
    while is_variable(atom):
        eqn = producers.get(atom)
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name == "broadcast_in_dim" and not eqn.invars[0].aval.shape:
            atom = eqn.invars[0]
        elif name in _COPIES:
            if name == "convert_element_type":
                conversions.append(eqn.params["new_dtype"])
            atom = eqn.invars[0]
        else:
            return None
    value = literal_value(atom)
    for dtype in reversed(conversions):
        value = value.astype(dtype)
    return np.asarray(value.astype(var.aval.dtype))


def _passed_through(producers: Mapping[Any, Any], var: Any, inputs: set[Any]) -> bool:
    atom = var
    while is_variable(atom):
        if atom in inputs:
            return True
        eqn = producers.get(atom)
        if eqn is None or eqn.primitive.name not in _COPIES:
            return False
        atom = eqn.invars[0]
    return False


def identity_primitive(name: str) -> Any:
    """A primitive that returns its one operand unchanged, under every transformation
    (evaluation, lowering, differentiation, ``vmap``): a mark a transform can find in a
    jaxpr it traced, on a value that passes through it as it is."""
    primitive = jex.Primitive(name)
    primitive.def_impl(lambda x: x)
    primitive.def_abstract_eval(lambda aval: aval)
    mlir.register_lowering(primitive, mlir.lower_fun(lambda x: x, multiple_results=False))
    ad.deflinear2(primitive, lambda cotangent, _: [cotangent])
    batching.primitive_batchers[primitive] = lambda args, dims: (primitive.bind(*args), dims[0])
    return primitive


def compute_on_function() -> Any:
    """``jax.experimental.compute_on``'s function form, which binds the ``compute_on``
    primitive: ``compute_on2`` in JAX 0.10.1 to 0.11.0 (where ``compute_on`` is a
    context manager), ``compute_on`` from JAX 0.11.1; JAX 0.10.0 defines it without
    exporting it."""
    from jax.experimental import compute_on as module

    if hasattr(module, "compute_on2"):
        return module.compute_on2
    if "out_memory_spaces" in inspect.signature(module.compute_on).parameters:
        return module.compute_on
    from jax._src import compute_on as defined  # JAX 0.10.0

    return defined.compute_on2
