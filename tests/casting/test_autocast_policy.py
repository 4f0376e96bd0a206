"""jaxscale.autocast gives each op the dtype PyTorch's CUDA autocast documents for it.

PyTorch's AMP docs list "CUDA ops that can autocast to float16", "... to float32"
and "... that promote to the widest input type"; every other op runs in its
inputs' type. For every op of those lists that JAX has, the output dtype under
``jaxscale.autocast`` is checked against the documented one.

Inputs are float32, as parameters and data are. The float32 and promote rows
take the output of a matmul (``x @ I``, float16 under autocast), as activations
reach them in a model, so each row shows the cast that autocast makes.
"""

from __future__ import annotations

import inspect
import re

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from support import decompositions, third_party
from support.model_training import equations

import jaxscale
from jaxscale.casting import AS_TRACED, CPU_POLICY, POLICY, UNSUPPORTED_HIGHER_ORDER, Precision
from jaxscale.casting._policy import VERSION_SPECIFIC

F16, BF16, F32, F64 = jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64
RNG = np.random.default_rng(0)


def arr(*shape, dtype=F32, low=0.1, high=0.9):
    return jnp.asarray(RNG.uniform(low, high, shape), dtype)


A, B = arr(4, 4), arr(4, 4)
_OTHER = np.random.default_rng(1)


def other(*shape):  # inputs drawn apart, so that adding rows leaves the others' draws alone
    return jnp.asarray(_OTHER.uniform(0.1, 0.9, shape), F32)


EYE = jnp.eye(4)


H = arr(4, 4)  # an activation: rows using it receive it through a matmul


def on_activations(fn, inputs):
    """``fn`` with each ``H`` among ``inputs`` reaching it through a matmul (float16)."""
    positions = {i for i, x in enumerate(inputs) if x is H}
    return lambda *xs: fn(*(x @ EYE if i in positions else x for i, x in enumerate(xs)))


IMAGE, KERNEL = arr(1, 3, 8, 8), arr(2, 3, 3, 3)

# (PyTorch op, function, inputs, dtype PyTorch's CUDA autocast gives)
LOWER_PRECISION = [
    ("matmul / @ / mm", lambda a, b: a @ b, (A, B), F16),
    ("bmm", lambda a, b: jnp.matmul(a, b), (arr(2, 4, 4), arr(2, 4, 4)), F16),
    ("mv", lambda a, b: a @ b, (A, arr(4)), F16),
    ("einsum", lambda a, b: jnp.einsum("ij,jk->ik", a, b), (A, B), F16),
    ("addmm", lambda c, a, b: c + a @ b, (arr(4), A, B), F16),
    ("baddbmm", lambda c, a, b: c + jnp.matmul(a, b), (arr(4), arr(2, 4, 4), arr(2, 4, 4)), F16),
    ("addmv", lambda c, a, b: c + a @ b, (arr(1), A, arr(4)), F16),
    ("conv2d", lambda x, k: lax.conv(x, k, (1, 1), "SAME"), (IMAGE, KERNEL), F16),
    ("conv_transpose2d", lambda x, k: lax.conv_transpose(x, k, (1, 1), "SAME",
        dimension_numbers=("NCHW", "IOHW", "NCHW")), (IMAGE, arr(3, 2, 3, 3)), F16),
    ("linear (nnx.Linear with bias)", lambda x: nnx.Linear(4, 3, rngs=nnx.Rngs(0))(x), (A,), F16),
    ("conv (nnx.Conv with bias)",
     lambda x: nnx.Conv(3, 2, (3, 3), rngs=nnx.Rngs(0))(x), (arr(1, 8, 8, 3),), F16),
    ("nnx.Einsum with bias",
     lambda x: nnx.Einsum("ab,bc->ac", (4, 3), (3,), rngs=nnx.Rngs(0))(x), (A,), F16),
    # the bias still belongs to the matmul when its output is permuted or reshaped first
    ("linear, transposed before its bias", lambda x, w, b: (x @ w).T + b[:, None],
     (A, B, arr(4)), F16),
    ("linear, reshaped before its bias", lambda x, w, b: (x @ w).reshape(2, 8) + b,
     (A, B, arr(8)), F16),
    ("einsum to a permuted layout, then its bias",
     lambda x, w, b: jnp.einsum("bij,jk->kbi", x, w) + b[:, None, None],
     (arr(2, 3, 4), B, arr(4)), F16),
    ("linear vmapped over examples (weight @ x + bias)",
     jax.vmap(lambda x, w, b: w @ x + b, in_axes=(0, None, None)), (A, B, other(4)), F16),
    ("linear, its bias broadcast in two steps (over positions, then the batch)",
     lambda x, w, b: x @ w + jnp.broadcast_to(b, (4, 4)), (other(2, 4, 4), B, other(4)), F16),
    # an addend varying along both operands' axes, or the batch's, is not a bias: `+`
    # promotes the matmul's float16 output to the addend's float32
    ("matmul + an attention bias over query and key positions",
     lambda q, k, bias: jnp.einsum("bqd,bkd->bqk", q, k) + bias[None],
     (other(2, 4, 8), other(2, 4, 8), A), F32),
    ("matmul + a relative position bias per head",
     lambda q, k, bias: jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias,
     (other(2, 4, 3, 8), other(2, 4, 3, 8), other(1, 3, 4, 4)), F32),
    ("matmul + a per-example mask", lambda q, k, mask: q @ jnp.swapaxes(k, 1, 2) + mask,
     (other(2, 4, 8), other(2, 4, 8), other(2, 1, 4)), F32),
]  # fmt: skip

