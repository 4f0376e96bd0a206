"""The public quantizers on arrays sharded along explicit mesh axes (``jax.make_mesh``'s
default): their reshapes into blocks follow no sharding type rule, and they raised
JAX's sharding type errors there. They now give, bit for bit, what they give on a mesh
with automatic axes, each result typed as its input where it has its shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from support import machine

import jaxscale

KEY = jax.random.key(1)
QUANTIZERS = {
    "quantize_mx": lambda x: jaxscale.quantize_mx(x),
    "quantize_mx along axis 0": lambda x: jaxscale.quantize_mx(x, axis=0),
    "quantize_mx, stochastic": lambda x: jaxscale.quantize_mx(x, key=KEY),
    "dequantize_mx": lambda x: jaxscale.dequantize_mx(*jaxscale.quantize_mx(x)),
    "quantize_blockwise int8": lambda x: jaxscale.quantize_blockwise(x, "int8"),
    "quantize_blockwise int4": lambda x: jaxscale.quantize_blockwise(x, "int4"),
    "dequantize_blockwise": lambda x: jaxscale.dequantize_blockwise(
        *jaxscale.quantize_blockwise(x, "int8"), "int8", signed=True
    ),
    "quantize_nvfp4": lambda x: jaxscale.quantize_nvfp4(x),
    "dequantize_nvfp4": lambda x: jaxscale.dequantize_nvfp4(*jaxscale.quantize_nvfp4(x)),
    "quantize_float8 rowwise": lambda x: jaxscale.quantize_float8(x, axis=-1),
}


def _bytes(array):
    return np.asarray(array.view(jnp.uint8) if array.dtype.itemsize == 1 else array).tobytes()


def _quantized(kind, quantize):
    mesh = machine.mesh((2, 4), ("data", "model"), axis_types=(kind,) * 2)
    values = np.random.default_rng(0).normal(size=(64, 512)).astype(np.float32)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(values), P("data", "model"))
        results = jax.jit(quantize)(x)
    return jax.tree.leaves(results)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_a_quantizer_on_explicit_mesh_axes_gives_what_it_gives_on_automatic_ones(name):
    explicit = _quantized(AxisType.Explicit, QUANTIZERS[name])
    automatic = _quantized(AxisType.Auto, QUANTIZERS[name])
    for a, b in zip(automatic, explicit, strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert _bytes(a) == _bytes(b)
        if b.shape == (64, 512):  # data, codes, values: sharded as the input
            assert b.sharding.spec == P("data", "model")
