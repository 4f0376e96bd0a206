"""jaxscale.float8_report: each matmul's error under a float8 recipe, against float64
arithmetic on the same operands, and the filter it proposes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support import machine
from support.model_training import matmul_dtypes
from support.sharded_mlp import sharded_mlp

import jaxscale
from jaxscale.casting import float8_report

BF16, F32 = jnp.bfloat16, jnp.float32
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(32, 64)), F32)
PARAMS = {
    "body": jnp.asarray(RNG.normal(size=(64, 64)) / 8, F32),
    "head": jnp.asarray(RNG.standard_t(2, size=(64, 32)) * 0.05, F32),
}


def loss(params, x):
    return jnp.mean(jnp.square(jnp.tanh(x @ params["body"]) @ params["head"]))


def relative(ours, exact):
    ours, exact = np.asarray(ours, np.float64), np.asarray(exact, np.float64)
    return np.linalg.norm(ours - exact) / np.linalg.norm(exact)


def in_recipe(recipe, a, b, dy):
    """The recipe's output and gradients of ``a @ b`` on ``dy``, as autocast runs it."""
    layer = jaxscale.autocast(lambda a, b: a @ b, dtype=BF16, float8=recipe)

    def run(a, b, dy):
        out, pullback = jax.vjp(layer, a, b)
        return (out, *pullback(dy.astype(BF16)))

    return jax.jit(run)(a, b, dy)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "mxfp8"])
def test_each_matmuls_errors_are_its_own_against_float64(recipe):
    report = float8_report(loss, PARAMS, X, recipe=recipe)
    body, head = report.matmuls
    # the float32 step's operands and output gradients (each matmul's operands are the
    # float32 step's own), and the exact products of those in float64
    with jax.default_matmul_precision("highest"):
        z = X @ PARAMS["body"]
        h = jnp.tanh(z)
        out = h @ PARAMS["head"]
        dout = jax.grad(lambda out: jnp.mean(jnp.square(out)))(out)
        dz = jax.grad(lambda z: jnp.mean(jnp.square(jnp.tanh(z) @ PARAMS["head"])))(z)
    for site, a32, b32, dy32 in ((body, X, PARAMS["body"], dz), (head, h, PARAMS["head"], dout)):
        a, b, dy = (np.asarray(v, np.float64) for v in (a32, b32, dy32))
        got, grad_a, grad_b = in_recipe(recipe, a32, b32, dy32)
        # to 1% and 2%: the report's step and this reference are compiled apart, and XLA
        # may keep a float32 value in one where the other rounds it to bfloat16 (a
        # gradient the recipe casts back to float32 at once), which moves a few codes
        # and block scales
        assert site.output == pytest.approx(relative(got, a @ b), rel=0.01)
        assert site.input_grad == pytest.approx(relative(grad_a, dy @ b.T), rel=0.02)
        assert site.weight_grad == pytest.approx(relative(grad_b, a.T @ dy), rel=0.02)
        assert 0.005 < site.output < 0.1  # float8's three significand bits
    # FLOPs: forward and two backward matmuls of each, out of every matmul of the step
    assert body.flops == pytest.approx(64 / 96)
    assert head.flops == pytest.approx(32 / 96)
    assert (body.site.weight, head.site.weight) == ("[0]['body']", "[0]['head']")


def test_flushed_and_saturated_values_are_counted():
    # values 2**-30 below a row's largest flush to zero in e4m3 (tensorwise scaling)
    x = X.at[:, :8].set(1e-12)
    report = float8_report(loss, PARAMS, x, recipe="tensorwise")
    body = report.matmuls[0]
    nonzero = x.size + np.count_nonzero(PARAMS["body"])
    assert body.flushed == pytest.approx(32 * 8 / nonzero)
    assert body.saturated == 0.0  # current scaling maps the amax to the largest value
    # MX's FLOOR scales clip a block's largest values above 448 times its power of two
    clipped = float8_report(
        loss,
        PARAMS,
        jnp.full((32, 64), 500.0),
        recipe=jaxscale.casting.MXRecipe("floor", scale_mode="floor"),
    )
    assert clipped.matmuls[0].saturated > 0


