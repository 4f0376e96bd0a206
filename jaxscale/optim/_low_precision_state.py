"""``low_precision_state``: an optimizer's state stored in bfloat16, float8, 8 or 4 bits.

Adam keeps two float32 numbers per parameter, twice the parameters' own memory in
float32 and four times it in bfloat16. Stored in bfloat16 they take half; in
torchao's block-wise float8 or 8-bit formats (``AdamWFp8``, ``AdamW8bit``) about a
quarter; in its 4-bit format (``AdamW4bit``) about an eighth. The optimizer itself
still computes in float32: the state is widened before each update and narrowed
after it, a slice at a time where the optimizer allows (see ``_in_place``).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale._src.deferred import derived_elementwise
from jaxscale._src.explicit_axes import (
    divisible_names,
    explicit_spec,
    placed_like,
    spec_for_shape,
)
from jaxscale._src.jaxprs import flattened_program, initial_values
from jaxscale._src.validation import dtype_name
from jaxscale.optim._blockwise import (
    BlockFormat,
    BlockLayout,
    _checked_block_size,
    block_layout,
    by_leading_axes,
    codes_shape,
    format_of,
    quantizable,
    quantize_blockwise,
    quantize_rows,
    rows_of,
    value_shape,
)
from jaxscale.optim._in_place import AS_IS, CPU_SLICE, Slot, update_in_place
from jaxscale.optim._kahan import KahanSummationState
from jaxscale.optim._master_weights import MasterWeightsState
from jaxscale.optim._variables import (
    held_like,
    holding,
    is_variable,
    sharding_names,
    value_of,
    values_of,
)
from jaxscale.optim._wrapping import as_float32_where_narrower, validated_inner

BFLOAT16 = np.dtype(jnp.bfloat16)
# torchao (after bitsandbytes) quantizes only tensors of at least this many elements
SMALLEST_QUANTIZED = 4096
# the fields of optax's states that hold second moments (sums and averages of squares),
# which torchao stores with the unsigned map: the Adam family's nu and nu_max, the name
# torchao gives them (Prodigy's, D-Adaptation's and MoMo-Adam's), Adagrad's and MADGRAD's
SECOND_MOMENTS = ("nu", "nu_max", "exp_avg_sq", "sum_of_squares", "grad_sum_sq")


def _signed_nu() -> tuple[type, ...]:
    """optax states whose ``nu`` is not a second moment and can be negative: SM3's is
    its momentum, Sophia's an estimate of the Hessian's diagonal."""
    names = [(optax, "ScaleBySM3State"), (getattr(optax, "contrib", None), "SophiaState")]
    return tuple(getattr(module, name) for module, name in names if hasattr(module, name))


_SIGNED_NU = _signed_nu()


def _parameter_side() -> dict[type, str | None]:
    """States whose fields hold parameters or gradients beside an optimizer's state:
    each type, and the field that holds the wrapped optimizer's state (``None``: none),
    the only field narrowed. Everything else in them is kept as it is: jaxscale's master
    copies and Kahan compensation, optax's accumulated gradients (``MultiSteps``,
    ``apply_every``), schedule-free's ``z`` (a sequence of parameters) and the starting
    parameters of DoG and DoWG. Quantized,
    those would be parameters or gradients rounded to 8 bits, which no recipe does."""
    side: dict[type, str | None] = {
        MasterWeightsState: "inner_state",
        KahanSummationState: "inner_state",
        optax.MultiStepsState: "inner_opt_state",
        optax.ApplyEvery: None,
    }
    contrib = getattr(optax, "contrib", None)
    schedule_free = getattr(contrib, "ScheduleFreeState", None)
    if schedule_free is not None:
        side[schedule_free] = "base_optimizer_state"
    # DoG and DoWG keep the parameters they started from beside scalars; optax before
    # 0.2.5 fills them at the first update, where init's program does not show them
    for name in ("DoGState", "DoWGState"):
        kind = getattr(contrib, name, None)
        if kind is not None:
            side[kind] = None
    return side


_PARAMETER_SIDE = _parameter_side()
_PARAMETER_TYPES: Any = tuple(_PARAMETER_SIDE)  # (Any: isinstance keeps nodes Any)


def _inner_field(node: Any) -> str | None:
    """The field of a ``_PARAMETER_SIDE`` state that holds its wrapped optimizer's state."""
    return next(field for kind, field in _PARAMETER_SIDE.items() if isinstance(node, kind))


