"""How autocast reaches inside each higher-order primitive.

Each rule rebuilds its equation through JAX's public API (``lax.scan``,
``lax.while_loop``, ``lax.switch``, ``jax.checkpoint``, ``jax.custom_jvp``,
``jax.custom_vjp``, ``jax.shard_map``), with the interpreter run on the inner
jaxprs. Values enter an inner jaxpr in whatever dtype autocast gave them; only
loop carries are held to the dtype they were traced with, since a loop needs
its carry's type to be the same on every iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.casting._interpreter import (
    HIGHER_ORDER,
    Autocaster,
    Tag,
    bind_protocol,
    cast,
    cast_floating,
    is_floating,
    widest,
)

Result = tuple[list[Any], list[Tag]]


def _register(*names: str) -> Any:
    def decorate(rule: Any) -> Any:
        for name in names:
            HIGHER_ORDER[name] = rule
        return rule

    return decorate


def _shapes(avals: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


@_register("jit", "pjit", "closed_call", "core_call")
def _inline_call(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Result:
    # A nested jit changes nothing inside an enclosing trace: its equations are
    # evaluated in place, so matmul/bias facts flow across its boundary too.
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return autocaster.eval(closed.jaxpr, closed.consts, invals, in_tags)


@_register("scan")
def _scan(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Result:
    params = eqn.params
    body = params["jaxpr"]
    consts, init, xs = _scan_operands(params, invals)
    num_carry = len(init)
    carry_dtypes = [a.dtype for a in _scan_operands(params, body.in_avals)[1]]
    init = cast_floating(init, carry_dtypes)

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = autocaster.run(body, [*consts, *carry, *x])
        return cast_floating(outs[:num_carry], carry_dtypes), outs[num_carry:]

    carry, ys = lax.scan(
        step,
        init,
        xs,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys], []


def _scan_operands(params: dict[str, Any], values: Sequence[Any]) -> tuple[list, list, list]:
    """A scan's operands (or its body's inputs) as ``(consts, carry, xs)``.

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


