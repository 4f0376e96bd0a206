"""Half-precision sums accumulate in float32 under autocast, and jaxscale traces under
``jax.allow_f16_reductions(False)``.

JAX differentiates a broadcast into a sum in the broadcast value's dtype, and a maximum
into a sum of its ties; under autocast both would be float16 or bfloat16 sums, which
``jax.allow_f16_reductions(False)`` refuses while tracing. PyTorch's CUDA kernels
accumulate half-precision sums in float (``acc_type<Half>``) and round once: autocast
writes the derivatives so that every such sum is a float32 one, forward and backward,
on every platform while the flag is off (on the CPU, with the flag on, the backward
sums stay in the half dtype for speed: ``_interpreter.summed_back_in_float32``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.extend import core as jex
from support import third_party

import jaxscale

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
RECIPES = [None, "tensorwise", "rowwise", "rowwise_with_gw_hp"]
no_half_sums = functools.partial(jax.allow_f16_reductions, False)


def linear(params, x):
    return jnp.mean((x @ params["w"] + params["b"][None]) ** 2)


def linear_params():
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(keys[0], (32, 16)) * 0.2, "b": jnp.ones(16)}
    return params, jax.random.normal(keys[2], (128, 32))


@pytest.mark.parametrize("float8", RECIPES)
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_layer_with_a_bias_trains_under_the_flag_in_every_configuration(
    dtype, device_type, float8
):
    params, x = linear_params()
    loss = jaxscale.autocast(linear, dtype=dtype, device_type=device_type, float8=float8)
    with no_half_sums():
        grads = jax.jit(jax.grad(loss))(params, x)
        # traced under the flag, where a half-precision sum would be refused
        inside = jax.eval_shape(
            jaxscale.autocast(jax.grad(linear), dtype=dtype, float8=float8), params, x
        )
    expected = jax.grad(linear)(params, x)
    assert grads["b"].dtype == F32  # gradient dtypes are what they were
    np.testing.assert_allclose(grads["b"], expected["b"], rtol=0.05, atol=1e-3)
    assert inside["b"].dtype == F32


# -- models written in plain JAX and in Flax NNX ------------------------------------------------


def attention(params, x):
    """Masked softmax attention with an embedding, a LayerNorm and mean pooling."""
    tokens = jnp.arange(x.shape[1]) % 7
    h = x + params["embed"][tokens][None]
    mean = h.mean(-1, keepdims=True)
    h = (h - mean) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5) * params["scale"][None, None]
    q, k, v = (h @ params[name] + params[f"{name}_bias"][None, None] for name in "qkv")
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / 4.0
    causal = jnp.tril(jnp.ones((1, x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(F32).min), axis=-1)
    return jnp.mean(jnp.einsum("bqk,bkd->bqd", weights, v).mean(axis=1) ** 2)


def attention_params():
    keys = jax.random.split(jax.random.key(1), 4)
    params = {"embed": jax.random.normal(keys[0], (7, 16)), "scale": jnp.ones(16)}
    for index, name in enumerate(("q", "k", "v")):
        params[name] = jax.random.normal(keys[index + 1], (16, 16)) * 0.25
        params[f"{name}_bias"] = jnp.full(16, 0.1)
    return params, jax.random.normal(jax.random.key(5), (4, 12, 16))


def scanned_layers(params, x):
    def layer(h, weights):
        w, b = weights
        return jnp.tanh(h @ w + b[None]), None

    h, _ = lax.scan(layer, x, (params["w"], params["b"]))
    return jnp.mean(h**2)


def scanned_params():
    w = jax.random.normal(jax.random.key(2), (3, 16, 16)) * 0.25
    return {"w": w, "b": jnp.full((3, 16), 0.1)}, jax.random.normal(jax.random.key(3), (32, 16))


class ConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.norm(self.conv(x)))
        return self.head(h.mean(axis=(1, 2)))  # mean pooling


def conv_loss(model, x):
    return jnp.mean(model(x) ** 2)


PLAIN_MODELS = {
    "attention": (attention, attention_params),
    "scan over layers": (scanned_layers, scanned_params),
}


def half_reduce_sums(jaxpr) -> list[str]:
    """Every reduce_sum of a float16 or bfloat16 operand over a non-unit axis, anywhere in
    ``jaxpr`` and the programs it calls."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_sum":
            operand = eqn.invars[0].aval
            summed = [operand.shape[axis] for axis in eqn.params["axes"]]
            if operand.dtype in (jnp.dtype(F16), jnp.dtype(BF16)) and any(n > 1 for n in summed):
                found.append(str(eqn))
        for sub in jex.jaxprs_in_params(eqn.params):
            found += half_reduce_sums(sub)
    return found


@pytest.mark.parametrize(("dtype", "device_type"), [(F16, "cuda"), (BF16, "cpu")])
@pytest.mark.parametrize("name", list(PLAIN_MODELS))
def test_plain_jax_models_differentiate_without_half_sums(name, dtype, device_type):
    fn, make = PLAIN_MODELS[name]
    params, x = make()
    loss = jaxscale.autocast(fn, dtype=dtype, device_type=device_type)
    with no_half_sums():
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x)
        grads = jax.jit(jax.grad(loss))(params, x)
    assert half_reduce_sums(jaxpr.jaxpr) == []
    expected = jax.grad(fn)(params, x)
    # within a few percent of the largest gradient (the keys' bias has none: softmax does
    # not see it, and its half-precision gradient is rounding noise)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
    for key in params:
        assert grads[key].dtype == F32
        np.testing.assert_allclose(grads[key], expected[key], atol=0.03 * scale, err_msg=key)


@jax.custom_jvp
def centred(x):
    return x - jnp.mean(x, axis=-1, keepdims=True)


