"""``low_precision_state``: an optimizer's state stored in bfloat16, float8 or 8 bits.

Adam keeps two float32 numbers per parameter, twice the parameters' own memory in
float32 and four times it in bfloat16. Stored in bfloat16 they take half; in
torchao's block-wise float8 or 8-bit formats (``AdamWFp8``, ``AdamW8bit``) about a
quarter. The optimizer itself still computes in float32: the state is widened before
each update and narrowed after it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale.optim._blockwise import (
    dequantize_blockwise,
    format_of,
    quantize_blockwise,
)
from jaxscale.optim._kahan import KahanSummationState
from jaxscale.optim._master_weights import MasterWeightsState
from jaxscale.optim._variables import holding, is_variable, sharding_names, value_of
from jaxscale.optim._wrapping import validated_inner

BFLOAT16 = np.dtype(jnp.bfloat16)
# torchao (after bitsandbytes) quantizes only tensors of at least this many elements
SMALLEST_QUANTIZED = 4096
# optax's names for second moments, which torchao stores with the unsigned map
SECOND_MOMENTS = ("nu", "nu_max")
# jaxscale's own states whose other fields are parameters (master copies, Kahan
# compensation), not statistics: only their inner_state is narrowed
_PARAMETER_SIDE = (MasterWeightsState, KahanSummationState)


class BlockQuantized(NamedTuple):
    """One leaf of an optimizer state in a block-wise format (:func:`quantize_blockwise`).

    Attributes:
      codes: ``float8_e4m3fn`` values or ``uint8`` indices, of the leaf's shape.
      scale: one float32 scale per block.
    """

    codes: jax.Array
    scale: jax.Array


class LowPrecisionState(NamedTuple):
    """State of :func:`low_precision_state`.

    Attributes:
      inner_state: the wrapped optimizer's state, each leaf stored as the format
        says: a bfloat16 array, a :class:`BlockQuantized`, or as the optimizer made it.
    """

    inner_state: Any


def low_precision_state(
    inner: optax.GradientTransformation, dtype: Any = jnp.bfloat16, *, block_size: int = 256
) -> optax.GradientTransformationExtraArgs:
    """Store ``inner``'s state in ``dtype`` between steps; ``inner`` computes on float32.

    Which leaves of ``inner``'s state are stored narrow, and how:

    * ``jnp.bfloat16``: every floating leaf that is not a scalar (scalars are counts,
      learning rates and other hyperparameters), rounded to nearest even.
    * ``jnp.float8_e4m3fn``: torchao's ``OptimStateFp8``; ``"int8"``: torchao's
      ``OptimState8bit``, with the unsigned map for second moments (optax's ``nu``
      and ``nu_max`` fields, torchao's ``exp_avg_sq``) and the signed map for the
      rest. As in torchao, only floating leaves of at least 4,096 elements whose size
      is a multiple of ``block_size`` are quantized (one float32 scale per
      ``block_size`` elements); the others stay as ``inner`` made them.

    Before each update the stored leaves are widened to float32 (bfloat16 exactly;
    the block formats with :func:`dequantize_blockwise`), ``inner`` runs, and its new
    state is stored again, so the state keeps its structure and dtypes from step to
    step (a requirement of ``jit``'s donated buffers and of
    :func:`jaxscale.grad_scaler`'s skipped steps); a change in ``inner``'s own
    structure or shapes is an error that names the leaf. Master copies and Kahan
    compensation buffers of jaxscale's transforms inside ``inner`` are parameters,
    not statistics, and are left as they are.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      dtype: ``jnp.bfloat16``, ``jnp.float8_e4m3fn`` or ``"int8"``.
      block_size: elements per scale for the block formats.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LowPrecisionState`.

    Raises:
      TypeError: for an ``inner`` that is not an Optax transform.
      ValueError: for another ``dtype`` or a ``block_size`` that is not a positive int.

    >>> import jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> state = jaxscale.low_precision_state(optax.adam(1e-3), "int8").init(params)
    >>> mu = state.inner_state[0].mu["w"]
    >>> mu.codes.dtype, mu.codes.shape, mu.scale.shape
    (dtype('uint8'), (64, 64), (16,))
    """
    inner = validated_inner(inner, "low_precision_state")
    fmt = BFLOAT16 if _is_bfloat16(dtype) else format_of(dtype)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")

    def store(path: tuple[Any, ...], node: Any) -> Any:
        # a leaf of Flax NNX's state arrives in a variable: the variables go inside a
        # BlockQuantized, which Flax then updates field by field (see _variables)
        leaf = value_of(node)
        if not _is_floating_array(leaf):
            return node
        if fmt is BFLOAT16:
            return holding(node, leaf.astype(BFLOAT16)) if leaf.ndim else node
        if leaf.size < SMALLEST_QUANTIZED or leaf.size % block_size:
            return node
        codes, scale = quantize_blockwise(leaf, fmt, block_size=block_size, signed=_signed(path))
        return BlockQuantized(
            holding(node, codes), holding(node, scale, out_sharding=_scale_sharding(node))
        )

    def load(path: tuple[Any, ...], leaf: Any) -> Any:
        if isinstance(leaf, BlockQuantized):
            codes, scale = value_of(leaf.codes), value_of(leaf.scale)
            return dequantize_blockwise(codes, scale, fmt, signed=_signed(path))
        if fmt is BFLOAT16 and _is_floating_array(leaf) and leaf.dtype == BFLOAT16 and leaf.ndim:
            return leaf.astype(jnp.float32)
        return leaf

    def init_fn(params: optax.Params) -> LowPrecisionState:
        return LowPrecisionState(_statistics_map(store, inner.init(params)))

    def update_fn(
        updates: optax.Updates,
        state: LowPrecisionState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LowPrecisionState]:
        wide_state = _statistics_map(load, state.inner_state)
        new_updates, new_wide_state = inner.update(updates, wide_state, params, **extra_args)
        stored = _statistics_map(store, new_wide_state)
        _require_same_layout(state.inner_state, stored)
        return new_updates, LowPrecisionState(stored)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _scale_sharding(node: Any) -> tuple[Any, ...] | None:
    """The sharding names of a leaf's scales: they run along the flattened leaf, so they
    shard as its first axis does when no other axis is sharded."""
    names = sharding_names(node)
    if names is None:
        return None
    return (names[0] if all(name is None for name in names[1:]) else None,)


def _is_bfloat16(dtype: Any) -> bool:
    if isinstance(dtype, str):
        return False
    try:
        return np.dtype(dtype) == BFLOAT16
    except TypeError:
        return False


def _is_floating_array(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def _signed(path: tuple[Any, ...]) -> bool:
    names = {getattr(key, "name", getattr(key, "key", None)) for key in path}
    return not names & set(SECOND_MOMENTS)


def _statistics_map(fn: Any, state: Any, path: tuple[Any, ...] = ()) -> Any:
    """``fn(path, leaf)`` on each leaf (a :class:`BlockQuantized` counts as one) of
    ``state``, except the parameter side of jaxscale's own states."""

    def is_leaf(node: Any) -> bool:
        return isinstance(node, (BlockQuantized, *_PARAMETER_SIDE)) or is_variable(node)

    def visit(subpath: tuple[Any, ...], node: Any) -> Any:
        if not isinstance(node, _PARAMETER_SIDE):
            return fn(path + subpath, node)
        return node._replace(
            inner_state=_statistics_map(
                fn, node.inner_state, path + subpath + (jax.tree_util.GetAttrKey("inner_state"),)
            )
        )

    return jax.tree_util.tree_map_with_path(visit, state, is_leaf=is_leaf)


def _layout(state: Any) -> list[tuple[str, Any]]:
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return [
        (jax.tree_util.keystr(path), jax.ShapeDtypeStruct(np.shape(leaf), _dtype(leaf)))
        for path, leaf in leaves
    ]


def _dtype(leaf: Any) -> Any:
    return getattr(leaf, "dtype", type(leaf))


def _require_same_layout(before: Any, after: Any) -> None:
    if jax.tree.structure(before) != jax.tree.structure(after):  # type: ignore[operator]
        raise ValueError(
            "the wrapped optimizer's state changed structure between init and update: "
            f"{jax.tree.structure(before)} became {jax.tree.structure(after)}"
        )
    for (path, old), (_, new) in zip(_layout(before), _layout(after), strict=True):
        if old != new:
            raise ValueError(
                f"the wrapped optimizer's state leaf {path} was {old.dtype}{list(old.shape)} "
                f"after init and is {new.dtype}{list(new.shape)} after update; its init and "
                "update must agree on every leaf's shape"
            )
