"""``autocast(..., device_type="cpu")`` against ``torch.autocast("cpu")``, op by op.

Each op runs under both autocasts on float32 and on bfloat16 inputs; the result
dtypes must be PyTorch's and the values agree to the result dtype's accuracy. Then a
transformer, the same weights in both frameworks: with the CPU policy jaxscale's
logits follow PyTorch's CPU autocast more closely than with the CUDA policy.
"""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import flax.linen
import haiku
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax import lax
from support import decompositions, machine, third_party
from support.decompositions import spd
from support.torch_transformer import small_twins

import jaxscale

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _on_the_cpu_device():
    # PyTorch's CPU autocast is the reference, bit for bit where its kernels round once,
    # so jaxscale runs on the CPU device too: a GPU sums in another order, and its
    # linear algebra takes no bfloat16 (where PyTorch's CPU autocast keeps it)
    with machine.on_cpu("compares with torch.autocast('cpu') bit for bit"):
        yield


def _spd_torch(a):
    return a @ a.T + 4 * torch.eye(a.shape[0], dtype=a.dtype)


# (name, jax function, torch function, inputs needed)
UNARY = [
    ("matmul", lambda a: a @ a, lambda a: a @ a),
    ("einsum", lambda a: jnp.einsum("ij,jk->ik", a, a), lambda a: torch.einsum("ij,jk->ik", a, a)),
    ("matmul with a vector", lambda a: a @ a[0], lambda a: a @ a[0]),
    ("conv1d",
     lambda a: jax.lax.conv_general_dilated(a[None], a[:, :, None], (1,), "VALID"),
     lambda a: F.conv1d(a[None], a[:, :, None])),
    ("exp", jnp.exp, torch.exp), ("exp2", jnp.exp2, torch.exp2), ("expm1", jnp.expm1, torch.expm1),
    ("log", jnp.log, torch.log), ("log2", jnp.log2, torch.log2), ("log1p", jnp.log1p, torch.log1p),
    ("pow", lambda a: a**2.5, lambda a: a**2.5), ("square", lambda a: a**2, lambda a: a**2),
    ("rsqrt", jax.lax.rsqrt, torch.rsqrt), ("sqrt", jnp.sqrt, torch.sqrt),
    ("reciprocal", lambda a: 1 / a, lambda a: 1 / a),
    ("div", lambda a: a / a[0], lambda a: a / a[0]),
    ("tanh", jnp.tanh, torch.tanh), ("tan", jnp.tan, torch.tan), ("sinh", jnp.sinh, torch.sinh),
    ("cosh", jnp.cosh, torch.cosh),
    ("asin", lambda a: jnp.arcsin(a / 4), lambda a: torch.asin(a / 4)),
    ("acos", lambda a: jnp.arccos(a / 4), lambda a: torch.acos(a / 4)),
    ("erf", jax.lax.erf, torch.erf),
    ("erfinv", lambda a: jax.lax.erf_inv(a / 4), lambda a: torch.erfinv(a / 4)),
    ("sigmoid", jax.nn.sigmoid, torch.sigmoid), ("gelu", lambda a: jax.nn.gelu(a, False), F.gelu),
    ("sum", jnp.sum, torch.sum), ("mean", jnp.mean, torch.mean), ("prod", jnp.prod, torch.prod),
    ("cumsum", lambda a: jnp.cumsum(a, 0), lambda a: torch.cumsum(a, 0)),
    ("cumprod", lambda a: jnp.cumprod(a, 0), lambda a: torch.cumprod(a, 0)),
    ("logcumsumexp", lambda a: jax.lax.cumlogsumexp(a, 0), lambda a: torch.logcumsumexp(a, 0)),
    ("max", jnp.max, torch.max),
    # type promotion's categories: a literal does not widen a 0-d value, a 0-d value does
    # widen another 0-d value
    ("mean of a product", lambda a: jnp.mean(a @ a), lambda a: torch.mean(a @ a)),
    ("0-d times 0-d", lambda a: (a @ a)[0, 0] * a[0, 0], lambda a: (a @ a)[0, 0] * a[0, 0]),
    ("softmax", jax.nn.softmax, lambda a: torch.softmax(a, -1)),
    ("log_softmax", jax.nn.log_softmax, lambda a: torch.log_softmax(a, -1)),
    ("logsumexp", lambda a: jax.nn.logsumexp(a, 0), lambda a: torch.logsumexp(a, 0)),
    ("norm", jnp.linalg.norm, torch.linalg.norm),
    ("cholesky",
     lambda a: jnp.linalg.cholesky(spd(a)), lambda a: torch.linalg.cholesky(_spd_torch(a))),
    ("qr", lambda a: jnp.abs(jnp.linalg.qr(a)[1]), lambda a: torch.abs(torch.linalg.qr(a)[1])),
    ("svd", lambda a: jnp.linalg.svd(a)[1], lambda a: torch.linalg.svd(a)[1]),
    ("eigh", lambda a: jnp.linalg.eigh(spd(a))[0], lambda a: torch.linalg.eigh(_spd_torch(a))[0]),
    ("fft", lambda a: jnp.abs(jnp.fft.fft(a)), lambda a: torch.abs(torch.fft.fft(a))),
]  # fmt: skip


