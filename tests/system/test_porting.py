"""The lines a PyTorch porter types: the autocast state, custom_fwd, a policy row for a
primitive of one's own, GradScaler's signature, and warnings where a port goes wrong."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex
from jax.interpreters import mlir

import jaxscale
from jaxscale.casting import Precision, register_policy

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
A = jnp.asarray(np.random.default_rng(0).uniform(0.1, 0.9, (4, 4)), F32)


def test_with_autocast_explains_the_function_form():
    with (
        pytest.raises(TypeError, match="is a function transform, not a context manager") as error,
        jaxscale.autocast(dtype=BF16),
    ):
        pass
    assert "jaxscale.autocast(loss_fn)(model, x, y)" in str(error.value)
    # the same object is the decorator form
    assert jaxscale.autocast(dtype=BF16)(lambda a: a @ a)(A).dtype == BF16


@pytest.mark.parametrize("jit", [False, True])
def test_the_autocast_state_seen_from_inside(jit):
    seen = []

    def inner(a):
        seen.append(
            ("disabled region", jaxscale.is_autocast_enabled(), jaxscale.get_autocast_dtype())
        )
        return a

    def fn(a):
        seen.append(("region", jaxscale.is_autocast_enabled(), jaxscale.get_autocast_dtype()))
        return jaxscale.autocast(inner, enabled=False)(a @ a)

    wrapped = jaxscale.autocast(fn, dtype=BF16)
    (jax.jit(wrapped) if jit else wrapped)(A)
    fn(A)
    assert seen[:2] == [("region", True, BF16), ("disabled region", False, BF16)]
    assert seen[2:] == [("region", False, F16), ("disabled region", False, F16)]


def test_a_custom_vjp_backward_rule_sees_the_forwards_autocast_state():
    seen = []

    @jax.custom_vjp
    def f(x):
        return x * 2

    def f_fwd(x):
        return f(x), None

    def f_bwd(_, g):
        seen.append(jaxscale.is_autocast_enabled())
        return (g * 2,)

    f.defvjp(f_fwd, f_bwd)
    jax.grad(lambda a: jnp.sum(jaxscale.autocast(f)(a @ a).astype(F32)))(A)
    assert seen == [True]  # the rule ran when JAX differentiated, under the forward's state


@jaxscale.custom_fwd(cast_inputs=F32)
def delicate(a, b):
    return jnp.exp(a @ b)


def test_custom_fwd_runs_its_body_in_the_cast_dtype_forward_and_backward():
    def model(a):
        return jnp.sum(delicate(a @ a, a))  # a @ a is float16; delicate gets float32

    jaxpr = jax.make_jaxpr(jax.grad(jaxscale.autocast(model)))(A)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    dtypes = sorted(str(e.outvars[0].aval.dtype) for e in dots)
    # the outer product and its two gradients in float16; delicate's product and its two
    # gradients in float32
    assert dtypes == ["float16"] * 3 + ["float32"] * 3
    # outside autocast it is the function itself
    assert delicate(A.astype(F16), A.astype(F16)).dtype == F16


def test_custom_fwd_without_cast_inputs_follows_the_enclosing_policy():
    plain = jaxscale.custom_fwd(lambda a, b: a @ b)
    assert jaxscale.autocast(plain)(A, A).dtype == F16
    with pytest.raises(TypeError, match="cast_inputs must be a floating dtype or None, got int32"):
        jaxscale.custom_fwd(cast_inputs=jnp.int32)
    with pytest.raises(TypeError, match="custom_fwd expects a callable, got int 3"):
        jaxscale.custom_fwd(3)


def _primitive(name):
    """A first-order primitive of one's own (as a Pallas kernel or an FFI call is)."""
    primitive = jex.Primitive(name)
    primitive.def_impl(lambda x: x * 2)
    primitive.def_abstract_eval(lambda x: x)
    mlir.register_lowering(primitive, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    return primitive


def test_a_registered_primitive_gets_its_row_and_an_unregistered_one_runs_as_traced():
    unregistered, registered = _primitive("porting_test_kernel"), _primitive("porting_test_f16")
    register_policy("porting_test_f16", Precision.LOWER, "a float16 kernel")

    def fn(a):
        return unregistered.bind(a), registered.bind(a)

    first, second = jaxscale.autocast(fn)(A)
    assert first.dtype == F32  # as traced
    assert second.dtype == F16  # its row: the autocast dtype
    assert jaxscale.casting.row_for("porting_test_f16").torch_ops == "a float16 kernel"
    with pytest.raises(TypeError, match=r"precision must be a jaxscale\.casting\.Precision"):
        register_policy("porting_test_f16", "float32")


def test_gradscaler_shows_its_real_signature():
    parameters = inspect.signature(jaxscale.GradScaler).parameters
    assert list(parameters)[:6] == [
        "device",
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "enabled",
    ]
    assert parameters["init_scale"].default == 2.0**16


def test_scaling_a_half_precision_loss_warns():
    scaler = jaxscale.GradScaler()
    with pytest.warns(jaxscale.ScaleWarning, match=r"^scale\(\) was given a float16 loss"):
        scaler.scale(jnp.float16(1e-4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(jnp.float32(1.0))  # the float32 loss autocast computes: silent
        scaler.scale({"a": jnp.ones(2, F16)})  # a tree of outputs is not a loss


def test_a_scaled_loss_that_overflows_warns_outside_jit():
    import optax

    opt_state = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=2.0**16).init(jnp.zeros(1))
    with pytest.warns(jaxscale.ScaleWarning) as caught:
        jaxscale.scale(jnp.bfloat16(3e38), opt_state)
    assert any("the scaled loss is inf" in str(w.message) for w in caught)


def test_the_region_answers_per_device_type_as_pytorch_does():
    seen = []

    def probe(x):
        seen.append(
            (
                jaxscale.is_autocast_enabled(),
                jaxscale.is_autocast_enabled("cpu"),
                jaxscale.is_autocast_enabled("cuda"),
                jaxscale.get_autocast_dtype(),
                jaxscale.get_autocast_dtype("cpu"),
                jaxscale.get_autocast_dtype("cuda"),
            )
        )
        return x

    probe(1.0)
    jaxscale.autocast(probe, device_type="cpu")(1.0)
    jaxscale.autocast(probe, device_type="cpu", dtype=jnp.float16)(1.0)
    jaxscale.autocast(probe)(1.0)
    bf16, f16 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
    assert seen == [
        (False, False, False, f16, bf16, f16),  # outside: each device type's default
        (True, True, False, bf16, bf16, f16),
        (True, True, False, f16, f16, f16),
        (True, False, True, f16, bf16, f16),
    ]


@pytest.mark.parametrize("bad", ["xpu", "CPU", 0])
def test_an_unknown_device_type_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=f'device_type must be "cuda" or "cpu", got {bad!r}'):
        jaxscale.autocast(lambda x: x, device_type=bad)
    with pytest.raises(ValueError, match="got None"):  # None is the region's, for the queries
        jaxscale.autocast(lambda x: x, device_type=None)
    with pytest.raises(ValueError, match="device_type must be"):
        jaxscale.is_autocast_enabled(bad)
    with pytest.raises(ValueError, match="device_type must be"):
        jaxscale.get_autocast_dtype(bad)


def test_torchs_positional_device_type_is_explained():
    with pytest.raises(TypeError, match=r'jaxscale.autocast\(fn, device_type="cpu"\)'):
        jaxscale.autocast("cpu")


def _scaler_step_fn():
    import optax
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, optimizer, scaler, x):
        grads = nnx.grad(lambda m: scaler.scale(jnp.sum(m(x))))(model)
        scaler.step(optimizer, model, grads)
        scaler.update()
        return scaler

    return model, optimizer, step