FLOAT32 = [
    ("exp", jnp.exp, (H,), F32),
    ("expm1", jnp.expm1, (H,), F32),
    ("log", jnp.log, (H,), F32),
    ("log10", jnp.log10, (H,), F32),
    ("log2", jnp.log2, (H,), F32),
    ("log1p", jnp.log1p, (H,), F32),
    ("pow (tensor exponent)", jnp.power, (H, H), F32),
    ("__pow__ (float exponent)", lambda x: x**2.5, (H,), F32),
    ("__pow__ (integer exponent)", lambda x: x**3, (H,), F32),
    ("__rpow__", lambda x: 2.0**x, (H,), F32),
    ("__rdiv__ / __rtruediv__", lambda x: 1.0 / x, (H,), F32),
    ("reciprocal", jnp.reciprocal, (H,), F32),
    ("rsqrt", lax.rsqrt, (H,), F32),
    ("sum", jnp.sum, (H,), F32),
    ("prod", jnp.prod, (H,), F32),
    ("cumsum", lambda x: jnp.cumsum(x, axis=0), (H,), F32),
    ("cumprod", lambda x: jnp.cumprod(x, axis=0), (H,), F32),
    ("erfinv", lambda x: jax.scipy.special.erfinv(x), (H,), F32),
    ("tan", jnp.tan, (H,), F32),
    ("sinh", jnp.sinh, (H,), F32),
    ("cosh", jnp.cosh, (H,), F32),
    ("asin", jnp.arcsin, (H,), F32),
    ("acos", jnp.arccos, (H,), F32),
    ("softmax", jax.nn.softmax, (H,), F32),
    ("log_softmax", jax.nn.log_softmax, (H,), F32),
    ("softmin", lambda x: jax.nn.softmax(-x), (H,), F32),
    ("softplus", jax.nn.softplus, (H,), F32),
    ("layer_norm", lambda x: nnx.LayerNorm(4, rngs=nnx.Rngs(0))(x), (H,), F32),
    ("group_norm", lambda x: nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0))(x), (H,), F32),
    ("norm", jnp.linalg.norm, (H,), F32),
    ("normalize", lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True), (H,), F32),
    ("cross_entropy", lambda x: optax.softmax_cross_entropy_with_integer_labels(
        x, jnp.arange(4)).mean(), (H,), F32),
    ("nll_loss", lambda x: -jnp.mean(jax.nn.log_softmax(x)[jnp.arange(4), jnp.arange(4)]),
     (H,), F32),
    ("mse_loss", lambda x, y: jnp.mean((x - y) ** 2), (H, H), F32),
    ("l1_loss", lambda x, y: jnp.mean(jnp.abs(x - y)), (H, H), F32),
    ("smooth_l1_loss", lambda x, y: jnp.mean(optax.huber_loss(x, y)), (H, H), F32),
    ("kl_div", lambda x, y: jnp.sum(optax.kl_divergence(jax.nn.log_softmax(x), y)), (H, H), F32),
    ("binary_cross_entropy_with_logits",
     lambda x, y: jnp.mean(optax.sigmoid_binary_cross_entropy(x, y)), (H, H), F32),
    ("cosine_similarity", lambda x, y: optax.cosine_similarity(x, y), (H, H), F32),
    ("cdist", lambda x, y: jnp.sqrt(jnp.sum((x[:, None] - y[None]) ** 2, -1)), (H, H), F32),
    ("logsumexp", jax.scipy.special.logsumexp, (H,), F32),
]  # fmt: skip

WIDEST = [
    ("add (float16 + float32)", lambda x, y: x + y * 1.0, (H, A), F32),
    ("addcmul", lambda c, a, b: c + 0.5 * a * b, (H, A, H), F32),
    ("addcdiv", lambda c, a, b: c + 0.5 * a / b, (H, A, H), F32),
    ("atan2", jnp.arctan2, (H, A), F32),
    ("cross", lambda a, b: jnp.cross(a[:, :3], b[:, :3]), (H, A), F32),
    ("index_put / scatter_add", lambda a, b: a.at[0].add(b[0]), (A, H), F32),
    ("cat", lambda a, b: jnp.concatenate([a, b]), (H, A), F32),
    ("where", lambda a, b: jnp.where(a > 0.5, a, b), (H, A), F32),
    ("float16 alone stays float16 (relu)", jax.nn.relu, (H,), F16),
    ("float16 alone stays float16 (tanh)", jnp.tanh, (H,), F16),
    ("float16 alone stays float16 (sigmoid)", jax.nn.sigmoid, (H,), F16),
    ("float16 * Python scalar stays float16", lambda x: x * 3.0 - 1.0, (H,), F16),
    ("float16 + 0-d float32 stays float16", lambda x, s: x * s, (H, jnp.float32(2.0)), F16),
    ("masked_fill with -1e4", lambda x: jnp.where(x > 0.5, x, -1e4), (H,), F16),
    ("max / argmax keep dtypes", lambda x: (jnp.max(x), jnp.argmax(x)), (H,), F16),
]  # fmt: skip


def _dtype_of(output):
    leaves = jax.tree.leaves(output)
    return leaves[0].dtype


CASES = [(*row, False) for row in LOWER_PRECISION] + [(*row, True) for row in FLOAT32 + WIDEST]


@pytest.mark.parametrize(
    ("op", "fn", "inputs", "expected", "activations"), CASES, ids=[row[0] for row in CASES]
)
def test_output_dtype_is_pytorchs_cuda_autocast_dtype(op, fn, inputs, expected, activations):
    if activations:
        fn = on_activations(fn, inputs)
    with third_party.standard_promotion():  # user code: JAX's default promotion
        out = jax.jit(jaxscale.autocast(fn))(*inputs)
        plain = jax.jit(fn)(*inputs)
    assert _dtype_of(out) == expected, op
    # and the value is the function's own, to float16 accuracy
    reference = np.asarray(_dtype_of_leaf(plain), np.float64)
    got = np.asarray(_dtype_of_leaf(out), np.float64)
    np.testing.assert_allclose(got, reference, rtol=2e-2, atol=2e-2, err_msg=op)