def test_the_proposal_keeps_the_worst_matmuls_until_the_rest_is_within_the_bound():
    report = float8_report(loss, PARAMS, X, recipe="nvfp4", key=jax.random.key(0), bound=0.0)
    assert len(report.kept) == 2
    assert report.float8_flops == 0.0
    errors = sorted(m.error for m in report.matmuls)
    report = float8_report(
        loss, PARAMS, X, recipe="nvfp4", key=jax.random.key(0), bound=(errors[0] + errors[1]) / 2
    )
    (kept,) = report.kept
    assert kept.error == errors[1]
    assert report.float8_flops == pytest.approx(1 - kept.flops)
    keep = report.proposed_filter()
    fn = jaxscale.autocast(loss, dtype=BF16, float8="rowwise", float8_filter=keep)
    jaxpr = jax.make_jaxpr(jax.grad(fn))(PARAMS, X)
    assert sum(n for k, n in matmul_dtypes(jaxpr).items() if "float8" in k[0]) == 3
    # a FLOPs budget leaves the largest matmul to the recipe and keeps the next
    budget = float8_report(loss, PARAMS, X, recipe="nvfp4", key=jax.random.key(0), bound=0.0,
                           keep_at_most=0.5)  # fmt: skip
    assert [m.site.weight for m in budget.kept] == ["[0]['head']"]
    table = report.table()
    assert table.splitlines()[0].split()[:3] == ["matmul", "shape", "MxKxN"]
    assert "keep" in table
    assert "proposal: 1 of 2 matmuls kept" in table
    assert str(report) == table


def test_each_layer_of_a_scan_is_measured_apart_as_if_unrolled():
    # (drawn from a generator of the test's own: the module's is drawn from by the tests
    # that run before this one, which depend on the order and the worker)
    ws = np.asarray(np.random.default_rng(1).normal(size=(4, 64, 64)) / 8, np.float32)
    ws[2, 0, 0] = 3e4  # one outlying weight: tensorwise scaling flushes the rest of layer 2
    ws = jnp.asarray(ws)

    def stack(ws, x):
        h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
        return jnp.mean(jnp.square(h @ PARAMS["head"]))

    def unrolled(layers, x):
        h = x
        for w in layers:
            h = jnp.tanh(h @ w)
        return jnp.mean(jnp.square(h @ PARAMS["head"]))

    report = float8_report(stack, ws, X, recipe="tensorwise")
    *layers, head = report.matmuls
    assert [m.site.layer for m in layers] == [0, 1, 2, 3]
    assert all(m.site.layers == 4 for m in layers)
    assert head.site.layer is None
    # the same figures as the same matmuls written out one by one
    apart = float8_report(unrolled, list(ws), X, recipe="tensorwise")
    for ours, theirs in zip(report.matmuls, apart.matmuls, strict=True):
        for field in ("output", "input_grad", "weight_grad", "flushed", "saturated", "flops"):
            assert getattr(ours, field) == pytest.approx(getattr(theirs, field), rel=1e-4), field
    assert layers[0].flops == pytest.approx(64 / (4 * 64 + 32))
    assert max(report.matmuls, key=lambda m: m.error) is layers[2]
    assert layers[2].flushed > 0.05
    assert max(m.error for m in report.matmuls[3:]) < 0.1
    assert "[0] layer 2" in report.table()
    # the proposal keeps that layer alone in bfloat16; autocast splits the scan there
    assert [(m.site.layer, m.site.weight) for m in report.kept] == [(2, "[0]")]
    keep = report.proposed_filter()
    assert [keep(m.site) for m in layers] == [True, True, False, True]
    policy = jaxscale.autocast(stack, dtype=BF16, float8="tensorwise", float8_filter=keep)
    dtypes = matmul_dtypes(jax.make_jaxpr(policy)(ws, X))
    # the scan in three runs of layers (0-1 and 3 in float8, 2 in bfloat16) and the head
    f8 = "float8_e4m3fn"
    assert dtypes == {("bfloat16", "bfloat16", "bfloat16"): 1, (f8, f8, "float32"): 3}, dtypes


