"""jaxscale.autocast reaches inside every higher-order primitive, differentiates, and
leaves NNX state, integers and parameters as they would be without it."""

from __future__ import annotations

import collections
import re

import equinox as eqx
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.custom_derivatives import linear_call
from jax.extend import core as jex
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import machine, third_party

import jaxscale

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
W = jnp.asarray(np.random.default_rng(0).uniform(-0.3, 0.3, (4, 4)), F32)
X = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, (3, 4)), F32)


def matmul_dtypes(jaxpr) -> collections.Counter:
    """(input dtypes..., output dtype) of every dot_general and convolution, inner jaxprs too."""
    found: collections.Counter = collections.Counter()

    def walk(inner):
        for eqn in inner.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                found[tuple(str(v.aval.dtype) for v in [*eqn.invars, *eqn.outvars])] += 1
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else [param]:
                    if isinstance(sub, jex.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex.Jaxpr):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return found


def all_in(dtype, counter):
    return bool(counter) and set(counter) == {(dtype, dtype, dtype)}


@jax.custom_jvp
def tanh_layer(x, w):
    return jnp.tanh(x @ w)


@tanh_layer.defjvp
def _tanh_layer_jvp(primals, tangents):
    x, w = primals
    out = tanh_layer(x, w)
    return out, (1 - out**2) * (tangents[0] @ w + x @ tangents[1])


@jax.custom_vjp
def doubled_grad_matmul(x, w):
    return x @ w


def _doubled_fwd(x, w):
    return x @ w, (x, w)


def _doubled_bwd(saved, g):
    x, w = saved
    return 2 * (g @ w.T), 2 * (x.T @ g)  # twice the true gradient: the rule must be used


doubled_grad_matmul.defvjp(_doubled_fwd, _doubled_bwd)

HIGHER_ORDER = {
    "nested jit": lambda w, x: jax.jit(lambda a, b: jnp.sin(a @ b))(x, w),
    "scan": lambda w, x: lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)[0],
    "fori_loop (static)": lambda w, x: lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x),
    "cond": lambda w, x: lax.cond(jnp.sum(x) > 0, lambda a: a @ w, lambda a: -(a @ w), x),
    "switch": lambda w, x: lax.switch(1, [lambda a: a @ w, lambda a: jnp.sin(a @ w)], x),
    "checkpoint": lambda w, x: jax.checkpoint(lambda a: jnp.sin(a @ w))(x),
    "custom_jvp (jax.nn.relu)": lambda w, x: jax.nn.relu(x @ w),
    "custom_jvp (user rule)": lambda w, x: tanh_layer(x, w),
    "custom_vjp (user rule)": lambda w, x: doubled_grad_matmul(x, w),
    "vmap": lambda w, x: jax.vmap(lambda row: jnp.tanh(row @ w))(x),
}


def loss_of(fn):
    return lambda w, x: jnp.sum(jnp.asarray(fn(w, x), F32) ** 2)


@pytest.mark.parametrize("name", list(HIGHER_ORDER))
def test_every_matmul_inside_runs_in_float16_forward_and_backward(name):
    fn = HIGHER_ORDER[name]
    forward = jax.make_jaxpr(jaxscale.autocast(fn))(W, X)
    assert all_in("float16", matmul_dtypes(forward)), matmul_dtypes(forward)
    backward = jax.make_jaxpr(jax.grad(jaxscale.autocast(loss_of(fn))))(W, X)
    assert all_in("float16", matmul_dtypes(backward)), matmul_dtypes(backward)
    # the same values as without autocast, to float16 accuracy
    np.testing.assert_allclose(
        np.asarray(jax.jit(jaxscale.autocast(fn))(W, X), np.float32),
        jax.jit(fn)(W, X),
        rtol=2e-2,
        atol=2e-2,
    )
    grad = jax.jit(jax.grad(jaxscale.autocast(loss_of(fn))))(W, X)
    assert grad.dtype == F32  # the parameter's dtype
    expected = jax.jit(jax.grad(loss_of(fn)))(W, X)
    np.testing.assert_allclose(grad, expected, rtol=5e-2, atol=5e-2)


def test_while_loop_with_a_dynamic_trip_count():
    def fn(w, x):
        return lax.while_loop(lambda c: jnp.max(jnp.abs(c)) < 8.0, lambda c: 2.0 * (c @ w), x + 1)

    w = jnp.eye(4)
    jaxpr = jax.make_jaxpr(jaxscale.autocast(fn))(w, X)
    assert all_in("float16", matmul_dtypes(jaxpr))
    out = jaxscale.autocast(fn)(w, X)
    assert out.dtype == F32  # the carry keeps the type the loop was traced with
    np.testing.assert_allclose(out, fn(w, X), rtol=1e-2)