BIG = arr(4, 16, low=300.0, high=1000.0)  # fits float16; its squares (up to 1e6) do not
BIG_CASES = {
    "nnx.LayerNorm": lambda x: nnx.LayerNorm(16, rngs=nnx.Rngs(0))(x),
    "nnx.LayerNorm (fast variance off)": lambda x: nnx.LayerNorm(
        16, use_fast_variance=False, rngs=nnx.Rngs(0)
    )(x),
    "nnx.GroupNorm": lambda x: nnx.GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0))(x),
    "nnx.RMSNorm": lambda x: nnx.RMSNorm(16, rngs=nnx.Rngs(0))(x),
    "linen LayerNorm": lambda x: flax.linen.LayerNorm().apply({"params": {
        "scale": jnp.ones(16), "bias": jnp.zeros(16)}}, x),
    "l2 normalize": lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True),
    "softmax of large logits": jax.nn.softmax,
    "cross entropy of large logits": lambda x: optax.softmax_cross_entropy_with_integer_labels(
        x, jnp.arange(4)).mean(),
    "mse of large errors": lambda x: jnp.mean((x - 1.0) ** 2),
    "sum past float16's range": jnp.sum,
    "variance": jnp.var,
}  # fmt: skip


@pytest.mark.parametrize("name", list(BIG_CASES))
def test_float32_ops_hold_activations_whose_squares_overflow_float16(name):
    # Norms square their input (lax.square, integer_pow): under float16 autocast an
    # activation of 300 squares to 9e4 > 65504, so those ops must run in float32
    def fn(x):
        return BIG_CASES[name](x @ jnp.eye(16))  # the activation comes out of a matmul

    assert jax.eval_shape(jaxscale.autocast(lambda x: x @ jnp.eye(16)), BIG).dtype == F16
    with third_party.standard_promotion():  # compiled: XLA's CPU keeps every float16 rounding
        out = np.asarray(jax.jit(jaxscale.autocast(fn))(BIG), np.float64)
        plain = np.asarray(jax.jit(fn)(BIG), np.float64)
    assert np.all(np.isfinite(out)), name
    np.testing.assert_allclose(out, plain, rtol=2e-2, atol=2e-2, err_msg=name)


def test_a_float16_input_keeps_the_casts_jax_wrote_for_it():
    # jnp.sum of a float16 array accumulates in float32 and casts back to float16:
    # that cast is in the traced program, and autocast keeps casts as written
    # (PyTorch's torch.sum of a float16 tensor under autocast returns float32)
    assert jaxscale.autocast(jnp.sum)(jnp.ones(4, F16)).dtype == F16


def _dtype_of_leaf(output):
    return jax.tree.leaves(output)[0].astype(F32)


def test_bfloat16_autocast_puts_matmuls_in_bfloat16_and_keeps_float32_ops():
    fn = jaxscale.autocast(lambda a, b: (a @ b, jnp.exp(a @ b), jnp.sum(a @ b)), dtype=BF16)
    mm, ex, total = fn(A, B)
    assert (mm.dtype, ex.dtype, total.dtype) == (BF16, F32, F32)


def test_float64_is_left_alone_as_pytorch_does():
    with jax.enable_x64(True):
        a = jnp.ones((2, 2), F64)
        mm, ex = jaxscale.autocast(lambda a: (a @ a, jnp.exp(a)))(a)
    assert (mm.dtype, ex.dtype) == (F64, F64)


def _dot_f32_result(x, w):  # half-precision operands, a float32 result asked for
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def _dot_general_of(fn, *args):
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "dot_general"]
    return [v.aval.dtype for v in eqn.invars], eqn.params["preferred_element_type"]


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("operands", [F16, BF16])
def test_a_float32_result_asked_of_half_precision_operands_stays_float32(operands, dtype):
    # A float32 result of float16 or bfloat16 operands is written on purpose (JAX's own
    # dot_product_attention asks for its logits so): autocast lowers the operands to
    # its dtype and keeps the result the function asked for
    x, w = A.astype(operands), B.astype(operands)
    fn = jaxscale.autocast(_dot_f32_result, dtype=dtype)
    assert _dot_general_of(fn, x, w) == ([dtype, dtype], F32)
    expected = _dot_f32_result(x.astype(dtype), w.astype(dtype))
    np.testing.assert_array_equal(fn(x, w), expected)
    einsum = jaxscale.autocast(
        lambda x, w: jnp.einsum("ij,jk->ik", x, w, preferred_element_type=F32), dtype=dtype
    )
    assert einsum(x, w).dtype == F32
    grads = jax.grad(lambda x, w: fn(x, w).sum(), argnums=(0, 1))(x, w)
    assert [g.dtype for g in grads] == [operands, operands]


def test_a_result_as_wide_as_an_operand_is_the_autocast_dtype_as_in_pytorch():
    # jnp.matmul of float32 operands asks for float32, and of a float16 and a float32
    # operand too: the operands' own width, which autocast lowers as PyTorch's matmul
    assert _dot_general_of(jaxscale.autocast(_dot_f32_result), A, B) == ([F16, F16], F16)
    mixed = jaxscale.autocast(_dot_f32_result)
    assert _dot_general_of(mixed, A.astype(F16), B) == ([F16, F16], F16)
    with third_party.standard_promotion():  # as user code written for it promotes
        assert jaxscale.autocast(jnp.matmul)(A.astype(F16), B).dtype == F16


@pytest.mark.parametrize("integers", [jnp.int8, jnp.int32])
def test_an_integer_operand_does_not_count_in_how_wide_a_result_is_asked(integers):
    # A weight-only quantized matmul: integer weights against float16 activations, a
    # float32 result asked for. Only the floating operand sets the width the result is
    # compared with; an int32 operand, as wide as float32, must not make the asked
    # float32 look like the operands' own width
    q = (B * 8).astype(integers)
    fn = jaxscale.autocast(_dot_f32_result)
    assert _dot_general_of(fn, A.astype(F16), q) == ([F16, integers], F32)
    np.testing.assert_array_equal(fn(A.astype(F16), q), _dot_f32_result(A.astype(F16), q))
    # float32 activations are lowered and the result with them, as for two float operands
    assert _dot_general_of(fn, A, q) == ([F16, integers], F16)


def test_integers_booleans_and_keys_are_never_touched():
    def fn(x, ids, mask, key):
        noise = jax.random.normal(key, x.shape)
        return x @ x + noise, ids * 2, mask & True, jnp.take(x, ids, axis=0), key

    key = jax.random.key(0)
    out = jaxscale.autocast(fn)(A, jnp.arange(4), jnp.ones(4, bool), key)
    assert [o.dtype for o in out[1:3]] == [jnp.int32, jnp.bool_]
    assert out[0].dtype == F32  # a float32 array (noise) widens the float16 product
    assert out[3].dtype == F32  # gather: the table's own dtype, as PyTorch's embedding
    assert jax.random.key_data(out[4]).tolist() == jax.random.key_data(key).tolist()