def test_a_conds_matmuls_are_measured_once_and_the_branch_not_taken_is_marked():
    # autocast traces a cond's branches once more for the types they agree on: their
    # matmuls were listed twice (four rows for two matmuls, two of them zeros) and the
    # matmuls after the cond measured into other rows
    ws = {"a": PARAMS["body"], "b": PARAMS["body"] * 2, "head": PARAMS["head"]}

    def branched(ws, x):
        h = jax.lax.cond(jnp.sum(x) > -1e9, lambda: x @ ws["a"], lambda: x @ ws["b"])
        return jnp.mean(jnp.square(jnp.tanh(h) @ ws["head"]))

    def straight(ws, x):
        return jnp.mean(jnp.square(jnp.tanh(x @ ws["a"]) @ ws["head"]))

    report = float8_report(branched, ws, X, recipe="rowwise")
    assert [m.site.weight for m in report.matmuls] == ["[0]['b']", "[0]['a']", "[0]['head']"]
    assert [m.ran for m in report.matmuls] == [False, True, True]
    assert [m.site.index for m in report.matmuls] == [0, 1, 2]
    assert report.table().splitlines()[1].split()[2:4] == ["not", "run"]
    expected = float8_report(straight, ws, X, recipe="rowwise").matmuls
    for ours, theirs in zip(report.matmuls[1:], expected, strict=True):
        for field in ("output", "input_grad", "weight_grad", "flushed", "saturated"):
            assert getattr(ours, field) == pytest.approx(getattr(theirs, field), rel=1e-5), field

    # the filter is asked once about each matmul, and the indices count each once
    asked = []

    def spy(site):
        asked.append(site.index)
        return True

    policy = jaxscale.autocast(branched, dtype=BF16, float8="rowwise", float8_filter=spy)
    jax.grad(policy)(ws, X)
    assert sorted(asked) == [0, 1, 2]


def test_a_reversed_scan_names_each_layer_by_its_place_in_the_stack():
    ws = np.asarray(np.random.default_rng(2).normal(size=(4, 64, 64)) / 8, np.float32)
    ws[2, 0, 0] = 3e4
    ws = jnp.asarray(ws)

    def backwards(ws, x):  # layer 3 runs first
        h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws, reverse=True)[0]
        return jnp.mean(h**2)

    report = float8_report(backwards, ws, X, recipe="tensorwise")
    assert [m.site.layer for m in report.matmuls] == [0, 1, 2, 3]
    assert max(report.matmuls, key=lambda m: m.error).site.layer == 2
    assert [m.site.layer for m in report.kept] == [2]
    keep = report.proposed_filter()
    assert [keep(m.site) for m in report.matmuls] == [True, True, False, True]


def test_a_scan_within_a_scan_is_measured_over_all_its_iterations():
    ws = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 64, 64)) / 8, F32)

    def nested(ws, x):
        def outer(h, block):
            return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, block)[0], None

        h = jax.lax.scan(outer, x, ws)[0]
        return jnp.mean(jnp.square(h @ PARAMS["head"]))

    report = float8_report(nested, ws, X, recipe="rowwise")
    inner, _head = report.matmuls
    assert inner.site.layer is None
    assert inner.flops == pytest.approx(6 * 64 / (6 * 64 + 32))
    assert 0.005 < inner.output < 0.1
    # refused, it is refused in every layer
    keep = dataclasses.replace(report, kept=(inner,)).proposed_filter()
    assert not keep(dataclasses.replace(inner.site, layer=1, layers=3))


