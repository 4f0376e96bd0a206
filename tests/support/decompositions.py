"""Matrix decompositions (``cholesky``, ``qr``, ``svd``, ``eigh``) in the tests of autocast.

JAX 0.11 and later check a decomposition's input dtype while the function is traced
and refuse bfloat16, with autocast or without; earlier releases traced it, and
autocast's CPU policy then cast it to float32 as PyTorch's CPU list does. A test asks
:func:`jax_traces_bfloat16` which of the two the running JAX does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NAMES = frozenset({"cholesky", "qr", "svd", "eigh"})


def spd(a: jax.Array) -> jax.Array:
    """A symmetric positive definite matrix from a square one, in ``a``'s dtype."""
    return a @ a.T + 4 * jnp.eye(a.shape[0], dtype=a.dtype)


@functools.cache
def jax_traces_bfloat16() -> bool:
    """Whether the running JAX traces a decomposition of a bfloat16 input."""
    try:
        jax.eval_shape(jnp.linalg.cholesky, jax.ShapeDtypeStruct((2, 2), jnp.bfloat16))
    except TypeError:
        return False
    return True
