"""``autocast(..., grad_dtype=jnp.float32)``: the gradient of a float32 value narrowed for a
matmul comes out of the backward matmul in float32, from half-precision operands.

FSDP's ``MixedPrecision(reduce_dtype=torch.float32)`` is PyTorch's counterpart: the
data-parallel reduction of weight gradients in float32. Checked: the backward matmul's
dtypes, its values, the loss scale at which a float16 weight gradient overflows, the
dtype of the all-reduce on 8 devices, and that ``None`` changes nothing.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.sharded_mlp import sharded_mlp

import jaxscale

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


def layer(params, x):
    return jnp.mean((x @ params["w"] + params["b"][None]).astype(F32) ** 2)


def make(scale=1.0):
    keys = jax.random.split(jax.random.key(0), 2)
    params = {"w": jax.random.normal(keys[0], (64, 32)) * 0.1, "b": jnp.ones(32)}
    return params, jax.random.normal(keys[1], (256, 64)) * scale


def dot_dtypes(jaxpr) -> list[str]:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            operands = " x ".join(v.aval.dtype.name for v in eqn.invars)
            found.append(f"{operands} -> {eqn.outvars[0].aval.dtype.name}")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += dot_dtypes(sub)
    return found


def test_none_changes_nothing():
    params, x = make()
    plain = jax.make_jaxpr(jax.grad(jaxscale.autocast(layer)))(params, x)
    none = jax.make_jaxpr(jax.grad(jaxscale.autocast(layer, grad_dtype=None)))(params, x)
    assert str(plain) == str(none)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_the_weight_gradient_is_a_half_matmul_with_a_float32_result(dtype):
    params, x = make()
    grad = jax.grad(jaxscale.autocast(layer, dtype=dtype, grad_dtype=F32))
    half = np.dtype(dtype).name
    assert sorted(dot_dtypes(jax.make_jaxpr(grad)(params, x).jaxpr)) == sorted([
        f"{half} x {half} -> {half}",  # forward
        f"{half} x {half} -> float32",  # the input's gradient (unused)
        f"{half} x {half} -> float32",  # the weight's
    ])  # fmt: skip
    # the values: the float32 product of the same half-precision operands
    out_grad = jax.grad(lambda y: jnp.mean((y + params["b"].astype(dtype)[None]).astype(F32) ** 2))(
        x.astype(dtype) @ params["w"].astype(dtype)
    )
    expected = lax.dot_general(
        x.astype(dtype), out_grad, (((0,), (0,)), ((), ())), preferred_element_type=F32
    )
    # to float32's rounding: XLA may order the float32 sum differently in the two
    # programs (JAX 0.12.1's CPU backend does); a float16 result would be 2**-11 off
    largest = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(grad(params, x)["w"], expected, rtol=0, atol=2**-18 * largest)


def test_a_float16_weight_gradient_that_would_overflow_stays_finite():
    # under a loss scale of 2**20 the weight gradient's float16 matmul result overflows
    # (it sums 256 rows' products); in float32 it does not, and grad_scaler takes the step
    params, x = make(scale=4.0)
    params = {"w": params["w"]}
    tx = jaxscale.grad_scaler(optax.sgd(1e-3), init_scale=2.0**20)
    state = tx.init(params)

    def without_bias(params, x):
        return jnp.mean((x @ params["w"]).astype(F32) ** 2)

    def step(grad_dtype):
        loss = jaxscale.autocast(without_bias, grad_dtype=grad_dtype)
        grads = jax.grad(lambda p: jaxscale.scale(loss(p, x), state))(params)
        _, new_state = tx.update(grads, state, params)
        return grads, new_state

    grads, new_state = jax.jit(step, static_argnums=0)(None)
    assert not bool(jnp.isfinite(grads["w"]).all())
    assert bool(jaxscale.found_inf(new_state))
    grads, new_state = jax.jit(step, static_argnums=0)(F32)
    assert bool(jnp.isfinite(grads["w"]).all())
    assert not bool(jaxscale.found_inf(new_state))


def all_reduce_dtypes(hlo: str) -> list[str]:
    """The element types each all-reduce of the compiled program carries."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= (\(?[^=]*?\)?) all-reduce(?:-start)?\(", line)
        if match:
            found += re.findall(r"\b(f16|bf16|f32)\[", match.group(1))
    return found


def test_data_parallel_weight_gradients_are_all_reduced_in_float32():
    mesh = jax.make_mesh((8,), ("data",))
    params, x = make()
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def reduced(grad_dtype):
        grad = jax.jit(jax.grad(jaxscale.autocast(layer, grad_dtype=grad_dtype)))
        return sorted(all_reduce_dtypes(grad.lower(params, x).compile().as_text()))

    # the default reduces the float16 weight gradient (and the bias's) in float16; with
    # grad_dtype the weight's in float32 (the bias's sum is rounded to float16 first)
    assert reduced(None) == ["f16", "f16"]
    assert reduced(F32) == ["f16", "f32"]


