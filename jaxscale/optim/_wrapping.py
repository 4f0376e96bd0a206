"""What every low-precision transform checks and shares: the wrapped optimizer, the
parameters it needs, and which leaves are narrower than a precision."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale._src import validation


def validated_inner(inner: Any, transform: str) -> optax.GradientTransformationExtraArgs:
    """``inner`` as an Optax transform that accepts extra arguments; a clear error for a
    factory passed uncalled (``optax.adam`` for ``optax.adam(1e-3)``) or anything else."""
    problem = validation.optimizer_problem(inner, transform)
    if problem is not None:
        raise problem
    return optax.with_extra_args_support(inner)


def require_params(params: Any, transform: str) -> None:
    if params is None:
        raise ValueError(
            f"{transform} writes the parameters, so its update needs them: call "
            "tx.update(grads, opt_state, params)"
        )


def is_narrower(leaf: Any, dtype: Any) -> bool:
    """Whether ``leaf`` is a floating array with fewer bits than ``dtype``."""
    leaf_dtype = getattr(leaf, "dtype", None)
    if leaf_dtype is None or not jnp.issubdtype(leaf_dtype, jnp.floating):
        return False
    return np.dtype(leaf_dtype).itemsize < np.dtype(dtype).itemsize


def as_float32_where_narrower(tree: Any) -> Any:
    """``tree`` with each floating leaf narrower than float32 widened to float32."""
    return jax.tree.map(
        lambda leaf: leaf.astype(jnp.float32) if is_narrower(leaf, jnp.float32) else leaf, tree
    )


def map_with_optional(fn: Any, optional: Any, *trees: Any) -> Any:
    """``jax.tree.map`` over ``optional`` (a tree like ``trees[0]`` with ``None`` where
    a transform keeps nothing for a leaf) and ``trees``; ``fn`` sees ``None`` there."""
    return jax.tree.map(fn, optional, *trees, is_leaf=lambda node: node is None)


def floating_dtype(dtype: Any, name: str) -> np.dtype:
    """``dtype`` (a floating dtype or its name, ``"bfloat16"``) as a NumPy dtype."""
    try:
        result = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{name} must be a floating dtype or its name, such as jnp.float32 or 'float32', "
            f"got {dtype!r}"
        ) from None
    if not jnp.issubdtype(result, jnp.floating):
        raise ValueError(
            f"{name} must be a floating dtype or its name, such as jnp.float32 or 'float32', "
            f"got {result}"
        )
    return result


# The states of the transforms that write half-precision parameters their own way, by
# the transform's name: one such writer inside another sees the outer one's float32
# copies of the parameters, so it has nothing to write (and masters are never kept).
PARAMETER_WRITERS: dict[type, str] = {}


def require_no_writer_inside(state: Any, transform: str) -> None:
    """A ValueError when ``state`` (a wrapped optimizer's) holds a parameter writer's state."""
    found = [
        PARAMETER_WRITERS[type(node)]
        for node in jax.tree.leaves(state, is_leaf=lambda node: type(node) in PARAMETER_WRITERS)
        if type(node) in PARAMETER_WRITERS
    ]
    if found:
        raise ValueError(
            f"{transform}({found[0]}(...)): {found[0]} inside {transform} sees the float32 "
            f"copies {transform} gives it and never writes a half-precision parameter; use "
            f"one of them, around the optimizer (e.g. {transform}(optax.adamw(...)) or "
            f"{found[0]}(optax.adamw(...)))"
        )
