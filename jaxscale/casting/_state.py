"""Stateful objects among autocast's inputs: Flax NNX modules and optimizers.

An NNX module keeps its parameters and statistics in mutable ``Variable``s, and
a call may write to them (BatchNorm's running statistics, Dropout's RNG
counters). Tracing such a call to a jaxpr would leak the trace's values into the
module, so graph nodes are split into plain state first, passed through the jaxpr
as inputs and outputs, and the state the call wrote is put back into the
original objects, in their own dtypes.

NNX objects exist only if the caller imported flax, so flax is used from
``sys.modules`` when it is there and never imported here: autocast itself needs
jax alone.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def is_graph_node(value: Any) -> bool:
    graph = sys.modules.get("flax.nnx.graph")
    return graph is not None and bool(graph.is_graph_node(value))


class StatefulCall:
    """``fn(*args, **kwargs)`` with the graph nodes among them held apart as state.

    ``call_with(state_leaves, array_leaves)`` runs the call on copies built from
    those leaves and returns ``(output, new_state_leaves)``: a pure function of
    arrays, which can be traced. ``write_back(new_state_leaves)`` updates the
    original objects.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        owner: Any = fn
        self._method: str | None = None
        if inspect.ismethod(fn) and is_graph_node(fn.__self__):
            owner, self._method = fn.__self__, fn.__name__
        leaves, self._treedef = jax.tree.flatten((owner, args, kwargs), is_leaf=is_graph_node)
        # Each leaf is a graph node (state), an array (a traced input) or anything
        # else (static: Python numbers, strings, functions), closed over as is.
        self._kinds = [
            "node" if is_graph_node(leaf) else "array" if _is_array(leaf) else "static"
            for leaf in leaves
        ]
        self._leaves = leaves
        self._nodes = tuple(
            leaf for leaf, kind in zip(leaves, self._kinds, strict=True) if kind == "node"
        )
        self.array_leaves = [
            leaf for leaf, kind in zip(leaves, self._kinds, strict=True) if kind == "array"
        ]
        self.state_leaves: list[Any] = []
        if self._nodes:
            self._graphdef, state = _nnx().split(self._nodes)
            self.state_leaves, self._state_treedef = jax.tree.flatten(state)

    def call_with(self, state_leaves: list[Any], array_leaves: list[Any]) -> tuple[Any, list[Any]]:
        nodes: tuple[Any, ...] = ()
        if self._nodes:
            state = jax.tree.unflatten(self._state_treedef, state_leaves)
            nodes = _nnx().merge(self._graphdef, state)
        fresh = {"node": iter(nodes), "array": iter(array_leaves)}
        leaves = [
            next(fresh[kind]) if kind in fresh else leaf
            for leaf, kind in zip(self._leaves, self._kinds, strict=True)
        ]
        owner, args, kwargs = jax.tree.unflatten(self._treedef, leaves)
        fn = getattr(owner, self._method) if self._method else owner
        output = fn(*args, **kwargs)
        new_state: list[Any] = []
        if self._nodes:
            _, state = _nnx().split(nodes)
            new_state = jax.tree.leaves(state)
        return output, new_state

    def write_back(self, new_state_leaves: list[Any]) -> None:
        if self._nodes:
            state = jax.tree.unflatten(self._state_treedef, new_state_leaves)
            _nnx().update(self._nodes, state)


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic))