class BlockQuantized(NamedTuple):
    """One leaf of an optimizer state in a block-wise format (:func:`quantize_blockwise`).

    Attributes:
      codes: ``float8_e4m3fn`` values or ``uint8`` indices, of the leaf's shape (for
        ``"int4"``, two per byte along its last axis).
      scale: one float32 scale per block, shaped as the leaf's leading axes followed
        by its blocks.
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
    inner: optax.GradientTransformation,
    dtype: Any = jnp.bfloat16,
    *,
    block_size: int | None = None,
    partial_blocks: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Store ``inner``'s state in ``dtype`` between steps; ``inner`` computes on float32.

    Which leaves of ``inner``'s state are stored narrow, and how:

    * ``"bfloat16"``: every floating leaf that is not a scalar (scalars are counts,
      learning rates and other hyperparameters), rounded to nearest even.
    * ``"float8_e4m3fn"``: torchao's ``OptimStateFp8``; ``"int8"``: torchao's
      ``OptimState8bit``; ``"int4"``: torchao's ``OptimState4bit``. The integer formats
      use the unsigned map for second moments (the fields of optax's states named
      ``nu``, ``nu_max``, ``exp_avg_sq``, ``sum_of_squares`` and ``grad_sum_sq``; not
      SM3's ``nu``, its momentum, nor Sophia's, a Hessian estimate, which can be
      negative) and the signed map for the rest. As in torchao, only
      floating leaves of at least 4,096 elements whose size is a multiple of
      ``block_size`` are quantized, one float32 scale per block; the others stay as
      ``inner`` made them. With ``partial_blocks=True`` every floating leaf of at
      least 4,096 elements is quantized, a leaf that does not divide into blocks cut
      along its trailing axes with a shorter last block in each row
      (:func:`quantize_blockwise`); the leaves torchao quantizes are stored as before.

    Each update widens the stored state to float32 (bfloat16 exactly; the block
    formats with :func:`dequantize_blockwise`) and half-precision gradients to float32
    (as torchao's optimizers upcast theirs), runs ``inner``, and stores its new
    state again, so the state keeps its structure and dtypes from step to step (a
    requirement of ``jit``'s donated buffers and of :func:`jaxscale.grad_scaler`'s
    skipped steps); a change in ``inner``'s own structure or shapes is an error that
    names the leaf. Master copies and Kahan compensation buffers of jaxscale's
    transforms inside ``inner`` are parameters, not statistics, and are left as they
    are; so are the gradients ``optax.MultiSteps`` and ``optax.apply_every`` accumulate
    and schedule-free's ``z`` (their wrapped optimizer's state is narrowed), and every
    leaf ``inner.init`` returns as a parameter it was given (Prodigy's ``params0``,
    DoG's ``init_params``, COCOB's ``init_particles``, MADGRAD's and Mechanic's
    ``x0``): the starting point those optimizers measure their distance from.

    Memory. Where ``inner``'s update is elementwise in its arrays (Adam, AdamW, SGD with
    momentum, Lion, RMSProp and the like, with any scalar schedule or global gradient-
    norm clipping), each parameter's state is widened, updated and narrowed a slice at a
    time and written back into its own buffers, so the compiled step needs no widened
    copy of the state; the update itself is computed on whole arrays, where XLA fuses it
    into the addition that applies it. With donated state an 8-bit Adam step's
    temporaries are about 2 bytes per parameter (on a CPU, a copy of the old codes,
    which that fused update reads after the loop has written the new ones). Other
    optimizers are computed on whole arrays. ``init`` stores a state that ``inner``
    fills with a constant (Adam's zeros) without quantizing it: a zero leaf is stored as
    torchao stores one (codes and scales zero), another constant as its quantized value,
    so ``jax.jit(tx.init)`` compiles at once.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      dtype: ``"bfloat16"``, ``"float8_e4m3fn"``, ``"int8"`` or ``"int4"`` (or the dtypes
        ``jnp.bfloat16``, ``jnp.float8_e4m3fn``, ``jnp.int8``, ``jnp.int4``).
      block_size: elements per scale for the block formats: torchao's by default (256;
        128 for ``"int4"``).
      partial_blocks: quantize the leaves whose size is not a multiple of
        ``block_size`` too.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LowPrecisionState`.

    Raises:
      TypeError: for an ``inner`` that is not an Optax transform, or a
        ``partial_blocks`` that is not a bool.
      ValueError: for another ``dtype``, naming the formats; a ``block_size`` below
        2 (or odd, for ``"int4"``); a ``block_size`` or ``partial_blocks`` given with
        ``"bfloat16"``, which has no blocks.

    >>> import jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> state = jaxscale.low_precision_state(optax.adam(1e-3), "int8").init(params)
    >>> mu = state.inner_state[0].mu["w"]
    >>> mu.codes.dtype, mu.codes.shape, mu.scale.shape
    (dtype('uint8'), (64, 64), (16,))
    """
    inner = validated_inner(inner, "low_precision_state")
    fmt = _state_format(dtype)
    if not isinstance(partial_blocks, bool):
        raise TypeError(f"partial_blocks must be True or False, got {partial_blocks!r}")
    if fmt is BFLOAT16:
        if block_size is not None or partial_blocks:
            raise ValueError(
                "bfloat16 state is stored element by element: block_size and partial_blocks "
                'apply to the block formats "int8", "int4" and "float8_e4m3fn"'
            )
        size = 0
    else:
        size = _checked_block_size(block_size, fmt)

    def layout_of(leaf: Any) -> BlockLayout | None:
        if not _is_floating_array(leaf) or leaf.size < SMALLEST_QUANTIZED:
            return None
        layout = block_layout(leaf.shape, size, partial_blocks=partial_blocks)
        return layout if quantizable(layout, fmt) else None

    def store(
        path: tuple[Any, ...], node: Any, origin: _Origin, unsigned: set, counts: list[int]
    ) -> Any:
        """The leaf stored; ``counts``: the leaves quantized, and those left as they are
        for want of a block size that divides them."""
        # a leaf of Flax NNX's state arrives in a variable: the variables go inside a
        # BlockQuantized, which Flax then updates field by field (see _variables)
        leaf = value_of(node)
        fill, parameters = origin
        if not _is_floating_array(leaf) or parameters:
            return node
        if fmt is BFLOAT16:
            if not leaf.ndim:
                return node
            narrow = jnp.full(leaf.shape, fill, BFLOAT16) if fill is not None else leaf
            return holding(node, _typed_like(narrow.astype(BFLOAT16), leaf))
        layout = layout_of(leaf)
        if layout is None:
            counts[1] += leaf.size >= SMALLEST_QUANTIZED
            return node
        counts[0] += 1
        slot = Slot("blocks", fmt=fmt, layout=layout, signed=path not in unsigned)
        if fill is None:
            codes, scale = quantize_blockwise(
                leaf, fmt.name, block_size=size, signed=slot.signed, partial_blocks=partial_blocks
            )
        else:
            codes, scale = _filled(slot, fill)
        codes, scale = _typed_like(codes, leaf), _typed_like(scale, leaf)
        # a variable's sharding names: on explicit mesh axes, its array's type's (an axis
        # whose length its devices do not divide is not named there)
        return BlockQuantized(
            holding(
                node, codes, out_sharding=_typed_names(codes, leaf) or _codes_sharding(node, fmt)
            ),
            holding(
                node, scale, out_sharding=_typed_names(scale, leaf) or _scale_sharding(node, layout)
            ),
        )

    def slot_of(path: tuple[Any, ...], stored: Any, unsigned: set) -> Slot:
        if isinstance(stored, BlockQuantized):
            shape = value_shape(np.shape(value_of(stored.codes)), fmt)
            layout = block_layout(shape, size, partial_blocks=partial_blocks)
            assert layout is not None
            # updated a slice of rows at a time: rows of the leading axes, so that a
            # parameter sharded along any of its axes keeps its state's shards in place
            rows = by_leading_axes(layout, CPU_SLICE)
            return Slot("blocks", fmt=fmt, layout=rows, signed=path not in unsigned)
        leaf = value_of(stored)
        if fmt is BFLOAT16 and _is_floating_array(leaf) and leaf.dtype == BFLOAT16 and leaf.ndim:
            return Slot("cast", dtype=BFLOAT16)
        return AS_IS

    def init_fn(params: optax.Params) -> LowPrecisionState:
        state = inner.init(params)
        leaves = jax.tree.leaves(state)
        origins = dict(zip(map(id, leaves), _init_origins(inner.init, params), strict=True))
        unsigned = _second_moment_paths(state)
        counts = [0, 0]  # quantized, left for want of a block that divides them
        stored = _statistics_map(
            lambda path, node: store(
                path, node, origins.get(id(value_of(node)), (None, False)), unsigned, counts
            ),
            state,
        )
        quantized, left = counts
        if fmt is not BFLOAT16 and not quantized and left:
            warnings.warn(
                f"low_precision_state({fmt.name!r}, block_size={size}) quantizes none of the "
                f"{left} state leaves of at least {SMALLEST_QUANTIZED} elements: none has a "
                "size that is a multiple of the block; pass a block_size that divides them, "
                "or partial_blocks=True",
                UserWarning,
                stacklevel=2,
            )
        return LowPrecisionState(stored)

    def update_fn(
        updates: optax.Updates,
        state: LowPrecisionState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LowPrecisionState]:
        # computed on the arrays alone, the results put back into the variables that
        # held the gradients and the old state (held_like)
        stored = values_of(state.inner_state)
        unsigned = _second_moment_paths(stored)
        slots = _slot_tree(lambda path, leaf: slot_of(path, leaf, unsigned), stored)

        def update(updates: Any, wide_state: Any, params: Any) -> Any:
            return inner.update(updates, wide_state, params, **extra_args)

        # inner computes on float32 gradients too, as torchao's optimizers upcast theirs:
        # bfloat16 gradients met the widened state in bfloat16 products (Adam's g * g),
        # and an update wider than its gradient (float32) broke optax's conditionals,
        # whose other branch keeps the gradients' dtype (apply_if_finite's zeros). The
        # loop widens each slice of the gradients itself (derived_elementwise).
        grads = values_of(updates)
        wide_grads = as_float32_where_narrower(grads)
        with derived_elementwise(wide_grads, grads, _as_float32):
            new_updates, new_stored = update_in_place(
                update, wide_grads, stored, slots, (values_of(params),)
            )
        _require_same_layout(stored, new_stored)
        new_updates = held_like(updates, new_updates)
        return new_updates, LowPrecisionState(held_like(state.inner_state, new_stored))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as_float32(gradient: Any) -> Any:
    return gradient.astype(jnp.float32)


