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
import numpy as np
from jax import lax

from jaxscale._src import leaves as _leaves

AxisName = Hashable | Sequence[Hashable]

# Leaves from this many elements up are folded before their check on CPU.
_SMALL_LEAF = 1 << 14
# Below this many elements, the CPU checks leaves of one shape and dtype together,
# in one reduction of up to ``_CHECKED_TOGETHER`` operands (see ``_cpu_all_finite_grouped``).
# Above it the folded check reads faster: a reduction runs on one core, the fold on all.
_GROUPED_BELOW = 1 << 17
_CHECKED_TOGETHER = 8
# The leaves of one reduction are combined elementwise into this many operands.
_OPERANDS = 2
# The bits of a float with its sign cleared, read as an integer, grow with its
# magnitude, and reach this value at +inf (NaNs lie above): a leaf is finite
# exactly when the largest such integer in it is below. Per dtype: the integer
# type of that width, and the bits of +inf.
_INF_BITS = {
    jnp.dtype(jnp.float16): (jnp.int16, 0x7C00),
    jnp.dtype(jnp.bfloat16): (jnp.int16, 0x7F80),
    jnp.dtype(jnp.float32): (jnp.int32, 0x7F800000),
    jnp.dtype(jnp.float64): (jnp.int64, 0x7FF0000000000000),
}
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
        scale, cpu=lambda s: jnp.float32(1.0) / s, default=_reciprocal_off_the_cpu
    )


def _reciprocal_off_the_cpu(scale: jax.Array) -> jax.Array:
    """:func:`correctly_rounded_reciprocal`, as a kernel of its own
    (:func:`_in_a_kernel_of_its_own`): it is read by the unscaling of every leaf."""
    return _in_a_kernel_of_its_own(correctly_rounded_reciprocal(scale))


def _in_a_kernel_of_its_own(value: jax.Array) -> jax.Array:
    """``value``, a float scalar, as the result of a two-element reduction.

    XLA's GPU compiler weighs fusing a scalar computation into each kernel that
    reads its result, and copies it there where that is cheap: the reciprocal of
    the scale, read by every gradient leaf's unscaling, added a fifth to the
    compile time of a 100-leaf step. A reduction is the root of its kernel and is
    fused into no reader. ``max(value, -inf)`` is ``value`` for every float but
    NaN, which stays NaN with the platform's bits (a GPU writes its canonical
    ``0x7FFFFFFF``); its two-element vector comes from an iota, which XLA does not
    simplify away as it would a broadcast.
    """
    first = lax.broadcasted_iota(jnp.int32, (2,), 0) == 0
    return jnp.max(jnp.where(first, value, jnp.asarray(-jnp.inf, value.dtype)))


def correctly_rounded_reciprocal(x: jax.Array) -> jax.Array:
    """``1 / x`` for float32 ``x``, rounded to nearest even, exactly on any platform.

    For ``x = m * 2**(e - 150)`` (``m`` its 24-bit significand, normalised first
    where ``x`` is subnormal, ``e`` its biased exponent) the reciprocal's
    significand is ``2**47 / m``. The float division estimates it (to within an
    ulp or two on a GPU); the remainder ``2**47 - q * m`` of the estimate ``q``,
    exact in 32-bit integers because it is small, then moves ``q`` to the nearest
    integer: the quotient rounded once. A result below float32's normal range is
    rounded where its subnormal encoding drops bits, and one above it is ``inf``:
    for every finite non-zero ``x`` the result is PyTorch's
    ``x.double().reciprocal().float()``, whatever the platform does with
    subnormals; ``1/±0`` is ``±inf``, ``1/±inf`` is ``±0`` and a NaN stays NaN.

    A handful of integer operations rather than a bit-by-bit long division: XLA's
    GPU compiler weighs fusing each operation of this scalar computation into every
    kernel that reads the result (the unscaling of each gradient leaf), so its
    length is compile time on every step that unscales.
    """
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & jnp.uint32(0x80000000)
    biased = ((bits >> 23) & 0xFF).astype(jnp.int32)
    fraction = bits & 0x7FFFFF
    # a subnormal x: shift its fraction up to a 24-bit significand, lowering its exponent
    shift = jnp.where(biased == 0, lax.clz(fraction).astype(jnp.int32) - 8, 0)
    significand = jnp.where(biased == 0, fraction << shift.astype(jnp.uint32), fraction | 0x800000)
    exponent = jnp.where(biased == 0, 1 - shift, biased)
    quotient, remainder = _nearest_quotient(significand)
    # 1/x = (quotient + remainder / significand) * 2**(result_exponent - 150), with
    # quotient in [2**23, 2**24] and |remainder| <= significand / 2
    result_exponent = 253 - exponent
    # Bits dropped below the result's last place: none for a normal result, 1 - exponent
    # for a subnormal one (1 or 2: x is at most 2**128)
    dropped = jnp.maximum(1 - result_exponent, 0).astype(jnp.uint32)
    kept = quotient >> dropped
    lost = quotient & ((jnp.uint32(1) << dropped) - 1)
    half = jnp.uint32(1) << (jnp.maximum(dropped, 1) - 1)
    # Round to nearest, ties to even: below the dropped bits lies remainder/significand,
    # in [-1/2, 1/2] (zero only for a power of two). A normal result drops nothing.
    at_half = lost == half
    up = (dropped > 0) & (
        (lost > half)
        | (at_half & (remainder > 0))
        | (at_half & (remainder == 0) & ((kept & 1) == 1))
    )
    kept = kept + up.astype(jnp.uint32)
    # Normal: a quotient of 2**24 (a power of two's reciprocal) is one exponent higher.
    # Subnormal: the encoding is the kept bits, a carry into bit 23 being the smallest
    # normal's.
    carried = kept >> 24
    normal = (jnp.maximum(result_exponent, 1).astype(jnp.uint32) + carried) << 23
    normal = normal | ((kept >> carried) & 0x7FFFFF)
    result = jnp.where(result_exponent >= 1, normal, kept)
    result = jnp.where(
        result_exponent + carried.astype(jnp.int32) >= 255, jnp.uint32(0x7F800000), result
    )
    # zero, inf and NaN, also in integers: a float division there would let XLA compare
    # x with zero as a float, which a CPU that treats subnormals as zero gets wrong
    zero = (biased == 0) & (fraction == 0)
    result = jnp.where(zero, jnp.uint32(0x7F800000), result)
    result = jnp.where(biased == 255, jnp.where(fraction == 0, 0, fraction | 0x7FC00000), result)
    return lax.bitcast_convert_type(result | sign, jnp.float32)


