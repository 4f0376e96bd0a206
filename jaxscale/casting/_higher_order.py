"""How autocast reaches inside each higher-order primitive.

Each rule rebuilds its equation through JAX's public API (``lax.scan``,
``lax.while_loop``, ``lax.switch``, ``jax.checkpoint``, ``jax.custom_jvp``,
``jax.custom_vjp``, ``jax.custom_batching.custom_vmap``, ``jax.shard_map``), with
the interpreter run on the inner jaxprs. Values enter an inner jaxpr in whatever
dtype autocast gave them; only loop carries are held to the dtype they were traced
with, since a loop needs its carry's type to be the same on every iteration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jaxscale._src.jaxprs import (
    bind_in_context,
    bind_protocol,
    called_program,
    compute_on_function,
    is_literal,
    jit_defined_in_jax,
    scan_operand_groups,
    shard_map_checks_varying,
    shard_map_manual_axes,
)
from jaxscale.casting._interpreter import (
    HIGHER_ORDER,
    Autocaster,
    Tag,
    captured_tags,
    cast,
    cast_floating,
    evaluating_a_jvp_rule,
    is_floating,
    widest,
)
from jaxscale.casting._matmul_site import checked_answer
from jaxscale.casting._policy import FLOAT32_FUNCTIONS
from jaxscale.casting._region import autocast_state

Result = tuple[list[Any], list[Tag]]
_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _register(*names: str) -> Any:
    def decorate(rule: Any) -> Any:
        for name in names:
            HIGHER_ORDER[name] = rule
        return rule

    return decorate


def _called_under_autocast(
    autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]
) -> Callable[..., list[Any]]:
    """The program a call-like equation runs, as a function of values standing in for
    ``invals`` evaluated under autocast: the body of a rule that rebuilds the call with
    JAX's own function for it (keyword arguments, a composite's attributes, are
    already in the program)."""
    jaxpr, consts = called_program(eqn)

    def body(*args: Any, **_: Any) -> list[Any]:
        return autocaster.eval_in_place_of(jaxpr, consts, args, invals, in_tags)

    return body


@_register("jit", "closed_call")  # closed_call: JAX 0.10 only
def _inline_call(
    autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag], **_: Any
) -> Result:
    # A nested jit changes nothing inside an enclosing trace: its equations are
    # evaluated in place, so matmul/bias facts flow across its boundary too.
    jaxpr, consts = called_program(eqn)
    if autocaster.device_type == "cuda" and jit_defined_in_jax(eqn) in FLOAT32_FUNCTIONS:
        invals = [autocaster.cast(v, jnp.float32) if v.dtype in _HALF else v for v in invals]
    return autocaster.eval(jaxpr, consts, invals, in_tags, captured_tags(consts))


@_register("xla_metadata_call")  # JAX 0.11 and later
def _xla_metadata_call(autocaster: Autocaster, eqn: Any, invals: list[Any],
                       in_tags: list[Tag], *, ad_metadata: Any, xla_metadata: Any,
                       **_: Any) -> Result:  # fmt: skip
    # jax.experimental.xla_metadata.xla_metadata_call: the call is rebuilt with the same
    # metadata around the function under autocast, so the attributes still reach the
    # operations XLA compiles for it
    # (JAX 0.11 and later, the versions that emit the primitive)
    from jax.experimental.xla_metadata import (  # type: ignore[attr-defined,unused-ignore]
        xla_metadata_call2,
    )

    # ad_metadata as recorded: "same", () for "drop", or pairs
    recorded = ad_metadata if ad_metadata == "same" else (dict(ad_metadata) or "drop")
    rebuilt = xla_metadata_call2(
        _called_under_autocast(autocaster, eqn, invals, in_tags),
        metadata=dict(xla_metadata),
        ad_metadata=recorded,
    )
    return list(rebuilt(*invals)), []


@_register("compute_on")
def _compute_on(autocaster: Autocaster, eqn: Any, invals: list[Any],
                in_tags: list[Tag], *, compute_type: Any, out_memory_spaces: Any,
                **params: Any) -> Result:  # fmt: skip
    # jax.experimental.compute_on's function form (host offloading): the call is rebuilt
    # with the same compute type, output memory spaces and compiler options around the
    # function under autocast, so its operations still run where they were placed
    options = params.get("compiler_options_json")  # from JAX 0.10.1
    rebuilt = compute_on_function()(
        _called_under_autocast(autocaster, eqn, invals, in_tags),
        compute_type=compute_type,
        out_memory_spaces=list(out_memory_spaces),
        **({} if options is None else {"compiler_options": json.loads(options)}),
    )
    return list(rebuilt(*invals)), []


@_register("fused_call")
def _fused(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag], *,
           out_spaces: Any, **_: Any) -> Result:  # fmt: skip
    # jax.experimental.fused: a function XLA must compile as one GPU kernel, rebuilt
    # with the same output memory spaces around the function under autocast
    from jax.experimental.fused import fused

    body = _called_under_autocast(autocaster, eqn, invals, in_tags)
    return list(fused(out_spaces=out_spaces)(body)(*invals)), []


@_register("custom_linear_solve", "pallas_call", "custom_partitioning")
def _as_traced(
    autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag], **_: Any
) -> Result:
    # jnp.linalg.solve and the iterative solvers: linear algebra runs as written (see
    # AS_TRACED in the policy), so the equation is bound again on its traced dtypes.
    # A Pallas kernel too: it was written for the dtypes it was traced with, and its
    # operations act on its buffers, where a cast has no meaning (as a hand-written
    # kernel is left alone by PyTorch's autocast); and a custom_partitioning operation,
    # whose partition rule gives each device a function written for those dtypes. A
    # row given to either with register_policy comes first.
    traced = [v.aval.dtype for v in eqn.invars]
    return bind_in_context(eqn, cast_floating(invals, traced)), []


@_register("composite")
def _composite(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag],
               *, attributes: Any, name: str, version: int, **_: Any) -> Result:  # fmt: skip
    # lax.composite: a named operation defined by its decomposition, which a compiler
    # may replace by a kernel of its own. Autocast casts inside the decomposition, as
    # inside any function, and the result is again a composite of the same name,
    # version and attributes (a compiler matching it on its dtypes then sees autocast's).
    given = {
        # an array attribute is held hashable; its ``val`` is the array given
        key: treedef.unflatten([getattr(leaf, "val", leaf) for leaf in leaves])
        for key, leaves, treedef in attributes
    }

    decomposition = _called_under_autocast(autocaster, eqn, invals, in_tags)
    rebuilt = lax.composite(decomposition, name, version)
    return list(rebuilt(*invals, **given)), []


@_register("scan")
def _scan(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag], *,
          jaxpr: Any, length: int, reverse: bool, unroll: Any,
          **params: Any) -> Result:  # fmt: skip
    body = jaxpr
    consts, init, xs = scan_operand_groups(params, invals)
    const_tags, _, xs_tags = scan_operand_groups(params, in_tags)
    num_carry = len(init)
    carry_dtypes = [a.dtype for a in scan_operand_groups(params, body.in_avals)[1]]
    init = cast_floating(init, carry_dtypes)
    # what the constants are holds in every step; a slice of a given value is given (a
    # layer's parameters scanned over); the carry is computed anew
    body_tags = [*const_tags, *[Tag.NONE] * num_carry, *[t & Tag.GIVEN for t in xs_tags]]

    keyed = autocaster.key is not None and autocaster.float8 is not None
    # the iteration's index is scanned over where a stochastic rounding draws from it or
    # a measurement is kept per layer
    indexed = keyed or autocaster.per_iteration
    origins = [autocaster.origin_of(x) for x in xs]

    def make_step() -> Callable[..., Any]:
        # a new function each time: JAX caches a scan body's trace by the function, and
        # the probe of :func:`_layer_segments` traces it with no matmul decided
        def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            outer_key, outer_iteration = autocaster.key, autocaster.iteration
            if indexed:
                *x, iteration = x
                if keyed:  # each iteration draws its own stochastic rounding
                    autocaster.key = jax.random.fold_in(outer_key, iteration)
                if autocaster.per_iteration:
                    autocaster.iteration = iteration
            # a slice of an argument is still that argument (a layer of a stacked weight)
            named = [(value, origin) for value, origin in zip(x, origins, strict=True) if origin]
            autocaster.name_inputs([v for v, _ in named], [o for _, o in named])
            try:
                outs = autocaster.run(body, [*consts, *carry, *x], body_tags)
            finally:
                autocaster.key, autocaster.iteration = outer_key, outer_iteration
            return cast_floating(outs[:num_carry], carry_dtypes), outs[num_carry:]

        return step

    def scan_over(start: int, stop: int, carry: list[Any]) -> tuple[list[Any], list[Any]]:
        whole = start == 0 and stop == length
        sliced = xs if whole else [x[start:stop] for x in xs]
        if indexed:
            sliced = [*sliced, jnp.arange(start, stop, dtype=jnp.uint32)]
        outer_layer, autocaster.layer = autocaster.layer, (start, length)
        outer_repeats, autocaster.repeats = autocaster.repeats, autocaster.repeats * (stop - start)
        try:
            return lax.scan(
                make_step(), carry, sliced, length=stop - start, reverse=reverse, unroll=unroll
            )
        finally:
            autocaster.layer, autocaster.repeats = outer_layer, outer_repeats

    segments = _layer_segments(autocaster, body, consts, init, xs, length, scan_over)
    carry, pieces = init, {}
    for start, stop in reversed(segments) if reverse else segments:
        carry, pieces[start] = scan_over(start, stop, carry)
    ys = [
        jnp.concatenate([pieces[start][i] for start, _ in segments])
        if len(segments) > 1 else pieces[0][i]
        for i in range(len(pieces[0]))
    ]  # fmt: skip
    return [*carry, *ys], []


def _layer_segments(
    autocaster: Autocaster, body: Any, consts: list[Any], init: list[Any], xs: list[Any],
    length: int, scan_over: Any,
) -> list[tuple[int, int]]:  # fmt: skip
    """The runs of consecutive iterations of a scan for which the float8 filter decides
    the body's matmuls alike (one run when there is no filter, or no matmul to decide).

    The body is traced once with every decision deferred (the sites are recorded), then
    the filter is asked about each site at each iteration."""
    keep = autocaster.float8_filter
    if keep is None or autocaster.float8 is None or length <= 1:
        return [(0, length)]
    recorded: list[Any] = []
    outer, autocaster.recording = autocaster.recording, recorded
    count = autocaster.site_count
    try:
        jax.eval_shape(lambda carry: scan_over(0, 1, carry), init)
    finally:
        autocaster.recording = outer
        autocaster.site_count = count
    if not recorded:
        return [(0, length)]

    def decisions(layer: int) -> tuple[bool, ...]:
        return tuple(
            checked_answer(keep(s), keep, s)
            for s in (dataclasses.replace(site, layer=layer, layers=length) for site in recorded)
        )

    segments: list[tuple[int, int]] = []
    previous = None
    for layer in range(length):
        current = decisions(layer)
        if current != previous:
            segments.append((layer, layer + 1))
        else:
            segments[-1] = (segments[-1][0], layer + 1)
        previous = current
    return segments


@_register("while")
def _while(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag], *,
           cond_jaxpr: Any, body_jaxpr: Any, cond_nconsts: int, body_nconsts: int,
           **_: Any) -> Result:  # fmt: skip
    cond, body = cond_jaxpr, body_jaxpr
    cond_consts = invals[:cond_nconsts]
    rest = invals[cond_nconsts:]
    body_consts, init = rest[:body_nconsts], rest[body_nconsts:]
    carry_dtypes = [a.dtype for a in body.in_avals[body_nconsts:]]
    cond_tags = [*in_tags[:cond_nconsts], *[Tag.NONE] * len(init)]
    body_tags = [*in_tags[cond_nconsts:][:body_nconsts], *[Tag.NONE] * len(init)]

    def keep_going(carry: Any) -> Any:
        return autocaster.run(cond, [*cond_consts, *carry], cond_tags)[0]

    def step(carry: Any) -> list[Any]:
        outs = autocaster.run(body, [*body_consts, *carry], body_tags)
        return cast_floating(outs, carry_dtypes)

    return list(lax.while_loop(keep_going, step, cast_floating(init, carry_dtypes))), []


@_register("cond")
def _cond(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag], *,
          branches: Any, **_: Any) -> Result:  # fmt: skip
    index, operands = invals[0], invals[1:]

    def branch_fn(closed: Any) -> Any:
        def branch(*ops: Any) -> list[Any]:
            return autocaster.eval_in_place_of(
                closed.jaxpr, closed.consts, ops, operands, in_tags[1:]
            )

        return branch

    # Branches must agree on their outputs' types: each output takes the widest
    # dtype any branch gives it.
    shapes = [autocaster.shapes_of(branch_fn(b), *operands) for b in branches]
    targets = []
    for outputs in zip(*shapes, strict=True):
        target = outputs[0].dtype
        for other in outputs[1:]:
            if is_floating(target) and is_floating(other.dtype):
                target = widest(target, other.dtype)
        targets.append(target)

    def unified(closed: Any) -> Any:
        return lambda *ops: cast_floating(branch_fn(closed)(*ops), targets)

    return list(lax.switch(index, [unified(b) for b in branches], *operands)), []


@_register("remat2")  # jax.checkpoint, nnx.remat
def _remat(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag], *,
           jaxpr: Any, prevent_cse: bool, policy: Any, **_: Any) -> Result:  # fmt: skip
    def body(*args: Any) -> list[Any]:
        return autocaster.eval_in_place_of(jaxpr, [], args, invals, in_tags)

    rematted = jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)
    return list(rematted(*invals)), []


@_register("custom_jvp_call")
def _custom_jvp(autocaster: Autocaster, eqn: Any, invals: list[Any],
                in_tags: list[Tag], *, call_jaxpr: Any, symbolic_zeros: bool,
                **_: Any) -> Result:  # fmt: skip
    # The primal runs under autocast now; the user's JVP rule runs under autocast when
    # JAX differentiates, and only then, with the tangents JAX gives it (symbolic
    # zeros where it has them), as JAX would run the rule itself.
    call, wants_symbolic_zeros = call_jaxpr, symbolic_zeros
    traced = list(call.in_avals)  # abstract values: shapes, dtypes, varying mesh axes

    @_in_custom_rule(autocaster)
    def primal(*args: Any) -> list[Any]:
        return autocaster.eval_in_place_of(call.jaxpr, call.consts, args, invals, in_tags)

    @_in_custom_rule(autocaster)
    def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        out_shapes = autocaster.shapes_of(primal, *primals)
        if not wants_symbolic_zeros:
            tangents = [_instantiate(t) for t in tangents]
        (_, rule), _ = bind_protocol(eqn)
        given = _Arguments([*primals, *tangents], [*traced, *map(_tangent_aval, traced)])
        zero_outputs: list[Any] = []

        def traced_rule(*arrays: Any) -> list[Any]:
            outs = list(rule.call_wrapped(*given.merge(arrays)))
            zero_outputs[:] = [None if _is_array(o) else o for o in outs]
            return [o for o in outs if _is_array(o)]

        # the rule sees the forward's state
        with autocast_state(True, autocaster.dtype, autocaster.device_type):
            rule_jaxpr = jax.make_jaxpr(traced_rule)(*given.traced_arrays)
        # the primals are what they were outside; the tangents are computed
        tags = given.select([*in_tags, *[Tag.NONE] * len(tangents)])
        autocaster.follow(primals, invals)
        with evaluating_a_jvp_rule():
            arrays = iter(autocaster.run(rule_jaxpr, given.arrays, tags))
        outs = [next(arrays) if zero is None else zero for zero in zero_outputs]
        half = len(outs) // 2
        primal_out = cast_floating(outs[:half], [s.dtype for s in out_shapes])
        tangent_out = [
            t if not _is_array(t) or _is_float0(t) else cast(t, _tangent_dtype(s.dtype))
            for t, s in zip(outs[half:], out_shapes, strict=True)
        ]
        return primal_out, tangent_out

    rebuilt = jax.custom_jvp(primal)
    rebuilt.defjvp(jvp, symbolic_zeros=True)
    return list(rebuilt(*invals)), []


@_register("custom_vmap_call")
def _custom_vmap(autocaster: Autocaster, eqn: Any, invals: list[Any],
                 in_tags: list[Tag], *, call: Any, rule: Any, in_tree: Any,
                 **_: Any) -> Result:  # fmt: skip
    # jax.custom_batching.custom_vmap (and sequential_vmap): the function runs under
    # autocast now; the user's batching rule runs under autocast when JAX batches it,
    # and only then, traced at the dtypes it was written for, as the function was. Its
    # results take the dtypes the function gives under autocast, so a function casts
    # the same batched or not.
    traced = [aval.dtype for aval in call.in_avals]

    def function(*args: Any) -> list[Any]:
        return autocaster.eval_in_place_of(call.jaxpr, call.consts, args, invals, in_tags)

    out_dtypes = [shape.dtype for shape in autocaster.shapes_of(function, *invals)]
    rebuilt = jax.custom_batching.custom_vmap(function)

    @rebuilt.def_vmap
    def batched(axis_size: int, in_batched: list[bool], *args: Any) -> tuple[list, list]:
        out_batched: list[Any] = []

        def traced_rule(*arrays: Any) -> list[Any]:
            outs, flags = rule(
                axis_size,
                list(jax.tree.unflatten(in_tree, in_batched)),
                *jax.tree.unflatten(in_tree, arrays),
            )
            out_batched[:] = jax.tree.leaves(flags)
            return jax.tree.leaves(outs)

        shapes = [
            jax.ShapeDtypeStruct(jnp.shape(arg), dtype)
            for arg, dtype in zip(args, traced, strict=True)
        ]
        with autocast_state(True, autocaster.dtype, autocaster.device_type):
            rule_jaxpr = jax.make_jaxpr(traced_rule)(*shapes)
        outs = autocaster.run(rule_jaxpr, list(args), [Tag.NONE] * len(args))
        return cast_floating(outs, out_dtypes), out_batched

    return list(rebuilt(*invals)), []


@_register("custom_vjp_call")
def _custom_vjp(autocaster: Autocaster, eqn: Any, invals: list[Any],
                in_tags: list[Tag], *, call_jaxpr: Any, symbolic_zeros: bool,
                **_: Any) -> Result:  # fmt: skip
    # The primal runs under autocast now; the user's forward and backward rules run
    # under autocast when JAX differentiates, and only then, with the perturbation
    # flags and symbolic zero cotangents JAX gives them.
    call, wants_symbolic_zeros = call_jaxpr, symbolic_zeros
    traced = list(call.in_avals)  # abstract values: shapes, dtypes, varying mesh axes
    cotangent_avals = [_tangent_aval(a) for a in call.out_avals]

    @_in_custom_rule(autocaster)
    def primal(*args: Any) -> list[Any]:
        return autocaster.eval_in_place_of(call.jaxpr, call.consts, args, invals, in_tags)

    @_in_custom_rule(autocaster)
    def forward(*inputs: Any) -> tuple[list[Any], tuple[list[Any], _BackwardFacts]]:
        values = [i.value for i in inputs]
        perturbed = [bool(i.perturbed) for i in inputs]
        (_, fwd, _), bind_params = bind_protocol(eqn)

        def traced_forward(*vals: Any) -> Any:
            return fwd.call_wrapped(*[x for pair in zip(vals, perturbed) for x in pair])  # noqa: B905

        with autocast_state(True, autocaster.dtype, autocaster.device_type):
            fwd_jaxpr = jax.make_jaxpr(traced_forward)(*traced)
        _, res_tree, *rest = bind_params["out_trees"]()
        forwarded = list(rest[0]) if rest else [None] * res_tree.num_leaves
        computed = res_tree.num_leaves - sum(f is not None for f in forwarded)
        outs = autocaster.eval_in_place_of(
            fwd_jaxpr.jaxpr, fwd_jaxpr.consts, values, invals, in_tags
        )
        # A residual the forward rule returned as a constant reaches the backward rule
        # as JAX passes it: the very value (a Python bool steering its code stays one).
        computed_values = iter(
            var.val if is_literal(var) else out
            for var, out in zip(fwd_jaxpr.jaxpr.outvars[:computed], outs, strict=False)
        )
        computed_avals = iter(fwd_jaxpr.out_avals[:computed])
        residuals, residual_avals = [], []
        for f in forwarded:
            residuals.append(next(computed_values) if f is None else values[f])
            residual_avals.append(next(computed_avals) if f is None else traced[f])
        out_dtypes = [s.dtype for s in autocaster.shapes_of(primal, *values)]
        facts = _BackwardFacts(
            tuple(residual_avals),
            tuple(np.dtype(_tangent_dtype(v.dtype)) for v in values),
        )
        return cast_floating(outs[computed:], out_dtypes), (residuals, facts)

    @_in_custom_rule(autocaster)
    def backward(saved: tuple[list[Any], _BackwardFacts], cotangents: Any) -> tuple[Any, ...]:
        residuals, facts = saved
        if not wants_symbolic_zeros:
            cotangents = [_instantiate(c) for c in cotangents]
        (_, _, bwd), _ = bind_protocol(eqn)
        given = _Arguments([*residuals, *cotangents], [*facts.residuals, *cotangent_avals])
        zero_outputs: list[bool] = []

        def traced_backward(*arrays: Any) -> list[Any]:
            outs = bwd.call_wrapped(*given.merge(arrays))
            if len(outs) == 2 and isinstance(outs[0], (list, tuple)) and not _is_array(outs[1]):
                outs = outs[0]  # JAX 0.12 and later return (cotangents, backward-pass logs)
            zero_outputs[:] = [not _is_array(o) for o in outs]
            return [o for o in outs if _is_array(o)]

        # as PyTorch's custom_bwd does
        with autocast_state(True, autocaster.dtype, autocaster.device_type):
            bwd_jaxpr = jax.make_jaxpr(traced_backward)(*given.traced_arrays)
        nonzero = iter(autocaster.run(bwd_jaxpr, given.arrays))
        grads = []
        for dtype, zero in zip(facts.input_tangents, zero_outputs, strict=True):
            grad = None if zero else next(nonzero)
            keep = grad is None or _is_float0(grad) or dtype == jax.dtypes.float0
            grads.append(grad if keep else cast(grad, dtype))
        return tuple(grads)

    rebuilt = jax.custom_vjp(primal)
    rebuilt.defvjp(forward, backward, symbolic_zeros=True)
    return list(rebuilt(*invals)), []


@contextlib.contextmanager
def _in_custom_rule(autocaster: Autocaster) -> Iterator[None]:
    """While a custom derivative's function runs (as a decorator, on every call):
    ``autocaster.custom_rule_depth`` counts it."""
    autocaster.custom_rule_depth += 1
    try:
        yield
    finally:
        autocaster.custom_rule_depth -= 1


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _BackwardFacts:
    """What a custom_vjp's backward rule needs from its forward, beside the residuals:
    the residuals' traced abstract values and the tangent dtype of each input."""

    residuals: tuple[Any, ...]
    input_tangents: tuple[np.dtype, ...]


