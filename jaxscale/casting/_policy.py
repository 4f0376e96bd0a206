"""PyTorch's autocast policies (CUDA's and the CPU's), as tables from JAX primitives to
precisions.

PyTorch's AMP documentation lists the CUDA ops that autocast to float16 (matmuls
and convolutions), the ops that autocast to float32 (exponentials, logarithms,
powers, sums and products, norms, softmax and losses), and says every other op
runs in the type of its inputs, promoting to the widest when they differ. JAX
programs are made of primitives, so each row here is a primitive, with the
PyTorch ops it stands for. Softmax, layer norm and the losses are not primitives:
they are built from ``exp``, ``log``, ``rsqrt`` and ``reduce_sum``, which the
table sends to float32, so their results are float32 as in PyTorch.

A primitive in no row runs exactly as traced: its floating inputs are returned
to the dtypes the function was traced with. That keeps any primitive this table
has not been checked against (bit casts, random number generation, scatters with
their own update functions) as correct as without autocast.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any


class Precision(enum.Enum):
    """How a primitive's floating inputs are cast before it runs."""

    LOWER = "the autocast dtype"
    """Cast to the autocast dtype (float16 or bfloat16); float64 inputs stay."""

    FLOAT32 = "float32"
    """Cast float16 and bfloat16 inputs to float32; float64 inputs stay."""

    WIDEST = "the widest input dtype"
    """Run in the inputs' dtype; when they differ, promote to the widest (PyTorch's
    type promotion, in which a scalar does not widen an array)."""

    RECIPROCAL = "float32 for a reciprocal, else the widest input dtype"
    """``div`` of a scalar by an array is PyTorch's ``reciprocal``/``__rdiv__`` (float32);
    any other division follows :attr:`WIDEST`."""

    AS_TRACED = "as traced"
    """Cast floating inputs back to the dtypes the function was traced with."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One primitive's precision and the PyTorch ops it stands for."""

    precision: Precision
    torch_ops: str


LOWER, FLOAT32, WIDEST = Precision.LOWER, Precision.FLOAT32, Precision.WIDEST
_PROMOTES = "type promotion (not in PyTorch's lists)"
_MOVES = "moves data without arithmetic (not in PyTorch's lists)"
_COLLECTIVE = "a collective inside shard_map (not an autocast op)"