def _float_quotient(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """The platform's float32 division, which a GPU rounds to within an ulp or two."""
    return numerator / denominator


def quotient_within_one(dividend: int, significand: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(q, r)``, int32: ``q`` within one of ``dividend / significand`` and
    ``r = dividend - q * significand`` exactly, for a uint32 ``significand`` in
    ``[2**23, 2**24)`` and an integer ``dividend`` exact in float32 whose quotient is
    at least ``2**23`` and below ``2**31``.

    The float division estimates the quotient to within a few ulps (an integer-valued
    float, as the quotient is at least 2**23). The remainder of an estimate within 64
    of the quotient is below 2**31 in magnitude, so uint32 arithmetic, which wraps
    modulo 2**32, gives it exactly from the dividend's low 32 bits. The remainder's
    ratio to the divisor, rounded, then moves the estimate to within one; the caller's
    last exact step rounds it as it needs (nearest, or down).
    """
    divisor = significand.astype(jnp.float32)
    estimate = _float_quotient(jnp.float32(dividend), divisor).astype(jnp.uint32)
    low_bits = jnp.uint32(dividend & 0xFFFFFFFF)
    remainder = lax.bitcast_convert_type(low_bits - estimate * significand, jnp.int32)
    steps = _float_quotient(remainder.astype(jnp.float32), divisor)
    steps = jnp.clip(jnp.round(steps), -64, 64).astype(jnp.int32)
    quotient = estimate.astype(jnp.int32) + steps
    return quotient, remainder - steps * significand.astype(jnp.int32)


def _nearest_quotient(significand: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(q, r)``: ``q`` the integer nearest to ``2**47 / significand`` and
    ``r = 2**47 - q * significand``, for a uint32 ``significand`` in ``[2**23, 2**24)``:
    :func:`quotient_within_one`, then a last exact step to the nearest (a quotient is
    never halfway between two integers: 2**48 has no odd divisor).
    """
    quotient, remainder = quotient_within_one(1 << 47, significand)
    divisor = significand.astype(jnp.int32)
    up = 2 * remainder > divisor
    down = 2 * remainder < -divisor
    quotient = quotient + up.astype(jnp.int32) - down.astype(jnp.int32)
    remainder = remainder - jnp.where(up, divisor, 0) + jnp.where(down, divisor, 0)
    return quotient.astype(jnp.uint32), remainder


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
    and dtype (a model's layers, its biases) are checked together, eight at a time,
    in one kernel that also reads faster than one per leaf
    (:func:`_magnitudes_checked_together`). Large leaves keep :func:`_folded_check`, which
    spreads its pass over every core. Only with a single CPU device: operands of
    one reduction must share a sharding, and two leaves of one shape sharded
    differently would be gathered.

    The reductions form a binary tree: each takes the verdicts of two others into
    the elements it reduces, so the root's verdict is that of every leaf, and
    reductions of different branches run in parallel. A final "and" of one flag per
    leaf would be one fusion with a parameter per leaf, whose compile time XLA's
    CPU backend grows faster than the number of leaves (1.8 s at 1,000 leaves,
    where the whole check compiles in 0.6 s as a tree). The verdicts go in as
    data, not as the reductions' init values: XLA takes an init value to be the
    identity of the reduction, and drops it where it rewrites a reduction into
    something else.
    """
    same_kind: dict[tuple[Any, Any], list[jax.Array]] = collections.defaultdict(list)
    nodes: list[list[jax.Array]] = []  # the leaves each reduction checks
    for leaf in leaves:
        if leaf.size >= _GROUPED_BELOW:
            nodes.append([leaf])
        elif leaf.size:  # an empty leaf is finite, and could carry no verdict
            same_kind[(leaf.shape, leaf.dtype)].append(leaf)
    nodes += [
        group[start : start + _CHECKED_TOGETHER]
        for group in same_kind.values()
        for start in range(0, len(group), _CHECKED_TOGETHER)
    ]
    # Node k takes the verdicts of nodes 2k + 1 and 2k + 2 (a binary heap).
    verdicts: list[list[jax.Array]] = [[] for _ in nodes]
    for k in reversed(range(len(nodes))):
        children = [c for c in (2 * k + 1, 2 * k + 2) if c < len(nodes)]
        carried = [flag for child in children for flag in verdicts[child]]
        verdicts[k] = _checked_node(nodes[k], carried)
    return jnp.stack([jnp.asarray(True), *(verdicts[0] if nodes else [])]).all()


def _in_slots(flags: list[jax.Array], slots: int) -> list[jax.Array]:
    """``flags`` and-ed into at most ``slots`` flags, the i-th into slot ``i % slots``."""
    return [functools.reduce(operator.and_, flags[i::slots]) for i in range(min(slots, len(flags)))]


def _checked_node(leaves: list[jax.Array], carried: list[jax.Array]) -> list[jax.Array]:
    """The verdicts of one reduction over ``leaves``: each true when its share of the
    leaves is finite and its share of ``carried`` true; all of them true together
    exactly when every leaf is finite and every carried verdict true."""
    if len(leaves) == 1 and leaves[0].size >= _GROUPED_BELOW:
        return [_cpu_leaf_check(leaves[0], *_in_slots(carried, 1))]
    if leaves[0].dtype in _INF_BITS:
        return _magnitudes_checked_together(leaves, carried)
    return _checked_together(leaves, _in_slots(carried, len(leaves)))


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


def _magnitudes_checked_together(
    leaves: list[jax.Array], carried: list[jax.Array]
) -> list[jax.Array]:
    """The verdicts of ``leaves`` (one shape, a dtype of ``_INF_BITS``) and ``carried``,
    from one variadic reduction of ``_OPERANDS`` operands.

    Each operand is the elementwise maximum of the magnitude bits (the float's bits
    with its sign cleared, as an integer) of a share of the leaves, and of
    ``carried`` verdicts, a false one as the bits of +inf; its verdict is whether its
    largest element lies below +inf's bits. Integer maxima are what XLA's CPU
    backend vectorises best: against one boolean operand per leaf, this compiles in
    15-30% less time and reads as fast or faster. The leaves are not empty.
    """
    bits_type, inf_bits = _INF_BITS[leaves[0].dtype]
    sign_cleared = np.array(np.iinfo(bits_type).max, bits_type)
    operands: list[Any] = [None] * min(_OPERANDS, len(leaves))
    for i, leaf in enumerate(leaves):
        magnitude = lax.bitcast_convert_type(leaf, bits_type) & sign_cleared
        j = i % len(operands)
        operands[j] = magnitude if operands[j] is None else lax.max(operands[j], magnitude)
    finite, infinite = np.array(0, bits_type), np.array(inf_bits, bits_type)
    for i, flag in enumerate(carried):
        j = i % len(operands)
        operands[j] = jnp.maximum(operands[j], lax.select(flag, finite, infinite))

    def larger(left: tuple[jax.Array, ...], right: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return tuple(lax.max(a, b) for a, b in zip(left, right, strict=True))

    # 0 is the maximum's identity on magnitudes, which are never negative.
    starts = (finite,) * len(operands)
    largest = lax.reduce(tuple(operands), starts, larger, tuple(range(leaves[0].ndim)))
    return [value < infinite for value in largest]


def _checked_together(leaves: list[jax.Array], carried: list[jax.Array]) -> list[jax.Array]:
    """One boolean per leaf of ``leaves`` (one shape), from one variadic reduction: the
    check of a dtype with no entry in ``_INF_BITS`` (the float8 formats: several
    have no infinity, and some write NaN as the bits of negative zero).

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
    finite; a mutable array reference (``jax.new_ref``) is checked for the value it
    holds. One read of each leaf. Under ``jax.jit`` with sharded arrays
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
    leaves = _leaves.floating_leaves(_leaves.read_references(tree))
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
