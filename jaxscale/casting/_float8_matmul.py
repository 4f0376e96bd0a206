"""Float8 matmuls with torchao's training recipes, for ``autocast(..., float8=...)``.

torchao's ``Float8Linear`` computes ``y = x @ w.T`` with three matmuls, each
quantizing its own operands with current (dynamic) scaling:

* forward ``output = x @ w_t``: ``x`` scaled along its contracting axis (the last),
  ``w_t`` along its contracting axis (the first), or each as a whole;
* backward ``grad_input = grad_output @ w_t.T``: ``grad_output`` along its last axis,
  the weight along the same (its output) axis;
* backward ``grad_weight_t = x.T @ grad_output``: both along the batch axis.

A recipe says, for each of the six casts, the float8 type and whether the scale is
per tensor or per row (or no cast: high precision), and whether scales are
rounded down to powers of two. Each matmul multiplies float8 operands with a
float32 result and divides the two scales back out, then casts to the autocast
dtype. A ``custom_vjp`` keeps ``x`` and ``w_t`` in high precision for the backward
pass, as torchao does, so the backward matmuls quantize afresh.

A JAX ``dot_general`` is this matmul when it has no batch dimensions: its left
operand's free dimensions are flattened into rows and its right operand (the
weight, as in ``x @ w.T``, ``nnx.Linear`` and torchao) into columns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale._src.explicit_axes import explicit_axes_made_automatic
from jaxscale._src.jaxprs import dot_dimension_numbers
from jaxscale._src.scopes import FLOAT8_MATMUL
from jaxscale.casting._float8 import quantize_float8
from jaxscale.casting._mx import dequantize_mx, quantize_mx
from jaxscale.casting._mx_gather import dequantize_whole
from jaxscale.casting._nvfp4_matmul import (
    NVFP4_RECIPES,
    NVFP4Recipe,
    nvfp4_forward_operands,
    nvfp4_linear,
)

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Cast:
    """How one operand of one matmul is quantized: the float8 ``dtype``, and ``rowwise``
    (one scale per row along the axis the matmul contracts) or one per tensor."""

    dtype: Any = E4M3
    rowwise: bool = False


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """torchao's ``Float8LinearConfig`` for current scaling: the six casts of a linear
    layer's three matmuls (``None``: that operand stays in high precision, and so must
    the other operand of its matmul) and the rounding of scales.

    Attributes:
      name: the recipe's name.
      input, weight: the forward matmul's operands.
      grad_output, weight_for_grad_input: the input-gradient matmul's operands.
      input_for_grad_weight, grad_output_for_grad_weight: the weight-gradient matmul's.
      power_of_2: round every scale down to a power of two.
      stochastic_gradients: round the output gradient (the operand of both backward
        matmuls) to float8 stochastically, from ``autocast``'s ``key``; off by default,
        as torchao rounds to nearest.
    """

    name: str
    input: Cast | None
    weight: Cast | None
    grad_output: Cast | None
    weight_for_grad_input: Cast | None
    input_for_grad_weight: Cast | None
    grad_output_for_grad_weight: Cast | None
    power_of_2: bool = False
    stochastic_gradients: bool = False

    def __post_init__(self) -> None:
        for first, second, matmul in (
            (self.input, self.weight, "output"),
            (self.grad_output, self.weight_for_grad_input, "grad_input"),
            (self.input_for_grad_weight, self.grad_output_for_grad_weight, "grad_weight"),
        ):
            if (first is None) != (second is None):
                raise ValueError(
                    f"float8 recipe {self.name!r}: the {matmul} matmul has one operand in "
                    "float8 and one in high precision; both or neither must be cast"
                )


_ROWWISE_E4M3 = Cast(E4M3, rowwise=True)

RECIPES: dict[str, Float8Recipe] = {
    "tensorwise": Float8Recipe(
        "tensorwise",
        input=Cast(E4M3),
        weight=Cast(E4M3),
        grad_output=Cast(E5M2),
        weight_for_grad_input=Cast(E4M3),
        input_for_grad_weight=Cast(E4M3),
        grad_output_for_grad_weight=Cast(E5M2),
    ),
    "rowwise": Float8Recipe(
        "rowwise",
        input=_ROWWISE_E4M3,
        weight=_ROWWISE_E4M3,
        grad_output=_ROWWISE_E4M3,
        weight_for_grad_input=_ROWWISE_E4M3,
        input_for_grad_weight=_ROWWISE_E4M3,
        grad_output_for_grad_weight=_ROWWISE_E4M3,
        power_of_2=True,
    ),
    "rowwise_with_gw_hp": Float8Recipe(
        "rowwise_with_gw_hp",
        input=_ROWWISE_E4M3,
        weight=_ROWWISE_E4M3,
        grad_output=_ROWWISE_E4M3,
        weight_for_grad_input=Cast(E4M3),  # one power-of-two scale for the whole weight
        input_for_grad_weight=None,  # the weight gradient in high precision
        grad_output_for_grad_weight=None,
        power_of_2=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class MXRecipe:
    """torchao's MXFP8 training recipe (``MXFP8Linear``, ``MXFP8_EMULATED_RCEIL``): every
    operand of a linear layer's three matmuls in MXFP8, blocked along that matmul's
    contracting dimension, each block with its own power-of-two scale.

    Attributes:
      name: the recipe's name.
      scale_mode: ``"rceil"`` or ``"floor"`` (:func:`jaxscale.quantize_mx`).
      wgrad_with_hp: the weight gradient's matmul in high precision (torchao's
        ``wgrad_with_hp=True``).
      block_size: elements per scale.
      stochastic_gradients: round the output gradient's scaled values to float8
        stochastically in both backward matmuls, from ``autocast``'s ``key``; off by
        default, as torchao rounds to nearest.
      all_gather_in_mx: make the weight whole on every device as MX before it is
        dequantized, for its forward and input-gradient matmuls, so that a sharded
        weight's all-gather (FSDP's) moves float8 data and E8M0 scales, about half
        of bfloat16's bytes, where XLA otherwise gathers the dequantized weight. The
        weight is then whole on every device whatever its sharding: for FSDP, not for
        a weight split for tensor parallelism. On a mesh with automatic axes a program
        compiled for several devices with it cannot be serialized by ``jax.export``
        (the partitioning is a Python callback); on explicit axes the weight is made
        whole by sharding constraints, and a weight the program gathers itself
        (``reshard(w, P())``) is gathered as MX. Off by default.
    """

    name: str
    scale_mode: str = "rceil"
    wgrad_with_hp: bool = False
    block_size: int = 32
    stochastic_gradients: bool = False
    all_gather_in_mx: bool = False


MX_RECIPES: dict[str, MXRecipe] = {
    "mxfp8": MXRecipe("mxfp8"),
    "mxfp8_wgrad_with_hp": MXRecipe("mxfp8_wgrad_with_hp", wgrad_with_hp=True),
}

Recipe = Float8Recipe | MXRecipe | NVFP4Recipe


def quantizes_before_gathering(recipe: Recipe) -> bool:
    """Whether ``recipe``, given a weight sharded along a mesh axis, makes it whole after
    quantizing it (float8 data and scales move, not its own dtype): the float8 recipes,
    whose quantizations XLA's partitioner moves a gather past, and an MX recipe with
    ``all_gather_in_mx``. An explicit-axes program's own gather of a weight
    (``reshard(w, P())``) is moved into such a recipe's matmul."""
    if isinstance(recipe, MXRecipe):
        return recipe.all_gather_in_mx
    return isinstance(recipe, Float8Recipe)