# (primitive, precision, PyTorch ops it stands for)
_TABLE: list[tuple[str, Precision, str]] = [
    # PyTorch's "CUDA ops that can autocast to float16"
    ("dot_general", LOWER, "matmul, @, mm, bmm, mv, addmm, addbmm, baddbmm, addmv, addr, linear, "
     "einsum, chain_matmul, multi_dot, RNN cells; also dot and tensordot, which PyTorch promotes"),
    ("conv_general_dilated", LOWER, "conv1d/2d/3d, conv_tbc, conv_transpose1d/2d/3d"),
    # PyTorch's "CUDA ops that can autocast to float32"
    ("exp", FLOAT32, "exp; the exp in softmax, log_softmax, softmin, cross_entropy, nll_loss, "
     "kl_div, poisson_nll_loss, softplus"),
    ("exp2", FLOAT32, "exp (base 2)"),
    ("expm1", FLOAT32, "expm1"),
    ("log", FLOAT32, "log, log10, log2; the log in log_softmax and the losses"),
    ("log2", FLOAT32, "log2 (a primitive of its own from JAX 0.12)"),
    ("log1p", FLOAT32, "log1p, softplus"),
    ("pow", FLOAT32, "pow, __pow__, __rpow__"),
    ("integer_pow", FLOAT32, "pow with an integer exponent: x ** 2 in mse_loss and norms, "
     "reciprocal"),
    ("square", FLOAT32, "pow(x, 2)"),
    ("rsqrt", FLOAT32, "rsqrt; the normalisation of layer_norm, group_norm, normalize"),
    ("reduce_sum", FLOAT32, "sum, mean; the sums in softmax, layer_norm, group_norm, norm, cdist, "
     "pdist, dist, cosine_similarity and every loss"),
    ("reduce_prod", FLOAT32, "prod"),
    ("cumsum", FLOAT32, "cumsum"),
    ("cumprod", FLOAT32, "cumprod"),
    ("cumlogsumexp", FLOAT32, "logcumsumexp (the exp and log it is made of)"),
    ("erf_inv", FLOAT32, "erfinv"),
    ("tan", FLOAT32, "tan"),
    ("sinh", FLOAT32, "sinh"),
    ("cosh", FLOAT32, "cosh"),
    ("asin", FLOAT32, "asin"),
    ("acos", FLOAT32, "acos"),
    # JAX 0.12.1's functions of pi and of one: as the ops they scale or shift
    ("asinpi", FLOAT32, "asin (divided by pi: asinpi, JAX 0.12.1)"),
    ("acospi", FLOAT32, "acos (divided by pi: acospi, JAX 0.12.1)"),
    ("tanpi", FLOAT32, "tan (of pi times its input: tanpi, JAX 0.12.1)"),
    ("exp2m1", FLOAT32, "expm1 (base 2: exp2m1, JAX 0.12.1)"),
    ("log2p1", FLOAT32, "log1p (base 2: log2p1, JAX 0.12.1)"),
    ("div", Precision.RECIPROCAL, "reciprocal, __rdiv__, __rtruediv__ (float32); "
     "any other division promotes"),
    # everything else runs in its inputs' dtype: the ones checked to be safe so
    ("add", WIDEST, _PROMOTES), ("add_any", WIDEST, _PROMOTES), ("sub", WIDEST, _PROMOTES),
    ("mul", WIDEST, _PROMOTES), ("neg", WIDEST, _PROMOTES), ("max", WIDEST, _PROMOTES),
    ("min", WIDEST, _PROMOTES), ("abs", WIDEST, _PROMOTES), ("sign", WIDEST, _PROMOTES),
    ("rem", WIDEST, _PROMOTES), ("floor", WIDEST, _PROMOTES), ("ceil", WIDEST, _PROMOTES),
    ("round", WIDEST, _PROMOTES), ("nextafter", WIDEST, _PROMOTES),
    ("is_finite", WIDEST, _PROMOTES), ("reduce_precision", WIDEST, _PROMOTES),
    ("sqrt", WIDEST, _PROMOTES), ("cbrt", WIDEST, _PROMOTES), ("tanh", WIDEST, _PROMOTES),
    ("logistic", WIDEST, "sigmoid (not in PyTorch's lists)"), ("sin", WIDEST, _PROMOTES),
    ("cos", WIDEST, _PROMOTES), ("atan", WIDEST, _PROMOTES),
    ("atan2", WIDEST, "atan2 (PyTorch's promote list)"), ("asinh", WIDEST, _PROMOTES),
    ("acosh", WIDEST, _PROMOTES), ("atanh", WIDEST, _PROMOTES),
    ("sinpi", WIDEST, "sin of pi times its input (JAX 0.12.1; type promotion)"),
    ("cospi", WIDEST, "cos of pi times its input (JAX 0.12.1; type promotion)"),
    ("atanpi", WIDEST, "atan divided by pi (JAX 0.12.1; type promotion)"),
    ("atan2pi", WIDEST, "atan2 divided by pi (JAX 0.12.1; PyTorch's promote list)"),
    ("fma", WIDEST, "addcmul's a * b + c, fused (JAX 0.12.1; type promotion)"),
    ("fmuladd", WIDEST, "a * b + c, fused where the backend may (JAX 0.12.1; type promotion)"),
    ("erf", WIDEST, "erf, and gelu's exact form (not in PyTorch's lists)"),
    ("erfc", WIDEST, _PROMOTES), ("lgamma", WIDEST, _PROMOTES), ("digamma", WIDEST, _PROMOTES),
    ("eq", WIDEST, _PROMOTES), ("ne", WIDEST, _PROMOTES), ("lt", WIDEST, _PROMOTES),
    ("le", WIDEST, _PROMOTES), ("gt", WIDEST, _PROMOTES), ("ge", WIDEST, _PROMOTES),
    ("eq_to", WIDEST, "total-order comparison (searchsorted, interp)"),
    ("lt_to", WIDEST, "total-order comparison (searchsorted, interp)"),
    ("le_to", WIDEST, "total-order comparison (searchsorted, interp)"),
    ("one_minus_square", WIDEST, "1 - x**2, the derivative of tanh (JAX 0.12)"),
    ("polynomial", WIDEST, "polyval (Horner's rule, JAX 0.12)"),
    ("select_n", WIDEST, "where, masked_fill (type promotion)"),
    ("clamp", WIDEST, "clamp (type promotion)"),
    ("reduce_max", WIDEST, "max, amax"), ("reduce_min", WIDEST, "min, amin"),
    ("argmax", WIDEST, "argmax"), ("argmin", WIDEST, "argmin"), ("cummax", WIDEST, "cummax"),
    ("cummin", WIDEST, "cummin"), ("sort", WIDEST, "sort"), ("top_k", WIDEST, "topk"),
    ("approx_top_k", WIDEST, "topk (approximate)"),
    ("reduce_window_max", WIDEST, "max_pool"), ("reduce_window_min", WIDEST, "-max_pool(-x)"),
    ("reduce_window_sum", WIDEST, "avg_pool (not in PyTorch's lists)"),
    ("reshape", WIDEST, _MOVES), ("broadcast_in_dim", WIDEST, _MOVES),
    ("transpose", WIDEST, _MOVES), ("squeeze", WIDEST, _MOVES),
    ("rev", WIDEST, _MOVES), ("slice", WIDEST, _MOVES), ("dynamic_slice", WIDEST, _MOVES),
    ("dynamic_update_slice", WIDEST, _MOVES), ("gather", WIDEST, "indexing, embedding"),
    ("concatenate", WIDEST, "cat (PyTorch's promote list)"), ("pad", WIDEST, _MOVES),
    ("split", WIDEST, _MOVES), ("copy", WIDEST, _MOVES), ("device_put", WIDEST, _MOVES),
    ("name", WIDEST, "checkpoint_name: names a value for remat policies, keeps its dtype"),
    ("xla_metadata_value", WIDEST,
     "set_xla_metadata(x, ...): tags the operation that made x, keeps its dtype"),
    ("convert_element_type", WIDEST, ".to(dtype), .float(), .half(): kept as written"),
    ("stop_gradient", WIDEST, "detach"), ("optimization_barrier", WIDEST, _MOVES),
    ("sharding_constraint", WIDEST, _MOVES), ("reshard", WIDEST, _MOVES),
    ("shard_alike", WIDEST, "shard_alike(x, y): gives two values one sharding, keeps each dtype"),
    ("host_local_array_to_global_array", WIDEST, _MOVES),
    ("global_array_to_host_local_array", WIDEST, _MOVES),
    ("psum", WIDEST, _COLLECTIVE), ("pmax", WIDEST, _COLLECTIVE), ("pmin", WIDEST, _COLLECTIVE),
    ("psum_invariant", WIDEST, _COLLECTIVE), ("all_gather", WIDEST, _COLLECTIVE),
    ("all_gather_invariant", WIDEST, _COLLECTIVE), ("ppermute", WIDEST, _COLLECTIVE),
    ("all_to_all", WIDEST, _COLLECTIVE),
    ("reduce_scatter", WIDEST, _COLLECTIVE), ("pbroadcast", WIDEST, _COLLECTIVE),
    ("pvary", WIDEST, _COLLECTIVE), ("pmax_scatter", WIDEST, _COLLECTIVE),
    ("pmin_scatter", WIDEST, _COLLECTIVE), ("pxor", WIDEST, _COLLECTIVE),
]  # fmt: skip

