"""A traced function evaluated on slices of its arrays, where it is elementwise on them.

An optimizer's update is, for most optimizers, elementwise in every array it reads:
Adam's new moments and step for one element depend on that element's gradient,
moments and parameter, and on scalars (the step count, a learning-rate schedule, a
global gradient norm). Such a program can be evaluated on a slice of each array at
a time, which is how jaxscale keeps an update's temporaries a small constant per
parameter instead of a widened copy of the whole state.

:class:`ElementwiseProgram` reads the traced program once, flattened to primitives:

* an equation whose outputs are all scalars is evaluated once, on the whole arrays
  (a norm, a count, a bias correction);
* a ``cond`` on a scalar becomes every branch's equations and a ``select_n`` of
  their results (an optimizer that applies its update every few steps);
* every other equation must be elementwise: one of :data:`ELEMENTWISE` on arrays of
  one shape (and scalars), a broadcast of a scalar to that shape, or an ``iota`` of
  it (each element's index along an axis, as random bits drawn elementwise hash it),
  which a slice computes from its elements' positions in the whole array;
* the arrays fall into components, the sets joined by equations: one parameter's
  gradient, moments and step, say. A component is evaluated on slices with
  :meth:`ElementwiseProgram.evaluate_slice`, given the scalars of the whole
  evaluation.

Anything else (a reduction to an array, a reshape, a matrix product, a loop) makes
the program not elementwise, and :meth:`ElementwiseProgram.read` returns ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxscale._src.jaxprs import (
    bind_equation,
    flattened_program,
    iota_parameters,
    is_literal,
    is_variable,
    literal_value,
    parameters_for_shape,
)

# Primitives whose result at an index depends only on their operands at that index.
ELEMENTWISE = frozenset(
    {
        "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
        "bitcast_convert_type", "cbrt", "ceil", "clamp", "convert_element_type", "copy",
        "copy_p", "cos", "cosh",
        "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
        "ge", "gt", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic",
        "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "population_count",
        "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n", "shift_left",
        "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "sqrt",
        "square", "sub", "tan", "tanh", "xor",
    }
)  # fmt: skip


def _is_scalar(atom: Any) -> bool:
    return not np.shape(atom.aval) if hasattr(atom, "aval") else True


@dataclasses.dataclass
class ElementwiseProgram:
    """A flattened program, elementwise on its arrays; see the module's notes.

    Attributes:
      invars: the program's inputs, one per argument leaf.
      outvars: its outputs (variables or literals), one per result leaf.
      equations: its equations, calls inlined.
      constants: each constant variable's value.
      component: each array variable's component.
      branches: whether the program chooses between branches (a ``cond``, read as
        every branch computed and a ``select_n`` of their results): an output may
        then be an input as it was, which the program does not show.
      whole: the arrays computed once, on whole arrays, as the scalars are: those made
        from scalars alone for other such arrays (a vector of each leaf's finiteness).
    """

    invars: list[Any]
    outvars: list[Any]
    equations: list[Any]
    constants: dict[Any, Any]
    component: dict[Any, int]
    branches: bool = False
    whole: frozenset[Any] = frozenset()

    @classmethod
    def read(cls, fn: Callable[..., Any], *args: Any) -> ElementwiseProgram | None:
        """``fn`` (a function of ``args``, arrays or ``jax.ShapeDtypeStruct``, that returns
        a list of arrays) traced and read; ``None`` when it is not elementwise."""
        closed = jax.make_jaxpr(fn)(*args)
        invars, outvars, equations, constants = flattened_program(closed, conds_as_selects=True)
        branches = any(eqn.primitive.name == "cond" for eqn in flattened_program(closed)[2])
        parent: dict[Any, Any] = {}

        def root(var: Any) -> Any:
            while parent.setdefault(var, var) is not var:
                parent[var] = parent[parent[var]]
                var = parent[var]
            return var

        whole = _computed_whole(invars, equations)
        for eqn in equations:
            outs = [v for v in eqn.outvars if is_variable(v)]
            if all(_is_scalar(v) or v in whole for v in outs):
                continue
            arrays = [
                v
                for v in [*eqn.invars, *outs]
                if is_variable(v) and not _is_scalar(v) and v not in whole
            ]
            if not _elementwise(eqn, arrays):
                return None
            first = root(arrays[0])
            for var in arrays[1:]:
                parent[root(var)] = first
        for var in invars:
            if not _is_scalar(var):
                root(var)
        roots: dict[Any, int] = {}
        component = {var: roots.setdefault(root(var), len(roots)) for var in list(parent)}
        return cls(invars, outvars, equations, constants, component, branches, whole)

    def component_of(self, atom: Any) -> int | None:
        """The component of an array variable; ``None`` for a scalar or a literal."""
        return self.component.get(atom) if is_variable(atom) else None

    def evaluate(self, args: Sequence[Any]) -> tuple[list[Any], dict[Any, Any]]:
        """The program on ``args``: its results, and every variable's value (the scalars
        that :meth:`evaluate_slice` takes). Values nothing reads are left to XLA to drop."""
        env: dict[Any, Any] = {**self.constants, **dict(zip(self.invars, args, strict=True))}
        for eqn in self.equations:
            values = [literal_value(a) if is_literal(a) else env[a] for a in eqn.invars]
            for var, value in zip(eqn.outvars, bind_equation(eqn, values), strict=True):
                if is_variable(var):
                    env[var] = value
        return [_read(atom, env) for atom in self.outvars], env

    def evaluate_slice(
        self,
        component: int,
        wanted: Sequence[Any],
        arrays: dict[Any, Any],
        values: dict[Any, Any],
        shape: tuple[int, ...],
        positions: Callable[[], Any] | None = None,
    ) -> list[Any]:
        """The variables ``wanted`` of ``component``, computed on slices of shape ``shape``.

        ``arrays`` gives the slice of each array input the component reads (program
        inputs and array constants); ``values`` the scalars, from :meth:`evaluate`;
        ``positions`` makes each element's row-major index in the whole array (uint32,
        of ``shape``), from which an ``iota`` is computed (a slice taken from anywhere
        but the start of the arrays needs it).
        """
        needed = set(wanted)
        selected = []
        for eqn in reversed(self.equations):
            outs = [v for v in eqn.outvars if is_variable(v)]
            if any(v in needed for v in outs) and self.component_of(outs[0]) == component:
                selected.append(eqn)
                needed.update(v for v in eqn.invars if is_variable(v) and not _is_scalar(v))
        env = dict(arrays)
        for eqn in reversed(selected):
            invals = []
            for atom in eqn.invars:
                if is_literal(atom):
                    invals.append(literal_value(atom))
                elif _is_scalar(atom) or atom in self.whole:
                    invals.append(values[atom])
                else:
                    invals.append(env[atom])
            iota = iota_parameters(eqn)
            if iota is not None:
                results = [_iota_at(iota, positions, shape)]
            else:
                results = bind_equation(eqn, invals, parameters_for_shape(eqn, shape))
            for var, value in zip(eqn.outvars, results, strict=True):
                if is_variable(var):
                    env[var] = value
        return [env[var] for var in wanted]

    def array_inputs(self, component: int) -> list[Any]:
        """The array inputs and array constants ``component`` reads."""
        return [v for v in [*self.invars, *self.constants] if self.component.get(v) == component]


def _computed_whole(invars: list[Any], equations: list[Any]) -> frozenset[Any]:
    """The arrays no input array reaches except through a scalar, and from which no
    such array is computed but through a scalar: computed once, as scalars are (the
    per-leaf finiteness flags ``optax.apply_if_finite`` stacks into a vector and
    reduces, say). An array made from scalars for a component (``jnp.zeros_like`` of a
    gradient, random bits hashed from an ``iota``) is the component's."""
    local = {v for v in invars if not _is_scalar(v)}
    for eqn in equations:
        if any(is_variable(v) and v in local for v in eqn.invars):
            local.update(v for v in eqn.outvars if is_variable(v) and not _is_scalar(v))
    feeding = set(local)  # and the arrays they are computed from
    for eqn in reversed(equations):
        if any(is_variable(v) and v in feeding for v in eqn.outvars):
            feeding.update(v for v in eqn.invars if is_variable(v) and not _is_scalar(v))
    whole: set[Any] = set()
    for eqn in equations:
        outs = [v for v in eqn.outvars if is_variable(v) and not _is_scalar(v)]
        if outs and not any(v in feeding for v in outs):
            whole.update(outs)
    return frozenset(whole)


