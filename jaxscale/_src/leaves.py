"""Which leaves of a tree the scaler touches, and in what precision.

Floating leaves (float8 through float64) are scaled, unscaled and checked for
inf/NaN. Integer, boolean and ``float0`` leaves (``jax.grad`` of integer inputs)
and ``None`` pass through untouched. Complex leaves are rejected: float16 has no
complex counterpart, so a complex gradient never needs loss scaling, and PyTorch
rejects them too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._src.jaxprs import is_ref


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


def read_references(tree: Any) -> Any:
    """``tree`` with each mutable array reference (``jax.new_ref``; a variable's value in
    Flax's reference mode) replaced by the value it holds now."""
    return jax.tree.map(lambda leaf: leaf[...] if is_ref(leaf) else leaf, tree)


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
    """Raise ``ValueError`` unless ``grads`` matches ``params`` leaf for leaf, in shape.

    Checked before a step so that a mismatch is reported by name, before anything
    is traced or changed, rather than deep inside the optimizer. As in Optax, a
    ``None`` gradient (at a leaf or over a whole subtree) means "no update here",
    and parameters that are not floating arrays (an Equinox module's activation
    function, an integer buffer) need no gradient. A gradient's shape is its
    parameter's, or that shape after leading batch axes (per-example gradients).
    """
    mismatch = structure_mismatch(grads, params)
    if mismatch is not None:
        raise mismatch
    require_matching_shapes(grads, params)


def structure_mismatch(grads: Any, params: Any) -> ValueError | None:
    """The ``ValueError`` naming the leaves where ``grads`` and ``params`` differ in tree
    structure (as :func:`require_matching` sees them), or ``None`` where they agree."""
    grad_leaves = dict(_leaves_with_paths(grads))
    param_leaves = dict(_leaves_with_paths(params))
    no_update = {path for path, grad in grad_leaves.items() if grad is None}
    missing = [
        jax.tree_util.keystr(path)
        for path, param in param_leaves.items()
        if path not in grad_leaves
        and _is_floating_array(param)
        and not any(path[:n] in no_update for n in range(len(path)))
    ]
    extra = [
        jax.tree_util.keystr(path)
        for path, grad in grad_leaves.items()
        if path not in param_leaves and grad is not None
    ]
    if not (missing or extra):
        return None
    problems = []
    if missing:
        problems.append(f"no gradient for parameter {', '.join(missing)}")
    if extra:
        problems.append(f"a gradient at {', '.join(extra)} with no parameter")
    return ValueError(
        "the gradients do not match the parameters' tree structure: " + "; ".join(problems)
    )


def require_matching_shapes(grads: Any, params: Any) -> None:
    """Raise ``ValueError`` for a gradient whose shape is not its parameter's (at the same
    path; leading batch axes allowed), naming the path and both shapes."""
    param_leaves = dict(_leaves_with_paths(params))
    for path, grad in _leaves_with_paths(grads):
        param = param_leaves.get(path)
        if grad is None or param is None:
            continue
        shape, expected = np.shape(grad), np.shape(param)
        # per-example gradients (as optax.contrib.differentially_private_aggregate
        # takes them) carry leading batch axes before the parameter's shape
        if shape[len(shape) - len(expected) :] != expected or len(shape) < len(expected):
            raise ValueError(
                f"the gradient at {jax.tree_util.keystr(path)} has shape {shape}, "
                f"but its parameter has shape {expected}"
            )


def optax_params_mismatch(grads: Any, params: Any) -> ValueError | None:
    """Check ``grads`` against an Optax transformation's ``params``: a shape mismatch at
    a path both share raises ``ValueError`` now; a mismatch of tree structure is
    returned, for :func:`noted_on_failure` to name if the optimizer then fails.

    Optax's ``params`` need not have the gradients' structure: ``optax.lookahead``
    takes its fast and slow parameters together.
    """
    require_matching_shapes(grads, params)
    return structure_mismatch(grads, params)


@contextlib.contextmanager
def noted_on_failure(mismatch: ValueError | None) -> Iterator[None]:
    """Run the block; if it raises and ``mismatch`` is not ``None``, add ``mismatch``'s
    message to the error as a note (PEP 678) and let it propagate.

    A structure mismatch with an Optax transformation's ``params`` is not an error
    in itself (:func:`optax_params_mismatch`); where the optimizer's update fails,
    it is the likely reason, and the note names its leaves.
    """
    try:
        yield
    except Exception as error:
        if mismatch is not None:
            error.add_note(str(mismatch))
        raise


def _leaves_with_paths(tree: Any) -> list[tuple[Any, Any]]:
    """``(path, leaf)`` pairs of ``tree``, with ``None`` kept as a leaf."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda node: node is None)[0]


def _is_floating_array(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))