def _inputs(dtype_name: str):
    rng = np.random.default_rng(0)
    values = (rng.uniform(0.5, 1.5, size=(16, 16)) / 4).astype(np.float32)
    values = np.asarray(jnp.asarray(values, jnp.bfloat16).astype(jnp.float32))  # bf16-exact
    ours = jnp.asarray(values).astype(dtype_name)
    theirs = torch.from_numpy(values.copy()).to(getattr(torch, dtype_name))
    return ours, theirs


# jnp.prod of a bfloat16 array casts its float32 product back to bfloat16 (see below)
_CAST_BACK_BY_JNP = {("prod", "bfloat16")}


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("name", "ours", "theirs"), UNARY, ids=[row[0] for row in UNARY])
def test_each_op_takes_the_dtype_torch_cpu_autocast_gives_it(name, ours, theirs, input_dtype):
    a, t = _inputs(input_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = theirs(t)
    refused = name in decompositions.NAMES and input_dtype == "bfloat16"
    if refused and not decompositions.jax_traces_bfloat16():
        # autocast traces the function as written, and this JAX refuses the function
        # itself: the error is JAX's own, the same with autocast as without
        refusal = f"{name} does not accept dtype bfloat16"
        with pytest.raises(TypeError, match=refusal):
            ours(a)
        with pytest.raises(TypeError, match=refusal):
            jaxscale.autocast(ours, device_type="cpu")(a)
        return
    with third_party.standard_promotion():
        got = jaxscale.autocast(ours, device_type="cpu")(a)
    expected_dtype = str(expected.dtype).removeprefix("torch.")
    if (name, input_dtype) in _CAST_BACK_BY_JNP:
        expected_dtype = input_dtype
    assert str(got.dtype) == expected_dtype, name
    # the values: both computed in that dtype, so they agree to its accuracy
    tolerance = 2e-2 if got.dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(
        np.asarray(got, np.float32), expected.float().numpy(), rtol=tolerance, atol=tolerance
    )


def _nhwc(f):  # a jax pooling of an NHWC array, on the NCHW layout torch pools
    return lambda a: jnp.transpose(f(jnp.transpose(a, (0, 2, 3, 1))), (0, 3, 1, 2))


# (name, policies, jax function, torch function): float16 sums and products PyTorch's
# kernels accumulate in float32 and round once, where XLA rounds every partial result
ACCUMULATING = [
    ("sum", ("cpu",), lambda h: jnp.sum(h, axis=0), lambda h: h.sum(0)),
    ("cumsum", ("cpu",), lambda h: jnp.cumsum(h, axis=0), lambda h: h.cumsum(0)),
    ("cumprod", ("cpu",), lambda h: jnp.cumprod(1 + h / 64, axis=0),
     lambda h: (1 + h / 64).cumprod(0)),
    ("avg_pool 2x2", ("cpu", "cuda"), _nhwc(lambda h: flax.linen.avg_pool(h, (2, 2), (2, 2))),
     lambda h: F.avg_pool2d(h, 2)),
]  # fmt: skip


def _on_a_float16_conv_output(ours, theirs, policies):
    """PyTorch's ``theirs`` and jaxscale's ``ours`` (one per policy) of the same
    convolution's output under float16 autocast."""
    # Dyadic inputs whose products and sums float32 holds exactly: the convolution is
    # then exact before its one rounding to float16, in either framework and in any
    # order of summation. With arbitrary inputs the two frameworks' CPU kernels sum in
    # orders that vary with the processor (an AMD EPYC and an Intel Xeon differ), and
    # the sums under test would start from different float16 values.
    rng = np.random.default_rng(0)
    x = (rng.integers(-32, 33, size=(4, 8, 32, 32)) / 8).astype(np.float32)
    k = (rng.integers(-64, 65, size=(8, 8, 3, 3)) / 256).astype(np.float32)

    def jax_fn(x, k):
        return ours(jax.lax.conv_general_dilated(x, k, (1, 1), "SAME"))

    with torch.autocast("cpu", dtype=torch.float16):
        expected = theirs(F.conv2d(torch.from_numpy(x), torch.from_numpy(k), padding=1))
    assert expected.dtype == torch.float16
    with third_party.standard_promotion():
        return expected.numpy(), [
            jaxscale.autocast(jax_fn, device_type=policy, dtype=jnp.float16)(x, k)
            for policy in policies
        ]


@pytest.mark.parametrize(
    ("name", "policies", "ours", "theirs"), ACCUMULATING, ids=[row[0] for row in ACCUMULATING]
)
def test_float16_sums_are_accumulated_in_float32_bit_for_bit_as_pytorchs(
    name, policies, ours, theirs
):
    expected, results = _on_a_float16_conv_output(ours, theirs, policies)
    for got in results:
        assert got.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(got), expected)