def test_the_table_names_a_pytorch_op_for_every_row_and_covers_the_lists():
    assert {name for name, row in POLICY.items() if row.precision is Precision.LOWER} == {
        "dot_general",
        "conv_general_dilated",
    }
    float32 = {name for name, row in POLICY.items() if row.precision is Precision.FLOAT32}
    assert {
        "exp",
        "log",
        "log1p",
        "expm1",
        "pow",
        "integer_pow",
        "rsqrt",
        "reduce_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "erf_inv",
        "tan",
        "sinh",
        "cosh",
        "asin",
        "acos",
    } <= float32
    assert all(row.torch_ops for row in POLICY.values())


def test_the_cpu_table_moves_what_pytorchs_cpu_lists_move_and_keeps_the_rest():
    lower = {name for name, row in CPU_POLICY.items() if row.precision is Precision.LOWER}
    assert lower == {"dot_general", "conv_general_dilated"}
    float32 = {name for name, row in CPU_POLICY.items() if row.precision is Precision.FLOAT32}
    assert float32 == {
        "reduce_prod", "fft", "cholesky", "eig", "eigh", "lu", "geqrf", "householder_product",
        "ormqr", "qr", "svd", "triangular_solve",
    }  # fmt: skip
    changed = {name for name in POLICY if CPU_POLICY[name].precision != POLICY[name].precision}
    assert changed == {
        "exp", "exp2", "expm1", "log", "log2", "log1p", "pow", "integer_pow", "square", "rsqrt",
        "reduce_sum", "cumsum", "cumprod", "cumlogsumexp", "erf_inv", "tan", "sinh", "cosh",
        "asin", "acos", "div", "asinpi", "acospi", "tanpi", "exp2m1", "log2p1",
    }  # fmt: skip
    assert all(row.torch_ops for row in CPU_POLICY.values())
    assert set(CPU_POLICY) - set(POLICY) <= set(AS_TRACED)  # linear algebra and fft


def _cholesky_inputs(closed):
    return [
        eqn.invars[0].aval.dtype for eqn in closed.jaxpr.eqns if eqn.primitive.name == "cholesky"
    ]


def test_the_cpu_policy_decomposes_a_narrowed_value_in_float32():
    # under torch.autocast("cpu") a bfloat16 matmul's output reaches cholesky in float32;
    # the matmul comes last, so that nothing float32 widens its output on the way. The
    # value was float32 when traced, so running cholesky as traced would give float32
    # too: the CPU list's row shows only on a bfloat16 input (the test below)
    b = jnp.asarray(RNG.uniform(0.5, 1.5, (8, 8)) / 4, F32) + jnp.eye(8)
    fn = jaxscale.autocast(lambda b: jnp.linalg.cholesky(b @ b.T), device_type="cpu")
    with third_party.standard_promotion():
        got = fn(b)
        closed = jax.make_jaxpr(fn)(b)
    assert got.dtype == F32
    assert _cholesky_inputs(closed) == [F32]
    product = (b.astype(BF16) @ b.T.astype(BF16)).astype(F32)
    np.testing.assert_allclose(got, jnp.linalg.cholesky(product), rtol=1e-2, atol=1e-2)


def test_a_bfloat16_input_to_a_decomposition_is_float32_or_refused_as_jax_refuses_it():
    # JAX 0.11 and later refuse bfloat16 input to a decomposition while tracing; autocast
    # traces the function as written, so the refusal is JAX's own, with it or without.
    # Where JAX traces it, the CPU policy casts it to float32 as PyTorch's CPU list does.
    a = jnp.asarray(RNG.uniform(0.5, 1.5, (8, 8)) / 4, BF16)
    fn = jaxscale.autocast(lambda a: jnp.linalg.cholesky(decompositions.spd(a)), device_type="cpu")
    if decompositions.jax_traces_bfloat16():
        with third_party.standard_promotion():
            assert fn(a).dtype == F32
            assert _cholesky_inputs(jax.make_jaxpr(fn)(a)) == [F32]
        return
    refusal = "cholesky does not accept dtype bfloat16"
    with pytest.raises(TypeError, match=refusal):
        jnp.linalg.cholesky(decompositions.spd(a))
    with pytest.raises(TypeError, match=refusal):
        fn(a)


def test_an_unlisted_primitive_runs_exactly_as_traced():
    # bitcast_convert_type is in no row: its input returns to the traced float32
    fn = jaxscale.autocast(lambda a: lax.bitcast_convert_type(jnp.tanh(a @ a), jnp.int32))
    assert fn(A).dtype == jnp.int32
    assert fn(A).shape == (4, 4)


PERMUTED = jnp.asarray([5, 3, 1, 0, 2, 6])
SCATTERS_INTO_NEW_ARRAYS = {
    "segment_sum": lambda h, i: jax.ops.segment_sum(h, i, num_segments=3),
    "zeros.at[i].add": lambda h, i: jnp.zeros((3, 4), h.dtype).at[i].add(h),
    "segment_max": lambda h, i: jax.ops.segment_max(h, i, num_segments=3),
    "zeros.at[p].set": lambda h, _: jnp.zeros((7, 4), h.dtype).at[PERMUTED].set(h),
}


@pytest.mark.parametrize("scatter", SCATTERS_INTO_NEW_ARRAYS.values(), ids=SCATTERS_INTO_NEW_ARRAYS)
def test_a_scatter_into_a_new_array_runs_as_traced_in_float32(scatter):
    # Scatters run as traced: a message-passing sum (segment_sum of a layer's float16
    # output) accumulates its float16 values in float32 and returns float32, where
    # PyTorch's index_add_ into torch.zeros(..., dtype=h.dtype) stays float16. The
    # README's "Where jaxscale differs" has the row.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 4)), F32)
    w = jnp.asarray(rng.normal(size=(4, 4)), F32)
    index = jnp.asarray([0, 2, 2, 1, 0, 2])
    got = jaxscale.autocast(lambda x, w: scatter(x @ w, index))(x, w)
    half_product = (x.astype(F16) @ w.astype(F16)).astype(F32)
    assert got.dtype == F32
    # (a GPU's scatter-add may sum in another order: float32's accuracy, not its bits)
    np.testing.assert_allclose(got, scatter(half_product, index), rtol=1e-6)