def test_an_nnx_model_is_measured_and_left_as_it_was():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(64, 64, rngs=rngs)
            self.head = nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.body(x)))

    model = Model(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    report = float8_report(lambda m, x: jnp.mean(m(x) ** 2), model, X, recipe="rowwise")
    assert [m.site.weight for m in report.matmuls] == [
        "[0]['body']['kernel'].value",
        "[0]['head']['kernel'].value",
    ]
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)


def test_mistakes_are_named():
    with pytest.raises(ValueError, match="measures a float8 recipe"):
        float8_report(loss, PARAMS, X, recipe=None)
    with pytest.raises(TypeError, match="scalar floating loss"):
        float8_report(lambda p, x: x @ p["body"], PARAMS, X)
    with pytest.raises(ValueError, match="has no matmul"):
        float8_report(lambda p, x: jnp.sum(x[:10, :10] @ p["body"][:10, :10]), PARAMS, X)
    with pytest.raises(ValueError, match="bound must be"):
        float8_report(loss, PARAMS, X, bound=-1.0)
    with pytest.raises(ValueError, match="keep_at_most must be"):
        float8_report(loss, PARAMS, X, keep_at_most=2.0)
    with pytest.raises(ValueError, match="needs a key"):
        float8_report(loss, PARAMS, X, recipe="nvfp4")


@jax.custom_vjp
def clipped_product(x, w):
    return x @ w


def _clipped_forward(x, w):
    return x @ w, (x, w)


def _clipped_backward(saved, g):
    x, w = saved
    return jnp.clip(g @ w.T, -1.0, 1.0), x.T @ g


clipped_product.defvjp(_clipped_forward, _clipped_backward)


@jax.custom_jvp
def smooth_product(x, w):
    return jnp.tanh(x @ w)


@smooth_product.defjvp
def _smooth_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    y = jnp.tanh(x @ w)
    return y, (1 - y**2) * (dx @ w + x @ dw)


def test_matmuls_inside_a_users_derivative_rule_are_named_and_left_out():
    # A jax.custom_vjp's backward rule (or a custom_jvp's JVP rule) computes the
    # gradients of the matmuls inside it, where the report's probes cannot reach: they
    # are left out of the table (they raised JAX's UnexpectedTracerError), named in a
    # warning and counted in the FLOPs autocast runs in the recipe. The matmul outside
    # measures what it measures in the same function written without the rules.
    params = {**PARAMS, "middle": PARAMS["body"] * 0.5}

    def with_rules(params, x):
        h = clipped_product(smooth_product(x, params["body"]), params["middle"])
        return jnp.mean(jnp.square(h @ params["head"]))

    def without(params, x):
        h = jnp.tanh(x @ params["body"]) @ params["middle"]
        return jnp.mean(jnp.square(h @ params["head"]))

    with pytest.warns(UserWarning, match=r"\[0\]\['body'\], \[0\]\['middle'\] \(inside a jax"):
        report = float8_report(with_rules, params, X, recipe="rowwise")
    plain = float8_report(without, params, X, recipe="rowwise")
    assert [m.site.weight for m in report.matmuls] == ["[0]['head']"]
    assert [s.weight for s in report.unmeasured] == ["[0]['body']", "[0]['middle']"]
    head = plain.matmuls[-1]
    assert report.matmuls[0].output == head.output
    assert report.matmuls[0].weight_grad == head.weight_grad
    assert report.matmuls[0].flops == pytest.approx(head.flops)  # 32x64x32 of 3 matmuls: 1/5
    assert report.unmeasured_flops == pytest.approx(0.8)
    assert report.float8_flops == pytest.approx(1.0)
    assert report.table().splitlines()[-1] == (
        "not measured: 2 matmuls inside a custom_vjp or custom_jvp, 80.0% of matmul FLOPs, "
        "in rowwise"
    )