def test_the_user_custom_vjp_rule_is_used_for_the_backward_pass():
    fn = HIGHER_ORDER["custom_vjp (user rule)"]
    grad = jax.grad(jaxscale.autocast(loss_of(fn)))(W, X)
    true_grad = jax.grad(lambda w, x: jnp.sum((x @ w) ** 2))(W, X)
    np.testing.assert_allclose(grad, 2 * true_grad, rtol=2e-2, atol=2e-2)


def test_shard_map_body_is_cast():
    mesh = machine.mesh((4,), ("d",))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d")))
    fn = jax.shard_map(
        lambda a, w: lax.psum(jnp.sum(a @ w), "d"),
        mesh=mesh,
        in_specs=(P("d"), P()),
        out_specs=P(),
    )
    jaxpr = jax.make_jaxpr(jaxscale.autocast(fn))(x, W)
    assert all_in("float16", matmul_dtypes(jaxpr))
    np.testing.assert_allclose(jaxscale.autocast(fn)(x, W), fn(x, W), rtol=1e-2)
    with jax.set_mesh(mesh):
        grad = jax.grad(lambda w: jaxscale.autocast(fn)(x, w))(W)
    assert grad.dtype == F32


def test_scan_carries_keep_their_traced_dtype():
    def fn(w, x):
        return lax.scan(lambda c, _: (c @ w, c @ w), x, None, length=2)

    carry, ys = jaxscale.autocast(fn)(W, X)
    assert carry.dtype == F32  # the loop needs its carry's type on every iteration
    assert ys.dtype == F16  # per-iteration outputs are what the body made


FILL = np.full((1, 4), -1e9, np.float32)  # a captured float32 constant beyond float16's range


def one_example_and_a_fill(x, w, b):
    """A layer on a batch of one (its bias of the product's shape) and a captured
    constant added as a bias, which autocast narrows to float16 saturating (-65504)."""
    return x[:1] @ w + b.reshape(1, -1), x @ w + FILL


def _wrapped(kind, fn=one_example_and_a_fill):
    if kind == "jax.checkpoint":
        return jax.checkpoint(fn)
    if kind == "lax.cond":
        return lambda *a: lax.cond(jnp.all(jnp.isfinite(a[0])), fn, fn, *a)
    if kind == "lax.scan, closing over the arguments":
        return lambda *a: jax.tree.map(
            lambda y: y[0], lax.scan(lambda c, _: (c, fn(*a)), 0.0, length=1)[1]
        )
    if kind == "lax.scan over the arguments, stacked":
        return lambda *a: jax.tree.map(
            lambda y: y[0], lax.scan(lambda c, xs: (c, fn(*xs)), 0.0, [v[None] for v in a])[1]
        )
    if kind == "lax.fori_loop":
        return lambda *a: lax.fori_loop(0, 1, lambda i, carry: fn(*a), fn(*a))
    if kind == "jax.custom_jvp":
        wrapped = jax.custom_jvp(fn)
        wrapped.defjvp(lambda primals, tangents: jax.jvp(fn, primals, tangents))
        return wrapped
    if kind == "jax.custom_vjp":
        wrapped = jax.custom_vjp(fn)
        wrapped.defvjp(lambda *a: jax.vjp(fn, *a), lambda pullback, g: pullback(g))
        return wrapped
    if kind == "shard_map":
        return jax.shard_map(fn, mesh=machine.mesh((1,), ("d",)), in_specs=P(), out_specs=P())
    if kind == "lax.composite":
        return lax.composite(fn, "jaxscale_tests.body")
    return jax.jit(fn)


@pytest.mark.parametrize(
    "kind",
    [
        "jax.jit",
        "jax.checkpoint",
        "lax.cond",
        "lax.scan, closing over the arguments",
        "lax.scan over the arguments, stacked",
        "lax.fori_loop",
        "shard_map",
        "jax.custom_jvp",
        "jax.custom_vjp",
        "lax.composite",
    ],
)
def test_a_function_casts_as_it_does_alone_inside_each_higher_order_primitive(kind):
    # what autocast knows of a value (a parameter, a constant) holds inside the body too
    b = jnp.linspace(-1, 1, 4)
    alone = jaxscale.autocast(one_example_and_a_fill)(X, W, b)
    assert [a.dtype for a in alone] == [F16, F16]
    assert np.all(np.asarray(alone[1]) == np.float16(-65504))
    inside = jaxscale.autocast(_wrapped(kind))(X, W, b)
    if kind.startswith("jax.custom"):  # the rules, as differentiation runs them
        cast = jaxscale.autocast(_wrapped(kind))
        differentiated = (
            jax.jvp(cast, (X, W, b), (X, W, b))[0]
            if kind == "jax.custom_jvp"
            else jax.vjp(cast, X, W, b)[0]
        )
        assert [d.dtype for d in differentiated] == [F16, F16]
        np.testing.assert_array_equal(np.asarray(differentiated[0]), np.asarray(alone[0]))
        np.testing.assert_array_equal(np.asarray(differentiated[1]), np.asarray(alone[1]))
    for got, expected in zip(inside, alone, strict=True):
        # a loop's carry keeps the dtype it was traced with
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, F32))