POLICY: Mapping[str, Row] = {name: Row(precision, ops) for name, precision, ops in _TABLE}
"""Primitive name -> :class:`Row`: the precision it runs in and the PyTorch ops it stands for."""

_UNLISTED = Row(Precision.AS_TRACED, "not in the table: runs as traced")

# PyTorch's CPU autocast (``torch.autocast("cpu")``, bfloat16 by default) lists the same
# matmuls and convolutions as CUDA's, but a different float32 list: exponentials,
# logarithms, powers, sums and softmax are not on it (a bfloat16 input stays bfloat16),
# while prod, linear algebra and fft are.
_CPU_KEEPS_INPUT_DTYPE = (
    "exp", "exp2", "expm1", "log", "log2", "log1p", "pow", "integer_pow", "square", "rsqrt",
    "reduce_sum", "cumsum", "cumprod", "cumlogsumexp", "erf_inv", "tan", "sinh", "cosh", "asin",
    "acos", "div", "asinpi", "acospi", "tanpi", "exp2m1", "log2p1",
)  # fmt: skip
_CPU_FLOAT32 = {
    "fft": "fft_fft, fft_rfft, fft_ifft and the rest of torch.fft",
    "cholesky": "cholesky, linalg_cholesky, linalg_cholesky_ex",
    "eig": "linalg_eig, linalg_eigvals",
    "eigh": "linalg_eigh, linalg_eigvalsh",
    "lu": "_lu_with_info, linalg_lu_factor",
    "geqrf": "geqrf, qr, linalg_qr",
    "householder_product": "orgqr, linalg_householder_product",
    "ormqr": "ormqr",
    "qr": "qr, linalg_qr",
    "svd": "svd, linalg_svd, linalg_svdvals, pinverse",
    "triangular_solve": "triangular_solve, linalg_solve_triangular",
}

