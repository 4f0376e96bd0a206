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
  ``conv`` and ``addmm`` include their bias. A bias varies only along the axes one
  operand contributes (a layer's output features); an addend that also varies along
  the other operand's axes or the batch axes (an attention bias over query and key
  positions, a per-example mask) is added as PyTorch's ``+`` adds, promoting. Which
  operand each axis comes from is followed through views (:mod:`._axes`). An addend
  as large as the product (a layer applied to one example, where the bias and the
  product have one shape) is a bias only when it is ``GIVEN``, and either
  ``EXPANDED`` or added to a matrix-vector product; a residual computed by the
  function is added as ``+`` adds.
* ``GIVEN``: one of the function's arguments or a value it captured, through views
  alone (reshapes, transposes, dtype conversions, broadcasts): how a layer's
  parameter reaches the layer.
* ``EXPANDED``: a view that gave a value new size-1 axes and nothing else
  (``jnp.reshape(bias, (1, -1))``, ``jnp.broadcast_to`` onto a batch of one), through
  further views: the axes a bias is given to broadcast over a batch.
* ``MAXIMUM``, ``STABILIZER``: a maximum over an axis (``reduce_max``, through
  broadcasts and the ``max`` with ``-inf`` JAX adds), and such a maximum held
  constant by ``stop_gradient``. ``x - stop_gradient(max(x))`` is how
  ``jax.nn.softmax``, ``log_softmax`` and ``logsumexp`` begin: PyTorch runs those
  ops in float32, so that subtraction runs in float32 (in float16 a ``-65504`` mask
  fill minus a maximum of 16 or more would round to ``-inf``).
* ``CONSTANT``: known when the function was traced (a literal, a constant the
  trace captured, or computed from such alone). Narrowed to float16 or bfloat16
  it saturates at the dtype's largest finite value instead of becoming inf: a
  mask fill of ``jnp.finfo(jnp.float32).min`` or ``-1e9`` stays a large negative
  number, as PyTorch's ``finfo(scores.dtype).min``, read at run time, is.
* ``KNOWN``: a constant no gradient can reach: a literal, a concrete array the
  trace captured, or computed from such alone. A captured value of an enclosing
  trace (parameters a closure passes to ``jax.grad``) is ``CONSTANT`` but not
  ``KNOWN``.

Every equation is evaluated inside its own context (:func:`equation_context`):
the casts and operations it becomes carry the user's source line, name stack and
sharding context.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.explicit_axes import (
    explicit_spec,
    explicit_spec_of_type,
    first_explicitly_sharded,
    on_automatic_axes,
)
from jaxscale._src.frames import location
from jaxscale._src.jaxprs import (
    bind_in_context,
    contains_jaxpr,
    dot_dimension_numbers,
    equation_context,
    equation_frames,
    is_literal,
    is_traced,
    is_variable,
    literal_value,
    name_stack_text,
    parameters,
    parameters_to_bind,
    preferred_element_type,
)
from jaxscale.casting import _axes
from jaxscale.casting._float8_matmul import (
    Recipe,
    as_rows_and_columns,
    float8_dot_general,
    quantizes_before_gathering,
)
from jaxscale.casting._float8_matmul import eligible as float8_eligible
from jaxscale.casting._float32_gradients import dot_with_float32_gradients
from jaxscale.casting._matmul_site import MatmulSite, checked_answer
from jaxscale.casting._policy import Precision, is_registered, row_for

# The named scope every autocast call runs under. Equations traced under it were
# already decided by that (inner) autocast, so an enclosing one leaves them as traced.
MARKER = "jaxscale.autocast"
# The scopes JAX's transforms add to a name stack, which name no layer.
_TRANSFORM_SCOPE = re.compile(r"^(jit|pjit|jvp|transpose|checkpoint|remat|rematted_computation)\b")


class Tag(enum.Flag):
    NONE = 0
    SCALAR = enum.auto()
    BROADCAST = enum.auto()
    PRODUCT = enum.auto()
    CONSTANT = enum.auto()
    MAXIMUM = enum.auto()
    STABILIZER = enum.auto()
    KNOWN = enum.auto()
    GIVEN = enum.auto()
    EXPANDED = enum.auto()


# Primitives that move values without arithmetic: what a value is survives them.
_VIEWS = {"reshape", "transpose", "squeeze", "copy", "name", "device_put", "xla_metadata_value"}
# Views through which a value is still the argument it came from, for the matmul
# sites' weight paths (a cast is one: a float32 parameter narrowed to bfloat16; so is a
# change of sharding: a weight made whole on explicit mesh axes, ``reshard(w, P())``).
_ORIGIN_KEEPING = _VIEWS | {"convert_element_type", "reshard", "sharding_constraint", "mesh_cast"}
# Equations through which a gathered weight is followed to where autocast casts it or
# a float8 recipe quantizes it, which is then done before it is gathered
# (Autocaster._note_gathered)
_GATHERED_THROUGH = {"transpose", "convert_element_type"}


def _one_leading_index(eqn: Any) -> int | None:
    """The index a ``slice`` equation takes along the leading axis where it takes that
    one index and every other axis whole (a layer of a stacked array), else ``None``."""
    params = parameters(eqn)
    shape = eqn.invars[0].aval.shape
    start, limit = params["start_indices"], params["limit_indices"]
    strides = params.get("strides")
    if not shape or limit[0] - start[0] != 1 or any(s not in (None, 1) for s in strides or ()):
        return None
    if any(b != 0 or e != n for b, e, n in zip(start[1:], limit[1:], shape[1:], strict=True)):
        return None
    return int(start[0])


