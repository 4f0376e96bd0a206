"""Tracing a call whose inputs hold stateful objects: Flax NNX modules and optimizers.

jaxscale's function transforms (autocast, locate_nonfinite, precision_stats) trace
the function they wrap to a jaxpr and evaluate it anew. An NNX module keeps its
parameters and statistics in mutable ``Variable``s, and a call may write to them
(BatchNorm's running statistics, Dropout's RNG counters). Tracing such a call to a
jaxpr would leak the trace's values into the module, so graph nodes are split
into plain state first, passed through the jaxpr as inputs and outputs, and the
state the call wrote is put back into the original objects.

NNX objects exist only if the caller imported flax, so flax is used from
``sys.modules`` when it is there and never imported here: the transforms need
jax alone.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._src.jaxprs import is_ref


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def is_graph_node(value: Any) -> bool:
    graph = sys.modules.get("flax.nnx.graph")
    return graph is not None and bool(graph.is_graph_node(value))


class StatefulCall:
    """``fn(*args, **kwargs)`` with the graph nodes among them held apart as state.

    ``call_with(state_leaves, array_leaves)`` runs the call on copies built from
    those leaves and returns ``(output_arrays, new_state_leaves)``: a pure function
    of arrays, which can be traced; ``output(output_arrays)`` is the call's result.
    ``write_back(new_state_leaves, written)`` updates the original objects.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        owner: Any = fn
        self._method: str | None = None
        if inspect.ismethod(fn) and is_graph_node(fn.__self__):
            owner, self._method = fn.__self__, fn.__name__
        with_paths, self._treedef = jax.tree_util.tree_flatten_with_path(
            (owner, args, kwargs), is_leaf=is_graph_node
        )
        paths = [path for path, _ in with_paths]
        leaves = [leaf for _, leaf in with_paths]
        # Each leaf is a graph node (state), an array or a reference (a traced input;
        # Flax takes a reference for a graph node of its own) or anything else (static:
        # Python numbers, strings, functions), closed over as is.
        self._kinds = [
            "array"
            if _is_array(leaf) or is_ref(leaf)
            else "node"
            if is_graph_node(leaf)
            else "static"
            for leaf in leaves
        ]
        self._leaves = leaves
        self._nodes = tuple(
            leaf for leaf, kind in zip(leaves, self._kinds, strict=True) if kind == "node"
        )
        self.array_leaves = [
            leaf for leaf, kind in zip(leaves, self._kinds, strict=True) if kind == "array"
        ]
        self.array_paths = [
            _argument_path(path)
            for path, kind in zip(paths, self._kinds, strict=True)
            if kind == "array"
        ]
        self.state_leaves: list[Any] = []
        self.state_paths: list[str] = []
        self.state_refs: list[bool] = []  # for each state leaf: whether it is a reference
        if self._nodes:
            self._graphdef, state = _nnx().split(self._nodes)
            self.state_leaves, self._state_treedef = jax.tree.flatten(state)
            _refuse_hijax_variables(self.state_leaves)
            # the variables that hold a reference are written through it, in place
            self.state_refs = [is_ref(leaf) for leaf in self.state_leaves]
            node_paths = [
                _argument_path(path)
                for path, kind in zip(paths, self._kinds, strict=True)
                if kind == "node"
            ]
            # nnx.split of the tuple of nodes keys each node's state by its position
            self.state_paths = [
                node_paths[path[0].key] + jax.tree_util.keystr(path[1:])
                if isinstance(getattr(path[0], "key", None), int)
                else jax.tree_util.keystr(path)
                for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]
            ]

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
            new_state = [
                leaf
                for leaf, held in zip(jax.tree.leaves(state), self.state_refs, strict=True)
                if not held
            ]
        # Only arrays are outputs of the trace; anything else the call returns (a
        # string, a Python number) is kept aside and returned as it is.
        output_leaves, self.output_treedef = jax.tree.flatten(output)
        self.output_count = len(output_leaves)
        self.static_outputs = {
            i: leaf for i, leaf in enumerate(output_leaves) if not _is_array(leaf)
        }
        arrays = [leaf for i, leaf in enumerate(output_leaves) if i not in self.static_outputs]
        threaded = _threaded_state(output)
        self.threaded_outputs = [
            was for i, was in enumerate(threaded) if i not in self.static_outputs
        ]
        return arrays, new_state

    def output(self, arrays: list[Any]) -> Any:
        """The call's result from its array outputs (after :meth:`call_with` was traced)."""
        given = iter(arrays)
        leaves = [
            self.static_outputs[i] if i in self.static_outputs else next(given)
            for i in range(self.output_count)
        ]
        return jax.tree.unflatten(self.output_treedef, leaves)

    def write_back(self, new_state_leaves: list[Any], written: list[bool]) -> None:
        """Update the original objects with ``new_state_leaves``: the variables with a
        leaf marked in ``written``. Both lists leave out the variables that hold a
        reference, which the call wrote in place.

        A variable the call only read is left alone. Flax refuses any write to a
        variable created outside the JAX trace that is running, even of its own value,
        so writing it back would fail where the call without jaxscale works: a module
        closed over by a ``jax.jit`` function, which reads its parameters.
        """
        if not self._nodes or not any(written):
            return
        given, flags = iter(new_state_leaves), iter(written)
        new_state_leaves = [
            leaf if held else next(given)
            for leaf, held in zip(self.state_leaves, self.state_refs, strict=True)
        ]
        written = [False if held else next(flags) for held in self.state_refs]
        state = jax.tree.unflatten(self._state_treedef, new_state_leaves)
        if not all(written):
            paths = jax.tree_util.tree_flatten_with_path(state)[0]
            written_paths = {
                variable_path(path)
                for (path, _), was_written in zip(paths, written, strict=True)
                if was_written
            }
            state = _nnx().filter_state(state, lambda path, _: tuple(path) in written_paths)
        _nnx().update(self._nodes, state)


