"""Arrays sharded along explicit mesh axes (sharding in types, ``jax.make_mesh``'s default).

On such a mesh each array's type names its sharding, and every operation must say how
its result is sharded where JAX cannot infer it. The low-precision state's slice loop
reshapes, slices and recomputes its arrays piece by piece, and a float8 recipe's matmul
reshapes its operands into blocks and reduces them to scales, none of which JAX's type
rules follow; each runs with the mesh's axes made automatic for its duration
(:func:`on_automatic_axes`), each array constrained to the sharding its type had, so
that XLA's partitioner places what is computed from it where it lies, as on a mesh with
automatic axes. The state ``init`` makes is typed with the shardings of the leaves it
stands for (:func:`placed_like`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale._src.deferred import applied, derived_elementwise, elementwise_chain
from jaxscale._src.jaxprs import arguments_retyped

EXPLICIT = jax.sharding.AxisType.Explicit
AUTO = jax.sharding.AxisType.Auto

# Whether the trace is inside on_automatic_axes (a program whose mesh has explicit axes)
_RETYPED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxscale_explicit_axes_made_automatic", default=False
)


def explicit_axes_made_automatic() -> bool:
    """Whether the operations being traced run inside :func:`on_automatic_axes`: in a
    program whose mesh's axes are explicit, made automatic for them."""
    return _RETYPED.get()


def explicit_spec(array: Any) -> PartitionSpec | None:
    """The partition spec of ``array``'s type where it names an explicit mesh axis,
    else ``None`` (a replicated array, an automatic mesh, no mesh, no array)."""
    try:
        aval = jax.typeof(array)
    except TypeError:  # (not an array)
        return None
    return explicit_spec_of_type(aval)


def explicit_spec_of_type(aval: Any) -> PartitionSpec | None:
    """:func:`explicit_spec` of an abstract value (a traced variable's type)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(kind == EXPLICIT for kind in getattr(mesh, "axis_types", ())):
        return None
    return spec if any(axis is not None for axis in spec) else None


def first_explicitly_sharded(*trees: Any) -> tuple[tuple[int, ...], PartitionSpec] | None:
    """The shape and partition spec of the first array in ``trees`` sharded along an
    explicit mesh axis, or ``None``."""
    for leaf in jax.tree.leaves(trees):
        spec = explicit_spec(leaf)
        if spec is not None:
            return tuple(jax.typeof(leaf).shape), spec
    return None


def spec_for_shape(spec: PartitionSpec, like: Any, shape: tuple[int, ...]) -> PartitionSpec:
    """``spec`` (of the array ``like``) for an array of ``shape`` that shares its leading
    axes: a quantized leaf's codes (its shape, or its last axis halved) and scales (its
    leading axes, then one of blocks). Each axis keeps its name where the new length is
    still divisible by the mesh axes' size; the last axis of a shorter shape takes the
    name of the first of the trailing axes it stands for, where no later one is named."""
    mesh = _mesh_of(like)
    names = tuple(spec) + (None,) * (len(jax.typeof(like).shape) - len(spec))
    k = len(shape) - 1
    if len(shape) < len(names):
        last = names[k] if all(name is None for name in names[k + 1 :]) else None
        names = (*names[:k], last)
    kept = tuple(
        name if name is None or length % _size(mesh, name) == 0 else None
        for name, length in zip(names, shape, strict=True)
    )
    return PartitionSpec(*kept)


def placed_like(array: Any, like: Any, spec: PartitionSpec) -> Any:
    """``array`` typed as sharded by ``spec`` on the mesh of ``like``'s type."""
    return jax.sharding.reshard(array, NamedSharding(_mesh_of(like), spec))