def _side_by_side():
    cases = {
        "optimization_barrier": lambda h, w: lax.optimization_barrier((h, w)),
        "sort carrying values": lambda h, w: lax.sort((h, w), num_keys=1),
        "device_put": lambda h, w: jax.device_put((h, w)),
    }
    try:  # JAX 0.10 to 0.11.1
        from jax.experimental.shard_alike import shard_alike
    except ImportError:
        return cases
    return {**cases, "shard_alike": shard_alike}


@pytest.mark.parametrize("together", _side_by_side().values(), ids=_side_by_side())
def test_values_passed_side_by_side_keep_their_own_dtypes(together):
    # a float16 activation held at a barrier beside float32 weights (or moved, or sorted
    # with them) is not promoted: no arithmetic joins the two
    h, w = jaxscale.autocast(lambda x, w: together(x @ w, w))(A, B)
    assert (h.dtype, w.dtype) == (F16, F32)
    expected_h, expected_w = together(A.astype(F16) @ B.astype(F16), B)
    np.testing.assert_array_equal(h, expected_h)
    np.testing.assert_array_equal(w, expected_w)


def test_an_fft_of_a_float16_activation_runs_in_float32():
    # JAX has no half-precision complex type: the FFT of a layer's float16 output runs as
    # traced, on the float32 of the rounded product (PyTorch's CUDA kernels would give
    # complex32). The README's "Where jaxscale differs" has the row.
    got = jaxscale.autocast(lambda x, w: jnp.fft.rfft(x @ w))(A, B)
    assert got.dtype == jnp.complex64
    rounded = (A.astype(F16) @ B.astype(F16)).astype(F32)
    np.testing.assert_allclose(got, jnp.fft.rfft(rounded), rtol=1e-6, atol=1e-6)


def test_an_array_moved_beside_a_scalar_still_promotes_as_an_array():
    # jax.device_put of (a 0-d value, a residual): the residual is not taken for a
    # scalar, so adding it to a float16 product promotes to float32, as PyTorch's + does
    def fn(x, w, residual):
        _, residual = jax.device_put((jnp.float32(2.0), residual))
        return x @ w + residual

    assert jaxscale.autocast(fn)(A, B, H).dtype == F32
    assert jaxscale.autocast(lambda x, w, r: x @ w + jax.device_put(r))(A, B, H).dtype == F32


SPARSE_MATMULS = ("bcoo_dot_general", "bcsr_dot_general")


def _sparse_formats():
    from jax.experimental import sparse

    return {"BCOO": sparse.BCOO.fromdense, "BCSR": sparse.BCSR.fromdense}


@pytest.mark.parametrize("to_sparse", _sparse_formats().values(), ids=_sparse_formats())
def test_a_sparse_matmul_runs_in_the_dtype_it_was_written_in(to_sparse):
    # a graph convolution's adjacency @ (x @ w): the dense matmul is float16, the sparse
    # one float32, as written (JAX's sparse kernels take float32; PyTorch's autocast runs
    # torch.sparse.mm in float16). The README's "Where jaxscale differs" has the row.
    adjacency = to_sparse(jnp.asarray(np.random.default_rng(2).random((4, 4)) < 0.5, F32))
    fn = jaxscale.autocast(lambda x, w: adjacency @ (x @ w))
    got = fn(A, B)
    assert got.dtype == F32
    expected = adjacency @ (A.astype(F16) @ B.astype(F16)).astype(F32)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    jaxpr = jax.make_jaxpr(fn)(A, B)
    [product] = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in SPARSE_MATMULS]
    floating = [v.aval.dtype for v in product.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]
    assert floating == [F32, F32]  # the sparse values and the dense operand
    grad = jax.grad(lambda w: jnp.sum(fn(A, w)))(B)
    np.testing.assert_allclose(grad, jax.grad(lambda w: jnp.sum(adjacency @ (A @ w)))(B), rtol=1e-2)


def _on_host_block(x, w):
    from jaxscale._src.jaxprs import compute_on_function

    on_host = compute_on_function()(
        lambda x: jnp.tanh(x @ w),
        compute_type="device_host",
        out_memory_spaces=jax.memory.Space.Device,
    )
    return on_host(x) @ w


def test_a_compute_on_call_stays_one_with_autocast_inside():
    # host offloading: the call keeps its compute type and output memory spaces, with
    # the autocast dtype inside it
    fn = jaxscale.autocast(_on_host_block)
    [outer] = [e for e in jax.make_jaxpr(fn)(A, B).eqns if e.primitive.name == "compute_on"]
    [plain] = [
        e for e in jax.make_jaxpr(_on_host_block)(A, B).eqns if e.primitive.name == "compute_on"
    ]
    for param in ("compute_type", "out_memory_spaces", "compiler_options_json"):
        assert outer.params.get(param) == plain.params.get(param)  # options from JAX 0.10.1
    inner = [e for e in equations(outer.params["jaxpr"]) if e.primitive.name == "dot_general"]
    assert [str(e.outvars[0].aval.dtype) for e in inner] == ["float16"]
    assert jax.eval_shape(fn, A, B).dtype == F16


def _compute_on_exported():
    from jax.experimental import compute_on as module

    return hasattr(module, "compute_on2") or (
        "out_memory_spaces" in inspect.signature(module.compute_on).parameters
    )