@_register("while")
def _while(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Result:
    params = eqn.params
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    cond_consts = invals[: params["cond_nconsts"]]
    rest = invals[params["cond_nconsts"] :]
    body_consts, init = rest[: params["body_nconsts"]], rest[params["body_nconsts"] :]
    carry_dtypes = [a.dtype for a in body.in_avals[params["body_nconsts"] :]]

    def keep_going(carry: Any) -> Any:
        return autocaster.run(cond, [*cond_consts, *carry])[0]

    def step(carry: Any) -> list[Any]:
        return cast_floating(autocaster.run(body, [*body_consts, *carry]), carry_dtypes)

    return list(lax.while_loop(keep_going, step, cast_floating(init, carry_dtypes))), []


@_register("cond")
def _cond(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Result:
    index, operands = invals[0], invals[1:]
    branches = eqn.params["branches"]

    def branch_fn(closed: Any) -> Any:
        return lambda *ops: autocaster.run(closed, ops)

    # Branches must agree on their outputs' types: each output takes the widest
    # dtype any branch gives it.
    shapes = [jax.eval_shape(branch_fn(b), *operands) for b in branches]
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


@_register("checkpoint", "remat2", "remat")
def _remat(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Result:
    jaxpr = eqn.params["jaxpr"]

    def body(*args: Any) -> list[Any]:
        return autocaster.eval(jaxpr, [], args)[0]

    rematted = jax.checkpoint(
        body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
    )
    return list(rematted(*invals)), []


@_register("custom_jvp_call")
def _custom_jvp(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Result:
    # The primal and the user's JVP rule both run under autocast; the rule is traced
    # from JAX's own re-binding protocol (get_bind_params) at the traced dtypes.
    call = eqn.params["call_jaxpr"]
    (_, rule), _ = bind_protocol(eqn)
    traced = _shapes(call.in_avals)
    tangent_shapes = [jax.ShapeDtypeStruct(s.shape, _tangent_dtype(s.dtype)) for s in traced]
    rule_jaxpr = jax.make_jaxpr(lambda *xs: rule.call_wrapped(*xs))(*traced, *tangent_shapes)

    @jax.custom_jvp
    def primal(*args: Any) -> list[Any]:
        return autocaster.run(call, args)

    @primal.defjvp
    def jvp(primals: Any, tangents: Any) -> Any:
        out_shapes = jax.eval_shape(primal, *primals)
        dtypes = [s.dtype for s in out_shapes]
        tangents = [t if _is_float0(t) else cast(t, p.dtype) for t, p in zip(tangents, primals)]  # noqa: B905
        outs = autocaster.run(rule_jaxpr, [*primals, *tangents])
        half = len(outs) // 2
        primal_out = cast_floating(outs[:half], dtypes)
        tangent_out = [
            t if _is_float0(t) else cast(t, d)
            for t, d in zip(outs[half:], [_tangent_dtype(d) for d in dtypes], strict=True)
        ]
        return primal_out, tangent_out

    return list(primal(*invals)), []


@_register("custom_vjp_call")
def _custom_vjp(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Result:
    # The user's forward and backward rules are kept, and both run under autocast.
    call = eqn.params["call_jaxpr"]
    num_consts = eqn.params["num_consts"]
    (_, fwd, bwd), bind_params = bind_protocol(eqn)
    traced = _shapes(call.in_avals)
    nonzeros = [False] * num_consts + [True] * (len(traced) - num_consts)

    def forward(*vals: Any) -> Any:
        pairs = [x for pair in zip(vals, nonzeros, strict=True) for x in pair]
        return fwd.call_wrapped(*pairs)

    fwd_jaxpr = jax.make_jaxpr(forward)(*traced)
    trees = bind_params["out_trees"]()
    res_tree = trees[1]
    forwarded = list(trees[2]) if len(trees) > 2 else [None] * res_tree.num_leaves
    computed = res_tree.num_leaves - sum(f is not None for f in forwarded)
    res_shapes = iter(_shapes(fwd_jaxpr.out_avals[:computed]))
    residual_shapes = [next(res_shapes) if f is None else traced[f] for f in forwarded]
    cotangent_shapes = [
        jax.ShapeDtypeStruct(a.shape, _tangent_dtype(a.dtype)) for a in call.out_avals
    ]
    zero_outputs: list[bool] = []

    def backward(*args: Any) -> list[Any]:
        outs = bwd.call_wrapped(*args)
        if (
            len(outs) == 2
            and isinstance(outs[0], (list, tuple))
            and not isinstance(outs[1], jax.Array | jax.core.Tracer)
        ):
            outs = outs[0]  # JAX 0.12 and later return (cotangents, backward-pass logs)
        outs = list(outs)
        zero_outputs[:] = [not hasattr(o, "shape") or type(o).__name__ == "Zero" for o in outs]
        return [o for o, zero in zip(outs, zero_outputs, strict=True) if not zero]

    bwd_jaxpr = jax.make_jaxpr(backward)(*residual_shapes, *cotangent_shapes)

    @jax.custom_vjp
    def primal(*args: Any) -> list[Any]:
        return autocaster.run(call, args)

    def primal_fwd(*args: Any) -> Any:
        dtypes = [s.dtype for s in jax.eval_shape(primal, *args)]
        outs = autocaster.run(fwd_jaxpr, args)
        computed_res = iter(outs[:computed])
        residuals = [next(computed_res) if f is None else args[f] for f in forwarded]
        return cast_floating(outs[computed:], dtypes), (residuals, list(args))

    def primal_bwd(saved: Any, cotangents: Any) -> tuple[Any, ...]:
        residuals, args = saved
        nonzero = iter(autocaster.run(bwd_jaxpr, [*residuals, *cotangents]))
        grads = []
        for arg, zero in zip(args, zero_outputs, strict=True):
            grad = jnp.zeros(arg.shape, _tangent_dtype(arg.dtype)) if zero else next(nonzero)
            grads.append(grad if _is_float0(grad) else cast(grad, _tangent_dtype(arg.dtype)))
        return tuple(grads)

    primal.defvjp(primal_fwd, primal_bwd)
    return list(primal(*invals)), []


@_register("shard_map")
def _shard_map(autocaster: Autocaster, eqn: Any, invals: list[Any], in_tags: list[Tag]) -> Result:
    params = eqn.params
    jaxpr = params["jaxpr"]

    def body(*args: Any) -> tuple[Any, ...]:
        return tuple(autocaster.eval(jaxpr, [], args)[0])

    axes = next(
        params[k] for k in ("newly_manual_axes", "manual_axes", "axis_names") if k in params
    )
    mapped = jax.shard_map(
        body,
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=set(axes),
        check_vma=params.get("check_vma", params.get("check_rep", True)),
    )
    return list(mapped(*invals)), []


def _tangent_dtype(dtype: Any) -> Any:
    return dtype if is_floating(dtype) else jax.dtypes.float0


def _is_float0(value: Any) -> bool:
    return getattr(value, "dtype", None) == jax.dtypes.float0