def _unbatched(pool):  # an Equinox pooling layer (channels first, one example) per example
    return lambda h: jax.vmap(pool)(h)


def _haiku_same(h):  # Haiku's SAME pooling divides by each window's count of real elements
    window = (1, 3, 3, 1)
    return _nhwc(lambda g: haiku.avg_pool(g, window, (1, 1, 1, 1), "SAME"))(h)


# (name, jax function, torch function, result dtype): average pools, one kernel in
# PyTorch that divides the float32 sum and rounds once; in JAX a window sum, views of
# it, then a division. Where the code divides by a count it makes in float32 (Flax
# without padding counts; Haiku counts in the dtype it traced, float32), the quotient
# is float32 as the code says, and holds PyTorch's value before its rounding.
POOLS = [
    ("flax 3x3, padded", _nhwc(lambda h: flax.linen.avg_pool(h, (3, 3), padding=((1, 1), (1, 1)))),
     lambda h: F.avg_pool2d(h, 3, 1, 1), jnp.float16),
    ("flax 3x3, stride 2", _nhwc(lambda h: flax.linen.avg_pool(h, (3, 3), (2, 2))),
     lambda h: F.avg_pool2d(h, 3, 2), jnp.float16),
    ("flax 3x3, padding not counted",
     _nhwc(lambda h: flax.linen.avg_pool(h, (3, 3), padding=((1, 1), (1, 1)),
                                         count_include_pad=False)),
     lambda h: F.avg_pool2d(h, 3, 1, 1, count_include_pad=False), jnp.float32),
    ("equinox AvgPool2d 5x5", _unbatched(eqx.nn.AvgPool2d(5, 1)), lambda h: F.avg_pool2d(h, 5, 1),
     jnp.float16),
    ("haiku avg_pool SAME", _haiku_same,
     lambda h: F.avg_pool2d(h, 3, 1, 1, count_include_pad=False), jnp.float32),
]  # fmt: skip


@pytest.mark.parametrize(("name", "ours", "theirs", "dtype"), POOLS, ids=[row[0] for row in POOLS])
def test_an_average_pool_divides_its_float32_sum_and_rounds_once_as_pytorchs(
    name, ours, theirs, dtype
):
    expected, results = _on_a_float16_conv_output(ours, theirs, ("cpu", "cuda"))
    for got in results:
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float16)), expected)