@centred.defjvp
def centred_jvp(primals, tangents):
    # a JVP rule written as softmax's is (JAX 0.12.1's jax.nn.softmax is one): the
    # tangent's mean is broadcast back over the axis, which JAX transposes into a sum
    (x,), (t,) = primals, tangents
    return centred(x), t - jnp.mean(t, axis=-1, keepdims=True)


def centred_layer(params, x):
    return jnp.mean(jnp.tanh(centred(x @ params["w"])) ** 2)


@pytest.mark.parametrize("softmax", ["custom_jvp_call", "jax.nn.softmax's"])
def test_a_jvp_rules_broadcast_tangent_is_summed_back_in_float32(softmax):
    # JAX transposes the tangent arithmetic of a custom JVP rule as the rule wrote it:
    # the broadcast of a bfloat16 tangent became a bfloat16 sum, which the flag refuses
    # (under PyTorch's CPU policy softmax runs in bfloat16, and JAX 0.12.1 writes
    # jax.nn.softmax as a custom_jvp by default: JAX's flag turns it on in earlier ones)
    if softmax == "custom_jvp_call":
        fn, (params, x) = centred_layer, linear_params()
    else:
        fn, (params, x) = attention, attention_params()
    loss = jaxscale.autocast(fn, dtype=BF16, device_type="cpu")
    previous = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", True)
    try:
        with no_half_sums():
            jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x)
            grads = jax.jit(jax.grad(loss))(params, x)
        expected = jax.grad(fn)(params, x)
    finally:
        jax.config.update("jax_softmax_custom_jvp", previous)
    assert half_reduce_sums(jaxpr.jaxpr) == []
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
    for key in params:
        np.testing.assert_allclose(grads[key], expected[key], atol=0.03 * scale, err_msg=key)


def test_with_the_flag_on_only_the_cpu_program_sums_in_half():
    # the default, kept for speed on the CPU: the accelerators' branch of the program
    # still sums in float32, and JAX's flag sees the half sum of the CPU branch
    params, x = attention_params()
    jaxpr = jax.make_jaxpr(jax.grad(jaxscale.autocast(attention)))(params, x)
    assert half_reduce_sums(jaxpr.jaxpr)
    report = jaxscale.lowering_report(jax.grad(jaxscale.autocast(attention)), params, x)
    assert set(report.sum_dtypes) == {"f32"}


@pytest.mark.parametrize(("dtype", "device_type"), [(F16, "cuda"), (BF16, "cpu")])
def test_a_convolutional_nnx_model_trains_under_the_flag(dtype, device_type):
    model = ConvNet(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (8, 10, 10, 3))
    graphdef, state = nnx.split(model)
    loss = jaxscale.autocast(conv_loss, dtype=dtype, device_type=device_type)

    def grads_of(loss):
        def of_state(state):
            return loss(nnx.merge(graphdef, state), x)

        return jax.grad(of_state)(state)

    with third_party.standard_promotion(), no_half_sums():
        jaxpr = jax.make_jaxpr(lambda: grads_of(loss))()
        grads = jax.jit(lambda: grads_of(loss))()
    assert half_reduce_sums(jaxpr.jaxpr) == []
    with third_party.standard_promotion():
        expected = grads_of(conv_loss)
    got, want = nnx.to_pure_dict(grads), nnx.to_pure_dict(expected)
    assert got["conv"]["bias"].dtype == F32  # zero in exact arithmetic: BatchNorm removes it
    for layer, name in (("head", "bias"), ("head", "kernel"), ("norm", "scale")):
        value, reference = got[layer][name], want[layer][name]
        tolerance = 0.05 * float(jnp.abs(reference).max())
        np.testing.assert_allclose(value, reference, atol=tolerance, err_msg=f"{layer}.{name}")


@pytest.mark.parametrize("tool", ["locate_nonfinite", "precision_stats"])
def test_the_diagnosis_tools_trace_under_the_flag(tool):
    params, x = attention_params()
    loss = jaxscale.autocast(attention, dtype=F16)
    wrapped = getattr(jaxscale, tool)(jax.grad(loss))
    with no_half_sums():
        grads, _ = jax.jit(wrapped)(params, x)
    # the same gradient; XLA may order a float32 sum differently in the larger program
    expected = jax.jit(jax.grad(loss))(params, x)["q_bias"]
    np.testing.assert_allclose(grads["q_bias"], expected, rtol=2**-10, atol=2**-24)


# -- the sums are more accurate ---------------------------------------------------------------


def test_a_bias_gradient_is_the_float32_sum_rounded_once():
    # A float16 bias broadcast over 4,096 rows: its gradient sums 4,096 float16
    # cotangents per column. Accumulated in float32 and rounded once it is within half an
    # ulp (and float32's own error) of the float64 sum. (On this CPU the half-precision
    # sum that the default keeps measured up to 0.57 ulps off, in the same columns.)
    rows, columns = 4096, 16
    values = (0.5 + jax.random.uniform(jax.random.key(7), (rows, columns)) / 8).astype(F16)
    exact = np.asarray(values, np.float64).sum(axis=0)

    def loss(bias, ones):
        product = ones @ jnp.ones((1, columns)) + bias[None]  # float16 under autocast
        return jnp.sum(product * lax.stop_gradient(values.astype(F32)))

    with no_half_sums():
        grad = jax.jit(jax.grad(jaxscale.autocast(loss)))(jnp.zeros(columns), jnp.ones((rows, 1)))
    ulp = np.spacing(exact.astype(np.float16)).astype(np.float64)
    assert np.max(np.abs(np.asarray(grad, np.float64) - exact) / ulp) <= 0.5 + 2.0**-4
