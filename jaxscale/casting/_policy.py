"""PyTorch's CUDA autocast policy, as a table from JAX primitives to precisions.

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
    ("erf", WIDEST, "erf, and gelu's exact form (not in PyTorch's lists)"),
    ("erfc", WIDEST, _PROMOTES), ("lgamma", WIDEST, _PROMOTES), ("digamma", WIDEST, _PROMOTES),
    ("eq", WIDEST, _PROMOTES), ("ne", WIDEST, _PROMOTES), ("lt", WIDEST, _PROMOTES),
    ("le", WIDEST, _PROMOTES), ("gt", WIDEST, _PROMOTES), ("ge", WIDEST, _PROMOTES),
    ("select_n", WIDEST, "where, masked_fill (type promotion)"),
    ("clamp", WIDEST, "clamp (type promotion)"),
    ("reduce_max", WIDEST, "max, amax"), ("reduce_min", WIDEST, "min, amin"),
    ("argmax", WIDEST, "argmax"), ("argmin", WIDEST, "argmin"), ("cummax", WIDEST, "cummax"),
    ("cummin", WIDEST, "cummin"), ("sort", WIDEST, "sort"), ("top_k", WIDEST, "topk"),
    ("reduce_window_max", WIDEST, "max_pool"), ("reduce_window_min", WIDEST, "-max_pool(-x)"),
    ("reduce_window_sum", WIDEST, "avg_pool (not in PyTorch's lists)"),
    ("reshape", WIDEST, _MOVES), ("broadcast_in_dim", WIDEST, _MOVES),
    ("transpose", WIDEST, _MOVES), ("squeeze", WIDEST, _MOVES), ("expand_dims", WIDEST, _MOVES),
    ("rev", WIDEST, _MOVES), ("slice", WIDEST, _MOVES), ("dynamic_slice", WIDEST, _MOVES),
    ("dynamic_update_slice", WIDEST, _MOVES), ("gather", WIDEST, "indexing, embedding"),
    ("concatenate", WIDEST, "cat (PyTorch's promote list)"), ("pad", WIDEST, _MOVES),
    ("split", WIDEST, _MOVES), ("copy", WIDEST, _MOVES), ("copy_p", WIDEST, _MOVES),
    ("convert_element_type", WIDEST, ".to(dtype), .float(), .half(): kept as written"),
    ("stop_gradient", WIDEST, "detach"), ("optimization_barrier", WIDEST, _MOVES),
    ("sharding_constraint", WIDEST, _MOVES), ("mesh_cast", WIDEST, _MOVES),
    ("reshard", WIDEST, _MOVES),
    ("psum", WIDEST, _COLLECTIVE), ("pmax", WIDEST, _COLLECTIVE), ("pmin", WIDEST, _COLLECTIVE),
    ("psum_invariant", WIDEST, _COLLECTIVE), ("all_gather", WIDEST, _COLLECTIVE),
    ("all_gather_invariant", WIDEST, _COLLECTIVE), ("ppermute", WIDEST, _COLLECTIVE),
    ("all_to_all", WIDEST, _COLLECTIVE), ("psum_scatter", WIDEST, _COLLECTIVE),
    ("reduce_scatter", WIDEST, _COLLECTIVE), ("pbroadcast", WIDEST, _COLLECTIVE),
    ("pvary", WIDEST, _COLLECTIVE), ("pcast", WIDEST, _COLLECTIVE),
]  # fmt: skip

POLICY: Mapping[str, Row] = {name: Row(precision, ops) for name, precision, ops in _TABLE}
"""Primitive name -> :class:`Row`: the precision it runs in and the PyTorch ops it stands for."""

_UNLISTED = Row(Precision.AS_TRACED, "not in the table: runs as traced")


def row_for(primitive_name: str) -> Row:
    """The policy row of a first-order primitive; unlisted ones run as traced."""
    return POLICY.get(primitive_name, _UNLISTED)
