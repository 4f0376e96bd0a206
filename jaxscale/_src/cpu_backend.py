"""What XLA's CPU backend does with bfloat16 arrays in a loop, asked of the backend itself.

A loop that updates an optimizer's state a slice at a time (``jaxscale.optim``'s
``_in_place``) reads and writes slices of bfloat16 arrays. XLA's CPU backend before
jaxlib 0.11.2 has no bfloat16 slicing: it converts the whole array to float32 and
back around each slice it reads or writes, so a loop over a bfloat16 array costs a
float32 copy of it (and, carried through the loop, one per iteration: 27 ms instead of
0.5 for 64 slices of 4M elements, measured on jaxlib 0.10.2). Newer versions slice
bfloat16 as they slice float32. Which one is installed is read from the backend: a
small loop is compiled once per process and its temporaries measured.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROWS, _ROW = 16, 128


@functools.cache
def slices_bfloat16_in_place() -> bool:
    """Whether XLA's CPU backend updates a slice of a bfloat16 array carried through a
    loop without widening the whole array (``False`` where there is no CPU backend).

    >>> from jaxscale._src.cpu_backend import slices_bfloat16_in_place
    >>> isinstance(slices_bfloat16_in_place(), bool)
    True
    """
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # (JAX_PLATFORMS without "cpu")
        return False

    def halve_each_row(array: jax.Array) -> jax.Array:
        def body(row: jax.Array, array: jax.Array) -> jax.Array:
            piece = lax.dynamic_slice(array, (row, 0), (1, _ROW))
            return lax.dynamic_update_slice(array, piece * jnp.bfloat16(0.5), (row, 0))

        return lax.fori_loop(0, _ROWS, body, array)

    with _without_a_mesh() as meshless:
        if meshless:
            probe: Any = jax.device_put(np.zeros((_ROWS, _ROW), jnp.bfloat16), cpu)  # (4 KiB)
        else:  # (compiled for the devices of the mesh in context, a CPU's where it asks)
            probe = jax.ShapeDtypeStruct((_ROWS, _ROW), jnp.bfloat16)
        compiled = jax.jit(halve_each_row, donate_argnums=0).lower(probe).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        return False
    # widened, the array would be a float32 temporary of twice its bytes
    return int(analysis.temp_size_in_bytes) < _ROWS * _ROW * 2


@contextlib.contextmanager
def _without_a_mesh() -> Iterator[bool]:
    """Traces the probe with no mesh in context (a step traced under ``jax.set_mesh``
    with explicit axes, or inside ``shard_map``, would type the probe's values with the
    mesh's axes and its operands without them). Yields whether no mesh was in context,
    so that the probe may be placed on a CPU device (under ``jax.set_mesh`` it is
    compiled for the mesh's devices)."""
    get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    use_abstract_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
    meshless = get_abstract_mesh is None or not get_abstract_mesh().axis_names
    if meshless or use_abstract_mesh is None:
        yield meshless
        return
    with use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        yield meshless


def loops_over_bfloat16() -> bool:
    """Whether a step compiled for the default backend updates a bfloat16 state in a
    loop: on an accelerator, or on a CPU backend that slices bfloat16 in place."""
    return jax.default_backend() != "cpu" or slices_bfloat16_in_place()
