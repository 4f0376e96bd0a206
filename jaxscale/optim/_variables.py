"""Flax NNX variables met inside an optimizer's state, known by their methods (no flax import).

``nnx.Optimizer`` initialises its optimizer on ``nnx.state(model)``, whose leaves are
``nnx.Param`` variables, so an Optax ``init`` that maps over the parameters returns its
state leaves inside variables of the same kind and metadata (``out_sharding`` among
it). Flax keeps that structure: between steps it writes each new value into the
variable that held the old one. A transform that stores one state leaf as several
arrays (a quantized leaf's codes and scales) must therefore put the variables inside
its container, never the container inside one variable: Flax would write the container
back as a generic ``nnx.State``, and the next step would read that instead.
"""

from __future__ import annotations

from typing import Any

import jax


def is_variable(node: Any) -> bool:
    """Whether ``node`` is a ``flax.nnx.Variable``: a value behind ``get_value`` with metadata."""
    return callable(getattr(node, "get_value", None)) and callable(
        getattr(node, "get_metadata", None)
    )


def value_of(node: Any) -> Any:
    """The array a variable holds, or ``node`` itself."""
    return node.get_value() if is_variable(node) else node


def sharding_names(node: Any) -> tuple[Any, ...] | None:
    """A variable's ``out_sharding`` names (one per axis of its value), or ``None``."""
    if not is_variable(node):
        return None
    names = node.get_metadata().get("out_sharding")
    return tuple(names) if names else None


def holding(variable: Any, value: Any, *, out_sharding: Any = None) -> Any:
    """``value`` in a variable like ``variable`` (or ``value`` itself where there is none).

    The new variable keeps ``variable``'s kind and metadata; ``out_sharding``, when
    given, replaces its sharding names (for a value of another shape, such as a
    quantized leaf's scales).
    """
    if not is_variable(variable):
        return value
    if out_sharding is None:
        return variable.copy(value)
    return variable.copy(value, out_sharding=tuple(out_sharding))


def values_of(tree: Any) -> Any:
    """``tree`` with each variable replaced by the array it holds."""
    return jax.tree.map(value_of, tree, is_leaf=is_variable)


def held_like(like: Any, tree: Any) -> Any:
    """``tree`` (``like``'s structure, arrays where ``like`` has variables) with each
    array put into a copy of the variable ``like`` has there: a transform that computes
    on :func:`values_of` its arguments returns the trees it was given. (Parameters
    split from a Flax NNX model, ``nnx.split(model, nnx.Param, ...)``, hold each array
    in a variable, and so do the gradients taken of them and the state ``init`` made
    from them.) Where ``like`` holds no variable, ``tree`` is returned as it is, whatever
    its structure: an optimizer's updates need not mirror its gradients
    (``optax.lookahead`` returns fast and slow updates for the fast gradients)."""
    if not any(is_variable(leaf) for leaf in jax.tree.leaves(like, is_leaf=is_variable)):
        return tree
    return jax.tree.map(holding, like, tree, is_leaf=is_variable)