@pytest.mark.skipif(
    not _compute_on_exported(),
    reason="JAX 0.10.0 does not export compute_on's function form, and cannot lower it here",
)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_compute_on_call_runs_on_the_host_in_the_autocast_dtype(mode):
    fn = jaxscale.autocast(_on_host_block)
    got = (jax.jit(fn) if mode == "jit" else fn)(A, B)
    assert got.dtype == F16
    np.testing.assert_allclose(np.asarray(got, F32), _on_host_block(A, B), rtol=1e-2, atol=1e-2)
    hlo = jax.jit(fn).lower(A, B).as_text()
    assert re.search(r"stablehlo\.dot_general.*_xla_compute_type = \"host\".*tensor<4x4xf16>", hlo)
    grad = jax.grad(lambda w: jnp.sum(fn(A, w).astype(F32)))(B)
    expected = jax.grad(lambda w: jnp.sum(_on_host_block(A, w)))(B)
    np.testing.assert_allclose(grad, expected, rtol=2e-2, atol=2e-2)


def test_a_fused_kernel_stays_one_with_autocast_inside():
    # jax.experimental.fused: one GPU kernel (lowered for CUDA only), here as traced and
    # as lowered for a GPU
    from jax.experimental.fused import fused

    def block(x, w):
        # (its operands in one memory space: passed in, not closed over)
        kernel = fused(out_spaces=(jax.memory.Space.Device,))(lambda x, w: jnp.tanh(x @ w))
        return kernel(x, w) @ w

    fn = jaxscale.autocast(block)
    [outer] = [e for e in jax.make_jaxpr(fn)(A, B).jaxpr.eqns if e.primitive.name == "fused_call"]
    assert outer.params["out_spaces"] == (jax.memory.Space.Device,)
    inner = [e for e in equations(outer.params["jaxpr"]) if e.primitive.name == "dot_general"]
    assert [str(e.outvars[0].aval.dtype) for e in inner] == ["float16"]
    assert jax.eval_shape(fn, A, B).dtype == F16
    report = jaxscale.lowering_report(fn, A, B, platform="cuda")
    assert report.matmul_dtypes == {"f16 x f16 -> f16": 2}


# -- every primitive of the running JAX has a decision -------------------------------------------

_LIST_PRIMITIVES = """
import sys
import jax, jax.numpy, jax.nn, jax.scipy.special, jax.scipy.linalg, jax.random, jax.lax
import jax.experimental, jax.ad_checkpoint, jax.custom_derivatives, jax.experimental.shard_map
from jax._src import core


def primitive_names():
    names = set()
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("jax"):
            for value in list(vars(module).values()):
                if isinstance(value, core.Primitive):
                    names.add(value.name)
    return names


names = primitive_names()
# From Pallas only its kernel launch: the operations a kernel is written in (dozens, and
# different in each release) run inside pallas_call, where autocast never reaches
import jax.experimental.pallas
names |= primitive_names() & {"pallas_call"}
# XLA metadata (set_xla_metadata on a value; xla_metadata_call from JAX 0.11)
import jax.experimental.xla_metadata
names |= primitive_names() & {"xla_metadata_value", "xla_metadata_call"}
# Every experimental module a user may import that defines primitives of its own (not
# thunky, from JAX 0.12, whose primitives make up GPU runtime programs, not traced
# functions); each module only where the running JAX has it
import importlib
loaded = primitive_names()
for module in ("sparse", "rnn", "compute_on", "fused", "shard_alike", "buffer_callback",
               "multihost_utils", "overlap"):
    try:
        importlib.import_module("jax.experimental." + module)
    except ImportError:
        continue
names |= primitive_names() - loaded
print(" ".join(sorted(names)))
"""


@pytest.fixture(scope="module")
def running_jax_primitives():
    import subprocess
    import sys

    # a fresh interpreter with a fixed set of imports: what is loaded here depends on
    # which tests this worker ran before
    result = subprocess.run(
        [sys.executable, "-c", _LIST_PRIMITIVES], capture_output=True, text=True, check=True
    )
    names = set(result.stdout.split())
    assert len(names) > 200
    return names


def _decided():
    from jaxscale.casting._interpreter import _OPAQUE_WITH_JAXPR, HIGHER_ORDER

    return {
        "policy row": set(POLICY),
        "CPU policy row": set(CPU_POLICY),
        "higher-order rule": set(HIGHER_ORDER),
        "first-order with its own update jaxpr": set(_OPAQUE_WITH_JAXPR),
        "as traced on purpose": set(AS_TRACED),
        "refused higher-order": set(UNSUPPORTED_HIGHER_ORDER),
    }


def test_every_primitive_of_the_running_jax_has_a_decision(running_jax_primitives):
    decided = set().union(*_decided().values())
    assert running_jax_primitives - decided == set()


def test_every_primitive_name_jaxscale_lists_exists_in_the_running_jax(running_jax_primitives):
    from jaxscale.casting._state_writes import STATE_WRITE

    own = {STATE_WRITE.name}  # jaxscale's mark for a module's variable writes
    for where, names in _decided().items():
        missing = names - running_jax_primitives - set(VERSION_SPECIFIC) - own
        assert missing == set(), where


def test_every_primitive_name_the_interpreter_singles_out_exists_in_the_running_jax(
    running_jax_primitives,
):
    from jaxscale.casting import _axes
    from jaxscale.casting import _interpreter as interpreter

    for where, names in {
        "views": interpreter._VIEWS,
        "each operand on its own": interpreter._EACH_OPERAND_ON_ITS_OWN,
        "broadcasting elementwise": interpreter._BROADCASTING_ELEMENTWISE,
        "accumulating in float32": interpreter._ACCUMULATES_IN_FLOAT32,
        "divided before rounding": interpreter._DIVIDED_BEFORE_ROUNDING,
        "axis labels": _axes.LABELLED,
    }.items():
        assert set(names) - running_jax_primitives - set(VERSION_SPECIFIC) == set(), where


def test_no_primitive_is_decided_twice():
    # (the CPU table is the CUDA table with rows changed: a second view of the same names)
    groups = [names for where, names in _decided().items() if where != "CPU policy row"]
    for i, first in enumerate(groups):
        for second in groups[i + 1 :]:
            assert not first & second, first & second


