"""The jaxpr interpreter that applies the autocast policy, one equation at a time.

A function is traced once to a jaxpr with the dtypes it was written for, then
evaluated anew: each first-order equation has its floating inputs cast as its
policy row says (:mod:`._policy`) and is bound again, so JAX records the casts
and the lower-precision operations in the caller's trace. Higher-order
equations (jit, scan, while, cond, remat, custom_jvp, custom_vjp, shard_map) are
rebuilt by the rules in :mod:`._higher_order`, which run this interpreter on
their inner jaxprs. Integer, boolean and key values are never touched.

Values carry three facts about how the *traced* program made them, which the
casts need:

* ``SCALAR``: a literal, a 0-d value, or one broadcast from such. As in PyTorch's
  type promotion, a scalar does not widen an array (``x * 2.0`` stays float16).
* ``BROADCAST``: broadcast from a smaller array, as a bias is.
* ``PRODUCT``: the output of a matmul or convolution, through reshapes and
  transposes. A bias added to it is cast to its dtype, since PyTorch's ``linear``,
  ``conv`` and ``addmm`` include their bias.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex

from jaxscale.casting._policy import Precision, row_for
from jaxscale.core import bind_equation as bind

# The named scope every autocast call runs under. Equations traced under it were
# already decided by that (inner) autocast, so an enclosing one leaves them as traced.
MARKER = "jaxscale.autocast"


class Tag(enum.Flag):
    NONE = 0
    SCALAR = enum.auto()
    BROADCAST = enum.auto()
    PRODUCT = enum.auto()


# Primitives that move values without arithmetic: what a value is survives them.
_VIEWS = {"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p"}
# First-order primitives that carry a jaxpr of their own (an update or reduction
# function): not higher-order in meaning, so they run as traced.
_OPAQUE_WITH_JAXPR = {
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    "scatter_apply", "reduce", "reduce_window", "select_and_scatter",
    "select_and_scatter_add", "select_and_gather_add",
}  # fmt: skip
_LOWER_ELIGIBLE = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

HigherOrderRule = Callable[["Autocaster", Any, list[Any], list[Tag]], tuple[list[Any], list[Tag]]]
HIGHER_ORDER: dict[str, HigherOrderRule] = {}


def is_floating(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def cast(value: Any, dtype: Any) -> Any:
    """``value`` in ``dtype``; unchanged (the same object) when it already is."""
    if value.dtype == dtype:
        return value
    return lax.convert_element_type(value, dtype)


def cast_floating(values: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    """Each floating value in its counterpart's dtype; other values unchanged."""
    return [
        cast(v, d) if is_floating(v.dtype) and is_floating(d) else v
        for v, d in zip(values, dtypes, strict=True)
    ]


def widest(a: Any, b: Any) -> np.dtype:
    """The floating dtype both ``a`` and ``b`` fit in, as PyTorch promotes floats:
    the larger one, and float32 for float16 with bfloat16. (``jnp.promote_types``
    would refuse under ``jax_numpy_dtype_promotion="strict"``.)"""
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if {a, b} == set(_HALF):
        return np.dtype(jnp.float32)
    return a if a.itemsize > b.itemsize else b


def has_jaxpr(value: Any) -> bool:
    if isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr)):
        return True
    return isinstance(value, (tuple, list)) and any(has_jaxpr(v) for v in value)


def is_marked(eqn: Any) -> bool:
    return MARKER in str(eqn.source_info.name_stack)