CPU_POLICY: Mapping[str, Row] = {
    **POLICY,
    **{
        name: Row(WIDEST, POLICY[name].torch_ops + "; not on PyTorch's CPU float32 list")
        for name in _CPU_KEEPS_INPUT_DTYPE
    },
    **{
        name: Row(FLOAT32, ops + " (PyTorch's CPU float32 list)")
        for name, ops in _CPU_FLOAT32.items()
    },
}
"""The table of ``jaxscale.autocast(..., device_type="cpu")``: PyTorch's CPU autocast
lists, as :data:`POLICY` is its CUDA lists."""

POLICIES: Mapping[str, Mapping[str, Row]] = {"cuda": POLICY, "cpu": CPU_POLICY}
"""Device type -> its policy table."""

FLOAT32_FUNCTIONS: Mapping[str, str] = {
    "norm": "norm, linalg.norm, linalg.vector_norm, normalize (jnp.linalg.norm squares its "
    "input with a multiplication, which in float16 would overflow from 256 up)",
    "vector_norm": "linalg.vector_norm",
    "matrix_norm": "linalg.matrix_norm",
}
"""Functions of JAX's own library (jitted, so they appear as one ``jit`` equation) that
PyTorch's float32 list names as ops: their floating inputs are cast to float32 and
everything inside runs from there, as PyTorch runs the op in float32."""


def _group(reason: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), reason)


