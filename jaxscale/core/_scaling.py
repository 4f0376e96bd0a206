"""The arithmetic of the scale: multiplying by it, dividing by it, and the inf/NaN check.

Scaling a loss, unscaling its gradients and checking them are one concept seen
from three sides, and they share one convention: floating leaves are computed in
float32 (float64 for float64 leaves) and returned in their own dtype; integer,
boolean and ``float0`` leaves and ``None`` pass through.
"""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.core import _leaves

AxisName = Hashable | Sequence[Hashable]

# Leaves from this many elements up are folded before their check on CPU.
_SMALL_LEAF = 1 << 14
# Below this many elements, the CPU checks leaves of one shape and dtype together,
# in one reduction of up to ``_CHECKED_TOGETHER`` operands (see ``_cpu_all_finite_grouped``).
# Above it the folded check reads faster: a reduction runs on one core, the fold on all.
_GROUPED_BELOW = 1 << 17
_CHECKED_TOGETHER = 8
# Neighbouring elements and-ed by the CPU check (at most). XLA's CPU fusion
# emits a producer at most 15 times within one fusion; eight leave room for a
# gradient whose own computation reads a value twice.
_FOLDS = 8


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
        return _multiply(leaf, scale)

    return jax.tree_util.tree_map_with_path(scale_leaf, outputs)


def inverse_scale(scale: jax.Array) -> jax.Array:
    """Return ``1 / scale`` in float32, as PyTorch's ``_scale.double().reciprocal().float()``.

    A correctly rounded float32 division equals PyTorch's double reciprocal rounded
    to float32: the reciprocal of a 24-bit significand is never within a
    double-precision rounding error of a float32 rounding boundary, so the two
    roundings PyTorch performs cannot differ from one. XLA divides correctly
    rounded on CPU; GPUs divide float32 to within an ulp or two, so elsewhere the
    reciprocal is computed exactly by :func:`correctly_rounded_reciprocal`.

    >>> import jax.numpy as jnp
    >>> from jaxscale.core import inverse_scale
    >>> inverse_scale(jnp.float32(1024.0))
    Array(0.00097656, dtype=float32)
    """
    scale = jnp.asarray(scale, dtype=jnp.float32)
    return lax.platform_dependent(
        scale, cpu=lambda s: jnp.float32(1.0) / s, default=correctly_rounded_reciprocal
    )


def correctly_rounded_reciprocal(x: jax.Array) -> jax.Array:
    """``1 / x`` for float32 ``x``, rounded to nearest even, in integer arithmetic.

    For a normal ``x = m * 2**(e - 150)`` (``m`` its 24-bit significand, ``e`` its
    biased exponent) the reciprocal's significand is ``2**47 / m``, computed by
    long division in uint32 (24 quotient bits, the remainder deciding the
    rounding). Where the result would not be a normal float32 (``x`` zero,
    subnormal, infinite, NaN or above ``2**125``) the float division is used;
    those scales give subnormal or non-finite reciprocals, which a GPU flushes or
    handles as PyTorch's does.
    """
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    exponent = (bits >> 23) & 0xFF
    significand = (bits & 0x7FFFFF) | 0x800000
    remainder = jnp.full_like(bits, 1 << 23)
    quotient = jnp.zeros_like(bits)
    for _ in range(24):
        remainder = remainder << 1
        fits = remainder >= significand
        remainder = jnp.where(fits, remainder - significand, remainder)
        quotient = (quotient << 1) | fits.astype(jnp.uint32)
    # round to nearest, ties to even: compare twice the remainder with the divisor
    twice = remainder << 1
    up = (twice > significand) | ((twice == significand) & ((quotient & 1) == 1))
    quotient = quotient + up.astype(jnp.uint32)
    carried = quotient >> 24  # rounding up 0xFFFFFF gives 2**24: one exponent higher
    result_exponent = jnp.uint32(253) - exponent + carried
    result = (result_exponent << 23) | ((quotient >> carried) & 0x7FFFFF)
    power_of_two = (bits & 0x7FFFFF) == 0
    result = jnp.where(power_of_two, (jnp.uint32(254) - exponent) << 23, result)
    exact = (exponent >= 1) & ((exponent <= 252) | (power_of_two & (exponent == 253)))
    return jnp.where(exact, lax.bitcast_convert_type(result, jnp.float32), 1.0 / x)


def unscale(tree: Any, inv_scale: jax.Array) -> Any:
    """Multiply every floating leaf of ``tree`` by ``inv_scale``, keeping each leaf's dtype.

    The product is formed in float32 (float64 for float64 leaves) and rounded once
    to the leaf's dtype, as PyTorch's kernel does.
    """
    factors: dict[Any, jax.Array] = {}  # inv_scale in each precision, converted once

    def multiply(leaf: jax.Array) -> jax.Array:
        precision = _leaves.compute_dtype(leaf.dtype)
        if precision not in factors:
            factors[precision] = lax.convert_element_type(inv_scale, precision)
        return _multiply(leaf, factors[precision])

    return _leaves.map_floating(multiply, tree)