def test_forward_mode_is_refused():
    params, x = make()
    loss = jaxscale.autocast(layer, grad_dtype=F32)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda w: loss({**params, "w": w}, x), (params["w"],), (params["w"],))


def test_float8_layers_follow_their_recipe():
    params, x = make()
    with_grad = jax.make_jaxpr(
        jax.grad(jaxscale.autocast(layer, dtype=BF16, float8="tensorwise", grad_dtype=F32))
    )(params, x)
    assert "float8_e4m3fn" in str(with_grad)


@pytest.mark.parametrize("bad", [jnp.float16, "float32x", 32])
def test_other_grad_dtypes_are_refused(bad):
    with pytest.raises(ValueError, match=r"grad_dtype must be None or jnp\.float32"):
        jaxscale.autocast(layer, grad_dtype=bad)


def test_half_activations_times_a_float32_weight_give_a_float32_weight_gradient():
    # the activations are float16 already; the weight is float32, narrowed by autocast:
    # its gradient is the float32 product, finite where a float16 result would overflow
    x = (jax.random.normal(jax.random.key(1), (256, 64)) * 4.0).astype(F16)
    w = jax.random.normal(jax.random.key(2), (64, 32)) * 0.1

    def loss(w, x):  # lax takes the mixed operands as they are (jnp would promote x)
        return jnp.sum(lax.dot_general(x, w, (((1,), (0,)), ((), ())))) * 2.0**10

    grad = jax.grad(jaxscale.autocast(loss, grad_dtype=F32))(w, x)
    assert grad.dtype == F32
    assert bool(jnp.isfinite(grad).all())
    expected = lax.dot_general(x, jnp.full((256, 32), 2.0**10, F16), (((0,), (0,)), ((), ())),
                               preferred_element_type=F32)  # fmt: skip
    np.testing.assert_allclose(grad, expected, rtol=2**-18)  # float32's rounding, as above
    assert not bool(jnp.isfinite(jax.grad(jaxscale.autocast(loss))(w, x)).all())


def test_contracting_axes_in_another_order_give_the_right_gradients():
    # "bjk,kjn->bn": the two operands list their contracting axes in different orders
    x = jax.random.normal(jax.random.key(1), (16, 4, 8))
    w = jax.random.normal(jax.random.key(2), (8, 4, 32)) * 0.1

    def loss(x, w):
        return jnp.sum(jnp.einsum("bjk,kjn->bn", x, w).astype(F32) ** 2)

    ours = jax.grad(jaxscale.autocast(loss, grad_dtype=F32), argnums=(0, 1))(x, w)
    reference = jax.grad(jaxscale.autocast(loss), argnums=(0, 1))(x, w)
    for got, want in zip(ours, reference, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0.02, atol=0.02 * float(jnp.abs(want).max()))


def test_a_sharded_weight_on_an_explicit_mesh_keeps_its_sharding_in_the_gradient():
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.random.normal(jax.random.key(1), (16, 64))
    w = jax.random.normal(jax.random.key(2), (64, 32)) * 0.1
    with jax.set_mesh(mesh):
        x = jax.device_put(x, P())
        w = jax.device_put(w, P("model", None))  # the contracted axis sharded

        def loss(x, w):
            return jnp.sum(jnp.dot(x, w, out_sharding=P()).astype(F32) ** 2)

        grads = jax.jit(jax.grad(jaxscale.autocast(loss, grad_dtype=F32), argnums=(0, 1)))(x, w)
        assert jax.typeof(grads[1]).sharding.spec == P("model", None)
        reference = jax.jit(jax.grad(jaxscale.autocast(loss), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(grads[1], reference[1], rtol=0.02, atol=0.02)


def test_a_contraction_over_an_explicitly_sharded_axis_computes_what_automatic_axes_do():
    # Flax's sharding guide's two layers on jax.make_mesh's default axes: the second
    # layer contracts over the devices' axis and names its result's sharding, which the
    # matmul that keeps float32 gradients dropped (JAX's sharding type error)
    results = []
    for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
        with sharded_mlp(kind) as (model, x):

            def loss(model, x):
                return jnp.mean(model(x).astype(F32) ** 2)

            cast = jaxscale.autocast(loss, dtype=jnp.bfloat16, grad_dtype=F32)
            value, grads = jax.jit(nnx.value_and_grad(cast))(model, x)
            results.append((float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]))
    (automatic, automatic_grads), (explicit, explicit_grads) = results
    assert explicit == automatic
    for a, b in zip(automatic_grads, explicit_grads, strict=True):
        np.testing.assert_array_equal(a, b)