def test_only_a_pools_window_sum_is_divided_before_rounding():
    # x.sum() / n is two PyTorch ops, each rounding: the division reads the rounded sum
    # (the sum as lax writes it, a reduce_sum in the traced function itself, as a pool's is)
    def mean(a):
        return lax.reduce(a, np.float16(0), lax.add, (0,)) / 7

    fn = jaxscale.autocast(mean, device_type="cpu", dtype=jnp.float16)
    jaxpr = jax.make_jaxpr(fn)(np.ones((64, 256), np.float16)).jaxpr
    (division,) = [e for e in jaxpr.eqns if e.primitive.name == "div"]
    assert [str(v.aval.dtype) for v in division.invars] == ["float16", "float16"]


def test_the_cuda_policy_differs_from_the_cpu_one_where_pytorchs_lists_do():
    def fn(a):
        product = a @ a  # bfloat16 under either policy
        return jnp.exp(product), jnp.sum(product), jnp.linalg.norm(product), jnp.prod(product)

    a, _ = _inputs("float32")
    cuda = jaxscale.autocast(fn, dtype=jnp.bfloat16)(a)
    cpu = jaxscale.autocast(fn, device_type="cpu")(a)
    assert [x.dtype for x in cuda] == [jnp.float32] * 4
    assert [x.dtype for x in cpu] == [jnp.bfloat16] * 3 + [jnp.float32]


