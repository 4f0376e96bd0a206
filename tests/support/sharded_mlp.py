"""Flax's sharding guide's two layers, on a mesh with automatic or explicit axes.

The first layer's columns and the second's rows are sharded along ``model``, the batch
along ``data``, on a 2 x 4 mesh. On explicit axes (sharding in types, ``jax.make_mesh``'s
default) the second layer's contraction over a sharded axis names its result's
sharding, as such a contraction must there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from support import machine


class ShardedMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, explicit: bool, width: int = 256, hidden: int = 512):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Param(init(rngs.params(), (width, hidden)), out_sharding=(None, "model"))
        self.down = nnx.Param(init(rngs.params(), (hidden, width)), out_sharding=("model", None))
        self.explicit = explicit

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = nnx.relu(x @ self.up)
        if self.explicit:
            return jnp.matmul(hidden, self.down, out_sharding=P("data", None))
        return hidden @ self.down


@contextlib.contextmanager
def sharded_mlp(kind: Any, batch: int = 32, **sizes: int) -> Iterator[tuple[ShardedMLP, Any]]:
    """Within ``jax.set_mesh`` of a 2 x 4 mesh of ``kind`` axes: the model (built under
    ``nnx.jit``, each parameter placed as its metadata says) and a batch of inputs."""
    mesh = machine.mesh((2, 4), ("data", "model"), axis_types=(kind,) * 2)
    explicit = kind == AxisType.Explicit
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: ShardedMLP(nnx.Rngs(0), explicit, **sizes))()
        width = model.up.shape[0]
        inputs = np.random.default_rng(1).normal(size=(batch, width)).astype(np.float32)
        yield model, jax.device_put(jnp.asarray(inputs), P("data"))
