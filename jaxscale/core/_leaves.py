"""Which leaves of a tree the scaler touches, and in what precision.

Floating leaves (float8 through float64) are scaled, unscaled and checked for
inf/NaN. Integer, boolean and ``float0`` leaves (``jax.grad`` of integer inputs)
and ``None`` pass through untouched. Complex leaves are rejected: float16 has no
complex counterpart, so a complex gradient never needs loss scaling, and PyTorch
rejects them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_floating(leaf: Any) -> bool:
    """Whether ``leaf`` is a floating array the scaler acts on; raises for non-arrays."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        raise TypeError(f"expected an array, got {type(leaf).__name__} {leaf!r}")
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"complex arrays are not supported, got dtype {dtype}")
    return bool(jnp.issubdtype(dtype, jnp.floating))


def compute_dtype(dtype: Any) -> Any:
    """Arithmetic precision for a leaf: float64 for float64, float32 otherwise.

    PyTorch computes in ``opmath_t``: float for half, bfloat16 and float; double
    for double.
    """
    return jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32


def map_floating(fn: Callable[[jax.Array], Any], tree: Any) -> Any:
    """Apply ``fn`` to the floating leaves of ``tree``; other leaves are returned as is.

    Errors for unsupported leaves name the leaf's path in the tree.
    """

    def apply(path: Any, leaf: Any) -> Any:
        try:
            floating = is_floating(leaf)
        except TypeError as error:
            where = jax.tree_util.keystr(path) or "<root>"
            raise TypeError(f"leaf {where}: {error}") from None
        return fn(leaf) if floating else leaf

    return jax.tree_util.tree_map_with_path(apply, tree)


def floating_leaves(tree: Any) -> list[jax.Array]:
    """The floating leaves of ``tree`` in flattening order, validated as by :func:`map_floating`."""
    found: list[jax.Array] = []

    def collect(leaf: jax.Array) -> jax.Array:
        found.append(leaf)
        return leaf

    map_floating(collect, tree)
    return found


def require_matching(grads: Any, params: Any) -> None:
    """Raise ``ValueError`` unless ``grads`` has the tree structure and shapes of ``params``.

    Checked before a step so that a mismatch is reported by name, before anything
    is traced or changed, rather than deep inside the optimizer.
    """
    grad_leaves = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    param_leaves = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    missing = [jax.tree_util.keystr(k) for k in param_leaves if k not in grad_leaves]
    extra = [jax.tree_util.keystr(k) for k in grad_leaves if k not in param_leaves]
    if missing or extra:
        problems = []
        if missing:
            problems.append(f"no gradient for parameter {', '.join(missing)}")
        if extra:
            problems.append(f"a gradient at {', '.join(extra)} with no parameter")
        raise ValueError(
            "the gradients do not match the parameters' tree structure: " + "; ".join(problems)
        )
    for path, grad in grad_leaves.items():
        shape, expected = np.shape(grad), np.shape(param_leaves[path])
        if shape != expected:
            raise ValueError(
                f"the gradient at {jax.tree_util.keystr(path)} has shape {shape}, "
                f"but its parameter has shape {expected}"
            )