def test_jnp_reductions_of_half_precision_inputs_keep_the_cast_back_jnp_writes():
    # jnp.prod (and jnp.sum) of a bfloat16 array compute in float32 and cast the result
    # back to bfloat16 in the traced code; autocast keeps casts the code wrote, so where
    # PyTorch's float32 list gives float32 for a bfloat16 input, jaxscale gives bfloat16.
    a, t = _inputs("bfloat16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.prod(t).dtype == torch.float32
    assert jaxscale.autocast(jnp.prod, device_type="cpu")(a).dtype == jnp.bfloat16
    assert jaxscale.autocast(jnp.prod, device_type="cpu")(a.astype(jnp.float32)).dtype == (
        jnp.float32
    )


def test_a_transformer_under_the_cpu_policy_agrees_with_torchs_cpu_autocast(char_lm):
    model, twin, x, _ = small_twins(char_lm)
    with third_party.standard_promotion():
        cpu_logits = nnx.jit(lambda m, x: jaxscale.autocast(m, device_type="cpu")(x))(model, x)
        cuda_logits = nnx.jit(lambda m, x: jaxscale.autocast(m, dtype=jnp.bfloat16)(x))(model, x)
    assert cpu_logits.dtype == cuda_logits.dtype == jnp.bfloat16
    on_cpu_lists, on_cuda_lists = (np.asarray(v, np.float32) for v in (cpu_logits, cuda_logits))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch_logits = twin(torch.from_numpy(np.array(x)).long())
    assert torch_logits.dtype == torch.bfloat16
    reference = torch_logits.float().numpy()
    rms = math.sqrt(float(np.mean(reference**2)))
    # both bfloat16 computations agree with PyTorch's to bfloat16 accuracy
    assert float(np.sqrt(np.mean((on_cpu_lists - reference) ** 2))) < 2e-2 * rms
    assert float(np.sqrt(np.mean((on_cuda_lists - reference) ** 2))) < 2e-2 * rms


def test_a_loss_decorated_with_custom_fwd_runs_in_float32_as_pytorchs_cpu_losses_do():
    import optax

    @jaxscale.custom_fwd(cast_inputs=jnp.float32)
    def cross_entropy(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    a, t = _inputs("float32")
    labels = np.arange(16) % 5

    def loss(a, labels):
        return cross_entropy(a @ a, labels)

    def plain(a, labels):
        return optax.softmax_cross_entropy_with_integer_labels(a @ a, labels).mean()

    with third_party.standard_promotion():
        ours = jaxscale.autocast(loss, device_type="cpu")(a, labels)
        undecorated = jaxscale.autocast(plain, device_type="cpu")(a, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = t @ t
        theirs = F.cross_entropy(logits, torch.from_numpy(labels))
    assert logits.dtype == torch.bfloat16
    assert ours.dtype == jnp.float32
    assert theirs.dtype == torch.float32
    assert undecorated.dtype == jnp.bfloat16  # the loss's primitives keep bfloat16 there
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)


# -- a PyTorch AMP loop with a custom_fwd function, ported line by line ---------------------


class _TorchRMSNormalize(torch.autograd.Function):
    """A numerically delicate block PyTorch code keeps in float32 under autocast."""

    seen: ClassVar[list] = []  # (input dtype, autocast enabled) inside each forward

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, h):
        _TorchRMSNormalize.seen.append((h.dtype, torch.is_autocast_enabled("cpu")))
        inverse = torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(h, inverse)
        return h * inverse

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        h, inverse = ctx.saved_tensors
        mean = (grad * h).mean(-1, keepdim=True)
        return inverse * grad - h * inverse**3 * mean


def test_an_amp_loop_with_a_custom_fwd_function_ports_line_by_line():
    import optax
    from flax import nnx

    rng = np.random.default_rng(0)
    data = [
        (rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32))
        for _ in range(12)
    ]
    overflow_steps = {3, 4, 9}
    settings = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)

    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
    params = [*first.parameters(), *second.parameters()]
    initial = [p.detach().numpy().copy() for p in params]
    torch_opt = torch.optim.SGD(params, lr=1e-2)
    torch_scaler = torch.amp.GradScaler("cpu", **settings)
    torch_scales, torch_seen = [], []
    for step, (x, y) in enumerate(data):
        torch_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            hidden = first(torch.from_numpy(x))
            normalized = _TorchRMSNormalize.apply(hidden)
            torch_seen.append((hidden.dtype, normalized.dtype))
            loss = F.mse_loss(second(normalized), torch.from_numpy(y))
        torch_scaler.scale(loss).backward()
        if step in overflow_steps:
            first.weight.grad.fill_(float("inf"))
        torch_scaler.step(torch_opt)
        torch_scaler.update()
        torch_scales.append(torch_scaler.get_scale())

    class Model(nnx.Module):
        def __init__(self):
            self.first = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
            self.second = nnx.Linear(16, 1, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.second(rms_normalize(self.first(x)))

    jax_seen = []

    @jaxscale.custom_fwd(cast_inputs=jnp.float32)
    def rms_normalize(h):
        jax_seen.append((h.dtype, jaxscale.is_autocast_enabled("cpu")))
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

    model = Model()
    for layer, (w, b) in ((model.first, initial[:2]), (model.second, initial[2:])):
        layer.kernel[...] = jnp.asarray(w.T)
        layer.bias[...] = jnp.asarray(b)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(**settings)

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def train_step(model, optimizer, scaler, x, y, overflow):
        autocast_loss = jaxscale.autocast(loss_fn, device_type="cpu", dtype=jnp.float16)
        grads = nnx.grad(lambda m: scaler.scale(autocast_loss(m, x, y)))(model)
        grads = jax.tree.map(lambda g: jnp.where(overflow, jnp.inf, g), grads)
        scaler.step(optimizer, model, grads)
        scaler.update()

    jax_scales = []
    with third_party.standard_promotion():
        for step, (x, y) in enumerate(data):
            train_step(model, optimizer, scaler, x, y, step in overflow_steps)
            jax_scales.append(scaler.get_scale())

    assert jax_scales == torch_scales
    assert torch_seen[0] == (torch.float16, torch.float32)  # the block's output is float32
    # inside the block: float32 inputs and autocast off, in both
    assert set(_TorchRMSNormalize.seen) == {(torch.float32, False)}
    assert set(jax_seen) == {(np.dtype(jnp.float32), False)}
    np.testing.assert_allclose(
        np.asarray(model.first.kernel[...]), first.weight.detach().numpy().T, atol=2e-3
    )
    np.testing.assert_allclose(
        np.asarray(model.second.kernel[...]), second.weight.detach().numpy().T, atol=2e-3
    )