def _elementwise(eqn: Any, arrays: list[Any]) -> bool:
    name = eqn.primitive.name
    shapes = {tuple(np.shape(var.aval)) for var in arrays}
    if len(shapes) != 1:
        return False
    if name == "broadcast_in_dim":
        return _is_scalar(eqn.invars[0])
    if name == "iota":
        return True
    if name not in ELEMENTWISE:
        return False
    if name == "bitcast_convert_type":
        sizes = {np.dtype(v.aval.dtype).itemsize for v in [*eqn.invars, *eqn.outvars]}
        return len(sizes) == 1
    return True


def _iota_at(
    iota: tuple[int, tuple[int, ...], np.dtype],
    positions: Callable[[], Any] | None,
    shape: tuple[int, ...],
) -> Any:
    """An ``iota`` along ``dimension`` of the whole array's ``whole_shape``, at the slice's
    elements: each element's index along that axis, from its row-major position."""
    dimension, whole_shape, dtype = iota
    if positions is None:
        raise ValueError("a slice of an iota needs the positions of its elements")
    stride = int(np.prod(whole_shape[dimension + 1 :], dtype=np.int64))
    index = positions() // np.uint32(stride) % np.uint32(whole_shape[dimension])
    return index.astype(dtype).reshape(shape)


def _read(atom: Any, env: dict[Any, Any]) -> Any:
    return literal_value(atom) if is_literal(atom) else env[atom]