def bind_protocol(eqn: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(subfuns, params)`` by JAX's own protocol for binding a traced equation again.

    ``get_bind_params`` turns a higher-order primitive's inner jaxprs back into the
    functions its ``bind`` takes. Recent JAX returns one dict holding them under
    ``"subfuns"``; earlier versions return the pair.
    """
    result = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(result, tuple):
        return tuple(result[0]), dict(result[1])
    result = dict(result)
    return tuple(result.pop("subfuns", ())), result


class Autocaster:
    """Evaluates jaxprs with the policy for one autocast ``dtype`` (float16 or bfloat16)."""

    def __init__(self, dtype: Any):
        self.dtype = np.dtype(dtype)
        # Casts made in the jaxpr being evaluated, so that a value cast for several
        # operations is converted once: {(id(value), dtype): (value, cast value)}.
        self._casts: dict[tuple[int, Any], tuple[Any, Any]] = {}

    def cast(self, value: Any, dtype: Any) -> Any:
        """``cast(value, dtype)``, reusing this jaxpr's earlier cast of the same value."""
        if value.dtype == dtype:
            return value
        key = (id(value), np.dtype(dtype))
        if key not in self._casts:  # the value is kept in the entry, so its id stays its own
            self._casts[key] = (value, cast(value, dtype))
        return self._casts[key][1]

    def run(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        """Evaluate a ``ClosedJaxpr`` on ``args``; returns its outputs."""
        return self.eval(closed.jaxpr, closed.consts, args)[0]

    def eval(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        arg_tags: Sequence[Tag] | None = None,
    ) -> tuple[list[Any], list[Tag]]:
        """Evaluate an open ``Jaxpr``; returns its outputs and what they are (:class:`Tag`)."""
        outer_casts, self._casts = self._casts, {}
        try:
            return self._eval(jaxpr, consts, args, arg_tags)
        finally:
            self._casts = outer_casts

    def _eval(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        arg_tags: Sequence[Tag] | None,
    ) -> tuple[list[Any], list[Tag]]:
        env: dict[Any, Any] = {}
        tags: dict[Any, Tag] = {}

        def read(atom: Any) -> Any:
            if isinstance(atom, jex.Literal):
                return np.asarray(atom.val, dtype=atom.aval.dtype)  # type: ignore[attr-defined]
            return env[atom]

        def tag_of(atom: Any) -> Tag:
            shape = getattr(atom.aval, "shape", None)
            if isinstance(atom, jex.Literal):
                return Tag.SCALAR
            return (Tag.SCALAR if shape == () else Tag.NONE) | tags.get(atom, Tag.NONE)

        def write(var: Any, value: Any, tag: Tag) -> None:
            if not isinstance(var, jex.DropVar):
                env[var] = value
                tags[var] = tag

        arg_tags = arg_tags or [Tag.NONE] * len(args)
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            write(var, value, Tag.NONE)
        for var, value, tag in zip(jaxpr.invars, args, arg_tags, strict=True):
            write(var, value, tag)

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            in_tags = [tag_of(v) for v in eqn.invars]
            name = eqn.primitive.name
            if is_marked(eqn):
                traced = [v.aval.dtype for v in eqn.invars]
                outvals, out_tags = bind(eqn, cast_floating(invals, traced)), None
            elif name in HIGHER_ORDER:
                outvals, out_tags = HIGHER_ORDER[name](self, eqn, invals, in_tags)
            elif any(has_jaxpr(p) for p in eqn.params.values()) and name not in _OPAQUE_WITH_JAXPR:
                raise NotImplementedError(
                    f"jaxscale.autocast does not know the higher-order primitive {name!r}, "
                    "so it cannot cast the operations inside it. Call that part outside "
                    "autocast, or inside jaxscale.autocast(..., enabled=False)."
                )
            else:
                outvals, out_tags = self.first_order(eqn, invals, in_tags)
            out_tags = out_tags or [Tag.NONE] * len(outvals)
            for var, value, tag in zip(eqn.outvars, outvals, out_tags, strict=True):
                write(var, value, tag)

        return [read(v) for v in jaxpr.outvars], [tag_of(v) for v in jaxpr.outvars]

    # -- first-order equations ----------------------------------------------------------

    def first_order(
        self, eqn: Any, invals: list[Any], in_tags: list[Tag]
    ) -> tuple[list[Any], list[Tag]]:
        name = eqn.primitive.name
        precision = row_for(name).precision
        traced = [v.aval.dtype for v in eqn.invars]
        params = dict(eqn.params)
        if precision is Precision.RECIPROCAL:
            precision = (
                Precision.FLOAT32
                if Tag.SCALAR in in_tags[0] and Tag.SCALAR not in in_tags[1]
                else Precision.WIDEST
            )

        if precision is Precision.AS_TRACED:
            invals = cast_floating(invals, traced)
        elif precision is Precision.LOWER:
            floating = [v for v in invals if is_floating(v.dtype)]
            if floating and all(v.dtype in _LOWER_ELIGIBLE for v in floating):
                invals = [self.cast(v, self.dtype) if is_floating(v.dtype) else v for v in invals]
                if is_floating(params.get("preferred_element_type")):
                    params["preferred_element_type"] = self.dtype
        elif precision is Precision.FLOAT32:
            invals = [self.cast(v, jnp.float32) if v.dtype in _HALF else v for v in invals]
        elif name in ("add", "add_any") and _is_bias_add(eqn, invals, in_tags):
            product = 0 if Tag.PRODUCT in in_tags[0] else 1
            invals[1 - product] = self.cast(invals[1 - product], invals[product].dtype)
        else:
            invals = self._promote_to_widest(invals, in_tags, traced)

        outvals = bind(eqn, invals, params)
        return outvals, _output_tags(name, precision, eqn, in_tags, len(outvals))

    def _promote_to_widest(
        self, invals: list[Any], in_tags: list[Tag], traced: list[Any]
    ) -> list[Any]:
        """Floating inputs that shared a dtype when traced share one again: the widest of
        their current dtypes, counting arrays before scalars (a scalar does not widen)."""
        groups: dict[Any, list[int]] = {}
        for i, dtype in enumerate(traced):
            if is_floating(dtype) and is_floating(invals[i].dtype):
                groups.setdefault(np.dtype(dtype), []).append(i)
        out = list(invals)
        for members in groups.values():
            arrays = [i for i in members if Tag.SCALAR not in in_tags[i]] or members
            target = invals[arrays[0]].dtype
            for i in arrays[1:]:
                target = widest(target, invals[i].dtype)
            for i in members:
                out[i] = self.cast(invals[i], target)
        return out


def _is_bias_add(eqn: Any, invals: list[Any], in_tags: list[Tag]) -> bool:
    """One operand is a matmul's output, the other an addend broadcast over it (a bias):
    fewer elements when traced, or made by broadcasting, or a scalar."""
    if not all(is_floating(v.dtype) for v in invals):
        return False
    sizes = [int(np.prod(v.aval.shape, dtype=int)) for v in eqn.invars]
    for product, addend in ((0, 1), (1, 0)):
        if Tag.PRODUCT not in in_tags[product]:
            continue
        if sizes[addend] < sizes[product] or in_tags[addend] & (Tag.BROADCAST | Tag.SCALAR):
            return True
    return False


def _output_tags(
    name: str, precision: Precision, eqn: Any, in_tags: list[Tag], count: int
) -> list[Tag]:
    if precision is Precision.LOWER:
        return [Tag.PRODUCT] * count
    if name in _VIEWS:
        return [in_tags[0]] * count
    if name == "convert_element_type":
        return [in_tags[0] & (Tag.SCALAR | Tag.BROADCAST)]
    if name == "broadcast_in_dim":
        source = eqn.invars[0].aval
        grew = np.prod(source.shape, dtype=int) < np.prod(eqn.outvars[0].aval.shape, dtype=int)
        return [(in_tags[0] & (Tag.SCALAR | Tag.BROADCAST)) | (Tag.BROADCAST if grew else Tag.NONE)]
    return [Tag.NONE] * count