def test_checkpoint_name_keeps_the_autocast_dtype():
    from jax.ad_checkpoint import checkpoint_name

    fn = jaxscale.autocast(lambda a: checkpoint_name(a @ a, "h") + 1.0)
    jaxpr = jax.make_jaxpr(fn)(A)
    named = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "name"]
    assert [str(e.outvars[0].aval.dtype) for e in named] == ["float16"]
    assert fn(A).dtype == F16


def test_linalg_solve_runs_in_the_dtype_it_was_written_in():
    def solve(a, b):
        return jnp.linalg.solve(a @ a.T + 4 * jnp.eye(4, dtype=a.dtype), b)

    with third_party.standard_promotion():
        got = jaxscale.autocast(solve)(A, B)
        expected = solve(A, B)
    assert got.dtype == F32
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)


def _scaled_sum_kernel(x_ref, y_ref, out_ref):
    # a Pallas kernel written for float32 buffers: 2x + y
    out_ref[...] = x_ref[...] * 2.0 + y_ref[...]


def scaled_sum(x, y):
    """The kernel above on the CPU (Pallas' interpreter), differentiable by a custom_vjp,
    as kernels are made differentiable."""
    from jax.experimental import pallas as pl

    def launch(x, y):
        out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(_scaled_sum_kernel, out_shape=out_shape, interpret=True)(x, y)

    differentiable = jax.custom_vjp(launch)
    differentiable.defvjp(lambda x, y: (launch(x, y), None), lambda _, g: (2.0 * g, g))
    return differentiable(x, y)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_pallas_kernel_runs_on_the_dtypes_it_was_written_for(mode):
    def block(w, x):
        h = x @ w  # float16 under autocast
        return scaled_sum(h, jnp.tanh(h)) @ w

    fn = jaxscale.autocast(block)
    fn = jax.jit(fn) if mode == "jit" else fn
    got = fn(A, B)
    assert got.dtype == F16
    np.testing.assert_allclose(np.asarray(got, F32), block(A, B), rtol=1e-2, atol=1e-2)
    # the matmuls in float16; the kernel given float32, as it was traced
    jaxpr = jax.make_jaxpr(jaxscale.autocast(block))(A, B)
    kernels = [e for e in equations(jaxpr) if e.primitive.name == "pallas_call"]
    assert len(kernels) == 1
    assert [str(v.aval.dtype) for v in kernels[0].invars + kernels[0].outvars] == ["float32"] * 3
    dots = [e for e in equations(jaxpr) if e.primitive.name == "dot_general"]
    assert {str(e.outvars[0].aval.dtype) for e in dots} == {"float16"}


def gated(x, y):
    """A sharded operation of one's own (``custom_partitioning``), written for float32
    and made differentiable by a ``custom_vjp``, as such operations are."""
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def launch(x, y):
        return jnp.tanh(x) * y

    def partition(mesh, arg_shapes, result_shape):
        shardings = tuple(arg.sharding for arg in arg_shapes)
        return mesh, lambda x, y: jnp.tanh(x) * y, result_shape.sharding, shardings

    launch.def_partition(
        infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
        partition=partition,
        sharding_rule="i j, i j -> i j",
    )
    differentiable = jax.custom_vjp(launch)
    differentiable.defvjp(
        lambda x, y: (launch(x, y), (x, y)),
        lambda saved, g: (g * saved[1] * (1 - jnp.tanh(saved[0]) ** 2), g * jnp.tanh(saved[0])),
    )
    return differentiable(x, y)


def test_a_custom_partitioning_operation_runs_on_the_dtypes_it_was_written_for():
    def block(w, x):
        h = x @ w  # float16 under autocast
        return gated(h, jnp.cos(h)) @ w

    got = jax.jit(jaxscale.autocast(block))(A, B)
    assert got.dtype == F16
    np.testing.assert_allclose(np.asarray(got, F32), block(A, B), rtol=1e-2, atol=1e-2)
    jaxpr = jax.make_jaxpr(jaxscale.autocast(block))(A, B)
    [operation] = [e for e in equations(jaxpr) if e.primitive.name == "custom_partitioning"]
    assert [str(v.aval.dtype) for v in operation.invars + operation.outvars] == ["float32"] * 3
    dots = [e for e in equations(jaxpr) if e.primitive.name == "dot_general"]
    assert {str(e.outvars[0].aval.dtype) for e in dots} == {"float16"}
    grads = jax.jit(jax.grad(lambda w: jnp.sum(jaxscale.autocast(block)(w, B).astype(F32))))(A)
    expected = jax.grad(lambda w: jnp.sum(block(w, B)))(A)
    assert grads.dtype == F32
    np.testing.assert_allclose(grads, expected, rtol=2e-2, atol=2e-2)


def test_the_gradient_through_a_pallas_kernel_follows_float32():
    def loss(w, x):
        h = x @ w
        return jnp.sum(scaled_sum(h, h) ** 2)

    expected = jax.grad(loss)(A, B)
    got = jax.jit(jax.grad(lambda w, x: jaxscale.autocast(loss)(w, x).astype(F32)))(A, B)
    assert got.dtype == F32
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


def _projected_gelu(x, w, *, approximate, offsets):
    # a composite's decomposition; ``approximate`` and ``offsets`` are its attributes
    return jax.nn.gelu(x @ w + offsets[None, :], approximate=approximate)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_composite_stays_one_with_autocast_inside_its_decomposition(mode):
    composite = lax.composite(_projected_gelu, "my.projected_gelu", version=2)
    offsets = np.linspace(-1.0, 1.0, 4, dtype=np.float32)  # an array attribute

    def block(x, w):
        return composite(x, w, approximate=False, offsets=offsets) @ w

    fn = jaxscale.autocast(block)
    got = (jax.jit(fn) if mode == "jit" else fn)(A, B)
    assert got.dtype == F16
    np.testing.assert_allclose(np.asarray(got, F32), block(A, B), rtol=1e-2, atol=1e-2)
    jaxpr = jax.make_jaxpr(fn)(A, B)
    [outer] = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "composite"]
    assert (outer.params["name"], outer.params["version"]) == ("my.projected_gelu", 2)
    assert outer.params["attributes"] == jax.make_jaxpr(block)(A, B).eqns[0].params["attributes"]
    decomposition = outer.params.get("jaxpr", outer.params.get("call_jaxpr"))  # 0.10 / 0.11+
    inner = [e for e in equations(decomposition) if e.primitive.name == "dot_general"]
    assert [str(e.outvars[0].aval.dtype) for e in inner] == ["float16"]
    hlo = jax.jit(fn).lower(A, B).as_text()
    assert 'stablehlo.composite "my.projected_gelu"' in hlo
    assert "version = 2" in hlo