# Primitives that take several values and treat each on its own: a barrier, a transfer,
# a sort that carries values along with its keys, a collective of several arrays. No
# arithmetic joins the values, so each keeps the dtype it has and none is promoted (a
# float16 activation held at an optimization_barrier beside float32 weights stays float16).
_EACH_OPERAND_ON_ITS_OWN = {
    "optimization_barrier", "device_put", "sort", "shard_alike",
    "host_local_array_to_global_array", "global_array_to_host_local_array",
    "psum", "pmax", "pmin", "psum_invariant", "ppermute", "pbroadcast", "pvary",
}  # fmt: skip
# First-order primitives that carry a jaxpr of their own (an update or reduction
# function): not higher-order in meaning, so they run as traced.
_OPAQUE_WITH_JAXPR = {
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    "reduce", "reduce_window", "select_and_scatter",
    "select_and_scatter_add", "select_and_gather_add",
}  # fmt: skip
_LOWER_ELIGIBLE = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _asks_for_a_wider_result(preferred: Any, traced: list[Any]) -> bool:
    """Whether a matmul's ``preferred_element_type`` is wider than every floating operand
    it was traced with: half-precision operands with a float32 result, written on
    purpose (``jnp.matmul`` and ``jnp.einsum`` ask for their operands' own dtype unless
    told otherwise). Autocast keeps such a result; it lowers the operands only."""
    widths = [np.dtype(d).itemsize for d in traced if is_floating(d)]
    return bool(widths) and np.dtype(preferred).itemsize > max(widths)


# Elementwise primitives that broadcast an operand with size-1 axes (or a 0-d one)
# against the others, and whose gradient for it is then a sum over those axes.
_BROADCASTING_ELEMENTWISE = {
    "add", "sub", "mul", "div", "max", "min", "atan2", "rem", "pow", "clamp", "select_n",
}  # fmt: skip

# Sums and products that keep a float16 or bfloat16 input's dtype (avg_pool; under the
# CPU policy also sum, cumsum, cumprod), which PyTorch's kernels accumulate in float32,
# rounding the result once: XLA would round every partial result.
_ACCUMULATES_IN_FLOAT32 = {"reduce_window_sum", "reduce_sum", "cumsum", "cumprod"}
# Maxima and minima over axes, of a float16 or bfloat16 input, computed in float32 and
# rounded back (exact: the result is one of the inputs). JAX differentiates a maximum into
# a sum of the tied positions in the input's dtype (softmax's and logsumexp's stabiliser
# included, stop_gradient or not); in float32 that sum is a float32 one.
_EXACT_IN_FLOAT32 = {"reduce_max", "reduce_min"}
# A window's sum divided by its size (or count) is one average-pooling kernel in PyTorch,
# which divides the float32 sum and rounds once: a division of such a sum, or of a view
# of it, reads the float32 sum.
_DIVIDED_BEFORE_ROUNDING = {"reduce_window_sum"}

# A rule for a higher-order primitive: ``rule(autocaster, eqn, invals, in_tags,
# **parameters)``, naming the equation's parameters it reads as keyword arguments.
HigherOrderRule = Callable[..., tuple[list[Any], list[Tag]]]
HIGHER_ORDER: dict[str, HigherOrderRule] = {}


def _narrower(dtype: Any, than: Any) -> bool:
    return bool(np.dtype(dtype).itemsize < np.dtype(than).itemsize)


def is_floating(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def _is_complex(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.complexfloating))
    except TypeError:
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


def narrows_range(source: Any, target: Any) -> bool:
    """Whether a floating ``source`` dtype holds finite values ``target`` cannot."""
    return bool(jnp.finfo(target).max < jnp.finfo(source).max)


def saturating_cast(value: Any, dtype: Any) -> Any:
    """``value`` in the narrower floating ``dtype``, finite values clipped to its range.

    Infinities and NaN stay what they are; a finite value beyond ``dtype``'s largest
    becomes that largest value (with its sign) instead of an infinity.
    """
    limit = float(jnp.finfo(dtype).max)
    if isinstance(value, (np.ndarray, np.generic)):  # a literal: clipped now
        known = np.where(np.isinf(value), value, np.clip(value, -limit, limit))
        return np.asarray(known, dtype=value.dtype).astype(dtype)
    bound = np.asarray(limit, value.dtype)
    traced = lax.select(lax.is_finite(value), lax.clamp(-bound, value, bound), value)
    return lax.convert_element_type(traced, dtype)


def captured_tags(consts: Sequence[Any]) -> list[Tag]:
    """What the constants a jaxpr captured when it was traced are: given and constant,
    and known unless they are an enclosing transformation's values."""
    return [Tag.GIVEN | Tag.CONSTANT | (Tag.NONE if is_traced(c) else Tag.KNOWN) for c in consts]


def is_marked(eqn: Any) -> bool:
    return MARKER in name_stack_text(eqn)