AS_TRACED: Mapping[str, str] = {
    **_group(
        "random numbers and keys",
        "random_bits random_clone random_fold_in random_gamma random_seed random_split "
        "random_unwrap random_wrap rng_bit_generator rng_uniform threefry2x32 threefry4x32 "
        "philox2x32 philox4x32 iota_2x32_shape random_gamma_grad random_poisson raw_bits",
    ),
    **_group(
        "bits, integers, booleans and indices (no floating arithmetic)",
        "and or not xor clz population_count shift_left shift_right_arithmetic "
        "shift_right_logical mulhi bitcast_convert_type reduce_and reduce_or reduce_xor iota "
        "zeros_like axis_index dimension_size dim_as_value platform_index create_token after_all "
        "program_order",
    ),
    **_group(
        "linear algebra: PyTorch's autocast has no half-precision rule for it; it runs in "
        "the dtype it was written in",
        "cholesky cholesky_update eig eigh geqp3 geqrf hessenberg householder_product lu "
        "lu_pivots_to_permutation ormqr qr schur svd symmetric_product triangular_solve "
        "tridiagonal tridiagonal_solve",
    ),
    **_group(
        "special functions (not in PyTorch's lists)",
        "bessel_i0e bessel_i1e igamma igamma_grad_a igammac polygamma "
        "regularized_incomplete_beta zeta",
    ),
    **_group("complex numbers (no half-precision counterpart)", "complex conj imag real"),
    **_group(
        "fft: JAX has no half-precision complex type, so a float16 input returns to the "
        "float32 it was traced in (PyTorch's CUDA kernels take float16 to complex32; its "
        "CPU autocast lists fft in float32, as CPU_POLICY does)",
        "fft",
    ),
    **_group(
        "matmuls whose precision the caller chose: float8 scaled matmuls, grouped (ragged) "
        "matmuls and cuDNN attention kernels",
        "scaled_matmul scaled_matmul_wrapper scaled_dot ragged_dot_general "
        "dot_product_attention_fwd dot_product_attention_bwd dot_product_attention_fwd_wrapper "
        "dot_product_attention_bwd_wrapper dot_product_attention_fp8_fwd "
        "dot_product_attention_fp8_bwd dot_product_attention_fp8_fwd_wrapper "
        "dot_product_attention_fp8_bwd_wrapper",
    ),
    **_group(
        "host callbacks, foreign functions and checks",
        "pure_callback io_callback debug_callback buffer_callback debug_print inspect_sharding "
        "ffi_call shape_assertion unreachable",
    ),
    **_group(
        "sparse arrays (jax.experimental.sparse): JAX's sparse matmul kernels (cuSPARSE) "
        "take float32 and wider; a half-precision sparse product falls back to a gather "
        "and a scatter-add that sums in half precision, so a sparse matmul runs in the "
        "dtype it was written in, where PyTorch's autocast runs torch.sparse.mm in float16",
        "bcoo_dot_general bcoo_dot_general_sampled bcoo_extract bcoo_fromdense "
        "bcoo_sort_indices bcoo_spdot_general bcoo_sum_duplicates bcoo_todense bcoo_transpose "
        "bcsr_dot_general bcsr_extract bcsr_fromdense bcsr_todense coo_fromdense coo_matmat "
        "coo_matvec coo_spmm coo_spmv coo_todense csr_fromdense csr_matmat csr_matvec csr_spmm "
        "csr_spmv csr_todense spsolve todense",
    ),
    **_group(
        "cuDNN's LSTM (jax.experimental.rnn): JAX's kernel takes float32 only, so it runs "
        "as written, where PyTorch's autocast runs cuDNN's RNNs in float16",
        "rnn_fwd rnn_bwd",
    ),
    **_group(
        "asynchronous halves of collectives, point-to-point transfers and sharding casts",
        "all_gather_start all_gather_done all_gather_reduced all_gather_reduced_start "
        "all_to_all_start all_to_all_done ppermute_start ppermute_done psum_start psum_done "
        "psum_invariant_start reduce_scatter_start reduce_scatter_done pbroadcast_start "
        "pbroadcast_done pbroadcast_dynamic ragged_all_to_all psend precv preduced "
        "unreduced_psum unreduced_psum_start unreduced_pmax unreduced_pmin "
        "unreduced_reduce_scatter unreduced_reduce_scatter_start reduced_vary_cast "
        "reduced_vary_cast_p vary_unreduced_cast vary_unreduced_cast_p layout_constraint "
        "relayout with_memory_space_constraint pin unpin",
    ),
    **_group(
        "mutable references, boxes and logs (JAX's state primitives)",
        "get swap addupdate accum_grad_in_ref new_ref empty_ref free_ref freeze box_get box_set "
        "new_box log_extend log_read new_log empty empty2 tie dce_sink to_edtype from_edtype "
        "stage",
    ),
    **_group(
        "JAX's experimental high-level array primitives",
        "broadcast_to stack unstack tile create_linear call_hi_primitive "
        "call_hi_primitive_linearized",
    ),
}
"""First-order primitives that run as traced on purpose, each with the reason. With
:data:`POLICY`, the higher-order rules and :data:`UNSUPPORTED_HIGHER_ORDER` this names
every primitive JAX 0.10 to 0.12 defines, in ``jax`` and in the experimental modules
that define primitives of their own (``sparse``, ``rnn``, ``compute_on``, ``fused``,
``shard_alike``, ``buffer_callback``, ``multihost_utils``, ``overlap``); a test checks
the running JAX against it."""