def test_a_model_stepped_in_a_checkpointed_loop_is_refused_with_the_reason():
    # Diffrax runs a solver's steps in Equinox's checkpointed while loop, a custom_vjp:
    # with every matmul inside it, nothing can be measured, and the error says why.
    import equinox as eqx

    def solve(params, y):
        def step(carry):
            i, y = carry
            return i + 1, y + 0.1 * jnp.tanh(y @ params["body"])

        _, y = eqx.internal.while_loop(
            lambda c: c[0] < 4, step, (0, y), max_steps=8, kind="checkpointed"
        )
        return jnp.mean(jnp.square(y))

    with pytest.raises(ValueError, match=r"cannot measure fn's float8 matmuls \[0\]\['body'\]"):
        float8_report(solve, PARAMS, X, recipe="rowwise")
    # autocast runs the loop's forward matmul in the recipe (in the forward rule, and
    # where the backward rule computes the forward again); the backward rule's own
    # matmuls, whose derivative JAX took when the rule was written, run in bfloat16
    fn = jaxscale.autocast(solve, dtype=BF16, float8="rowwise")
    assert matmul_dtypes(jax.make_jaxpr(jax.grad(fn))(PARAMS, X)) == {
        ("float8_e4m3fn", "float8_e4m3fn", "float32"): 2,
        ("bfloat16", "bfloat16", "bfloat16"): 2,
    }
    assert np.isfinite(jax.grad(fn)(PARAMS, X)["body"]).all()


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_a_report_on_explicit_mesh_axes_is_the_report_on_automatic_ones(recipe):
    # Flax's sharding guide's two layers: on jax.make_mesh's default axes the report's
    # float32 reference raised JAX's sharding type error (a contraction over a sharded
    # axis names its result's sharding there), and its probes met values typed on
    # another mesh inside the recipe's matmul
    reports = {}
    for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
        with sharded_mlp(kind) as (model, x):
            reports[kind] = float8_report(
                lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2),
                model,
                x,
                dtype=jnp.bfloat16,
                recipe=recipe,
            )
    automatic, explicit = reports.values()
    assert [m.site.weight for m in explicit.matmuls] == ["[0]['up'].value", "[0]['down'].value"]
    for a, b in zip(automatic.matmuls, explicit.matmuls, strict=True):
        assert a.site.weight == b.site.weight
        figures = ("output", "input_grad", "weight_grad", "flushed", "saturated", "flops")
        assert [getattr(a, f) for f in figures] == [getattr(b, f) for f in figures]


def test_a_matmul_of_two_activations_on_explicit_mesh_axes_is_left_out_as_on_automatic_ones():
    # Attention's scores and its weighted sum multiply two activations: the report
    # leaves them out, and on explicit axes (Flax's Gemma example, its batch sharded)
    # leaving them out met a result it could not type back and raised a pytree error
    rng = np.random.default_rng(5)
    weights = {n: jnp.asarray(rng.normal(size=(64, 64)) / 8, F32) for n in ("q", "k", "v")}
    tokens = jnp.asarray(rng.normal(size=(8, 16, 64)), F32)

    def attention(weights, x):
        q, k, v = (x @ weights[n] for n in ("q", "k", "v"))
        scores = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / 8)
        return jnp.mean(jnp.square(jnp.einsum("bts,bsd->btd", scores, v)))

    reports = {}
    for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
        with jax.set_mesh(machine.mesh((8,), ("data",), axis_types=(kind,))):
            x = jax.device_put(tokens, P("data"))
            reports[kind] = float8_report(attention, weights, x, recipe="rowwise")
    automatic, explicit = reports.values()
    assert [m.site.weight for m in explicit.matmuls] == ["[0]['q']", "[0]['k']", "[0]['v']"]
    for a, b in zip(automatic.matmuls, explicit.matmuls, strict=True):
        for figure in ("output", "input_grad", "weight_grad", "flushed", "saturated", "flops"):
            assert getattr(b, figure) == pytest.approx(getattr(a, figure), rel=1e-5), figure


