"""Multiplying a loss (or any tree of outputs) by the loss scale."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxscale import _leaves


def scale_outputs(outputs: Any, scale: jax.Array) -> Any:
    """Multiply every floating leaf of ``outputs`` by ``scale``, keeping each leaf's dtype.

    The counterpart of PyTorch's ``outputs * scaler._scale``. ``outputs`` is an
    array or any pytree of arrays (list, tuple, dict, ...), returned with the
    same structure. Each product is formed in float32 (float64 for float64
    leaves) and rounded once to the leaf's dtype; compute the loss in float32,
    since float16 cannot hold the default scale of 65536.

    Raises:
      TypeError: for a leaf that is not a floating array (an integer or complex
        array, a string, ...), naming the leaf.

    >>> import jax.numpy as jnp
    >>> from jaxscale import scale_outputs
    >>> scale_outputs(jnp.float32(0.25), jnp.float32(1024.0))
    Array(256., dtype=float32)
    """

    def scale_leaf(path: Any, leaf: Any) -> jax.Array:
        if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)):
            where = jax.tree_util.keystr(path) or "<root>"
            kind = f"dtype {leaf.dtype}" if hasattr(leaf, "dtype") else type(leaf).__name__
            raise TypeError(f"can only scale floating arrays, got {kind} at {where}")
        precision = _leaves.compute_dtype(leaf.dtype)
        return (leaf.astype(precision) * scale.astype(precision)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(scale_leaf, outputs)