def _refuse_hijax_variables(state_leaves: list[Any]) -> None:
    """Raise ``NotImplementedError`` for a state leaf that is a variable itself, not
    the value a variable holds: a variable of Flax's hijax mode, a JAX type of its own
    that jaxscale's transforms do not evaluate."""
    for leaf in state_leaves:
        if isinstance(leaf, _nnx().Variable):
            raise NotImplementedError(
                f"a module's state holds a {type(leaf).__name__}, a variable of Flax's hijax "
                "mode (nnx.var_defaults(hijax=True)), which jaxscale's transforms do not "
                "support; build the module in Flax's default mode or its reference mode "
                "(nnx.var_defaults(ref=True)). Nothing was changed."
            )


def _threaded_state(output: Any) -> list[bool]:
    """For each leaf of ``output``: whether it is state the call was given and returns
    updated, as Equinox threads an ``eqx.nn.State`` through a call. An NNX module's
    state is written back into its objects instead (:meth:`StatefulCall.write_back`);
    a Linen module's writes are marked where they are made
    (``jaxscale.casting._state_writes``)."""
    equinox = sys.modules.get("equinox")
    state_type = getattr(getattr(equinox, "nn", None), "State", None)
    if state_type is None:
        return [False] * len(jax.tree.leaves(output))
    threaded: list[bool] = []
    for part in jax.tree.leaves(output, is_leaf=lambda x: isinstance(x, state_type)):
        threaded += [isinstance(part, state_type)] * len(jax.tree.leaves(part))
    return threaded


def variable_path(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """The path of the NNX variable that holds a leaf of a ``State``: the keys of the
    state's nested mappings, without the key into the variable itself (its ``value``)."""
    keys = []
    for key in path:
        if not isinstance(key, jax.tree_util.DictKey):
            break
        keys.append(key.key)
    return tuple(keys)


def _argument_path(path: tuple[Any, ...]) -> str:
    """The ``keystr`` of a leaf of ``(fn, args, kwargs)``, from the call's point of view:
    ``[0]['b']`` for ``args[0]['b']``, ``['x']`` for ``kwargs['x']``, ``<fn>`` for the
    function itself (a module whose method is called)."""
    where, rest = path[0].idx, path[1:]
    if where == 0:
        return "<fn>" + jax.tree_util.keystr(rest)
    return jax.tree_util.keystr(rest)


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic))


