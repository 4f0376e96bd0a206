"""NVFP4 training matmuls, for ``autocast(..., float8="nvfp4")``: NVIDIA's recipe.

The recipe NVIDIA trained a 12B model with (arXiv 2509.25149), as TransformerEngine's
``NVFP4BlockScaling`` computes a linear layer's three matmuls, every operand in NVFP4
with TransformerEngine's scale chain (:func:`jaxscale.quantize_nvfp4`, ``"te"``) and a
per-tensor scale from the operand's own largest magnitude at this step:

* forward ``x @ w_t``: ``x`` in 1x16 blocks along the contracted axis, rounded to
  nearest; the weight in 16x16 tiles (the same tiles serve its transpose);
* input gradient ``dy @ w_t.T``: ``dy`` in 1x16 blocks, rounded stochastically; the
  weight as in the forward;
* weight gradient ``x.T @ dy``: both operands through the 16x16 random Hadamard
  transform along the contracted (batch) axis, then in 1x16 blocks along it, ``dy``
  rounded stochastically. The transform is orthogonal: it cancels in the product and
  spreads an outlier over its block before quantization.

The matmuls are emulated, as the MX recipes are: each operand quantized, dequantized
to the autocast dtype, and multiplied there (the float32 sums of a Blackwell GPU's
block-scaled matmul are a lowering this emulation does not do).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale.casting._nvfp4 import (
    DEFAULT_SIGNS,
    dequantize_nvfp4,
    quantize_nvfp4,
    random_hadamard_transform,
)


@dataclasses.dataclass(frozen=True)
class NVFP4Recipe:
    """NVIDIA's NVFP4 training recipe, with TransformerEngine's switches.

    Attributes:
      name: the recipe's name.
      random_hadamard_transform: the weight gradient's operands through the 16x16
        random Hadamard transform (TransformerEngine's ``disable_rht=False``).
      stochastic_rounding: the output gradient's codes rounded stochastically in both
        backward matmuls (needs ``autocast(..., key=...)``).
      weight_blocks_2d: the weight in 16x16 tiles; else in 1x16 blocks along each
        matmul's contracted axis, as the other operands.
      signs: the Hadamard transform's sign vector (TransformerEngine's default).
    """

    name: str = "nvfp4"
    random_hadamard_transform: bool = True
    stochastic_rounding: bool = True
    weight_blocks_2d: bool = True
    signs: tuple[int, ...] = DEFAULT_SIGNS

    block_size = 16  # every size a matmul contracts or keeps is a multiple of this


NVFP4_RECIPES: dict[str, NVFP4Recipe] = {"nvfp4": NVFP4Recipe()}


def _fp4(x: jax.Array, out_dtype: Any, key: jax.Array | None = None, tiles: bool = False) -> Any:
    """``x`` (2-D) quantized to NVFP4 along its last axis (16x16 tiles with ``tiles``)
    and dequantized to ``out_dtype``."""
    values = (
        x if x.dtype in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)) else x.astype(jnp.float32)
    )
    codes, scales, decode = quantize_nvfp4(values, block=(16, 16) if tiles else (1, 16), key=key)
    return dequantize_nvfp4(codes, scales, decode, out_dtype)


def _mm(a: jax.Array, b: jax.Array, out_dtype: Any) -> jax.Array:
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype).astype(
        out_dtype
    )


def _weight_seen(w_t: jax.Array, recipe: NVFP4Recipe, out_dtype: Any, axis: int) -> jax.Array:
    """The weight as the matmul contracting its ``axis`` sees it: 16x16 tiles, or 1x16
    blocks along that axis."""
    if recipe.weight_blocks_2d:
        return _fp4(w_t, out_dtype, tiles=True)
    return _fp4(w_t.T, out_dtype).T if axis == 0 else _fp4(w_t, out_dtype)


def nvfp4_forward_operands(
    x: jax.Array, w_t: jax.Array, recipe: NVFP4Recipe
) -> tuple[jax.Array, jax.Array]:
    """The forward matmul's operands as ``recipe`` quantizes them, in float32."""
    return _fp4(x, jnp.float32), _weight_seen(w_t, recipe, jnp.float32, 0)


def nvfp4_linear(
    x: jax.Array, w_t: jax.Array, recipe: NVFP4Recipe, out_dtype: Any, key: jax.Array | None
) -> jax.Array:
    """``x @ w_t`` for ``x`` (M, K) and ``w_t`` (K, N), its three matmuls by ``recipe``
    (see the module's notes); the result and both gradients in ``out_dtype`` (the
    gradients cast to each operand's own dtype). ``key`` draws the stochastic rounding
    of the output gradient (``None``: round to nearest)."""
    if recipe.stochastic_rounding and key is None:
        raise ValueError(
            "the nvfp4 recipe rounds output gradients stochastically and needs a key: pass "
            "jaxscale.autocast(..., float8='nvfp4', key=jax.random.key(step)), or use "
            "jaxscale.casting.NVFP4Recipe(stochastic_rounding=False)"
        )

    def weight(w_t: jax.Array, axis: int) -> jax.Array:
        return _weight_seen(w_t, recipe, out_dtype, axis)

    @jax.custom_vjp
    def matmul(x: jax.Array, w_t: jax.Array, key: Any) -> jax.Array:
        return _mm(_fp4(x, out_dtype), weight(w_t, 0), out_dtype)  # both along K

    def forward(x: jax.Array, w_t: jax.Array, key: Any) -> tuple[jax.Array, Any]:
        return matmul(x, w_t, key), (x, w_t, key)  # high precision kept

    def backward(saved: Any, grad: jax.Array) -> tuple[Any, Any, Any]:
        x, w_t, key = saved
        grad = grad.astype(out_dtype)
        dgrad_key, wgrad_key = (None, None) if key is None else tuple(jax.random.split(key))
        if not recipe.stochastic_rounding:
            dgrad_key = wgrad_key = None
        # input gradient: dy along N, the weight along N
        grad_x = _mm(_fp4(grad, out_dtype, dgrad_key), weight(w_t, 1).T, out_dtype)
        # weight gradient: x.T and dy.T along M, through the Hadamard transform
        xt, dyt = x.T, grad.T
        if recipe.random_hadamard_transform:
            xt = random_hadamard_transform(xt, recipe.signs)
            dyt = random_hadamard_transform(dyt, recipe.signs)
        grad_w_t = _mm(_fp4(xt, out_dtype), _fp4(dyt, out_dtype, wgrad_key).T, out_dtype)
        no_key = None if key is None else np.zeros(np.shape(key), jax.dtypes.float0)
        return grad_x.astype(x.dtype), grad_w_t.astype(w_t.dtype), no_key

    matmul.defvjp(forward, backward)
    return matmul(x, w_t, key)
