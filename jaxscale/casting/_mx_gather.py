"""An MX weight made whole across devices as MX: float8 data and E8M0 scales.

Under FSDP a weight is sharded between steps and all-gathered where a matmul needs it
whole. The MX recipes multiply dequantized operands (torchao's emulation), so what
reaches the matmul, and what XLA's partitioner gathers, is the dequantized weight in
the compute dtype: in bfloat16, twice the bytes of its float8 data and scales. XLA
moves a gather ahead of a quantization only for a single scalar scale.

:func:`dequantize_whole` is the weight's dequantization as a custom-partitioned
operation: whatever the shardings of its operands, its result is whole on every
device, and its operands are made whole first, so the gather carries the float8 data
and the E8M0 scales; each device then dequantizes the whole weight, the same
operations on the same values as on one device. Where a shard boundary cuts a block,
each device reduces its part of the block and XLA all-reduces one float32 per block for
its maximum: the quantized values are the same, and no high-precision value moves.

The partitioning rule is a Python function that XLA's partitioner calls while it
compiles a program for several devices. Such a program cannot be serialized with
``jax.export`` (JAX refuses callbacks), and JAX's persistent compilation cache keys it
by the callback's address, so it is compiled again in each process. One device's
program is the plain dequantization.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.casting._mx import dequantize_mx_blocks


def dequantize_whole(data: jax.Array, scale: jax.Array, dtype: Any, axis: int) -> jax.Array:
    """:func:`jaxscale.dequantize_mx` of a 2-D ``data`` blocked along ``axis``, whole on
    every device when partitioned: the float8 data and its scales gathered, not the
    dequantized values. Under ``jax.vmap``, the plain dequantization."""
    return dequantize_mx_whole(data, scale, np.dtype(dtype), axis % 2)


# A call of its own name, as the plain dequantization's, so that jaxscale.precision_stats
# finds the MX values it gives.
@functools.partial(jax.jit, static_argnums=(2, 3))
def dequantize_mx_whole(data: jax.Array, scale: jax.Array, dtype: np.dtype, axis: int) -> jax.Array:
    return _whole(dtype, axis)(data, scale)


@functools.cache
def _whole(dtype: np.dtype, axis: int) -> Any:
    @jax.custom_batching.custom_vmap
    def whole(data: jax.Array, scale: jax.Array) -> jax.Array:
        return _partitioned(data, scale, dtype, axis)

    @whole.def_vmap
    def batched(
        axis_size: int, in_batched: list[bool], data: jax.Array, scale: jax.Array
    ) -> tuple[jax.Array, bool]:
        data, scale = (
            value if is_batched else jax.numpy.broadcast_to(value, (axis_size, *value.shape))
            for value, is_batched in zip((data, scale), in_batched, strict=True)
        )
        return dequantize_mx_blocks(data, scale, dtype, axis + 1), True

    return whole


@functools.partial(custom_partitioning, static_argnums=(2, 3))
def _partitioned(data: jax.Array, scale: jax.Array, dtype: np.dtype, axis: int) -> jax.Array:
    return dequantize_mx_blocks(data, scale, dtype, axis)


def _replicated(mesh: Any) -> NamedSharding:
    """The sharding that holds a whole array on every device of ``mesh``."""
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
        # JAX names the mesh from the program's NamedSharding inputs (or jax.set_mesh)
        raise ValueError(
            "MXRecipe(all_gather_in_mx=True) gathers a weight over the devices of the "
            "program's mesh, but this program has none: shard its inputs with "
            "jax.sharding.NamedSharding (or call jax.set_mesh), or use "
            "all_gather_in_mx=False"
        )
    return NamedSharding(mesh, PartitionSpec())


def _infer(dtype: np.dtype, axis: int, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    del dtype, axis, arg_shapes, result_shape
    return _replicated(mesh)


def _partition(dtype: np.dtype, axis: int, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    del arg_shapes, result_shape
    whole = _replicated(mesh)

    def lower(data: jax.Array, scale: jax.Array) -> jax.Array:
        return dequantize_mx_blocks(data, scale, dtype, axis)

    return mesh, lower, whole, (whole, whole)


# The factors of the data, the scales and the result are unrelated: no sharding passes
# through the operation, in either direction, and the result is whole. The operands'
# shardings are left as XLA's own, not decoded into partition specs (which cannot express
# every tiling the partitioner gives the scales): the rule reads only the mesh.
_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer,
    sharding_rule="a b, c d -> e f",
    decode_shardings=False,
)