@pytest.mark.parametrize(
    "kind",
    [
        "jax.checkpoint",
        "lax.cond",
        "shard_map",
        "jax.custom_jvp",
        "jax.custom_vjp",
        "lax.composite",
    ],
)
def test_a_product_passed_into_a_body_keeps_what_is_known_of_its_axes(kind):
    # a per-example addend over a matmul's output promotes, as PyTorch's `+` does; the
    # body sees the product as a value of its own, whose axes autocast still knows
    def add(product, per_example):
        return product + per_example

    x, per_example = jnp.stack([X, -X], axis=1), jnp.linspace(0, 1, 12).reshape(3, 1, 4)
    body = _wrapped(kind, add)
    alone = jaxscale.autocast(lambda x, w, m: add(x @ w, m))(x, W, per_example)
    # under jit: the body's values are new tracers (eager ones may be the arrays passed)
    inside = jax.jit(jaxscale.autocast(lambda x, w, m: body(x @ w, m)))(x, W, per_example)
    assert alone.dtype == inside.dtype == F32
    np.testing.assert_array_equal(np.asarray(inside), np.asarray(alone))


# -- nnx: modules, scan over layers, remat, state --------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.gelu(self.linear(self.norm(x)))


def test_nnx_scan_over_layers_and_nnx_remat():
    @nnx.vmap(in_axes=0, out_axes=0)
    def stack(key):
        return Block(nnx.Rngs(key))

    blocks = stack(jax.random.split(jax.random.key(0), 3))

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(block, x):
        return nnx.remat(lambda b, y: b(y))(block, x)

    with third_party.standard_promotion():
        jaxpr = jax.make_jaxpr(jaxscale.autocast(run))(blocks, X)
        out = jaxscale.autocast(run)(blocks, X)
        reference = run(blocks, X)
    assert all_in("float16", matmul_dtypes(jaxpr))
    assert out.dtype == F32
    np.testing.assert_allclose(out, reference, rtol=2e-2, atol=2e-2)


class Stateful(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.norm(self.linear(x)))


def values(module):
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(module)):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


@pytest.mark.parametrize("mode", ["eager", "nnx.jit"])
def test_nnx_state_written_during_the_call_lands_in_the_module(mode):
    plain, cast = Stateful(nnx.Rngs(0)), Stateful(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, 4))

    def call(model, x):
        return model(x)

    run_cast = jaxscale.autocast(call)
    if mode == "nnx.jit":
        call, run_cast = nnx.jit(call), nnx.jit(run_cast)
    with third_party.standard_promotion(), jax.check_tracer_leaks():
        for _ in range(2):
            call(plain, x)
            run_cast(cast, x)
    expected, got = values(plain), values(cast)
    assert expected.keys() == got.keys()
    for key in expected:
        assert got[key].dtype == expected[key].dtype, key  # in the module's own dtype
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-2, atol=1e-3, err_msg=key)
    assert not np.array_equal(got["['norm']['mean'].value"], np.zeros(4))  # statistics moved
    assert got["['drop']['rngs']['count'].value"] == 2  # the RNG counter advanced twice


# -- mutable array references (jax.new_ref) -------------------------------------------------


def _write_products(ref, w, x):
    ref[...] = x @ w  # float16 under autocast, stored in the reference's float32
    ref[...] += x @ w
    return jnp.sum(ref[...])


@pytest.mark.parametrize("jit", [False, True])
def test_a_reference_argument_is_written_in_place_in_its_own_dtype(jit):
    product = (X.astype(F16) @ W.astype(F16)).astype(F32)
    ref = jax.new_ref(jnp.zeros((3, 4), F32))
    run = jaxscale.autocast(_write_products)
    total = (jax.jit(run) if jit else run)(ref, W, X)
    assert isinstance(ref, jax.Ref)
    assert ref[...].dtype == F32
    np.testing.assert_array_equal(ref[...], product + product)
    assert total.dtype == F32
    np.testing.assert_array_equal(total, jnp.sum(product + product))
    # a reference made inside the call, and one the call closes over
    stats = jax.new_ref(jnp.zeros((), F32))

    def loss(w, x):
        h = x @ w
        stats[...] += jnp.max(jnp.abs(h))
        inner = jax.new_ref(jnp.zeros_like(h, F32))
        inner[...] = h
        return jnp.sum(inner[...])

    run = jaxscale.autocast(loss)
    out = (jax.jit(run) if jit else run)(W, X)
    np.testing.assert_array_equal(out, jnp.sum(product))
    assert stats[...].dtype == F32
    np.testing.assert_array_equal(stats[...], jnp.max(jnp.abs(product)))