UNSUPPORTED_HIGHER_ORDER: Mapping[str, str] = _group(
    "a higher-order primitive autocast does not reach inside: it raises NotImplementedError "
    "naming it (call that part inside jaxscale.autocast(..., enabled=False))",
    "call call_exported custom_lin "
    "custom_jvp_call_jaxpr eval_jaxpr linear_call remat_opt run_state cudnn_fusion",
)
"""Higher-order primitives that autocast refuses, with the reason."""

VERSION_SPECIFIC: Mapping[str, str] = {
    **_group(
        "JAX 0.10 only",
        "box_get box_set call closed_call log_extend log_read new_box new_log pbroadcast_done "
        "pbroadcast_start psum_start unreduced_psum_start unreduced_reduce_scatter_start",
    ),
    **_group("JAX 0.10 and 0.11", "reduced_vary_cast_p vary_unreduced_cast_p"),
    **_group(
        "JAX 0.10.1 and later", "mulhi philox2x32 philox4x32 stack stage threefry4x32 unstack"
    ),
    **_group(
        "JAX 0.11 and later",
        "log2 one_minus_square relayout unreduced_pmax unreduced_pmin with_memory_space_constraint",
    ),
    **_group("JAX 0.11.2 and later (in jax.experimental.overlap from JAX 0.12)", "program_order"),
    **_group("JAX 0.10 to 0.11.1", "shard_alike"),
    **_group("JAX 0.11 and later, as a higher-order rule", "xla_metadata_call"),
    **_group(
        "JAX 0.12 and later",
        "pbroadcast_dynamic polynomial reduced_vary_cast vary_unreduced_cast",
    ),
    **_group(
        "JAX 0.12.1 and later",
        "acospi asinpi atan2pi atanpi cospi exp2m1 fma fmuladd log2p1 pmax_scatter "
        "pmin_scatter pxor random_gamma_grad random_poisson raw_bits sinpi tanpi",
    ),
}
"""Primitive names above that exist in some supported JAX versions only."""


_REGISTERED: dict[str, Row] = {}


def register_policy(primitive_name: str, precision: Precision, torch_ops: str = "") -> None:
    """Give a primitive of your own (an ``ffi_call``, a custom primitive) a row of the
    policy, so that autocast casts its floating inputs as ``precision`` says instead of
    running it as traced (a Pallas kernel's ``pallas_call`` runs as traced without
    one). A registered primitive is treated as one operation even when it holds jaxprs
    of its own (autocast does not cast inside it), and its row comes before any rule
    autocast has for the name. Registering a name again replaces its row.

    >>> import jaxscale
    >>> from jaxscale.casting import Precision
    >>> jaxscale.casting.register_policy("my_kernel", Precision.FLOAT32, "my fused op")
    >>> jaxscale.casting.row_for("my_kernel").precision
    <Precision.FLOAT32: 'float32'>
    """
    if not isinstance(primitive_name, str) or not primitive_name:
        raise TypeError(f"primitive_name must be a non-empty string, got {primitive_name!r}")
    if not isinstance(precision, Precision):
        raise TypeError(f"precision must be a jaxscale.casting.Precision, got {precision!r}")
    _REGISTERED[primitive_name] = Row(precision, torch_ops or "registered by the user")


def is_registered(primitive_name: str) -> bool:
    return primitive_name in _REGISTERED


def row_for(primitive_name: str, device_type: str = "cuda") -> Row:
    """The policy row of a first-order primitive under ``device_type``'s autocast
    (``"cuda"`` or ``"cpu"``): a registered row, else the table's; unlisted ones run as
    traced.

    >>> import jaxscale
    >>> jaxscale.casting.row_for("exp").precision, jaxscale.casting.row_for("exp", "cpu").precision
    (<Precision.FLOAT32: 'float32'>, <Precision.WIDEST: 'the widest input dtype'>)
    """
    table = POLICIES[validated_device_type(device_type)]
    return _REGISTERED.get(primitive_name) or table.get(primitive_name, _UNLISTED)


def validated_device_type(device_type: Any) -> str:
    """``device_type`` if it names a policy (``"cuda"`` or ``"cpu"``); else ValueError."""
    if not isinstance(device_type, str) or device_type not in POLICIES:
        raise ValueError(f'device_type must be "cuda" or "cpu", got {device_type!r}')
    return device_type