# A lax operation given operands of two dtypes fails while the function is traced, before
# jaxscale sees it: PyTorch's autocast would cast both, but only a traced program can be
# recast, so the user's code must be valid JAX on its own.
_MIXED_DTYPES_NOTE = (
    "jaxscale traces the function as JAX runs it before it changes any dtype, so each "
    "operation must accept its operands as they are: JAX's lax operations (an Equinox or "
    "lax convolution, lax.dot_general) take operands of one dtype, where torch.autocast "
    "would cast them. With half-precision parameters, cast the inputs to their dtype "
    "(x.astype(jnp.bfloat16)); autocast then runs each operation in its policy's dtype."
)


class TracedCall:
    """``fn(*args, **kwargs)`` traced to a jaxpr, ready to be evaluated anew.

    ``closed`` is the ``ClosedJaxpr``; ``inputs`` its arguments (NNX state leaves,
    then the array leaves of the arguments); ``input_paths`` their paths in
    ``(args, kwargs)`` (``jax.tree_util.keystr`` form, a module's state under its
    argument). ``finish(outs)`` takes the evaluated outputs, writes the state the
    call wrote back into the NNX objects, and returns the call's result.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._call = StatefulCall(fn, args, kwargs)
        try:
            self.closed, (out_shape, state_shape) = jax.make_jaxpr(
                self._call.call_with, return_shape=True
            )(self._call.state_leaves, self._call.array_leaves)
        except jax.errors.ConcretizationTypeError as error:
            error.add_note(self._concrete_value_note(str(error)))
            raise
        except TypeError as error:
            if "requires arguments to have the same dtypes" in str(error):
                error.add_note(_MIXED_DTYPES_NOTE)
            raise
        # A variable may hold a Python number, which the trace took as a weakly typed
        # array: the evaluation is given that array.
        state_inputs = [
            jnp.asarray(leaf) if isinstance(leaf, (bool, int, float, complex)) else leaf
            for leaf in self._call.state_leaves
        ]
        self.inputs = [*state_inputs, *self._call.array_leaves]
        self.input_paths = [*self._call.state_paths, *self._call.array_paths]
        self.state_dtypes = [s.dtype for s in state_shape]
        self._out_count = len(out_shape)
        # A state leaf that the jaxpr returns as it took it was only read (references
        # are inputs, never outputs).
        jaxpr = self.closed.jaxpr
        state_ins = [
            var for var, held in zip(jaxpr.invars, self._call.state_refs, strict=False) if not held
        ]
        state_outs = jaxpr.outvars[self._out_count :]
        self._written = [out is not given for out, given in zip(state_outs, state_ins, strict=True)]

    def _concrete_value_note(self, message: str) -> str:
        """What a user calling the function eagerly needs to know when it wanted the
        concrete value of an array argument: which one, and why it has none."""
        found = re.search(r"argument (array|state)_leaves\[(\d+)\]", message)
        which = "an array argument"
        if found:
            paths = self._call.array_paths if found[1] == "array" else self._call.state_paths
            index = int(found[2])
            if index < len(paths):
                which = f"the array argument {paths[index]}"
        return (
            f"jaxscale traces the function it wraps to a jaxpr, as jax.jit does, so {which} "
            "has no concrete value while it runs, even when called eagerly: a value that "
            "decides Python control flow (if, int(), a shape) is passed as a Python number "
            "or bool, not as an array; or use jax.lax.cond / jnp.where."
        )

    @property
    def threaded_outputs(self) -> list[bool]:
        """For each array output: whether it is state the call was given and returns
        updated (an Equinox ``State``'s leaves), which a transform that casts gives
        back in its traced dtype."""
        return self._call.threaded_outputs

    def finish(self, outs: list[Any]) -> Any:
        results, new_state = outs[: self._out_count], outs[self._out_count :]
        self._call.write_back(new_state, self._written)
        return self._call.output(results)