_NAMED: dict[str, Recipe] = {**RECIPES, **MX_RECIPES, **NVFP4_RECIPES}


def rounds_stochastically(recipe: Any) -> bool:
    """Whether ``recipe`` draws random bits (and so needs ``autocast``'s ``key``)."""
    if isinstance(recipe, NVFP4Recipe):
        return recipe.stochastic_rounding
    return bool(getattr(recipe, "stochastic_gradients", False))


def recipe_for(float8: Any) -> Recipe | None:
    """The recipe ``autocast(..., float8=...)`` names: ``None``, a name, or a recipe."""
    if float8 is None or isinstance(float8, Float8Recipe | MXRecipe | NVFP4Recipe):
        return float8
    if isinstance(float8, str) and float8 in _NAMED:
        return _NAMED[float8]
    raise ValueError(
        f"float8 must be None, one of {sorted(_NAMED)}, a jaxscale.casting.Float8Recipe, "
        f"MXRecipe or NVFP4Recipe, got {float8!r}"
    )


# -- which dot_generals are a linear layer's matmul --------------------------------------


def as_rows_and_columns(dimension_numbers: Any, lhs_shape: Any, rhs_shape: Any) -> Any:
    """For a ``dot_general`` with no batch dimensions, the permutations and sizes that
    make it ``(M, K) @ (K, N)``: ``(lhs_perm, rhs_perm, M, K, N)``; else ``None``."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_batch or rhs_batch or not lhs_contract:
        return None
    lhs_free = [d for d in range(len(lhs_shape)) if d not in lhs_contract]
    rhs_free = [d for d in range(len(rhs_shape)) if d not in rhs_contract]
    m = math.prod(lhs_shape[d] for d in lhs_free)
    k = math.prod(lhs_shape[d] for d in lhs_contract)
    n = math.prod(rhs_shape[d] for d in rhs_free)
    return (*lhs_free, *lhs_contract), (*rhs_contract, *rhs_free), m, k, n


def eligible(eqn: Any, recipe: Recipe | None = None) -> bool:
    """A floating ``dot_general`` with no batch dimensions whose rows, contracted size
    and columns are multiples of 16 (float8 matmul kernels need that alignment), or of
    an MX recipe's block size (each of the three matmuls blocks one of them)."""
    lhs, rhs = (v.aval for v in eqn.invars)
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (lhs, rhs)):
        return False
    layout = as_rows_and_columns(dot_dimension_numbers(eqn), lhs.shape, rhs.shape)
    alignment = recipe.block_size if isinstance(recipe, MXRecipe | NVFP4Recipe) else 16
    return layout is not None and all(size % alignment == 0 for size in layout[2:])


