"""The inf/NaN check: one boolean for a whole tree of gradients."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale import _leaves


def all_finite(tree: Any) -> jax.Array:
    """Return a boolean scalar: whether every floating element of ``tree`` is finite.

    ``+inf``, ``-inf`` and NaN all count as non-finite. Integer, boolean, ``float0``
    leaves and ``None`` are ignored, and a tree with no floating leaves is all
    finite. Under ``jax.jit`` with sharded arrays the result is already global;
    under ``shard_map`` or ``pmap`` reduce it over the mapped axis yourself (the
    :func:`~jaxscale.grad_scaler` transform does so for its ``axis_name``).

    >>> import jax.numpy as jnp
    >>> from jaxscale import all_finite
    >>> bool(all_finite({"w": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
    >>> bool(all_finite({"steps": jnp.arange(3), "none": None}))
    True
    """
    leaf_checks = [jnp.all(jnp.isfinite(leaf)) for leaf in _leaves.floating_leaves(tree)]
    return functools.reduce(jnp.logical_and, leaf_checks, jnp.asarray(True))