def test_an_nnx_module_of_references_is_written_through_them():
    with nnx.var_defaults(ref=True):
        model = Stateful(nnx.Rngs(0))
    plain = Stateful(nnx.Rngs(0))
    mean = model.norm.mean.get_raw_value()
    x = jax.random.normal(jax.random.key(1), (16, 4))
    with third_party.standard_promotion():
        for _ in range(2):
            jax.jit(lambda m, x: jaxscale.autocast(m)(x))(model, x)
            nnx.jit(lambda m, x: jaxscale.autocast(m)(x))(plain, x)
    assert model.norm.mean.get_raw_value() is mean  # written in place
    assert mean[...].dtype == F32
    np.testing.assert_array_equal(mean[...], plain.norm.mean[...])
    assert not np.array_equal(mean[...], np.zeros(4))


def test_a_module_closed_over_by_jax_jit_is_read_as_without_autocast():
    # A module the function only reads may be closed over by jax.jit, as without
    # autocast: autocast writes back only what the call wrote.
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    kernel = model.kernel.get_value()
    plain = jax.jit(lambda x: model(x))(X)
    cast = jax.jit(lambda x: jaxscale.autocast(model)(x))(X)
    assert plain.dtype == F32
    assert cast.dtype == F16
    np.testing.assert_array_equal(cast, jaxscale.autocast(model)(X))
    assert model.kernel.get_value() is kernel  # not rewritten, even with its own value

    # A frozen teacher closed over by an nnx.jit step that trains a student (distillation).
    student = nnx.Linear(4, 2, rngs=nnx.Rngs(1))

    @nnx.jit
    def distance(student, x):
        return jnp.sum((jaxscale.autocast(student)(x) - jaxscale.autocast(model)(x)) ** 2)

    grads = nnx.grad(distance)(student, X)
    assert grads["kernel"].get_value().dtype == F32
    assert model.kernel.get_value() is kernel

    # A module that writes its state there is refused by Flax, with or without autocast.
    norm = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    for call in (norm, jaxscale.autocast(norm)):
        with pytest.raises(flax.errors.TraceContextError, match="BatchStat"):
            jax.jit(lambda x, call=call: call(x))(X)


class Tempered(nnx.Module):
    """A module holding a Python number in a variable (a temperature, a step count)."""

    def __init__(self):
        self.linear = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        self.temperature = nnx.Variable(2.0)

    def __call__(self, x):
        return self.linear(x) / self.temperature.get_value()


def test_a_variable_holding_a_python_number():
    model = Tempered()
    expected = jaxscale.autocast(lambda x: model.linear(x) / 2.0)(X)
    out = jaxscale.autocast(model)(X)
    assert out.dtype == F16
    np.testing.assert_array_equal(out, expected)
    assert model.temperature.get_value() == 2.0
    assert isinstance(model.temperature.get_value(), float)  # read only: left as it was
    np.testing.assert_array_equal(nnx.jit(lambda m, x: jaxscale.autocast(m)(x))(model, X), out)
    _, report = jaxscale.locate_nonfinite(model)(X)
    assert not report.found


def test_only_the_variables_the_call_wrote_are_replaced():
    norm = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    scale, mean = norm.scale.get_value(), norm.mean.get_value()
    x = jax.random.normal(jax.random.key(2), (8, 4))
    jaxscale.autocast(norm)(x)
    assert norm.scale.get_value() is scale  # a parameter the call read
    assert norm.mean.get_value() is not mean  # a statistic it wrote
    reference = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    reference(x)
    np.testing.assert_array_equal(norm.mean.get_value(), reference.mean.get_value())
    np.testing.assert_array_equal(norm.var.get_value(), reference.var.get_value())


def flagged(w, x, flag):
    if flag:
        return x @ w
    return -(x @ w)


def test_an_array_that_decides_control_flow_is_named_when_tracing_fails():
    # Called eagerly, the plain function reads the flag's value; autocast traces the
    # function, as jit does, so JAX's error is kept and told which argument it was.
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    assert flagged(w, x, jnp.array(True)).dtype == F32
    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        jaxscale.autocast(flagged)(w, x, jnp.array(True))
    assert any("the array argument [2] has no concrete value" in n for n in raised.value.__notes__)
    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        jaxscale.locate_nonfinite(flagged)(w, x, flag=jnp.array(True))
    assert any("the array argument ['flag']" in note for note in raised.value.__notes__)
    # as a Python bool it is static
    assert jaxscale.autocast(flagged)(w, x, True).dtype == F16


