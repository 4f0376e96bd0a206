"""``jax.random.bits(key, shape, jnp.uint32)``, computed as elementwise arithmetic.

JAX draws bits from a Threefry key by hashing each element's index (its
"partitionable" Threefry, the default). On the CPU, JAX lowers the hash's twenty
rounds as a loop, so XLA writes every round's words to memory: a step that rounds a
parameter stochastically held three float32-sized arrays of random words beyond its
arguments, and spent more time drawing than updating. The same hash written out
round by round is plain elementwise integer arithmetic, which XLA fuses into the
computation that consumes the bits: nothing is written, and the bits are those JAX
draws, bit for bit.

Only Threefry keys in partitionable mode with fewer than 2**32 elements take this
path; any other key or setting is passed to ``jax.random.bits`` itself.

``random_uniform`` is ``jax.random.uniform(key, shape, jnp.float32)`` from the same
hash. Besides what is written, JAX's loop costs compile time that grows with the
draw's rank (measured on a CPU: 0.2 s for a (64, 512) draw, 0.38 s for (8, 128, 512),
1.35 s for a (3, 3, 8, 16) one, against 0.06 s for each as arithmetic), paid at every
site a step draws at.
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)  # Threefry's key-schedule constant


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``jax.random.bits(key, shape, jnp.uint32)``, fused into its consumer where it can be.

    >>> import jax, jax.numpy as jnp
    >>> from jaxscale._src.threefry import random_bits
    >>> key = jax.random.key(3)
    >>> bool((random_bits(key, (2, 5)) == jax.random.bits(key, (2, 5), jnp.uint32)).all())
    True
    """
    words = _key_words(key)
    if words is None or not shape or math.prod(shape) >= 1 << 32:
        return jax.random.bits(key, shape, jnp.uint32)
    index = _linear_index(shape)
    high, low = _threefry_2x32(words[0], words[1], jnp.zeros(shape, jnp.uint32), index)
    return high ^ low


def random_uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``jax.random.uniform(key, shape, jnp.float32)``: values in [0, 1), bit for bit
    JAX's, fused into their consumer where they can be.

    JAX makes a float32 in [1, 2) of a draw's top 23 bits and subtracts 1; so does this.

    >>> import jax, jax.numpy as jnp
    >>> from jaxscale._src.threefry import random_uniform
    >>> key = jax.random.key(3)
    >>> bool((random_uniform(key, (2, 5)) == jax.random.uniform(key, (2, 5))).all())
    True
    """
    # (from whichever bits random_bits draws: JAX's own uniform floats are made so too)
    mantissa = lax.shift_right_logical(random_bits(key, shape), np.uint32(32 - 23))
    one_to_two = lax.bitcast_convert_type(mantissa | np.uint32(0x3F800000), jnp.float32)
    return one_to_two - np.float32(1.0)


def _key_words(key: Any) -> tuple[jax.Array, jax.Array] | None:
    """The two 32-bit words of a Threefry key, or ``None`` where JAX would draw
    otherwise than this module computes."""
    config = cast(Any, jax.config)  # its options are attributes set at run time
    if not config.jax_threefry_partitionable:
        return None
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if "threefry" not in str(jax.random.key_impl(key)) or key.shape:
            return None
        data = jax.random.key_data(key)
    else:
        if "threefry" not in str(config.jax_default_prng_impl):
            return None
        data = jnp.asarray(key)
        if data.shape != (2,):
            return None
    data = data.astype(jnp.uint32)
    return data[0], data[1]


def _linear_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major index, from one iota per axis (which XLA partitions
    along any sharded axis, so a shard computes its own indices)."""
    strides = [int(np.prod(shape[axis + 1 :], dtype=np.int64)) for axis in range(len(shape))]
    terms = [
        lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        for axis, stride in enumerate(strides)
    ]
    index = terms[0]
    for term in terms[1:]:
        index = index + term
    return index


def _rotate_left(x: jax.Array, bits: int) -> jax.Array:
    return (x << np.uint32(bits)) | (x >> np.uint32(32 - bits))


def _threefry_2x32(
    key0: jax.Array, key1: jax.Array, x0: jax.Array, x1: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 with 20 rounds (Salmon et al., 2011), as JAX computes it."""
    schedule = [key0, key1, key0 ^ key1 ^ _PARITY]
    x0 = x0 + schedule[0]
    x1 = x1 + schedule[1]
    for block in range(5):
        for rotation in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, rotation)
            x1 = x0 ^ x1
        x0 = x0 + schedule[(block + 1) % 3]
        x1 = x1 + schedule[(block + 2) % 3] + np.uint32(block + 1)
    return x0, x1