@pytest.mark.parametrize(
    "recipe",
    [
        "nvfp4",
        dataclasses.replace(
            jaxscale.casting.RECIPES["rowwise"], name="rowwise+sr", stochastic_gradients=True
        ),
    ],
    ids=["nvfp4", "rowwise with stochastic gradients"],
)
def test_a_recipe_that_draws_is_measured_in_each_layer_of_a_scan(recipe):
    # a layer's key is drawn inside the scan's body, and the backward rule that measures
    # the gradients is traced outside it: the key must reach the rule as an argument
    ws = jnp.asarray(np.random.default_rng(2).normal(size=(3, 64, 64)) / 8, F32)

    def stack(ws, x):
        return jnp.mean(jnp.square(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]))

    def unrolled(layers, x):
        h = x
        for w in layers:
            h = jnp.tanh(h @ w)
        return jnp.mean(jnp.square(h))

    key = jax.random.key(0)
    report = float8_report(stack, ws, X, recipe=recipe, key=key)
    apart = float8_report(unrolled, list(ws), X, recipe=recipe, key=key)
    assert [m.site.layer for m in report.matmuls] == [0, 1, 2]
    for ours, theirs in zip(report.matmuls, apart.matmuls, strict=True):
        # the forward draws nothing: the same figures as the layers written out
        assert ours.output == pytest.approx(theirs.output, rel=1e-4)
        assert ours.flushed == pytest.approx(theirs.flushed, rel=1e-4)
        # the gradients' draws are other draws of the same rounding
        assert 0 < ours.input_grad == pytest.approx(theirs.input_grad, rel=0.2)
        assert 0 < ours.weight_grad == pytest.approx(theirs.weight_grad, rel=0.2)


@pytest.mark.parametrize("recipe", ["rowwise", "nvfp4"])
def test_a_scanned_stack_on_explicit_mesh_axes_is_reported_as_on_automatic_ones(recipe):
    # FSDP written out on explicit axes: each layer of a stacked weight sharded along
    # its rows, gathered in the scan's body by the program itself. The report's probe
    # index (the scan's iteration) and key (made under the mesh) were typed on the
    # explicit mesh where the measurement runs on automatic axes
    reports = {}
    for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
        mesh = machine.mesh((8,), ("fsdp",), axis_types=(kind,))
        with jax.set_mesh(mesh):
            ws = jax.device_put(
                jnp.asarray(np.random.default_rng(4).normal(size=(3, 64, 64)) / 8, F32),
                P(None, "fsdp", None),
            )
            x = jax.device_put(X, P("fsdp", None))
            key = jax.random.key(0) if recipe == "nvfp4" else None

            def stack(ws, x, kind=kind):
                def layer(h, w):
                    if kind == jax.sharding.AxisType.Explicit:
                        w = jax.sharding.reshard(w, P())
                    return jnp.tanh(h @ w), None

                return jnp.mean(jnp.square(jax.lax.scan(layer, x, ws)[0]))

            reports[kind] = float8_report(stack, ws, x, recipe=recipe, key=key)
    automatic, explicit = reports.values()
    assert [m.site.layer for m in explicit.matmuls] == [0, 1, 2]
    for a, b in zip(automatic.matmuls, explicit.matmuls, strict=True):
        assert a.site.weight == b.site.weight == "[0]"
        for figure in ("output", "input_grad", "weight_grad", "flushed", "saturated", "flops"):
            assert getattr(b, figure) == pytest.approx(getattr(a, figure), rel=1e-5), figure


def test_each_layer_of_a_scan_draws_its_own_rounding():
    # every layer the same matmul on the same operands (the carry passes through): the
    # gradients' errors differ from layer to layer only by the draws
    ws = jnp.broadcast_to(PARAMS["body"], (3, 64, 64))

    def stack(ws, x):
        _, ys = jax.lax.scan(lambda h, w: (h, h @ w), x, ws)
        return jnp.mean(jnp.square(ys))

    report = float8_report(stack, ws, X, recipe="nvfp4", key=jax.random.key(0))
    layers = report.matmuls
    assert [m.site.layer for m in layers] == [0, 1, 2]
    assert len({m.output for m in layers}) == 1  # the forward draws nothing
    assert len({m.input_grad for m in layers}) == 3
    assert len({m.weight_grad for m in layers}) == 3
