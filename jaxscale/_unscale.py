"""Unscaling gradients, as ``torch._amp_foreach_non_finite_check_and_unscale_``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxscale import _leaves
from jaxscale._finite import all_finite


def inverse_scale(scale: jax.Array) -> jax.Array:
    """Return ``1 / scale`` in float32, as PyTorch's ``_scale.double().reciprocal().float()``.

    A correctly rounded float32 division equals PyTorch's double reciprocal rounded
    to float32: the reciprocal of a 24-bit significand is never within a
    double-precision rounding error of a float32 rounding boundary, so the two
    roundings PyTorch performs cannot differ from one.
    """
    return jnp.float32(1.0) / jnp.asarray(scale, dtype=jnp.float32)


def unscale(tree: Any, inv_scale: jax.Array) -> Any:
    """Multiply every floating leaf of ``tree`` by ``inv_scale``, keeping each leaf's dtype.

    The product is formed in float32 (float64 for float64 leaves) and rounded once
    to the leaf's dtype, as PyTorch's kernel does.
    """

    def unscale_leaf(leaf: jax.Array) -> jax.Array:
        precision = _leaves.compute_dtype(leaf.dtype)
        product = leaf.astype(precision) * inv_scale.astype(precision)
        return product.astype(leaf.dtype)

    return _leaves.map_floating(unscale_leaf, tree)


def unscale_and_check(grads: Any, scale: jax.Array) -> tuple[Any, jax.Array]:
    """Unscale gradients of a scaled loss and report whether any was inf or NaN.

    The counterpart of ``torch._amp_foreach_non_finite_check_and_unscale_``:

    * ``found_inf`` is a boolean scalar, true when any element of any floating
      leaf of ``grads`` is ``+inf``, ``-inf`` or NaN. It is decided on the
      *scaled* values, before unscaling.
    * each floating leaf is multiplied by ``inv_scale``, the float32 rounding of
      ``1 / scale`` (see :func:`inverse_scale`), computed in float32 (float64 for
      float64 leaves) and returned in the leaf's own dtype;
    * integer, boolean and ``float0`` leaves and ``None`` pass through untouched;
      an empty tree is all finite.

    Unscaled values are returned even when ``found_inf`` is true, as PyTorch
    does; the caller decides whether to use them.

    Args:
      grads: a pytree of gradients of ``loss * scale``.
      scale: the float32 loss scale the loss was multiplied by.

    Returns:
      ``(unscaled_grads, found_inf)``.

    >>> import jax.numpy as jnp
    >>> from jaxscale import unscale_and_check
    >>> grads = {"w": jnp.array([512.0, 1024.0], jnp.float16)}
    >>> unscaled, found_inf = unscale_and_check(grads, jnp.float32(1024.0))
    >>> unscaled["w"], bool(found_inf)
    (Array([0.5, 1. ], dtype=float16), False)
    """
    found_inf = jnp.logical_not(all_finite(grads))
    return unscale(grads, inverse_scale(scale)), found_inf