def _multiply(leaf: jax.Array, factor: jax.Array) -> jax.Array:
    """``leaf * factor`` formed in the leaf's compute precision, rounded once to its dtype.

    Written in ``lax`` rather than ``jnp``: no promotion rules to resolve, which is
    most of the time a step takes to trace when it is done once per leaf.
    """
    precision = _leaves.compute_dtype(leaf.dtype)
    product = lax.mul(
        lax.convert_element_type(leaf, precision), lax.convert_element_type(factor, precision)
    )
    return lax.convert_element_type(product, leaf.dtype)


def _elementwise_check(leaf: jax.Array, carried: jax.Array | None = None) -> jax.Array:
    return _all_of(jnp.isfinite(leaf), carried)


def _all_of(flags: jax.Array, carried: jax.Array | None) -> jax.Array:
    """``jnp.all(flags)``, and-ed with ``carried`` when given: inside the reduction, as
    an "and" with every flag (which needs ``flags`` not to be empty)."""
    return jnp.all(flags if carried is None else flags & carried)


def _folded_check(leaf: jax.Array, carried: jax.Array | None = None) -> jax.Array:
    """``_elementwise_check`` for XLA's CPU backend: fold the leaf before reducing it.

    The last axis is cut into groups of ``folds`` neighbouring elements, and the
    ``isfinite`` flags of each group are and-ed: one elementwise pass over the
    leaf, which XLA's CPU backend vectorises, splits across cores and fuses with
    whatever computes the leaf (nothing is materialised when the gradient is a
    cheap function of parameters and data). Only the folded flags, a byte per
    ``folds`` elements, go through the reduction, which on CPU is several times
    slower per byte. Neighbours are grouped, never distant elements, so a leaf
    sharded across devices is folded where it lies, without moving data.
    """
    last = leaf.shape[-1]  # large leaves have an axis
    folds = next((k for k in range(_FOLDS, 1, -1) if last % k == 0), None)
    if folds is None:
        return _elementwise_check(leaf, carried)
    groups = leaf.reshape(*leaf.shape[:-1], last // folds, folds)
    folded = jnp.isfinite(groups[..., 0])
    for i in range(1, folds):
        folded = folded & jnp.isfinite(groups[..., i])
    return _all_of(folded, carried)


def leaf_is_finite(leaf: jax.Array) -> jax.Array:
    """A boolean scalar: whether every element of the floating array ``leaf`` is finite."""
    if leaf.size < _SMALL_LEAF:
        return _elementwise_check(leaf)
    return lax.platform_dependent(leaf, cpu=_folded_check, default=_elementwise_check)


def _cpu_all_finite_grouped(*leaves: jax.Array) -> jax.Array:
    """``all_finite`` for XLA's CPU backend with one device: leaves of one shape together.

    XLA's CPU backend splits each reduction into two ``reduce-window`` stages and a
    final reduction, three kernels per leaf to compile; a reduction of several
    operands at once (a variadic ``reduce``) is left whole. So leaves sharing a shape
    and dtype (a model's layers, its biases) are and-reduced together, a few at a
    time, in one kernel that also reads faster than one per leaf. Large leaves keep
    :func:`_folded_check`, which spreads its pass over every core. Only with a single
    CPU device: operands of one reduction must share a sharding, and two leaves of one
    shape sharded differently would be gathered.

    The reductions form a binary tree: each and-s the flags of two others into
    the elements it reduces, so the root's few flags hold the verdict of every
    leaf, and reductions of different branches run in parallel. A final "and" of
    one flag per leaf would be one fusion with a parameter per leaf, whose compile
    time XLA's CPU backend grows faster than the number of leaves (1.8 s at 1,000
    leaves, where the whole check compiles in 0.6 s as a tree). The flags go in as
    data, not as the reductions' init values: XLA takes an init value to be the
    identity of the reduction, and drops it where it rewrites a reduction into
    something else.
    """
    same_kind: dict[tuple[Any, Any], list[jax.Array]] = collections.defaultdict(list)
    nodes: list[list[jax.Array]] = []  # the leaves each reduction checks
    for leaf in leaves:
        if leaf.size >= _GROUPED_BELOW:
            nodes.append([leaf])
        elif leaf.size:  # an empty leaf is finite, and could carry no flag
            same_kind[(leaf.shape, leaf.dtype)].append(leaf)
    nodes += [
        group[start : start + _CHECKED_TOGETHER]
        for group in same_kind.values()
        for start in range(0, len(group), _CHECKED_TOGETHER)
    ]
    # Node k reads the flags of nodes 2k + 1 and 2k + 2 (a binary heap); sorted by
    # size, no node has more flags to pass on than its parent has leaves to take them.
    nodes.sort(key=len, reverse=True)
    flags: list[list[jax.Array]] = [[] for _ in nodes]
    for k in reversed(range(len(nodes))):
        children = [flags[c] for c in (2 * k + 1, 2 * k + 2) if c < len(nodes)]
        carried = [functools.reduce(operator.and_, column) for column in _columns(children)]
        flags[k] = _checked_node(nodes[k], carried)
    return jnp.stack([jnp.asarray(True), *(flags[0] if nodes else [])]).all()


def _columns(lists: list[list[jax.Array]]) -> list[list[jax.Array]]:
    """``[[a[0], b[0]], [a[1], b[1]], [a[2]], ...]`` of ``[a, b]``: the i-th of each list."""
    width = max(map(len, lists), default=0)
    return [[flags[i] for flags in lists if i < len(flags)] for i in range(width)]


def _checked_node(leaves: list[jax.Array], carried: list[jax.Array]) -> list[jax.Array]:
    """The flag of each of ``leaves`` (one reduction), and-ed with ``carried``'s, one each."""
    if len(leaves) == 1 and leaves[0].size >= _GROUPED_BELOW:
        return [_cpu_leaf_check(leaves[0], carried[0] if carried else None)]
    return _checked_together(leaves, carried)


def _cpu_all_finite_by_leaf(*leaves: jax.Array) -> jax.Array:
    """``all_finite`` for XLA's CPU backend with several devices: each leaf where it lies."""
    return jnp.stack([_cpu_leaf_check(leaf) for leaf in leaves]).all()


def _cpu_leaf_check(leaf: jax.Array, carried: jax.Array | None = None) -> jax.Array:
    if leaf.size < _SMALL_LEAF:
        return _elementwise_check(leaf, carried)
    return _folded_check(leaf, carried)


def _one_cpu_device() -> bool:
    """Whether programs compiled for the CPU run on one device (no sharding to respect).

    False when the CPU backend is not loaded (``JAX_PLATFORMS=cuda``): a program lowered
    for the CPU from such a process (``jax.export``) may run on any number of devices,
    and the leaf-by-leaf check is right for all of them.
    """
    try:
        return len(jax.devices("cpu")) == 1
    except RuntimeError:  # JAX's answer for a platform it did not load
        return False


def _checked_together(leaves: list[jax.Array], carried: list[jax.Array]) -> list[jax.Array]:
    """One boolean per leaf of ``leaves`` (one shape), from one variadic reduction.

    ``carried`` holds at most one flag per leaf, and-ed into that leaf's flags, so
    each returned flag is also the "and" of the one carried in. The leaves are not
    empty.
    """
    flags = tuple(
        jnp.isfinite(leaf) & carried[i] if i < len(carried) else jnp.isfinite(leaf)
        for i, leaf in enumerate(leaves)
    )

    def both(left: tuple[jax.Array, ...], right: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return tuple(a & b for a, b in zip(left, right, strict=True))

    starts = (True,) * len(leaves)
    return list(lax.reduce(flags, starts, both, tuple(range(leaves[0].ndim))))


def _elementwise_all_finite(*leaves: jax.Array) -> jax.Array:
    """``all_finite`` off the CPU: each leaf's elementwise check."""
    return jnp.stack([_elementwise_check(leaf) for leaf in leaves]).all()


def all_finite(tree: Any) -> jax.Array:
    """Return a boolean scalar: whether every floating element of ``tree`` is finite.

    ``+inf``, ``-inf`` and NaN all count as non-finite. Integer, boolean, ``float0``
    leaves and ``None`` are ignored, and a tree with no floating leaves is all
    finite. One read of each leaf. Under ``jax.jit`` with sharded arrays
    the result is already global; under ``shard_map`` or ``pmap`` reduce it over
    the mapped axis (:func:`any_over_axis`; the transform and the facade do so
    for their ``axis_name``).

    >>> import jax.numpy as jnp
    >>> from jaxscale import all_finite
    >>> bool(all_finite({"w": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
    >>> bool(all_finite({"steps": jnp.arange(3), "none": None}))
    True
    """
    leaves = _leaves.floating_leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    # Decided here, not inside the branch: JAX caches a traced branch by its function.
    cpu = _cpu_all_finite_grouped if _one_cpu_device() else _cpu_all_finite_by_leaf
    flag = lax.platform_dependent(*leaves, cpu=cpu, default=_elementwise_all_finite)
    return _computed_once(flag)


def _computed_once(flag: jax.Array) -> jax.Array:
    """``flag`` itself, in a form XLA computes once rather than in every fusion reading it.

    XLA copies cheap scalar arithmetic into each fusion that consumes it. The skip
    decision is an "and" over one check per leaf and is read by a select in every
    leaf's update, so copied there it would make the program, and its compile
    time, grow with the square of the number of leaves. A square root is an
    operation XLA's fusion does not duplicate; of 0 and 1 it is exact.
    """
    return jnp.sqrt(flag.astype(jnp.float32)) > 0


def any_over_axis(found_inf: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """``found_inf`` or-ed over every device of ``axis_name`` (itself when None).

    Under ``shard_map`` or ``pmap`` each device checks its own gradients; the
    skip decision must be the same everywhere, so it is reduced over the axis.
    """
    if axis_name is None:
        return found_inf
    return lax.pmax(found_inf.astype(jnp.int32), axis_name) > 0


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