def test_set_xla_metadata_on_a_value_keeps_it_in_the_autocast_dtype():
    from jax.experimental.xla_metadata import set_xla_metadata

    def block(x, w):
        return jnp.tanh(set_xla_metadata(x @ w, stage="projection"))

    fn = jaxscale.autocast(block)
    assert fn(A, B).dtype == F16
    [tagged] = [
        e for e in jax.make_jaxpr(fn)(A, B).jaxpr.eqns if e.primitive.name == "xla_metadata_value"
    ]
    assert str(tagged.outvars[0].aval.dtype) == "float16"
    hlo = jax.jit(fn).lower(A, B).as_text()
    assert re.search(r"stablehlo\.dot_general.*stage = \"projection\"", hlo)
    np.testing.assert_allclose(np.asarray(fn(A, B), F32), block(A, B), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_an_xla_metadata_call_stays_one_with_autocast_inside(mode):
    import jax.experimental.xla_metadata as xla_metadata

    if not hasattr(xla_metadata, "xla_metadata_call"):  # JAX 0.11 and later
        pytest.skip(f"JAX {jax.__version__} has no xla_metadata_call")

    def block(x, w):
        inner = xla_metadata.xla_metadata_call(lambda x: jnp.tanh(x @ w), stage="mlp", n=2)
        return inner(x) @ w

    fn = jaxscale.autocast(block)
    got = (jax.jit(fn) if mode == "jit" else fn)(A, B)
    assert got.dtype == F16
    np.testing.assert_allclose(np.asarray(got, F32), block(A, B), rtol=1e-2, atol=1e-2)
    [outer] = [
        e for e in jax.make_jaxpr(fn)(A, B).jaxpr.eqns if e.primitive.name == "xla_metadata_call"
    ]
    [plain] = [
        e for e in jax.make_jaxpr(block)(A, B).jaxpr.eqns if e.primitive.name == "xla_metadata_call"
    ]
    assert (
        outer.params["xla_metadata"]
        == plain.params["xla_metadata"]
        == (("n", "2"), ("stage", "mlp"))
    )
    assert outer.params["ad_metadata"] == plain.params["ad_metadata"]
    inner = [e for e in equations(outer.params["jaxpr"]) if e.primitive.name == "dot_general"]
    assert [str(e.outvars[0].aval.dtype) for e in inner] == ["float16"]
    assert 'stage = "mlp"' in jax.jit(fn).lower(A, B).as_text()
    # its gradient, through the metadata's own differentiation rule
    grad = jax.grad(lambda w: jnp.sum(fn(A, w).astype(F32)))(B)
    expected = jax.grad(lambda w: jnp.sum(block(A, w)))(B)
    np.testing.assert_allclose(grad, expected, rtol=2e-2, atol=2e-2)


def test_a_maximum_taken_with_an_initial_minus_infinity_is_subtracted_in_float32():
    # JAX 0.12.1's softmax subtracts jnp.max(x, initial=-inf) without a stop_gradient
    # (its derivative is a rule of its own): that maximum is the stabiliser too, in any
    # version; a maximum alone is not (a user's x - max(x) runs as PyTorch runs it)
    def stabilised(x, initial):
        m = jnp.max(x, axis=-1, keepdims=True, initial=initial)
        return jnp.exp(x - m)

    x = jnp.ones((2, 3), F16)
    for initial, dtype in ((-jnp.inf, "float32"), (None, "float16")):
        fn = jaxscale.autocast(lambda x, initial=initial: stabilised(x, initial))
        jaxpr = jax.make_jaxpr(fn)(x)
        subs = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "sub"]
        assert [str(e.outvars[0].aval.dtype) for e in subs] == [dtype], initial
    # a -inf floor of a value that is no maximum over an axis is no stabiliser either
    clamped = jaxscale.autocast(lambda x: jnp.exp(x - jnp.maximum(x * 2, -jnp.inf)))
    subs = [e for e in equations(jax.make_jaxpr(clamped)(x).jaxpr) if e.primitive.name == "sub"]
    assert [str(e.outvars[0].aval.dtype) for e in subs] == ["float16"]


@pytest.mark.parametrize(
    "fn",
    [jax.nn.softmax, jax.nn.log_softmax, jax.scipy.special.logsumexp],
    ids=["softmax", "log_softmax", "logsumexp"],
)
def test_softmax_subtracts_its_maximum_in_float32_as_pytorch_runs_the_op(fn):
    # PyTorch casts softmax's input to float32 before anything else. In float16 a
    # mask fill of -65504 minus a maximum of 16 or more rounds to -inf.
    scores = jnp.array([[40.0, 1.0, 3.0], [2.0, 5.0, 7.0]], F32)
    keep = np.array([[True, True, False], [True, False, False]])
    masked = lambda s: fn(jnp.where(keep, s @ jnp.eye(3), -1e9))  # noqa: E731
    with third_party.standard_promotion():
        jaxpr = jax.make_jaxpr(jaxscale.autocast(masked))(scores)
        # (from JAX 0.12.1 softmax and logsumexp are custom derivatives of their own)
        subs = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "sub"]
        assert subs
        assert str(subs[0].outvars[0].aval.dtype) == "float32"
        # compiled: XLA's CPU keeps every float16 rounding
        _, report = jax.jit(jaxscale.locate_nonfinite(jaxscale.autocast(masked)))(scores)
        got = np.asarray(jax.jit(jaxscale.autocast(masked))(scores), np.float64)
    assert not bool(report.found), report.describe()
    expected = np.asarray(jax.jit(masked)(scores), np.float64)
    if got.shape == keep.shape:  # a masked entry's log-probability saturates, as the fill did
        got, expected = got[keep], expected[keep]
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)