def _state_format(dtype: Any) -> Any:
    """bfloat16, or a block format; a ValueError that names every choice otherwise."""
    if dtype_name(dtype) == "bfloat16":
        return BFLOAT16
    try:
        return format_of(dtype)
    except ValueError:
        raise ValueError(
            "dtype must be 'bfloat16', 'float8_e4m3fn', 'int8' or 'int4' (the strings, or "
            f"jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8, jnp.int4), got {dtype!r}"
        ) from None


def _filled(slot: Slot, fill: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """The codes and scales of a leaf whose every element is ``fill``, without quantizing
    the leaf: zero as torchao's ``zeros`` (codes and scales zero, which dequantize to
    zero), another value as its one block quantized and repeated."""
    layout, fmt = slot.blocks
    shape = codes_shape(layout.shape, fmt)
    if float(fill) == 0.0:
        return jnp.zeros(shape, fmt.code_dtype), jnp.zeros(layout.scale_shape, jnp.float32)
    block = jnp.full((1, layout.block_size), fill, jnp.float32)
    one = block_layout((1, layout.block_size), layout.block_size)
    assert one is not None
    codes, scale = quantize_rows(rows_of(block, one), one, fmt, slot.signed)
    return jnp.full(shape, codes.reshape(-1)[0]), jnp.full(layout.scale_shape, scale.reshape(-1)[0])


def _typed_like(array: jax.Array, leaf: Any) -> jax.Array:
    """``array`` (a stored form of ``leaf``: codes, scales, bfloat16) sharded as ``leaf``
    is, where ``leaf``'s type names explicit mesh axes (``jnp.zeros_like`` keeps them,
    a fill made from constants does not); else ``array``."""
    spec = explicit_spec(leaf)
    if spec is None:
        return array
    return placed_like(array, leaf, spec_for_shape(spec, leaf, tuple(array.shape)))


# how ``init`` made a state leaf: the one constant it filled it with (or None), and
# whether it is one of the parameters themselves
_Origin = tuple[np.ndarray | None, bool]


def _init_origins(init: Any, params: Any) -> list[_Origin]:
    """For each leaf of ``init(params)`` (in flattening order): the one constant ``init``
    fills it with (``jnp.zeros_like``) or ``None``, and whether it is a parameter as it
    was passed (Prodigy's ``params0``, DoG's ``init_params``, MADGRAD's and Mechanic's
    ``x0``): read from ``init``'s traced program."""

    def flat_init(params: Any) -> list[Any]:
        return jax.tree.leaves(init(params))

    closed = jax.make_jaxpr(flat_init)(params)
    invars, outvars, equations, _ = flattened_program(closed)
    return initial_values(invars, outvars, equations)


def _typed_names(array: Any, leaf: Any) -> tuple[Any, ...] | None:
    """The sharding names of ``array``'s type, one per axis, where ``leaf`` (the state
    leaf it stores) is sharded along explicit mesh axes; else ``None``."""
    if explicit_spec(leaf) is None:
        return None
    spec = tuple(jax.typeof(array).sharding.spec)
    return (*spec, *(None,) * (np.ndim(array) - len(spec)))


def _codes_sharding(node: Any, fmt: BlockFormat) -> tuple[Any, ...] | None:
    """The sharding names of a leaf's codes: the leaf's own, each where the mesh's
    devices divide the codes' length along it (``"int4"`` halves the last axis)."""
    names = sharding_names(node)
    if names is None:
        return None
    leaf = value_of(node)
    return divisible_names(names, codes_shape(np.shape(leaf), fmt), leaf)


def _scale_sharding(node: Any, layout: BlockLayout) -> tuple[Any, ...] | None:
    """The sharding names of a leaf's scales (``shape[:k] + (blocks,)``): the leaf's own
    for its leading axes, and for the blocks the name of the first trailing axis when
    no later one is sharded; each where the mesh's devices divide the scales' length
    along it (Flax places a variable by its names, and refuses a length they do not
    divide: a 256 x 512 layer's scales are 256 x 2, its columns sharded 4 ways)."""
    names = sharding_names(node)
    if names is None:
        return None
    k = len(layout.scale_shape) - 1
    last = names[k] if all(name is None for name in names[k + 1 :]) else None
    return divisible_names((*names[:k], last), layout.scale_shape, value_of(node))


def _slot_tree(slot_of: Any, stored: Any, path: tuple[Any, ...] = ()) -> Any:
    """A :class:`Slot` for each stored leaf: as ``slot_of(path, leaf)`` says for the
    statistics, as is for the parameter side of the states in ``_PARAMETER_SIDE``."""

    def is_leaf(node: Any) -> bool:
        return isinstance(node, (BlockQuantized, *_PARAMETER_TYPES))

    def visit(subpath: tuple[Any, ...], node: Any) -> Any:
        if not isinstance(node, _PARAMETER_TYPES):
            return slot_of(path + subpath, node)
        inner = _inner_field(node)
        fields = {
            name: jax.tree.map(lambda _: AS_IS, getattr(node, name))
            if name != inner
            else _slot_tree(
                slot_of, getattr(node, name), path + subpath + (jax.tree_util.GetAttrKey(name),)
            )
            for name in node._fields
        }
        return node._replace(**fields)

    return jax.tree_util.tree_map_with_path(visit, stored, is_leaf=is_leaf)


def _is_floating_array(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def _second_moment_paths(state: Any) -> set[tuple[Any, ...]]:
    """The paths of the leaves (a :class:`BlockQuantized` or a variable counts as one)
    that lie in a second-moment field of an optax state (``SECOND_MOMENTS``, but in the
    states of ``_SIGNED_NU``): the leaves the integer formats store with the unsigned
    map. A field is a state's own (a dict entry named ``"nu"``, a parameter's name, is
    not one); the state types are found as the tree is walked."""
    found: set[tuple[Any, ...]] = set()

    def is_terminal(node: Any) -> bool:
        if isinstance(node, BlockQuantized) or is_variable(node):
            return True
        return jax.tree_util.treedef_is_leaf(jax.tree.structure(node))

    def visit(path: tuple[Any, ...], node: Any, unsigned: bool) -> None:
        if is_terminal(node):
            if unsigned:
                found.add(path)
            return
        fields = isinstance(node, tuple) and hasattr(node, "_fields")
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        for keys, child in children:
            second = (
                fields
                and getattr(keys[0], "name", None) in SECOND_MOMENTS
                and not isinstance(node, _SIGNED_NU)
            )
            visit(path + tuple(keys), child, unsigned or second)

    visit((), state, False)
    return found


def _statistics_map(fn: Any, state: Any, path: tuple[Any, ...] = ()) -> Any:
    """``fn(path, leaf)`` on each leaf (a :class:`BlockQuantized` counts as one) of
    ``state``, except the parameter side of the states in ``_PARAMETER_SIDE``."""

    def is_leaf(node: Any) -> bool:
        return isinstance(node, (BlockQuantized, *_PARAMETER_TYPES)) or is_variable(node)

    def visit(subpath: tuple[Any, ...], node: Any) -> Any:
        if not isinstance(node, _PARAMETER_TYPES):
            return fn(path + subpath, node)
        inner = _inner_field(node)
        if inner is None:
            return node
        key = jax.tree_util.GetAttrKey(inner)
        return node._replace(
            **{inner: _statistics_map(fn, getattr(node, inner), path + subpath + (key,))}
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