def test_a_lax_operation_given_two_dtypes_is_explained_as_a_tracing_error():
    # An Equinox convolution calls lax.conv_general_dilated, which refuses a float32 input
    # beside bfloat16 weights while the function is traced: torch.autocast would cast both,
    # and the note says what to write instead.
    conv = eqx.nn.Conv2d(3, 4, 3, key=jax.random.key(0))
    conv = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, conv)
    image = jnp.ones((3, 8, 8), F32)
    with pytest.raises(TypeError, match="requires arguments to have the same dtypes") as raised:
        jaxscale.autocast(conv, dtype=jnp.bfloat16)(image)
    assert any("cast the inputs to their dtype (x.astype(jnp.bfloat16))" in note
               for note in raised.value.__notes__)  # fmt: skip
    cast_first = jaxscale.autocast(conv, dtype=jnp.bfloat16)(image.astype(jnp.bfloat16))
    assert cast_first.shape == (4, 6, 6)


def test_what_is_not_an_array_is_returned_as_the_function_returned_it():
    def step(w, x):
        return {"y": x @ w, "rows": x.shape[0], "note": "projected", "none": None}

    for transform in (jaxscale.autocast, jaxscale.locate_nonfinite):
        out = transform(step)(jnp.ones((4, 4)), X)
        out = out[0] if transform is jaxscale.locate_nonfinite else out
        assert out["rows"] == X.shape[0]
        assert type(out["rows"]) is int
        assert out["note"] == "projected"
        assert out["none"] is None
    assert jaxscale.autocast(step)(jnp.ones((4, 4)), X)["y"].dtype == F16


def test_a_module_a_bound_method_and_a_decorated_method():
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    assert jaxscale.autocast(model)(X).dtype == F16
    assert jaxscale.autocast(model.__call__)(X).dtype == F16

    class Head(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

        @jaxscale.autocast
        def __call__(self, x):
            return self.linear(x)

        @jaxscale.autocast(dtype=BF16)
        def logits(self, x):
            return self.linear(x)

    head = Head()
    assert head(X).dtype == F16
    assert head.logits(X).dtype == BF16
    grads = nnx.grad(lambda m: jnp.sum(m(X).astype(F32)))(head)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {np.dtype(F32)}


# -- nesting, jit, eager ---------------------------------------------------------------


def test_a_nested_disabled_region_runs_as_written():
    def inner(w, x):
        return jnp.tanh(x @ w)

    def outer(w, x):
        return jaxscale.autocast(inner, enabled=False)(w, x) + (x @ w).astype(F32)

    counts = matmul_dtypes(jax.make_jaxpr(jaxscale.autocast(outer))(W, X))
    assert counts == {("float32", "float32", "float32"): 1, ("float16", "float16", "float16"): 1}


def test_a_nested_region_with_another_dtype_keeps_its_own():
    def outer(w, x):
        inner = jaxscale.autocast(lambda w, x: x @ w, dtype=BF16)(w, x)
        return inner.astype(F32) + (x @ w).astype(F32)

    counts = matmul_dtypes(jax.make_jaxpr(jaxscale.autocast(outer))(W, X))
    assert counts == {("bfloat16",) * 3: 1, ("float16",) * 3: 1}


def test_an_unknown_higher_order_primitive_raises_naming_it():
    def doubled(x):  # a linear function with its own transpose
        return linear_call(lambda _, x: x @ (2.0 * jnp.eye(2)), lambda _, t: 2.0 * t, (), x)

    with pytest.raises(NotImplementedError, match="'linear_call'"):
        jaxscale.autocast(doubled)(jnp.ones(2))
    # the remedy the message names: a disabled region inside
    fine = jaxscale.autocast(lambda x: jaxscale.autocast(doubled, enabled=False)(x))
    np.testing.assert_allclose(fine(jnp.ones(2)), [2.0, 2.0])


@jax.custom_batching.custom_vmap
def _layer(x, w):
    return jnp.tanh(x @ w)


@_layer.def_vmap
def _layer_batched(axis_size, in_batched, x, w):
    # the rule a user writes for a batch of examples: one batched matmul
    _RULE_CALLS.append(list(in_batched))
    return jnp.tanh(jnp.einsum("bij,jk->bik", x, w)), True


_RULE_CALLS: list = []


def test_a_custom_vmap_function_and_its_batching_rule_run_under_autocast():
    xs = jnp.stack([X, 2.0 * X, -X])
    expected = jnp.tanh(xs.astype(F16) @ W.astype(F16))
    run = jaxscale.autocast(_layer)
    assert run(X, W).dtype == F16
    np.testing.assert_array_equal(run(X, W), expected[0])
    _RULE_CALLS.clear()
    batched = jax.jit(jax.vmap(run, (0, None)))
    np.testing.assert_array_equal(batched(xs, W), expected)
    assert _RULE_CALLS == [[True, False]]  # JAX called the user's rule, once
    jaxpr = jax.make_jaxpr(jax.vmap(run, (0, None)))(xs, W)
    assert matmul_dtypes(jaxpr) == {("float16",) * 3: 1}  # the rule's einsum, in float16
    # differentiated through the rule, the gradient in the parameter's dtype
    grads = jax.grad(lambda w: jnp.sum(jax.vmap(run, (0, None))(xs, w).astype(F32)))(W)
    plain = jax.grad(lambda w: jnp.sum(jax.vmap(_layer, (0, None))(xs, w)))(W)
    assert grads.dtype == F32
    np.testing.assert_allclose(grads, plain, rtol=2e-2, atol=2e-2)
    # jax.custom_batching.sequential_vmap: a rule that maps the function over the batch
    one_by_one = jaxscale.autocast(jax.custom_batching.sequential_vmap(_layer.fun))
    np.testing.assert_array_equal(jax.vmap(one_by_one, (0, None))(xs, W), expected)


def test_under_jit_it_is_traced_once_and_eager_agrees():
    traces = []

    @jax.jit
    def step(w, x):
        traces.append(1)
        return jaxscale.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)))(w, x)

    first, second = step(W, X), step(2 * W, X)
    assert len(traces) == 1
    eager = jaxscale.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)))(2 * W, X)
    np.testing.assert_allclose(eager, second, rtol=1e-6)
    assert first.dtype == F32


