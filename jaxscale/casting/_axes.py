"""Where each axis of a value comes from: what tells a layer's bias from other addends.

PyTorch's ``linear``, ``conv`` and ``addmm`` include their bias, so under autocast a
bias is added in the autocast dtype; a tensor added to a matmul's output with ``+``
is promoted as ``+`` promotes. A jaxpr has only the ``add``. What tells them apart
is which axes the addend varies along:

* a bias varies along the axes one operand of the product contributes (a dense
  layer's output features, a convolution's output channels; the weight's axes, or
  under ``vmap`` of ``weight @ x`` the left operand's);
* an attention bias over query and key positions varies along both operands' axes,
  a per-example mask along the batch axes.

Labels, one per axis, record this. A matmul's or convolution's output is labelled
:data:`BATCH`, :data:`LHS` or :data:`RHS` by the operand the axis comes from; a
broadcast is labelled :data:`VARIES` or :data:`CONSTANT` along each axis. Views
(reshape, transpose, squeeze, dtype conversion) carry the labels along.
"""

from __future__ import annotations

from typing import Any

from jaxscale._src.jaxprs import (
    broadcast_dimensions,
    convolution_output_feature_axis,
    dot_dimension_numbers,
    reshape_keeps_order,
    squeezed_dimensions,
    transpose_permutation,
)

Labels = tuple[str, ...]

BATCH, LHS, RHS, MIXED = "batch", "lhs", "rhs", "mixed"
VARIES, CONSTANT = "varies", "constant"

_SAME_AXES = {"convert_element_type", "copy", "reduce_precision", "name", "device_put"}
LABELLED = {
    "dot_general", "conv_general_dilated", "broadcast_in_dim", "transpose", "squeeze", "reshape",
    *_SAME_AXES,
}  # fmt: skip
"""The primitives whose output :func:`of_output` can label: others need not be asked."""


def of_output(eqn: Any, source: Labels | None) -> Labels | None:
    """The labels of the single output of ``eqn``, whose first input is labelled ``source``;
    ``None`` where nothing is known."""
    name = eqn.primitive.name
    if name == "dot_general":
        return _dot_general(eqn)
    if name == "conv_general_dilated":
        return _convolution(eqn)
    if name == "broadcast_in_dim":
        return _broadcast(eqn, source)
    if source is None:
        return None
    if name in _SAME_AXES:
        return source
    if name == "transpose":
        return tuple(source[i] for i in transpose_permutation(eqn))
    if name == "squeeze":
        dropped = set(squeezed_dimensions(eqn))
        return tuple(label for i, label in enumerate(source) if i not in dropped)
    if name == "reshape" and reshape_keeps_order(eqn):
        return _reshape(tuple(eqn.invars[0].aval.shape), tuple(eqn.outvars[0].aval.shape), source)
    return None


def varies_along_one_operand(
    product: Labels | None, addend: Labels | None, addend_shape: Any, shape: Any
) -> bool:
    """Whether an addend of ``addend_shape`` (labelled ``addend``, or ``None``), added to
    ``product`` of ``shape``, varies only along the axes of one of the product's operands,
    as a bias does. Size-1 axes the addition broadcasts count as constant. ``True``
    where the product's axes are not known, the addend is 0-d, or it is as large as
    the product with no labels (broadcast by means not followed here)."""
    if product is None or len(product) != len(shape) or len(addend_shape) != len(shape):
        return True
    if addend is None:
        if tuple(addend_shape) == tuple(shape):
            return True
        addend = tuple(VARIES if n > 1 else CONSTANT for n in addend_shape)
    if any(a not in (VARIES, CONSTANT) for a in addend):
        return True
    sources = {
        p
        for p, a, n, out in zip(product, addend, addend_shape, shape, strict=True)
        if a == VARIES and n > 1 and out > 1
    }
    # an axis merged from both operands' axes tells nothing either way
    return sources <= {LHS, MIXED} or sources <= {RHS, MIXED}


def bias_of_the_products_shape(product: Labels | None, shape: Any, *, expanded: bool) -> bool:
    """Whether a parameter-like addend (an argument or captured value, through views) of
    the product's own ``shape`` is a layer's bias: a layer applied to one example.

    A bias and the product share a shape when the layer's batch is one: either the
    bias was given size-1 axes to broadcast over the batch (``expanded``: Flax's
    ``reshape(bias, (1, ..., -1))``), or the product is a matrix-vector product, one
    operand contributing no axis at all (Equinox's ``weight @ x + bias``). Either way
    its axes longer than 1 must all come from one operand. ``False`` where the
    product's axes are not known: unlike a smaller addend, one of full size is no bias
    unless shown to be."""
    if product is None or len(product) != len(shape):
        return False
    if not expanded and not (set(product) <= {LHS} or set(product) <= {RHS}):
        return False
    sources = {p for p, n in zip(product, shape, strict=True) if n > 1}
    return sources <= {LHS, MIXED} or sources <= {RHS, MIXED}


def _dot_general(eqn: Any) -> Labels:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dot_dimension_numbers(eqn)
    lhs_ndim, rhs_ndim = (len(v.aval.shape) for v in eqn.invars[:2])
    return (
        (BATCH,) * len(lhs_batch)
        + (LHS,) * (lhs_ndim - len(lhs_contract) - len(lhs_batch))
        + (RHS,) * (rhs_ndim - len(rhs_contract) - len(rhs_batch))
    )


def _convolution(eqn: Any) -> Labels:
    ndim = len(eqn.outvars[0].aval.shape)
    feature = convolution_output_feature_axis(eqn)
    # the batch and spatial axes come from the input, the output channels from the kernel
    return tuple(RHS if i == feature else LHS for i in range(ndim))


def _broadcast(eqn: Any, source: Labels | None) -> Labels:
    operand = tuple(eqn.invars[0].aval.shape)
    kept = dict(zip(broadcast_dimensions(eqn), range(len(operand)), strict=True))
    labels = []
    for axis in range(len(eqn.outvars[0].aval.shape)):
        i = kept.get(axis)
        varies = i is not None and operand[i] > 1 and (source is None or source[i] != CONSTANT)
        labels.append(VARIES if varies else CONSTANT)
    return tuple(labels)


def _reshape(before: tuple[int, ...], after: tuple[int, ...], source: Labels) -> Labels | None:
    """Labels through a reshape: each run of axes that is merged or split into another
    keeps its label if all its axes longer than 1 share one."""
    if 0 in before or 0 in after:
        return None
    labels: list[str] = []
    i = j = 0
    while i < len(before) or j < len(after):
        group_in, group_out = [i], [j]
        size_in = before[i] if i < len(before) else 1
        size_out = after[j] if j < len(after) else 1
        while size_in != size_out:
            if size_in < size_out:
                i += 1
                group_in.append(i)
                size_in *= before[i]
            else:
                j += 1
                group_out.append(j)
                size_out *= after[j]
        found = {source[k] for k in group_in if k < len(before) and before[k] > 1}
        label = _merged(found)
        labels.extend(label if after[k] > 1 else CONSTANT for k in group_out if k < len(after))
        i, j = group_in[-1] + 1, group_out[-1] + 1
    return tuple(labels)


def _merged(found: set[str]) -> str:
    if not found:
        return CONSTANT
    if len(found) == 1:
        return next(iter(found))
    return VARIES if found <= {VARIES, CONSTANT} else MIXED