def test_a_scaler_not_returned_from_jax_jit_is_warned_about_once():
    model, optimizer, step = _scaler_step_fn()
    scaler = jaxscale.GradScaler(init_scale=1024.0, growth_interval=1)
    jitted = jax.jit(step)
    for _ in range(3):
        jitted(model, optimizer, scaler, jnp.ones((3, 2)))  # the returned scaler is dropped
    with pytest.warns(jaxscale.ScaleWarning, match="the updated scaler was not returned"):
        assert scaler.get_scale() == 1024.0  # never moved
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scaler.skipped_steps() == 0  # said once


@pytest.mark.parametrize("how", ["returned from jax.jit", "nnx.jit", "eager"])
def test_a_scaler_that_came_back_is_not_warned_about(how):
    from flax import nnx

    model, optimizer, step = _scaler_step_fn()
    scaler = jaxscale.GradScaler(init_scale=1024.0, growth_interval=1)
    x = jnp.ones((3, 2))
    for _ in range(3):
        if how == "returned from jax.jit":
            scaler = jax.jit(step)(model, optimizer, scaler, x)
        elif how == "nnx.jit":
            nnx.jit(step)(model, optimizer, scaler, x)
        else:
            step(model, optimizer, scaler, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scaler.get_scale() == 8192.0
        assert scaler.state_dict()["scale"] == 8192.0