def on_automatic_axes(
    function: Callable[..., Any],
    arguments: tuple[Any, ...],
    result_specs: Callable[[Any], Any],
    within: Callable[[Callable[[Any], Any]], list[Any]] | None = None,
) -> Any:
    """``function(*arguments)`` with the explicit axes of the arguments' mesh made
    automatic while it runs: each argument array is constrained to the sharding its type
    names, so XLA's partitioner places what ``function`` computes from it where it lies.
    ``result_specs(results)`` gives a partition spec (or ``None``: replicated) for each
    result array, which the results are typed with after.

    What a transform reads from its context beside its arguments travels too: the
    sources of values derived from them elementwise (:mod:`jaxscale._src.deferred`),
    retyped as the arguments are, and the context managers ``within(retype)`` returns
    (a loss scaler's skip predicate, retyped by the function it is given), entered
    while ``function`` runs."""
    leaves, tree = jax.tree.flatten(arguments)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # (a step traced outside jax.set_mesh: the arrays' own mesh)
        mesh = next(_mesh_of(a) for a in leaves if explicit_spec(a) is not None)
    kinds = zip(mesh.axis_names, mesh.axis_types, strict=True)
    automatic = mesh.update_axis_types({name: AUTO for name, kind in kinds if kind == EXPLICIT})
    chains = [elementwise_chain(a) for a in leaves]
    token = _RETYPED.set(True)
    with jax.sharding.use_abstract_mesh(automatic), contextlib.ExitStack() as stack:
        stack.callback(_RETYPED.reset, token)
        # each array retyped once, so that one passed twice (the masters a writer
        # keeps, which its optimizer reads as the parameters) is one value inside
        done: dict[int, tuple[Any, Any]] = {}

        def retyped(array: Any) -> Any:
            if not isinstance(array, jax.Array):
                return array
            if id(array) not in done:
                typed = jax.sharding.reshard(array, PartitionSpec())
                spec = explicit_spec(array)
                if spec is not None:
                    sharding = NamedSharding(automatic, spec)
                    typed = jax.lax.with_sharding_constraint(typed, sharding)
                done[id(array)] = (array, typed)
            return done[id(array)][1]

        inputs = [retyped(a) for a in leaves]
        stack.enter_context(arguments_retyped(list(zip(leaves, inputs, strict=True))))
        for context in within(retyped) if within is not None else ():
            stack.enter_context(context)
        for chain, derived in zip(chains, inputs, strict=True):
            if chain is not None:  # its source and constants retyped as the arguments
                source, steps = chain
                steps = [(f, tuple(retyped(c) for c in constants)) for f, constants in steps]
                inside = retyped(source)
                stack.enter_context(arguments_retyped([(source, inside)]))
                stack.enter_context(
                    derived_elementwise(derived, inside, functools.partial(applied, steps))
                )
        results = function(*jax.tree.unflatten(tree, inputs))
        out_specs = result_specs(results)

    def typed_back(result: Any, spec: PartitionSpec | None) -> Any:
        if not isinstance(result, jax.Array):
            return result
        return jax.sharding.reshard(result, NamedSharding(mesh, spec or PartitionSpec()))

    return jax.tree.map(typed_back, results, out_specs)


def also_on_explicit_axes(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a quantizer, or its inverse, of its first argument) computed with
    explicit mesh axes made automatic where that argument is sharded along them (its
    reshapes into blocks follow no sharding type rule). Each result is typed as the
    first argument where it has its shape, else by :func:`spec_for_shape` (scales, a
    scalar replicated)."""

    @functools.wraps(function)
    def wrapped(x: Any, *args: Any, **kwargs: Any) -> Any:
        spec = explicit_spec(x)
        if spec is None:
            return function(x, *args, **kwargs)

        def result_spec(result: Any) -> PartitionSpec:
            shape = tuple(np.shape(result))
            if shape == tuple(np.shape(x)):
                return spec
            return spec_for_shape(spec, x, shape) if shape else PartitionSpec()

        return on_automatic_axes(
            lambda x, args, kwargs: function(x, *args, **kwargs),
            (x, args, kwargs),
            lambda results: jax.tree.map(result_spec, results),
        )

    return wrapped


def foreign_mesh(array: Any) -> Any:
    """The abstract mesh of ``array``'s type where it is not the current one (a value
    computed inside :func:`on_automatic_axes`, seen from outside), else ``None``."""
    current = jax.sharding.get_abstract_mesh()
    mesh = getattr(getattr(jax.typeof(array), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or current.empty or mesh == current:
        return None
    return mesh


def on_mesh(mesh: Any) -> Any:
    """A context in which ``mesh`` (from :func:`foreign_mesh`) is the current abstract
    mesh; none where it is ``None``."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh)


def replicated_here(array: Any) -> Any:
    """``array`` (typed on another mesh, :func:`foreign_mesh`) typed replicated on the
    current mesh."""
    current = NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec())
    return jax.sharding.reshard(array, current)


def divisible_names(names: tuple[Any, ...], shape: tuple[int, ...], like: Any) -> tuple[Any, ...]:
    """Sharding ``names`` for an array of ``shape``, each name dropped where its mesh axes'
    size does not divide its axis's length. The mesh is that of ``like`` (a concrete
    array's, or its type's), else the current one; with none known, ``names`` as they
    are."""
    mesh = None
    with contextlib.suppress(AttributeError, TypeError):  # (no mesh in its type)
        mesh = _mesh_of(like)
    if mesh is None or mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return names
    sizes = dict(mesh.shape)

    def divides(name: Any, length: int) -> bool:
        axes = name if isinstance(name, tuple) else (name,)
        return all(a in sizes for a in axes) and length % math.prod(sizes[a] for a in axes) == 0

    return tuple(
        name if name is None or divides(name, length) else None
        for name, length in zip(names, shape, strict=True)
    )


def _mesh_of(array: Any) -> Any:
    sharding = getattr(array, "sharding", None) if not isinstance(array, jax.core.Tracer) else None
    if isinstance(sharding, NamedSharding):  # a concrete array's: its devices
        return sharding.mesh
    return jax.typeof(array).sharding.mesh


def _size(mesh: Any, name: Any) -> int:
    names = name if isinstance(name, tuple) else (name,)
    return math.prod(dict(mesh.shape)[n] for n in names)