# -- the matmul ----------------------------------------------------------------------------


def _quantized(x: jax.Array, cast: Cast, axis: int, power_of_2: bool,
               key: jax.Array | None = None) -> tuple[Any, Any]:  # fmt: skip
    return quantize_float8(
        x, cast.dtype, axis=axis if cast.rowwise else None, power_of_2=power_of_2, key=key
    )


def _mm(a: jax.Array, b: jax.Array, cast_a: Cast | None, cast_b: Cast | None, recipe: Float8Recipe,
        out_dtype: Any, key_a: jax.Array | None = None,
        key_b: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """``a @ b`` for ``a`` (M, K) and ``b`` (K, N): in float8 with each operand's scale,
    or in high precision (``out_dtype``) when the recipe casts neither; an operand
    with a key rounded stochastically."""
    if cast_a is None:
        product = lax.dot_general(
            a.astype(out_dtype), b.astype(out_dtype), (((1,), (0,)), ((), ())),
            preferred_element_type=out_dtype,
        )  # fmt: skip
        return product.astype(out_dtype)
    assert cast_b is not None
    # one scope around it all: an inf born in the final cast is the float8 matmul's
    with jax.named_scope(FLOAT8_MATMUL):
        a8, scale_a = _quantized(a, cast_a, 1, recipe.power_of_2, key_a)  # along K
        b8, scale_b = _quantized(b, cast_b, 0, recipe.power_of_2, key_b)  # along K
        # An identity that keeps XLA from fusing both operands' quantization (the scales'
        # integer arithmetic) into the matmul: with rowwise scales computed by a long
        # division, XLA 0.12 on the CPU compiled one small matmul's gradient for minutes.
        a8, b8, scale_a, scale_b = lax.optimization_barrier((a8, b8, scale_a, scale_b))
        product = lax.dot_general(
            a8, b8, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        # torch._scaled_mm multiplies by the inverse scales (exact for powers of two)
        return (product * ((1.0 / scale_a) * (1.0 / scale_b))).astype(out_dtype)


def _gradient_keys(key: jax.Array | None) -> tuple[Any, Any]:
    """The keys of the input-gradient and weight-gradient matmuls' roundings."""
    if key is None:
        return None, None
    dgrad, wgrad = jax.random.split(key)
    return dgrad, wgrad


def no_cotangent(key: jax.Array | None) -> Any:
    """The cotangent of a custom rule's key argument: none (a key is not differentiable)."""
    return None if key is None else np.zeros(np.shape(key), jax.dtypes.float0)


def float8_linear(x: jax.Array, w_t: jax.Array, recipe: Float8Recipe, out_dtype: Any,
                  key: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """``x @ w_t`` for ``x`` (M, K) and ``w_t`` (K, N), its three matmuls in float8 by
    ``recipe``; the result and both gradients in ``out_dtype`` (the gradients are cast
    to each operand's own dtype). With ``recipe.stochastic_gradients``, ``key`` draws
    the output gradient's stochastic rounding."""
    if not recipe.stochastic_gradients:
        key = None

    @jax.custom_vjp
    def matmul(x: jax.Array, w_t: jax.Array, key: Any) -> jax.Array:
        return _mm(x, w_t, recipe.input, recipe.weight, recipe, out_dtype)

    def forward(x: jax.Array, w_t: jax.Array, key: Any) -> tuple[jax.Array, Any]:
        return matmul(x, w_t, key), (x, w_t, key)  # high precision kept, as torchao keeps it

    def backward(saved: Any, grad: jax.Array) -> tuple[Any, Any, Any]:
        x, w_t, key = saved
        grad = grad.astype(out_dtype)
        dgrad_key, wgrad_key = _gradient_keys(key)
        grad_x = _mm(grad, w_t.T, recipe.grad_output, recipe.weight_for_grad_input, recipe,
                     out_dtype, key_a=dgrad_key)  # fmt: skip
        grad_w_t = _mm(x.T, grad, recipe.input_for_grad_weight, recipe.grad_output_for_grad_weight,
                       recipe, out_dtype, key_b=wgrad_key)  # fmt: skip
        return grad_x.astype(x.dtype), grad_w_t.astype(w_t.dtype), no_cotangent(key)

    matmul.defvjp(forward, backward)
    return matmul(x, w_t, key)


def _mx_seen(value: jax.Array, axis: int, recipe: MXRecipe, out_dtype: Any,
             key: jax.Array | None = None, *, weight: bool = False,
             whole: NamedSharding | None = None) -> jax.Array:  # fmt: skip
    """``value`` quantized to MXFP8 in blocks along ``axis`` and dequantized; a
    ``weight`` made whole as MX first where the recipe says so: constrained to ``whole``
    where it is given (a program on explicit axes), else by custom partitioning."""
    data, scale = quantize_mx(
        value.astype(jnp.float32) if value.dtype != jnp.bfloat16 else value,
        block_size=recipe.block_size, axis=axis, scale_mode=recipe.scale_mode, key=key,
    )  # fmt: skip
    if weight and recipe.all_gather_in_mx:
        if whole is None:
            return dequantize_whole(data, scale, out_dtype, axis)
        data = lax.with_sharding_constraint(data, whole)
        scale = lax.with_sharding_constraint(scale, whole)
    return dequantize_mx(data, scale, out_dtype, axis=axis)


def mx_linear(x: jax.Array, w_t: jax.Array, recipe: MXRecipe, out_dtype: Any,
              key: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """``x @ w_t`` for ``x`` (M, K) and ``w_t`` (K, N) as torchao's ``MXFP8Linear`` with
    ``KernelPreference.EMULATED`` computes it: each matmul's operands quantized to MXFP8
    along its contracting dimension (:func:`quantize_mx`), dequantized to ``out_dtype``,
    and multiplied in ``out_dtype``; the weight gradient from high-precision operands
    with ``wgrad_with_hp``. The result and both gradients in ``out_dtype`` (the
    gradients cast to each operand's own dtype). With ``recipe.stochastic_gradients``,
    ``key`` draws the output gradient's stochastic rounding."""
    if not recipe.stochastic_gradients:
        key = None
    # In a program whose mesh has explicit axes the matmul is traced with them made
    # automatic, and a weight is made whole as MX by sharding constraints on that mesh:
    # the custom partitioning used elsewhere leaves its sharding annotations there for
    # the backend (JAX 0.12), which has no implementation of them. Decided here, where
    # the forward is traced, for the backward too (traced later, outside the region).
    whole = None
    if recipe.all_gather_in_mx and explicit_axes_made_automatic():
        whole = NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec())

    def mx(value: jax.Array, axis: int, key: jax.Array | None = None,
           weight: bool = False) -> jax.Array:  # fmt: skip
        return _mx_seen(value, axis, recipe, out_dtype, key, weight=weight, whole=whole)

    def mm(a: jax.Array, b: jax.Array) -> jax.Array:
        return lax.dot_general(
            a, b, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype
        ).astype(out_dtype)

    @jax.custom_vjp
    def matmul(x: jax.Array, w_t: jax.Array, key: Any) -> jax.Array:
        return mm(mx(x, 1), mx(w_t, 0, weight=True))  # both along K

    def forward(x: jax.Array, w_t: jax.Array, key: Any) -> tuple[jax.Array, Any]:
        return matmul(x, w_t, key), (x, w_t, key)  # high precision kept, as torchao keeps it

    def backward(saved: Any, grad: jax.Array) -> tuple[Any, Any, Any]:
        x, w_t, key = saved
        grad = grad.astype(out_dtype)
        dgrad_key, wgrad_key = _gradient_keys(key)
        grad_x = mm(mx(grad, 1, dgrad_key), mx(w_t, 1, weight=True).T)  # along N
        if recipe.wgrad_with_hp:
            grad_w_t = mm(x.astype(out_dtype).T, grad)
        else:
            grad_w_t = mm(mx(x, 0).T, mx(grad, 0, wgrad_key))  # along M
        return grad_x.astype(x.dtype), grad_w_t.astype(w_t.dtype), no_cotangent(key)

    matmul.defvjp(forward, backward)
    return matmul(x, w_t, key)


def float8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    recipe: Recipe,
    out_dtype: Any,
    key: jax.Array | None = None,
) -> jax.Array:
    """A batch-free ``dot_general`` as :func:`float8_linear` (or :func:`mx_linear`, or
    :func:`nvfp4_linear` with ``key`` for its stochastic rounding) on its rows and
    columns."""
    lhs_perm, rhs_perm, m, k, n = as_rows_and_columns(dimension_numbers, lhs.shape, rhs.shape)
    (lhs_contract, rhs_contract), _ = dimension_numbers
    x = jnp.transpose(lhs, lhs_perm).reshape(m, k)
    w_t = jnp.transpose(rhs, rhs_perm).reshape(k, n)
    if isinstance(recipe, MXRecipe):
        out = mx_linear(x, w_t, recipe, out_dtype, key)
    elif isinstance(recipe, NVFP4Recipe):
        out = nvfp4_linear(x, w_t, recipe, out_dtype, key)
    else:
        out = float8_linear(x, w_t, recipe, out_dtype, key)
    lhs_free_shape = [lhs.shape[d] for d in lhs_perm[: len(lhs_perm) - len(lhs_contract)]]
    rhs_free_shape = [rhs.shape[d] for d in rhs_perm[len(rhs_contract) :]]
    return out.reshape(*lhs_free_shape, *rhs_free_shape)


def forward_operands(
    x: jax.Array, w_t: jax.Array, recipe: Recipe, out_dtype: Any
) -> tuple[jax.Array, jax.Array, int]:
    """The forward matmul's operands ``x`` (M, K) and ``w_t`` (K, N) as ``recipe``
    quantizes them, dequantized to float32, and the significand bits of their format
    (what :func:`jaxscale.float8_report` counts flushed and saturated values from)."""
    if isinstance(recipe, MXRecipe):
        return _mx_seen(x, 1, recipe, jnp.float32), _mx_seen(w_t, 0, recipe, jnp.float32), 3
    if isinstance(recipe, NVFP4Recipe):
        x_seen, w_seen = nvfp4_forward_operands(x, w_t, recipe)
        return x_seen, w_seen, 1
    assert recipe.input is not None
    assert recipe.weight is not None

    def dequantized(value: jax.Array, cast: Cast, axis: int) -> jax.Array:
        data, scale = _quantized(value.astype(out_dtype), cast, axis, recipe.power_of_2)
        return data.astype(jnp.float32) * (1.0 / scale)

    bits = 3 if recipe.input.dtype == E4M3 else 2
    return dequantized(x, recipe.input, 1), dequantized(w_t, recipe.weight, 0), bits