class Autocaster:
    """Evaluates jaxprs with the policy for one autocast ``dtype`` (float16 or bfloat16)."""

    def __init__(
        self,
        dtype: Any,
        float8: Recipe | None = None,
        device_type: str = "cuda",
        *,
        grad_dtype: Any = None,
        float8_filter: Callable[[MatmulSite], bool] | None = None,
        key: Any = None,
    ):
        self.dtype = np.dtype(dtype)
        self.float8 = float8
        # which eligible matmuls run in the recipe (None: all); the key the recipes that
        # round stochastically draw from, folded with each matmul's index
        self.float8_filter = float8_filter
        self.key = key
        # the paths of the function's arguments, followed through views to the matmuls
        # that use them: {id(value): (value, path)}
        self._origins: dict[int, tuple[Any, str]] = {}
        # values a program on explicit mesh axes made whole itself (``reshard(w, P())``:
        # FSDP's all-gather, written out), followed through a transpose or a cast, each
        # with the same value computed from the shards: {id(value): (value, sharded)}
        self._gathered: dict[int, tuple[Any, Any]] = {}
        self.site_count = 0
        # the scan iteration (and length) a layer's matmuls are decided for
        self.layer: tuple[int, int] | None = None
        # while a scan's body is probed for its matmuls: the sites met, none decided
        self.recording: list[MatmulSite] | None = None
        # while a function is traced for its results' types alone (shapes_of)
        self.shape_pass = False
        # how many times the equations being evaluated run per call (a scan's length)
        self.repeats = 1
        # with ``per_iteration`` set (jaxscale.float8_report), inside a scan: the traced
        # index of the iteration running, so that each layer's matmul is measured apart
        self.per_iteration = False
        self.iteration: Any = None
        # measures each matmul in place of running it (jaxscale.float8_report): called
        # with (autocaster, eqn, operands), returns the result or None to run it as usual
        self.matmul_hook: Callable[[Autocaster, Any, list[Any]], Any] | None = None
        # how many functions of a ``jax.custom_vjp`` or ``jax.custom_jvp`` (the primal and
        # the user's rules) are being evaluated: their derivative is the rule's
        self.custom_rule_depth = 0
        self.device_type = device_type
        # float32: the matmuls' gradients of operands narrowed from float32 stay float32
        self.grad_dtype = grad_dtype
        # Casts made in the jaxpr being evaluated, so that a value cast for several
        # operations is converted once: {(id(value), dtype): (value, cast value)}.
        self._casts: dict[tuple[int, Any], tuple[Any, Any]] = {}
        # Where each axis of a product or a broadcast comes from (:mod:`._axes`), for the
        # values of this whole call, across nested jits: {id(value): (value, labels)}.
        self._axes: dict[int, tuple[Any, _axes.Labels]] = {}
        # The float32 sums behind float16 window sums, for a division that follows
        # (an average pool): {id(rounded sum): (rounded sum, float32 sum)}.
        self._window_sums: dict[int, tuple[Any, Any]] = {}

    def name_inputs(self, values: Sequence[Any], paths: Sequence[str]) -> None:
        """Record that ``values`` are the function's arguments at ``paths``."""
        for value, path in zip(values, paths, strict=True):
            self._origins[id(value)] = (value, path)

    def _note_origin(self, source: Any, view: Any) -> None:
        origin = self.origin_of(source)
        if origin is not None:
            self._origins[id(view)] = (view, origin)

    def origin_of(self, value: Any) -> str | None:
        entry = self._origins.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def _note_gathered(self, eqn: Any, invals: list[Any], outvals: list[Any]) -> None:
        """Record a value the program made whole from shards on explicit mesh axes, or
        computed by a transpose or a cast from one: autocast narrows it before it is
        gathered, and a float8 recipe that gathers what it quantizes
        (:func:`quantizes_before_gathering`) quantizes its shards."""
        name = eqn.primitive.name
        if len(outvals) != 1 or not invals:
            return
        if name == "reshard":
            if explicit_spec(invals[0]) is not None and explicit_spec(outvals[0]) is None:
                self._gathered[id(outvals[0])] = (outvals[0], invals[0])
        elif name in _GATHERED_THROUGH and parameters(eqn).get("sharding") is None:
            sharded = self.sharded_source(invals[0])
            if sharded is not None:  # the same equation on the shards (unused, it is dropped)
                (alternative,) = bind_in_context(eqn, [sharded, *invals[1:]])
                self._gathered[id(outvals[0])] = (outvals[0], alternative)

    def sharded_source(self, value: Any) -> Any | None:
        """``value`` computed from the shards it was gathered from, where a program on
        explicit mesh axes made it whole itself (:meth:`_note_gathered`); else ``None``."""
        entry = self._gathered.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def axes_of(self, value: Any) -> _axes.Labels | None:
        entry = self._axes.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def follow(self, inside: Sequence[Any], outside: Sequence[Any]) -> None:
        """The values a rule's body receives in place of ``outside``, one for one: what
        is known of each value's axes holds for the value that stands in for it."""
        for new, old in zip(inside, outside, strict=True):
            labels = self.axes_of(old)
            if labels is not None:
                self._axes[id(new)] = (new, labels)
            origin = self.origin_of(old)
            if origin is not None:
                self._origins[id(new)] = (new, origin)

    def shapes_of(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``jax.eval_shape(fn, *args)`` for a function evaluated by this autocaster, as a
        pass whose results are dropped (the types a ``cond``'s branches agree on): the
        matmuls it meets are not counted (their sites' ``index`` and keys), recorded or
        put to the float8 filter, and :attr:`matmul_hook` sees :attr:`shape_pass` set."""
        count, recording, outer = self.site_count, self.recording, self.shape_pass
        self.recording, self.shape_pass = None, True
        try:
            return jax.eval_shape(fn, *args)
        finally:
            self.site_count, self.recording, self.shape_pass = count, recording, outer

    def eval_in_place_of(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        outside: Sequence[Any],
        tags: Sequence[Tag],
    ) -> list[Any]:
        """Evaluate a rule's body on ``args``, the values standing in for ``outside`` (whose
        tags are ``tags``); returns its outputs."""
        self.follow(args, outside)
        return self.eval(jaxpr, consts, args, tags, captured_tags(consts))[0]

    def _note_axes(self, eqn: Any, invals: list[Any], outvals: list[Any]) -> None:
        if len(outvals) != 1 or not invals or eqn.primitive.name not in _axes.LABELLED:
            return
        labels = _axes.of_output(eqn, self.axes_of(invals[0]))
        if labels is not None:
            self._axes[id(outvals[0])] = (outvals[0], labels)

    def _note_window_sum_view(self, eqn: Any, invals: list[Any], outvals: list[Any]) -> None:
        """A view of a float16 window sum is one too: the same view of its float32 sum."""
        wide = self._window_sum(invals[0])
        if wide is not None and len(outvals) == 1 and outvals[0].dtype == invals[0].dtype:
            wide_view = bind_in_context(eqn, [wide, *invals[1:]], parameters_to_bind(eqn))[0]
            self._window_sums[id(outvals[0])] = (outvals[0], wide_view)

    def _window_sum(self, value: Any) -> Any | None:
        """The float32 sum ``value`` is the rounded form of, when it is a float16 window sum."""
        entry = self._window_sums.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def cast(self, value: Any, dtype: Any, tag: Tag = Tag.NONE) -> Any:
        """``value`` in ``dtype``, reusing this jaxpr's earlier cast of the same value.

        A :attr:`Tag.CONSTANT` value narrowed to a smaller range saturates
        (:func:`saturating_cast`).
        """
        if value.dtype == dtype:
            return value
        saturate = Tag.CONSTANT in tag and narrows_range(value.dtype, dtype)
        key = (id(value), np.dtype(dtype))
        if key not in self._casts:  # the value is kept in the entry, so its id stays its own
            sharded = self.sharded_source(value)
            if sharded is not None and not saturate and _narrower(dtype, value.dtype):
                # a value the program made whole itself (FSDP's gather on explicit axes,
                # written out): cast where it lies and made whole in ``dtype``, the same
                # values in fewer bytes (PyTorch FSDP's param_dtype)
                narrowed = jax.sharding.reshard(cast(sharded, dtype), jax.typeof(value).sharding)
            else:
                narrowed = saturating_cast(value, dtype) if saturate else cast(value, dtype)
            self._casts[key] = (value, narrowed)
        return self._casts[key][1]

    def run(
        self, closed: Any, args: Sequence[Any], arg_tags: Sequence[Tag] | None = None
    ) -> list[Any]:
        """Evaluate a ``ClosedJaxpr`` on ``args``; returns its outputs.

        Its constants were captured when it was traced: they are :attr:`Tag.GIVEN` and
        :attr:`Tag.CONSTANT`, and :attr:`Tag.KNOWN` unless they are an enclosing
        transformation's values (a function that closes over the parameters ``jax.grad``
        differentiates).
        """
        consts = closed.consts
        outs, _ = self.eval(closed.jaxpr, consts, args, arg_tags, captured_tags(consts))
        return outs

    def eval(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        arg_tags: Sequence[Tag] | None = None,
        const_tags: Sequence[Tag] | None = None,
    ) -> tuple[list[Any], list[Tag]]:
        """Evaluate an open ``Jaxpr``; returns its outputs and what they are (:class:`Tag`)."""
        outer_casts, self._casts = self._casts, {}
        try:
            return self._eval(jaxpr, consts, args, arg_tags, const_tags)
        finally:
            self._casts = outer_casts

    def _eval(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        arg_tags: Sequence[Tag] | None,
        const_tags: Sequence[Tag] | None,
    ) -> tuple[list[Any], list[Tag]]:
        env: dict[Any, Any] = {}
        tags: dict[Any, Tag] = {}

        def read(atom: Any) -> Any:
            return literal_value(atom) if is_literal(atom) else env[atom]

        def tag_of(atom: Any) -> Tag:
            if is_literal(atom):
                return Tag.SCALAR | Tag.CONSTANT | Tag.KNOWN
            shape = getattr(atom.aval, "shape", None)
            return (Tag.SCALAR if shape == () else Tag.NONE) | tags.get(atom, Tag.NONE)

        def write(var: Any, value: Any, tag: Tag) -> None:
            if is_variable(var):
                env[var] = value
                tags[var] = tag

        arg_tags = arg_tags or [Tag.NONE] * len(args)
        const_tags = const_tags or [Tag.NONE] * len(consts)
        for var, value, tag in zip(jaxpr.constvars, consts, const_tags, strict=True):
            write(var, value, tag)
        for var, value, tag in zip(jaxpr.invars, args, arg_tags, strict=True):
            write(var, value, tag)

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            in_tags = [tag_of(v) for v in eqn.invars]
            with equation_context(eqn):
                outvals, out_tags = self._equation(eqn, invals, in_tags)
            for var, value, tag in zip(eqn.outvars, outvals, out_tags, strict=True):
                write(var, value, tag)

        return [read(v) for v in jaxpr.outvars], [tag_of(v) for v in jaxpr.outvars]

    def _equation(
        self, eqn: Any, invals: list[Any], in_tags: list[Tag]
    ) -> tuple[list[Any], list[Tag]]:
        """One equation's outputs and their tags, evaluated in its own context."""
        name = eqn.primitive.name
        out_tags: list[Tag] | None = None
        if is_marked(eqn):
            traced = [v.aval.dtype for v in eqn.invars]
            outvals = bind_in_context(eqn, cast_floating(invals, traced))
        elif name in HIGHER_ORDER and not is_registered(name):
            outvals, out_tags = HIGHER_ORDER[name](self, eqn, invals, in_tags, **parameters(eqn))
        elif (
            any(contains_jaxpr(p) for p in parameters(eqn).values())
            and name not in _OPAQUE_WITH_JAXPR
            and not is_registered(name)
        ):
            raise NotImplementedError(
                f"jaxscale.autocast does not know the higher-order primitive {name!r}, "
                "so it cannot cast the operations inside it. Call that part outside "
                "autocast, or inside jaxscale.autocast(..., enabled=False), or give it a "
                "row with jaxscale.casting.register_policy."
            )
        else:
            outvals, out_tags = self.first_order(eqn, invals, in_tags)
            self._note_axes(eqn, invals, outvals)
            self._note_gathered(eqn, invals, outvals)
            if name in _ORIGIN_KEEPING and len(outvals) == 1 and invals:
                self._note_origin(invals[0], outvals[0])
            elif name == "slice" and (layer := _one_leading_index(eqn)) is not None:
                # one layer of a stacked weight, taken by a Python index (``ws[3]``, and
                # ``for w in ws`` before JAX 0.12): the stacked argument's path and index
                origin = self.origin_of(invals[0])
                if origin is not None:
                    self._origins[id(outvals[0])] = (outvals[0], f"{origin}[{layer}]")
            elif name == "unstack" and parameters(eqn).get("axis") == 0:
                # ``for w in ws`` from JAX 0.12: every layer at once
                origin = self.origin_of(invals[0])
                if origin is not None:
                    for layer, value in enumerate(outvals):
                        self._origins[id(value)] = (value, f"{origin}[{layer}]")
            if self._window_sums and name in _VIEWS:
                self._note_window_sum_view(eqn, invals, outvals)
        return outvals, out_tags or [Tag.NONE] * len(outvals)

    # -- first-order equations ----------------------------------------------------------

    def first_order(
        self, eqn: Any, invals: list[Any], in_tags: list[Tag]
    ) -> tuple[list[Any], list[Tag]]:
        """A first-order equation under autocast: its precision decided, its operands
        cast for it (a float8 or float32-gradient matmul replaces the equation), and
        the equation bound on them, summing in float32 where it sums half values."""
        precision = self._precision_of(eqn, invals, in_tags)
        traced = [v.aval.dtype for v in eqn.invars]
        if precision is Precision.LOWER and self._lowers(invals):
            replaced = self._replaced_matmul(eqn, invals, in_tags, traced)
            if replaced is not None:
                return [replaced], [Tag.PRODUCT]
        window_sums = [self._window_sum(v) for v in invals] if eqn.primitive.name == "div" else None
        params = parameters_to_bind(eqn)
        invals, bias_summed_in_float32 = self._cast_operands(
            eqn, precision, invals, in_tags, traced, params
        )
        outvals = self._bind_cast(eqn, invals, in_tags, params, window_sums, bias_summed_in_float32)
        return outvals, _output_tags(eqn.primitive.name, precision, eqn, in_tags, len(outvals))

    def _precision_of(self, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Precision:
        """The policy's precision for the equation, resolved where it depends on the
        operands: a reciprocal, softmax's subtraction of its maximum, complex matmuls."""
        name = eqn.primitive.name
        precision = row_for(name, self.device_type).precision
        if precision is Precision.RECIPROCAL:
            precision = (
                Precision.FLOAT32
                if Tag.SCALAR in in_tags[0] and Tag.SCALAR not in in_tags[1]
                else Precision.WIDEST
            )
        if name == "sub" and Tag.STABILIZER in in_tags[1] and self.device_type == "cuda":
            precision = Precision.FLOAT32  # softmax's x - max(x): the op runs in float32
        if precision is Precision.LOWER and any(_is_complex(v.dtype) for v in invals):
            # PyTorch's autocast leaves complex matmuls alone: every operand as traced (a
            # real operand of a complex matmul back to its traced float32), never a
            # float16 x complex64 product
            precision = Precision.AS_TRACED
        return precision

    @staticmethod
    def _lowers(invals: list[Any]) -> bool:
        """Whether a LOWER equation's floating operands may be lowered: all of them float32
        or half (a float64 or float8 operand keeps the equation as written)."""
        floating = [v for v in invals if is_floating(v.dtype)]
        return bool(floating) and all(v.dtype in _LOWER_ELIGIBLE for v in floating)

    def _replaced_matmul(
        self, eqn: Any, invals: list[Any], in_tags: list[Tag], traced: list[Any]
    ) -> Any | None:
        """The result of a matmul that runs as something other than itself: a float8
        recipe's, or one whose operands' gradients come out in float32; else ``None``."""
        if self.matmul_hook is not None and eqn.primitive.name == "dot_general":
            hook = self.matmul_hook
            measured = self._as_the_matmul(
                eqn, lambda lhs, rhs: hook(self, eqn, [lhs, rhs]), *invals
            )
            if measured is not None:
                return measured
        if self.float8 is not None and self.runs_in_float8(eqn) and self._takes(eqn, invals):
            # torchao's Float8Linear: the input in the autocast dtype, the weight
            # quantized from its own precision, the result in the autocast dtype
            lhs = self.cast(invals[0], self.dtype, in_tags[0])
            key = None if self.key is None else jax.random.fold_in(self.key, self.site_count - 1)
            matmul = functools.partial(
                float8_dot_general,
                dimension_numbers=dot_dimension_numbers(eqn),
                recipe=self.float8,
                out_dtype=self.dtype,
            )
            rhs = invals[1]
            sharded = None
            if quantizes_before_gathering(self.float8):
                sharded = self.sharded_source(rhs)
            if sharded is not None:
                # The weight quantized where it lies and made whole as float8 (XLA's
                # partitioner moves the gather past a quantization it can see), where
                # the program's own gather moves it in its dtype: the same values
                self.follow([sharded], [rhs])
                rhs = sharded
            return self._as_the_matmul(eqn, matmul, lhs, rhs, key=key)
        floating = [v for v in invals if is_floating(v.dtype)]
        if self._keeps_float32_gradients(eqn, floating, traced):
            dims, precision = dot_dimension_numbers(eqn), parameters(eqn).get("precision")
            return self._as_the_matmul(
                eqn,
                lambda a, b: dot_with_float32_gradients(a, b, dims, self.dtype, precision),
                invals[0],
                invals[1],
            )
        return None

    def _as_the_matmul(
        self, eqn: Any, function: Callable[..., Any], *operands: Any, **keys: Any
    ) -> Any:
        """``function(*operands, **keys)``, the result of the matmul ``eqn`` computed
        another way (a float8 recipe's, a report's measurement, one whose operands'
        gradients come out in float32). On explicit mesh axes it
        is computed with them made automatic (its blocks and scales follow no sharding
        type rule), its result typed as the matmul's, and the operands it receives known
        as those they stand for (a weight's name, its axes)."""
        if first_explicitly_sharded(*operands) is None:
            return function(*operands, **keys)

        def inside(operands: tuple[Any, ...], keys: dict[str, Any]) -> Any:
            self.follow(operands, outside)
            return function(*operands, **keys)

        outside = operands
        spec = explicit_spec_of_type(eqn.outvars[0].aval)
        # (a measurement that leaves the matmul as it is returns None: nothing to type)
        return on_automatic_axes(
            inside, (operands, keys), lambda result: None if result is None else spec
        )

    def _cast_operands(
        self, eqn: Any, precision: Precision, invals: list[Any], in_tags: list[Tag],
        traced: list[Any], params: dict[str, Any],
    ) -> tuple[list[Any], bool]:  # fmt: skip
        """The operands cast for ``precision`` (``params`` updated where the result dtype
        is one), and whether the equation is a bias addition whose gradient must be
        summed in float32."""
        name = eqn.primitive.name
        if precision is Precision.AS_TRACED:
            return [
                self.cast(v, d, t) if is_floating(v.dtype) and is_floating(d) else v
                for v, d, t in zip(invals, traced, in_tags, strict=True)
            ], False
        if precision is Precision.LOWER:
            if not self._lowers(invals):
                return invals, False
            preferred = preferred_element_type(eqn)
            if (
                preferred is not None
                and is_floating(preferred)
                and not _asks_for_a_wider_result(preferred, traced)
            ):
                params["preferred_element_type"] = self.dtype
            return [
                self.cast(v, self.dtype, t) if is_floating(v.dtype) else v
                for v, t in zip(invals, in_tags, strict=True)
            ], False
        if precision is Precision.FLOAT32:
            return [self.cast(v, jnp.float32) if v.dtype in _HALF else v for v in invals], False
        if name in ("add", "add_any") and self._is_bias_add(eqn, invals, in_tags):
            invals = list(invals)
            product = 0 if Tag.PRODUCT in in_tags[0] else 1
            addend = 1 - product
            invals[addend] = self.cast(invals[addend], invals[product].dtype, in_tags[addend])
            # its gradient is a sum over the axes it is broadcast along: here, or by a
            # jax.vmap applied outside autocast
            return invals, invals[addend].dtype in _HALF and Tag.KNOWN not in in_tags[addend]
        if name not in _EACH_OPERAND_ON_ITS_OWN:
            return self._promote_to_widest(invals, in_tags, traced), False
        return invals, False

    def _bind_cast(
        self, eqn: Any, invals: list[Any], in_tags: list[Tag], params: dict[str, Any],
        window_sums: list[Any] | None, bias_summed_in_float32: bool,
    ) -> list[Any]:  # fmt: skip
        """The equation bound on its cast operands; a sum of half values (a reduction, an
        average pool's window sum, a bias's or a broadcast's gradient) in float32."""
        name = eqn.primitive.name
        if name in (_ACCUMULATES_IN_FLOAT32 | _EXACT_IN_FLOAT32) and invals[0].dtype in _HALF:
            wide = bind_in_context(eqn, [cast(invals[0], jnp.float32)], params)
            outvals = [cast(v, invals[0].dtype) for v in wide]
            if name in _DIVIDED_BEFORE_ROUNDING:
                self._window_sums[id(outvals[0])] = (outvals[0], wide[0])
            return outvals
        if window_sums and window_sums[0] is not None and is_floating(invals[1].dtype):
            # an average pool: the float32 sum divided, then rounded once
            divisor = window_sums[1] if window_sums[1] is not None else invals[1]
            wide = bind_in_context(eqn, [window_sums[0], cast(divisor, jnp.float32)], params)
            return [cast(wide[0], invals[0].dtype)]
        if bias_summed_in_float32:
            return [
                bias_added_with_a_float32_gradient_sum(
                    lambda a, b: bind_in_context(eqn, [a, b], params)[0], *invals
                )
            ]
        if name == "broadcast_in_dim" and _sums_back_in_half(eqn, invals, in_tags, 0):
            rest = invals[1:]
            return [
                summed_back_in_float32(
                    lambda v: bind_in_context(eqn, [v, *rest], params)[0], invals[0]
                )
            ]
        if name in _BROADCASTING_ELEMENTWISE:
            invals = _broadcasts_summed_back_in_float32(eqn, invals, in_tags)
        return bind_in_context(eqn, invals, params)

    def _is_bias_add(self, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> bool:
        """One operand is a matmul's output, the other an addend broadcast over it (a bias):
        fewer elements when traced, or made by broadcasting, or a scalar. Where both
        operands' axes are known, the addend must vary along one operand's axes only."""
        if not all(is_floating(v.dtype) for v in invals):
            return False
        sizes = [int(np.prod(v.aval.shape, dtype=int)) for v in eqn.invars]
        for product, addend in ((0, 1), (1, 0)):
            if Tag.PRODUCT not in in_tags[product]:
                continue
            if sizes[addend] < sizes[product] or in_tags[addend] & (Tag.BROADCAST | Tag.SCALAR):
                return _axes.varies_along_one_operand(
                    self.axes_of(invals[product]),
                    self.axes_of(invals[addend]),
                    eqn.invars[addend].aval.shape,
                    eqn.outvars[0].aval.shape,
                )
            if sizes[addend] == sizes[product] and Tag.GIVEN in in_tags[addend]:
                return _axes.bias_of_the_products_shape(
                    self.axes_of(invals[product]),
                    eqn.outvars[0].aval.shape,
                    expanded=Tag.EXPANDED in in_tags[addend],
                )
        return False

    def _keeps_float32_gradients(self, eqn: Any, floating: list[Any], traced: list[Any]) -> bool:
        """With ``grad_dtype=float32``: a matmul narrowing an operand wider than the autocast
        dtype, whose result is the autocast dtype (not a wider one asked for)."""
        if self.grad_dtype is None or eqn.primitive.name != "dot_general":
            return False
        preferred = preferred_element_type(eqn)
        if (
            preferred is not None
            and is_floating(preferred)
            and _asks_for_a_wider_result(preferred, traced)
        ):
            return False
        return any(v.dtype.itemsize > self.dtype.itemsize for v in floating)

    def runs_in_float8(self, eqn: Any) -> bool:
        """A linear layer's matmul under a float8 recipe: eligible, and not a matmul of a
        backward pass traced inside the function (those run in the autocast dtype)."""
        return (
            self.float8 is not None
            and eqn.primitive.name == "dot_general"
            and float8_eligible(eqn, self.float8)
            and "transpose(" not in name_stack_text(eqn)
        )

    def _takes(self, eqn: Any, invals: list[Any]) -> bool:
        """Whether the float8 filter lets this eligible matmul run in the recipe (while a
        scan is probed: records its site and lets none)."""
        self.site_count += 1
        keep = self.float8_filter
        if (keep is None and self.recording is None) or self.shape_pass:
            return True  # (a pass for the results' types decides nothing: shapes_of)
        site = self.site(eqn, invals)
        if self.recording is not None or keep is None:
            if self.recording is not None:
                self.recording.append(site)
            return False
        return checked_answer(keep(site), keep, site)

    def site(self, eqn: Any, invals: list[Any]) -> MatmulSite:
        """The :class:`MatmulSite` a filter is told of ``eqn``."""
        lhs, rhs = invals[0], invals[1]
        _, _, m, k, n = as_rows_and_columns(dot_dimension_numbers(eqn), lhs.shape, rhs.shape)
        scopes = [
            part for part in name_stack_text(eqn).split("/")
            if part and part != MARKER and not _TRANSFORM_SCOPE.match(part)
        ]  # fmt: skip
        found = location(equation_frames(eqn))
        layer, layers = self.layer if self.layer is not None else (None, None)
        lhs_path, rhs_path = self.origin_of(lhs), self.origin_of(rhs)
        on_the_left = weight_on_the_left(lhs_path, rhs_path)
        weight = lhs_path if on_the_left else rhs_path
        # as a linear layer's: N counts the weight's own outputs (Equinox's weight @ x,
        # vmapped, puts the weight on the left)
        dims = (n, k, m) if on_the_left else (m, k, n)
        return MatmulSite(
            name_stack="/".join(scopes),
            weight=weight,
            source=found.user or found.library,
            shapes=(tuple(lhs.shape), tuple(rhs.shape)),
            dims=dims,
            index=self.site_count - 1,
            layer=layer,
            layers=layers,
        )

    def _promote_to_widest(
        self, invals: list[Any], in_tags: list[Tag], traced: list[Any]
    ) -> list[Any]:
        """Floating inputs that shared a dtype when traced share one again: the widest of
        their current dtypes among those of the highest of PyTorch's three promotion
        categories present: arrays, then 0-d values, then constant scalars (PyTorch's
        Python numbers). So a scalar does not widen an array, nor a literal a 0-d value."""
        groups: dict[Any, list[int]] = {}
        for i, dtype in enumerate(traced):
            if is_floating(dtype) and is_floating(invals[i].dtype):
                groups.setdefault(np.dtype(dtype), []).append(i)
        out = list(invals)
        for members in groups.values():
            highest = max(_promotion_category(in_tags[i]) for i in members)
            arrays = [i for i in members if _promotion_category(in_tags[i]) == highest]
            target = invals[arrays[0]].dtype
            for i in arrays[1:]:
                target = widest(target, invals[i].dtype)
            for i in members:
                out[i] = self.cast(invals[i], target, in_tags[i])
        return out


def weight_on_the_left(lhs: str | None, rhs: str | None) -> bool:
    """Whether a matmul's weight is its left operand, from the argument paths the two
    are views of: the one given, or of two given, the more deeply nested (a layer's
    parameter inside a module or a dict, where the input is an argument of its own);
    the right one on a tie (``x @ w``)."""
    if lhs is None or rhs is None:
        return lhs is not None

    def depth(path: str) -> int:
        return path.count("[") + path.count(".")

    return depth(lhs) > depth(rhs)


def _sums_back_in_half(eqn: Any, invals: list[Any], in_tags: list[Tag], index: int) -> bool:
    """Whether input ``index`` is a float16 or bfloat16 value that the equation spreads
    over more elements, so that its gradient is a sum: a broadcast, or an operand of
    an elementwise operation broadcast against a larger one. Values no gradient can
    reach (:attr:`Tag.KNOWN`) are left alone."""
    value = invals[index]
    if value.dtype not in _HALF or Tag.KNOWN in in_tags[index]:
        return False
    spread = np.prod(eqn.outvars[0].aval.shape, dtype=int)
    return bool(np.prod(value.shape, dtype=int) < spread)


def summed_back_in_float32(broadcast: Callable[[Any], Any], value: Any) -> Any:
    """``broadcast(value)`` for a float16 or bfloat16 ``value``, the same bit for bit,
    written so that its gradient, a sum over the broadcast axes, accumulates in float32
    and is rounded to ``value``'s dtype once.

    JAX differentiates a broadcast into a sum in the value's own dtype: the gradient of
    a float16 bias, or of a ``[batch, 1, 1, channels]`` embedding added to a feature
    map, would be a float16 sum of thousands of terms, whose accuracy is left to the
    compiler (XLA's CPU backend rounds each block's partial sum to float16), and which
    ``jax.allow_f16_reductions(False)`` refuses. PyTorch's ``sum_to_size`` accumulates
    in float32 and rounds once; so does this. The value is broadcast as it is; only its
    derivative is written through float32 (a ``custom_jvp``), so the forward pass is
    unchanged and the gradient's sum reads the float16 cotangent widened as it goes.

    Not on the CPU, unless ``jax.allow_f16_reductions(False)`` is in force: there the
    sum stays in ``value``'s dtype, because XLA's CPU backend writes each float32
    sum's widened input out in full, which made the main example's train step 1.38×
    slower (measured on a 2-core AMD EPYC).
    """
    return _on_the_cpu_in_half(broadcast, value)


def bias_added_with_a_float32_gradient_sum(add: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """``add(a, b)`` for a float16 or bfloat16 product and bias, the same bit for bit,
    written so that the bias's gradient, a sum over the axes it is broadcast along,
    accumulates in float32 and is rounded to its dtype once.

    The bias may be broadcast by this addition (size-1 axes, a 0-d value), and over a
    batch by a ``jax.vmap`` applied outside autocast, which traced one example
    (Equinox's ``jax.vmap(jaxscale.autocast(model))``): the derivative is written as
    :func:`added_through_float32`, so that either sum is a float32 one. On the CPU as
    :func:`summed_back_in_float32` says.
    """
    return _on_the_cpu_in_half(add, a, b)


def half_sums_allowed() -> bool:
    """Whether JAX lets a program sum float16 and bfloat16 values in their own dtype
    (``jax.allow_f16_reductions``, in force while the function is traced)."""
    return bool(getattr(jax.config, "jax_allow_f16_reductions", True))


def _on_the_cpu_in_half(fn: Callable[..., Any], *values: Any) -> Any:
    """``fn(*values)`` with a float32 derivative (:func:`_with_float32_tangent`), except
    in the CPU's program where half-precision sums are allowed."""
    wide = functools.partial(_with_float32_tangent, fn)
    if not half_sums_allowed():
        return wide(*values)
    return lax.platform_dependent(*values, cpu=fn, default=wide)


# How many user-written JVP rules (``jax.custom_jvp``) autocast is evaluating now.
_jvp_rules_running = [0]


@contextlib.contextmanager
def evaluating_a_jvp_rule() -> Iterator[None]:
    """While autocast evaluates a ``custom_jvp`` rule: the rule's tangent arithmetic is
    linear, and JAX transposes it as written instead of differentiating it, so
    :func:`_with_float32_tangent` writes its float32 derivative into the values."""
    _jvp_rules_running[0] += 1
    try:
        yield
    finally:
        _jvp_rules_running[0] -= 1


def _with_float32_tangent(fn: Callable[..., Any], *values: Any) -> Any:
    """``fn(*values)`` (float16 or bfloat16 values, one result in their dtype), whose
    derivative is ``fn`` of the tangents in float32, rounded to the result's dtype: its
    transpose, a gradient, then sums in float32 wherever ``fn`` broadcasts.

    Inside a JVP rule (:func:`evaluating_a_jvp_rule`) the values are tangents that JAX
    transposes as they are computed (a ``custom_jvp`` there is traced as its primal,
    whose transpose is a half-precision sum), so ``fn`` runs on the values widened to
    float32 and rounds its result back: the same values bit for bit (a broadcast moves
    them, and an addition rounded twice, to float32 and then to the half dtype, rounds
    as once, as :func:`added_through_float32` says), and its transpose sums in float32.
    """
    if _jvp_rules_running[0]:
        dtype = jax.eval_shape(fn, *values).dtype
        return cast(fn(*(cast(v, jnp.float32) for v in values)), dtype)

    @jax.custom_jvp
    def spread(*args: Any) -> Any:
        return fn(*args)

    @spread.defjvp
    def spread_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
        out = fn(*primals)
        wide = fn(*(cast(t, jnp.float32) for t in tangents))
        return out, cast(wide, out.dtype)

    return spread(*values)


def added_through_float32(add: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """``add`` of ``a`` and ``b`` (float16 or bfloat16) run in float32 and rounded to their
    dtype: their sum in that dtype, exactly. Float32's 24-bit significand is at least
    twice float16's (11 bits) and bfloat16's (8 bits) plus two, which makes rounding
    twice, to float32 and then to the half dtype, the same as rounding once; float32's
    exponent range holds both dtypes'."""
    return cast(add(cast(a, jnp.float32), cast(b, jnp.float32)), a.dtype)


def _broadcasts_summed_back_in_float32(
    eqn: Any, invals: list[Any], in_tags: list[Tag]
) -> list[Any]:
    """The float16 or bfloat16 operands an elementwise equation broadcasts (size-1
    axes, or a 0-d value), broadcast explicitly by :func:`summed_back_in_float32`."""
    shape = tuple(eqn.outvars[0].aval.shape)
    out = list(invals)
    for i, value in enumerate(invals):
        if _sums_back_in_half(eqn, invals, in_tags, i):
            axes = tuple(range(len(shape) - value.ndim, len(shape)))
            out[i] = summed_back_in_float32(functools.partial(_broadcast, shape, axes), value)
    return out


def _broadcast(shape: tuple[int, ...], axes: tuple[int, ...], value: Any) -> Any:
    return lax.broadcast_in_dim(value, shape, axes)


def _promotion_category(tag: Tag) -> int:
    """PyTorch's type-promotion category: 2 for an array, 1 for a 0-d value, 0 for a
    scalar known when traced (a Python number in PyTorch)."""
    if Tag.SCALAR not in tag:
        return 2
    return 0 if Tag.CONSTANT in tag else 1


def _output_tags(
    name: str, precision: Precision, eqn: Any, in_tags: list[Tag], count: int
) -> list[Tag]:
    """What each output is: the input's facts through views and broadcasts, a product
    after a matmul, and a constant when every input is one."""
    constant = Tag.CONSTANT if all(Tag.CONSTANT in t for t in in_tags) else Tag.NONE
    if all(Tag.KNOWN in t for t in in_tags):
        constant |= Tag.KNOWN
    return [tag | constant for tag in _structural_tags(name, precision, eqn, in_tags, count)]


def _structural_tags(
    name: str, precision: Precision, eqn: Any, in_tags: list[Tag], count: int
) -> list[Tag]:
    if precision is Precision.LOWER:
        return [Tag.PRODUCT] * count
    maximum = _maximum_tags(name, in_tags, eqn)
    if maximum is not Tag.NONE:
        return [maximum] * count
    if name in _VIEWS:
        dropped = Tag.CONSTANT | Tag.KNOWN | Tag.MAXIMUM | Tag.STABILIZER | Tag.EXPANDED
        # a view of several values (device_put of a tuple) passes each one's facts on
        sources = in_tags if name in _EACH_OPERAND_ON_ITS_OWN else [in_tags[0]] * count
        return [(tag & ~dropped) | _expanded(eqn, tag) for tag in sources]
    if name == "convert_element_type":
        return [in_tags[0] & (Tag.SCALAR | Tag.BROADCAST | Tag.GIVEN | Tag.EXPANDED)]
    if name == "broadcast_in_dim":
        source = eqn.invars[0].aval
        grew = np.prod(source.shape, dtype=int) < np.prod(eqn.outvars[0].aval.shape, dtype=int)
        kept = in_tags[0] & (Tag.SCALAR | Tag.BROADCAST | Tag.GIVEN)
        return [kept | (Tag.BROADCAST if grew else _expanded(eqn, in_tags[0]))]
    return [Tag.NONE] * count


def _is_initial_minus_infinity(eqn: Any, in_tags: list[Tag]) -> bool:
    """Whether ``eqn`` (a ``max``) is ``max(-inf, m)`` of a maximum over an axis ``m``,
    as ``jnp.max(..., initial=-jnp.inf)`` writes it."""
    literals = [literal_value(var) for var in eqn.invars if is_literal(var)]
    minus_infinity = any(
        np.ndim(value) == 0 and bool(np.isneginf(np.asarray(value, np.float64)))
        for value in literals
    )
    return minus_infinity and any(Tag.MAXIMUM in tag for tag in in_tags)


def _expanded(eqn: Any, tag: Tag) -> Tag:
    """:attr:`Tag.EXPANDED` for a view that only adds size-1 axes to its input (or keeps
    the axes of an input that is such a view); nothing otherwise."""
    before, after = tuple(eqn.invars[0].aval.shape), tuple(eqn.outvars[0].aval.shape)
    if [n for n in before if n != 1] != [n for n in after if n != 1]:
        return Tag.NONE
    added = len(after) > len(before)
    kept = Tag.EXPANDED in tag and len(after) == len(before)
    return Tag.EXPANDED if added or kept else Tag.NONE


def _maximum_tags(name: str, in_tags: list[Tag], eqn: Any) -> Tag:
    """A maximum over an axis (and its stop_gradient) through the operations JAX's
    softmax and logsumexp apply to it; ``Tag.NONE`` for anything else.

    The stabiliser is such a maximum held constant (``stop_gradient``), or taken with an
    initial ``-inf`` (``jnp.max(x, initial=-jnp.inf)``): JAX 0.12.1's softmax, a custom
    derivative of its own, subtracts that maximum without a ``stop_gradient``."""
    if name == "reduce_max":
        return Tag.MAXIMUM
    carried = Tag.MAXIMUM | Tag.STABILIZER
    if name == "stop_gradient" and Tag.MAXIMUM in in_tags[0]:
        return Tag.STABILIZER
    if name == "max" and _is_initial_minus_infinity(eqn, in_tags):
        return Tag.STABILIZER
    if name in ("broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type"):
        return in_tags[0] & carried
    if name in ("max", "select_n"):  # max(-inf, m); where(isfinite(m), m, 0)
        tags = [t & carried for t in in_tags if t & carried]
        return tags[0] if tags else Tag.NONE
    return Tag.NONE