def test_the_rewrite_adds_nothing_beyond_the_casts_a_hand_cast_version_has():
    def model(w, x):
        return jnp.sum(jnp.tanh(x @ w) @ w)

    def by_hand(w, x):
        w16 = w.astype(F16)
        h = jnp.tanh(x.astype(F16) @ w16)
        return jnp.sum((h @ w16).astype(F32))

    def ops(fn):
        # the CPU's program: a GPU's dots are library calls
        hlo = machine.compiled_on_cpu(jax.jit(fn), W, X).as_text()
        return collections.Counter(re.findall(r"= \w+\[[^\]]*\]\{?[^ ]* (\w+)\(", hlo))

    assert ops(by_hand)["dot"] == 2
    assert ops(jaxscale.autocast(model)) == ops(by_hand)


def test_disabled_at_the_top_is_the_function_itself():
    fn = jaxscale.autocast(lambda w, x: x @ w, enabled=False)
    assert fn(W, X).dtype == F32


@pytest.mark.parametrize(
    ("dtype", "error", "message"),
    [
        (jnp.float32, ValueError, "autocast dtype must be float16 or bfloat16, got float32"),
        ("float64", ValueError, "autocast dtype must be float16 or bfloat16, got float64"),
        (jnp.int8, ValueError, "autocast dtype must be float16 or bfloat16, got int8"),
        (3.5, TypeError, "autocast dtype must be jnp.float16 or jnp.bfloat16, got 3.5"),
    ],
)
def test_a_bad_dtype_raises_at_once(dtype, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        jaxscale.autocast(lambda x: x, dtype=dtype)
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        jaxscale.autocast(dtype=dtype)


def test_strings_and_numpy_dtypes_are_accepted():
    assert jaxscale.autocast(lambda a: a @ a, dtype="bfloat16")(W).dtype == BF16
    assert jaxscale.autocast(lambda a: a @ a, dtype=np.dtype("float16"))(W).dtype == F16


def test_other_bad_arguments_raise():
    with pytest.raises(TypeError, match=r"^autocast expects a callable, got int 3$"):
        jaxscale.autocast(3)
    with pytest.raises(TypeError, match=r"^enabled must be a bool, got str 'yes'$"):
        jaxscale.autocast(lambda x: x, enabled="yes")


def test_the_wrapper_keeps_the_function_name_and_docstring():
    def loss_fn(x):
        """The loss."""
        return x

    wrapped = jaxscale.autocast(loss_fn)
    assert (wrapped.__name__, wrapped.__doc__) == ("loss_fn", "The loss.")


def _scoped_matmul(w, x):
    with jax.named_scope("attention_block"):
        y = x @ w  # the line every re-bound operation of this matmul names
    return jnp.tanh(y)


def test_re_bound_operations_keep_the_users_line_and_named_scope():
    from jax.extend import source_info_util

    line = _scoped_matmul.__code__.co_firstlineno + 2
    jaxpr = jax.make_jaxpr(jaxscale.autocast(_scoped_matmul))(W, X)
    casts_and_dot = [
        e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("convert_element_type", "dot_general")
    ][:3]
    assert [e.primitive.name for e in casts_and_dot][-1] == "dot_general"
    for eqn in casts_and_dot:
        assert f"test_autocast.py:{line}" in source_info_util.summarize(eqn.source_info)
        assert "attention_block" in str(eqn.source_info.name_stack)
    # and in the compiled program's metadata, where profilers and XLA's errors read them
    hlo = jax.jit(jaxscale.autocast(_scoped_matmul)).lower(W, X).as_text(debug_info=True)
    dot_lines = [text for text in hlo.splitlines() if "dot_general" in text]
    assert any("attention_block" in text for text in dot_lines)
    assert f'test_autocast.py":{line}' in hlo


class _TimeConditionedConv(nnx.Module):
    """A diffusion model's block: a biased convolution plus a time embedding broadcast
    over the feature map (``[batch, 1, 1, channels]``), both products of matmuls."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.time = nnx.Linear(4, 8, rngs=rngs)

    def __call__(self, images, times):
        return self.conv(images) + self.time(times)[:, None, None, :]


BROADCAST_GRADIENTS = {
    "linear bias": lambda m, x, t: m.time(t),
    "convolution bias and a broadcast time embedding": lambda m, x, t: m(x, t),
    "jnp.broadcast_to of a product": lambda m, x, t: jnp.broadcast_to(
        m.time(t)[:, None, :], (t.shape[0], 5, 8)
    ),
    "a 0-d product times an array": lambda m, x, t: m.time(t) * (t[0] @ m.time.kernel[:, 0]),
}


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(BROADCAST_GRADIENTS))
def test_the_gradient_of_a_broadcast_half_value_is_summed_in_float32(name, dtype):
    # PyTorch's backward of a broadcast (sum_to_size) accumulates float16 in float32 and
    # rounds once; a float16 sum of thousands of a bias's terms would drift or overflow
    model = _TimeConditionedConv(nnx.Rngs(0))
    images = jnp.asarray(np.random.default_rng(2).normal(size=(4, 6, 6, 3)), F32)
    times = jnp.asarray(np.random.default_rng(3).normal(size=(4, 4)), F32)
    fn = BROADCAST_GRADIENTS[name]

    def loss(model):
        return jnp.sum(jnp.asarray(fn(model, images, times), F32) ** 2)

    graphdef, state = nnx.split(model)
    autocast_loss = jaxscale.autocast(loss, dtype=dtype)
    half = {F16: "f16", BF16: "bf16"}[dtype]
    with third_party.standard_promotion():
        forward = jax.make_jaxpr(lambda s: autocast_loss(nnx.merge(graphdef, s)))(state)
        grads = jax.grad(lambda s: autocast_loss(nnx.merge(graphdef, s)))
        accelerator = jaxscale.lowering_report(grads, state, platform="cuda")
        cpu = jaxscale.lowering_report(grads, state, platform="cpu")
        values = jax.eval_shape(grads, state)
    assert all_in(np.dtype(dtype).name, matmul_dtypes(forward))  # the products are half
    assert set(accelerator.sum_dtypes) == {"f32"}, accelerator.sum_dtypes
    assert accelerator.data_conditionals == 0  # the platform's choice is folded away
    # on the CPU the sums stay in the value's dtype (XLA's CPU backend would slow the
    # whole step down for float32 ones), and the gradients are float32 parameters' all
    # the same
    assert half in cpu.sum_dtypes, cpu.sum_dtypes
    assert {leaf.dtype for leaf in jax.tree.leaves(values)} == {np.dtype(F32)}


def _rounded_once(exact, dtype):
    """float64 values (exact sums) rounded to float16 or bfloat16 once, to nearest even,
    written out here (numpy's and ml_dtypes' casts are not the reference under test)."""
    info = jnp.finfo(dtype)
    significand = info.nmant + 1
    exact = np.asarray(exact, np.float64)
    finite = np.isfinite(exact) & (exact != 0)
    exponent = np.floor(np.log2(np.abs(np.where(finite, exact, 1.0))))
    ulp = np.exp2(np.maximum(exponent, info.minexp) - (significand - 1))
    rounded = np.where(finite, np.rint(exact / ulp) * ulp, exact)
    rounded = np.where(np.abs(rounded) > float(info.max), np.copysign(np.inf, exact), rounded)
    return rounded.astype(np.float32).astype(dtype)  # exact: every such value is one


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_a_half_addition_run_in_float32_and_rounded_is_the_half_addition_bit_for_bit(dtype):
    # a bias added to a product of one example's shape runs in float32 off the CPU, so
    # that vmap's sum of its gradient is float32's: the forward must not change a bit
    from jaxscale.casting._interpreter import added_through_float32

    rng = np.random.default_rng(0)
    bits = np.uint16
    every = np.arange(2**16, dtype=np.uint32).astype(bits)
    a = np.concatenate([every, every, every, rng.integers(0, 2**16, 2**20, dtype=bits)])
    b = np.concatenate(
        [
            rng.integers(0, 2**16, 2**16, dtype=bits),
            every ^ np.uint16(0x8000),  # the negation: exact zeros, and cancellation
            (every.astype(np.int32) + rng.integers(-3, 4, 2**16)).astype(bits),  # neighbours
            rng.integers(0, 2**16, 2**20, dtype=bits),
        ]
    )
    a, b = (jnp.asarray(x.view(jnp.dtype(dtype))) for x in (a, b))
    got = np.asarray(jax.jit(added_through_float32, static_argnums=0)(lax.add, a, b))
    # the IEEE sum, but where a value is below float32's smallest normal (bfloat16's
    # subnormals), which XLA's CPU backend flushes to zero. (Its float16 addition, on a
    # CPU with float16 arithmetic, flushes float16's subnormals too: not a reference.)
    tiny = float(jnp.finfo(F32).tiny)
    with np.errstate(invalid="ignore"):  # NaN operands and inf - inf
        values = [np.asarray(a, np.float64), np.asarray(b, np.float64)]  # numpy's: no flush
        exact = values[0] + values[1]  # exact for two halves
        want = _rounded_once(exact, dtype)
        nan = np.isnan(want)
        normal = ~nan & ~np.any([(x != 0) & (np.abs(x) < tiny) for x in [*values, exact]], axis=0)
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert normal.mean() > 0.9
    np.testing.assert_array_equal(got[normal].view(bits), want[normal].view(bits))
    assert (np.asarray(exact) != np.asarray(want, np.float64)).mean() > 0.3  # rounding ran


def test_parameters_a_closure_captures_are_summed_in_float32_like_arguments():
    # jax.grad(lambda p: autocast(lambda x: layer(p, x))(x)): the parameters reach the
    # autocast function as captured values of the enclosing trace, not as arguments
    x = jnp.asarray(np.random.default_rng(4).normal(size=(16, 4)), F32)
    params = {"w": W, "b": jnp.linspace(-1.0, 1.0, 4, dtype=F32)}

    def closing_over(params):
        layer = jaxscale.autocast(lambda x: x @ params["w"] + params["b"][None])
        return jnp.sum(layer(x).astype(F32) ** 2)

    def passing(params):
        layer = jaxscale.autocast(lambda p, x: x @ p["w"] + p["b"][None])
        return jnp.sum(layer(params, x).astype(F32) ** 2)

    for loss in (closing_over, passing):
        report = jaxscale.lowering_report(jax.grad(loss), params, platform="cuda")
        assert report.sum_dtypes == {"f32": 1}, (loss.__name__, report.sum_dtypes)
    closed, passed = jax.grad(closing_over)(params), jax.grad(passing)(params)
    for a, b in zip(jax.tree.leaves(closed), jax.tree.leaves(passed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_embedding_added_to_a_channels_last_convolution_promotes():
    # a (1, H, W, C) float32 position embedding varies along the image's axes, so it is
    # no bias of the convolution: PyTorch's + promotes to float32. A (C,) bias is one.
    x = jnp.ones((2, 8, 8, 3))
    kernel = jnp.ones((3, 3, 3, 16)) * 0.1
    position = jnp.ones((1, 8, 8, 16))
    bias = jnp.ones(16)

    def conv(x, kernel):
        return lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip

    def model(x, kernel, position, bias):
        return conv(x, kernel) + position, conv(x, kernel) + bias[None, None, None]

    cast = jaxscale.autocast(model, dtype=jnp.bfloat16)
    with_position, with_bias = cast(x, kernel, position, bias)
    assert with_position.dtype == jnp.float32
    assert with_bias.dtype == jnp.bfloat16


def test_an_embedding_added_to_a_reshaped_product_promotes():
    # (x.reshape(B*T, D) @ w).reshape(B, T, F) + pos: pos varies along T, which comes
    # from the input's rows, so it is no bias: float32, as PyTorch's + gives
    x, w, pos = jnp.ones((4, 8, 32)), jnp.ones((32, 16)), jnp.ones((8, 16))

    def model(x, w, pos):
        return (x.reshape(32, 32) @ w).reshape(4, 8, 16) + pos[None]

    assert jaxscale.autocast(model, dtype=jnp.bfloat16)(x, w, pos).dtype == jnp.float32
