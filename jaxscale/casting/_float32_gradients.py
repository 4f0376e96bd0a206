"""Matmuls on half-precision operands whose gradients come out in float32
(``autocast(..., grad_dtype=jnp.float32)``).

Autocast narrows a float32 weight to float16 for its matmul, and JAX differentiates
the matmul in float16: the weight's gradient is a float16 matmul's result, rounded to
float16 (where it can overflow) and only then widened back to the float32 weight.
FSDP's ``MixedPrecision(reduce_dtype=torch.float32)`` and MaxText's ``grad_dtype``
keep that gradient in float32 instead, so that a data-parallel all-reduce sums float32
values and no convert follows the backward matmul. Here the backward matmul multiplies
the same float16 operands and returns float32 (``preferred_element_type``), for each
operand autocast narrowed from float32; an operand that was already half precision
gets its gradient in its own dtype, as before.

The transposes follow ``dot_general``'s: the output's cotangent is contracted with the
other operand over that operand's free axes, and the result's axes put back in the
operand's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def dot_with_float32_gradients(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    half: Any,
    precision: Any = None,
) -> jax.Array:
    """``dot_general`` of ``lhs`` and ``rhs`` cast to ``half``, with a ``half`` result;
    the gradient of an operand wider than ``half`` is computed from ``half`` operands
    with a float32 result and returned in the operand's dtype, never rounded to
    ``half``."""

    def product(a: jax.Array, b: jax.Array) -> jax.Array:
        return lax.dot_general(
            a, b, dimension_numbers, precision=precision, preferred_element_type=half
        )

    @jax.custom_vjp
    def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
        return product(a.astype(half), b.astype(half))

    def forward(a: jax.Array, b: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        a_half, b_half = a.astype(half), b.astype(half)
        return product(a_half, b_half), (a_half, b_half)

    def backward(saved: tuple[jax.Array, jax.Array], grad: jax.Array) -> tuple[Any, Any]:
        a_half, b_half = saved
        grad = grad.astype(half)
        result_a = jnp.float32 if _wider(lhs.dtype, half) else half
        result_b = jnp.float32 if _wider(rhs.dtype, half) else half
        grad_a = lhs_cotangent(grad, b_half, dimension_numbers, a_half, result_a, precision)
        grad_b = rhs_cotangent(grad, a_half, dimension_numbers, b_half, result_b, precision)
        return grad_a.astype(lhs.dtype), grad_b.astype(rhs.dtype)

    matmul.defvjp(forward, backward)
    return matmul(lhs, rhs)


def _wider(dtype: Any, than: Any) -> bool:
    return np.dtype(dtype).itemsize > np.dtype(than).itemsize


def lhs_cotangent(
    grad: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    lhs: Any,
    result: Any,
    precision: Any = None,
    *,
    swapped: bool = False,
) -> jax.Array:
    """The cotangent of ``dot_general``'s left operand ``lhs`` (an array or its abstract
    value): ``grad`` (laid out as the product: batch axes, the left operand's free
    axes, the right operand's free axes; with ``swapped``, the right's free axes before
    the left's) contracted with ``rhs`` over ``rhs``'s free axes, in ``result``
    precision, sharded as ``lhs`` is where its mesh's axes are explicit."""
    lhs_ndim = lhs.ndim
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_free = [d for d in range(lhs_ndim) if d not in lhs_contract and d not in lhs_batch]
    rhs_free = [d for d in range(rhs.ndim) if d not in rhs_contract and d not in rhs_batch]
    batch = len(lhs_batch)
    first = batch + (0 if swapped else len(lhs_free))  # where rhs's free axes start in grad
    grad_rhs_free = tuple(range(first, first + len(rhs_free)))
    dims = ((grad_rhs_free, tuple(rhs_free)), (tuple(range(batch)), tuple(rhs_batch)))
    # out: batch axes, the lhs's free axes, then rhs's contracting axes in rhs's order,
    # which are the lhs's contracting axes in the order rhs_contract pairs them
    lhs_contract_in_rhs_order = [lhs_contract[i] for i in np.argsort(rhs_contract)]
    order = [*lhs_batch, *lhs_free, *lhs_contract_in_rhs_order]
    out = lax.dot_general(
        grad, rhs, dims, precision=precision, preferred_element_type=result,
        out_sharding=_sharding_in_order(lhs, order),
    )  # fmt: skip
    return lax.transpose(out, tuple(int(i) for i in np.argsort(order)))


def _sharding_in_order(operand: Any, order: list[int]) -> Any:
    """``operand``'s sharding with its axes taken in ``order``, where the mesh's axes are
    explicit (sharding in types: a contraction over a sharded axis must be told how to
    shard its result); ``None`` otherwise."""
    sharding = getattr(jax.typeof(operand), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or getattr(mesh, "empty", True):
        return None
    spec = tuple(sharding.spec) + (None,) * (operand.ndim - len(sharding.spec))
    return NamedSharding(mesh, PartitionSpec(*(spec[axis] for axis in order)))


def rhs_cotangent(
    grad: jax.Array,
    lhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    rhs: Any,
    result: Any,
    precision: Any = None,
) -> jax.Array:
    """The cotangent of ``dot_general``'s right operand ``rhs``: :func:`lhs_cotangent` of
    the product with its operands swapped."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    swapped = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    return lhs_cotangent(grad, lhs, swapped, rhs, result, precision, swapped=True)
