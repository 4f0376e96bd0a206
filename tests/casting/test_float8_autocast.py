"""autocast(..., float8=recipe): which matmuls run in float8, forward and backward, and how."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.model_training import matmul_dtypes
from support.sharded_mlp import sharded_mlp
from support.third_party import standard_promotion

import jaxscale
from jaxscale.casting import RECIPES, Cast, Float8Recipe, MXRecipe

BF16, F32 = jnp.bfloat16, jnp.float32
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(32, 64)), F32)
W = jnp.asarray(RNG.normal(size=(48, 64)) * 0.1, F32)


def linear(w, x):
    return x @ w.T


def relative_error(ours, exact):
    ours, exact = np.asarray(ours, np.float64), np.asarray(exact, np.float64)
    return np.linalg.norm(ours - exact) / np.linalg.norm(exact)


def float8_counts(jaxpr):
    return {kinds: n for kinds, n in matmul_dtypes(jaxpr).items() if "float8" in kinds[0]}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_linear_layer_runs_its_three_matmuls_as_the_recipe_says(recipe):
    fn = jaxscale.autocast(linear, dtype=BF16, float8=recipe)
    assert fn(W, X).dtype == BF16
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(fn(w, x).astype(F32) ** 2), argnums=(0, 1)))
    jaxpr = jax.make_jaxpr(grad)(W, X)
    found = float8_counts(jaxpr)
    expected = {
        "tensorwise": {(E4M3, E4M3, "float32"): 1, (E5M2, E4M3, "float32"): 1,
                       (E4M3, E5M2, "float32"): 1},
        "rowwise": {(E4M3, E4M3, "float32"): 3},
        "rowwise_with_gw_hp": {(E4M3, E4M3, "float32"): 2},
    }[recipe]  # fmt: skip
    assert found == expected
    if recipe == "rowwise_with_gw_hp":  # the weight gradient in bfloat16
        assert matmul_dtypes(jaxpr)[("bfloat16", "bfloat16", "bfloat16")] == 1
    grads = grad(W, X)
    reference = jax.grad(lambda w, x: jnp.sum(linear(w, x) ** 2), argnums=(0, 1))(W, X)
    assert [g.dtype for g in grads] == [F32, F32]  # each operand's own dtype
    for got, want in zip(grads, reference, strict=True):
        # float8 e4m3 keeps 3 significand bits: a few percent, summed over 64 products
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 0.1


def test_batched_unaligned_and_non_matmul_operations_follow_dtype():
    def model(w, x, q):
        attention = jnp.einsum("bqd,bkd->bqk", q, q)  # batch dimensions: not a linear layer
        small = x[:, :10] @ w[:10, :10]  # 10 is no multiple of 16
        return linear(w, x), attention, small, jnp.exp(x)

    q = jnp.ones((2, 16, 32))
    fn = jaxscale.autocast(model, dtype=BF16, float8="tensorwise")
    out = fn(W, X, q)
    assert [o.dtype for o in out] == [BF16, BF16, BF16, F32]
    found = matmul_dtypes(jax.make_jaxpr(fn)(W, X, q))
    assert found == {
        (E4M3, E4M3, "float32"): 1,
        ("bfloat16", "bfloat16", "bfloat16"): 2,
    }


def test_float8_none_is_autocast_as_before():
    plain = jax.make_jaxpr(jaxscale.autocast(linear, dtype=BF16))(W, X)
    none = jax.make_jaxpr(jaxscale.autocast(linear, dtype=BF16, float8=None))(W, X)
    assert str(plain) == str(none)


def test_leading_dimensions_are_rows_as_torchao_flattens_them():
    x3 = X.reshape(2, 16, 64)
    out = jaxscale.autocast(linear, dtype=BF16, float8="rowwise")(W, x3)
    flat = jaxscale.autocast(linear, dtype=BF16, float8="rowwise")(W, X)
    assert out.shape == (2, 16, 48)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32).reshape(32, 48), np.asarray(flat, np.float32)
    )


def test_a_grad_taken_inside_autocast_runs_its_backward_matmuls_in_dtype():
    def loss_and_grad(w, x):
        return jax.grad(lambda w: jnp.sum(linear(w, x).astype(F32) ** 2))(w)

    jaxpr = jax.make_jaxpr(jaxscale.autocast(loss_and_grad, dtype=BF16, float8="rowwise"))(W, X)
    found = matmul_dtypes(jaxpr)
    assert found[(E4M3, E4M3, "float32")] == 1  # the forward matmul only
    assert found[("bfloat16", "bfloat16", "bfloat16")] == 1  # w's gradient (x's is unused)


def test_an_nnx_model_trains_in_float8():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(64, 128, rngs=rngs), nnx.Linear(128, 16, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    def loss_fn(model, x, y):
        return jnp.mean((model(x).astype(F32) - y) ** 2)

    x = jnp.asarray(RNG.normal(size=(64, 64)), F32)
    y = jnp.sin(x[:, :16])
    losses = {}
    for float8 in (None, "tensorwise", "rowwise"):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        forward = jaxscale.autocast(loss_fn, dtype=BF16, float8=float8)

        @nnx.jit
        def step(model, optimizer, x, y, forward=forward):
            loss, grads = nnx.value_and_grad(forward)(model, x, y)
            optimizer.update(model, grads)
            return loss

        with standard_promotion():
            losses[float8] = [float(step(model, optimizer, x, y)) for _ in range(40)]
    for float8 in ("tensorwise", "rowwise"):
        assert losses[float8][-1] < 0.5 * losses[float8][0]
        assert abs(losses[float8][-1] - losses[None][-1]) < 0.1 * losses[None][0]


def test_a_custom_recipe_and_bad_recipes():
    mine = Float8Recipe(
        "e5m2 everywhere",
        input=Cast(jnp.float8_e5m2), weight=Cast(jnp.float8_e5m2),
        grad_output=Cast(jnp.float8_e5m2), weight_for_grad_input=Cast(jnp.float8_e5m2),
        input_for_grad_weight=None, grad_output_for_grad_weight=None,
    )  # fmt: skip
    found = matmul_dtypes(jax.make_jaxpr(jaxscale.autocast(linear, dtype=BF16, float8=mine))(W, X))
    assert found == {(E5M2, E5M2, "float32"): 1}
    with pytest.raises(ValueError, match="float8 must be None, one of"):
        jaxscale.autocast(linear, float8="blockwise")
    with pytest.raises(ValueError, match="one operand in float8 and one in high precision"):
        Float8Recipe("broken", Cast(), None, Cast(), Cast(), None, None)


# -- a mesh with explicit axes (sharding in types, jax.make_mesh's default) ----------------------


def _sharded_gradients(kind, recipe):
    """The loss, its gradients and the compiled step's collectives (kind and dtype) of
    the sharding guide's two layers under ``autocast(float8=recipe)`` on a 2 x 4 mesh of
    ``kind`` axes."""
    with sharded_mlp(kind) as (model, x):

        def loss(model, x):
            return jnp.mean(model(x).astype(F32) ** 2)

        draws = recipe == "nvfp4" or getattr(recipe, "stochastic_gradients", False)
        key = {"key": jax.random.key(3)} if draws else {}
        cast = jaxscale.autocast(loss, dtype=BF16, float8=recipe, **key)
        step = jax.jit(nnx.value_and_grad(cast))
        value, grads = step(model, x)
        text = step.lower(model, x).compile().as_text()
    found = re.findall(r"= (\w+)\[[0-9,]*\]\{[0-9,]*\} (all-\w+|collective-permute)", text)
    return float(value), [np.asarray(g, F32) for g in jax.tree.leaves(grads)], sorted(found)


EXPLICIT_RECIPES = {
    **{name: name for name in [*RECIPES, "mxfp8", "mxfp8_wgrad_with_hp", "nvfp4"]},
    "rowwise, stochastic gradients": dataclasses.replace(
        RECIPES["rowwise"], stochastic_gradients=True
    ),
    "mxfp8, gathered in MX": MXRecipe("mxfp8", all_gather_in_mx=True),
}


@pytest.mark.parametrize("name", list(EXPLICIT_RECIPES))
def test_a_recipe_on_explicit_mesh_axes_computes_what_it_computes_on_automatic_ones(name):
    # Every recipe raised JAX's sharding type errors on jax.make_mesh's default axes (its
    # operands' transposes, blocks and scales follow no type rule): its matmul now runs
    # with the axes made automatic, its result typed as the matmul's
    recipe = EXPLICIT_RECIPES[name]
    explicit = _sharded_gradients(jax.sharding.AxisType.Explicit, recipe)
    if name == "mxfp8, gathered in MX":
        # the weights made whole as MX: what mxfp8 computes on the same mesh, bit for
        # bit (on automatic axes XLA's partitioner, free to place the second layer's
        # contraction, gathers its activations instead of reducing its partial sums:
        # another summation order)
        expected = _sharded_gradients(jax.sharding.AxisType.Explicit, "mxfp8")
    else:
        expected = _sharded_gradients(jax.sharding.AxisType.Auto, recipe)
        assert explicit[2] == expected[2]  # the same collectives, of the same dtypes
    assert explicit[0] == expected[0]
    for a, b in zip(expected[1], explicit[1], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("recipe", ["rowwise", "nvfp4"])
def test_a_layer_written_weight_first_errs_as_written_input_first(recipe):
    # a layer applied per example under vmap (as Equinox's are), its weight the matmul's
    # left operand: NVFP4's weight gradient of a layer of 16 outputs written so was a dot
    # that XLA's CPU backend (before jaxlib 0.12) compiled and then could not execute
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(64, 32)), F32)
    w = jnp.asarray(rng.normal(size=(32, 16)) * 0.2, F32)
    key = jax.random.key(0) if recipe == "nvfp4" else None

    def gradients(layer):
        def of(w, x):
            return jnp.sum(jnp.tanh(layer(w, x)).astype(F32))

        fn = jaxscale.autocast(of, dtype=BF16, float8=recipe, key=key)
        return jax.jit(jax.grad(fn, argnums=(0, 1)))(w, x)

    weight_first = gradients(lambda w, x: jax.vmap(lambda row: w.T @ row)(x))
    input_first = gradients(lambda w, x: x @ w)
    plain = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)), argnums=(0, 1))(w, x)
    # each gradient's error as the recipe makes it either way (not bit for bit: the
    # products are summed in another order)
    for ours, theirs, exact in zip(weight_first, input_first, plain, strict=True):
        error = relative_error(ours, exact)
        assert error == pytest.approx(relative_error(theirs, exact), rel=0.25, abs=2e-3)
        assert 0 < error < 0.3