class _Arguments:
    """A rule's arguments, split into JAX arrays (inputs of the rule's jaxpr, traced
    at the dtypes the rule was written for) and the rest, which the rule receives
    as they are: symbolic zeros, float0 zeros, and constants the forward rule
    returned (a Python bool among the residuals may steer the backward rule's
    code, as it does when JAX runs the rule)."""

    def __init__(self, values: Sequence[Any], traced: Sequence[Any]):
        self._values = list(values)
        self._is_input = [isinstance(v, jax.Array) and not _is_float0(v) for v in values]
        self.arrays = [v for v, use in zip(values, self._is_input, strict=True) if use]
        self.traced_arrays = [t for t, use in zip(traced, self._is_input, strict=True) if use]

    def select(self, facts: Sequence[Any]) -> list[Any]:
        """The entries of ``facts``, one per value, that belong to the arrays."""
        return [f for f, use in zip(facts, self._is_input, strict=True) if use]

    def merge(self, arrays: Sequence[Any]) -> list[Any]:
        fresh = iter(arrays)
        return [next(fresh) if use else v for v, use in zip(self._values, self._is_input)]  # noqa: B905


def _instantiate(value: Any) -> Any:
    """A symbolic zero as the array of zeros it stands for; anything else unchanged."""
    if isinstance(value, SymbolicZero):
        return (
            np.zeros(value.shape, value.dtype)
            if value.dtype == jax.dtypes.float0
            else (jnp.zeros(value.shape, value.dtype))
        )
    return value


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic))


def _tangent_aval(aval: Any) -> Any:
    return aval.update(dtype=_tangent_dtype(aval.dtype))


@_register("shard_map")
def _shard_map(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag],
               *, jaxpr: Any, mesh: Any, in_specs: Any, out_specs: Any,
               **params: Any) -> Result:  # fmt: skip
    def body(*args: Any) -> tuple[Any, ...]:
        return tuple(autocaster.eval_in_place_of(jaxpr, [], args, invals, in_tags))

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        axis_names=shard_map_manual_axes(params),
        check_vma=shard_map_checks_varying(params),
    )
    return list(mapped(*invals)), []


def _tangent_dtype(dtype: Any) -> Any:
    return dtype if is_floating(dtype) else jax.dtypes.float0


def _is_float0(value: Any) -> bool:
    return getattr(value, "dtype", None) == jax.dtypes.float0
