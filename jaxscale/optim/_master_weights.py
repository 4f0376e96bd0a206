"""``master_weights``: float32 master copies of half-precision parameters (apex's O2).

Micikevicius et al. (2018) keep a float32 copy of every half-precision weight, let
the optimizer update the copy, and round it to half precision for the next forward
pass: an update far below the half-precision weight's ulp still moves the copy,
and accumulates until the rounded weight moves too.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale._src.deferred import derived_elementwise
from jaxscale._src.jaxprs import is_staged_argument
from jaxscale.optim._handed_down import FinishedStep, finishing
from jaxscale.optim._variables import held_like, values_of
from jaxscale.optim._wrapping import (
    PARAMETER_WRITERS,
    floating_dtype,
    is_narrower,
    map_with_optional,
    require_no_writer_inside,
    require_params,
    validated_inner,
)


class MasterWeightsState(NamedTuple):
    """State of :func:`master_weights`.

    Attributes:
      masters: a tree like the parameters: the master copy (in the master dtype) of
        each floating parameter narrower than it, ``None`` for the other leaves.
      inner_state: the wrapped optimizer's state, for the parameters at master
        precision.
    """

    masters: Any
    inner_state: Any


PARAMETER_WRITERS[MasterWeightsState] = "master_weights"


def master_weights(
    inner: optax.GradientTransformation, dtype: Any = jnp.float32
) -> optax.GradientTransformationExtraArgs:
    """Keep ``dtype`` master copies of the parameters narrower than ``dtype``, and run
    ``inner`` on them.

    ``init(params)`` copies each floating parameter narrower than ``dtype`` (bfloat16,
    float16, float8) to ``dtype``. ``update(grads, state, params)`` gives ``inner``
    the masters in place of those parameters and their gradients cast to ``dtype``,
    adds ``inner``'s updates to the masters in ``dtype``, and returns, for each such
    leaf, the ``dtype`` update that takes the parameter to its new master rounded to
    nearest in the parameter's dtype: ``optax.apply_updates(params, updates)`` (which
    adds in ``dtype`` and rounds once) lands on that value bit for bit whenever it is
    zero or at least 2⁻¹² of the old parameter in magnitude (the difference of the two
    is then exact in float32). Parameters already ``dtype`` or wider, and non-floating
    leaves, get exactly ``inner``'s updates.

    Under :func:`jaxscale.grad_scaler` a skipped step leaves the masters unchanged.
    :func:`jaxscale.master_params` reads the masters back, for evaluation or a
    checkpoint at full precision. Wrap the writers around the rest: inside
    :func:`stochastic_rounding` or :func:`kahan_summation`, which give ``inner``
    float32 copies of the parameters, masters would never be kept, and that is an
    error.

    Args:
      inner: the optimizer to run on the masters, e.g. ``optax.adamw(1e-3)``.
      dtype: the masters' dtype, or its name (``"float32"``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`MasterWeightsState`.

    Raises:
      TypeError: for an ``inner`` that is not an Optax transform (a factory such as
        ``optax.adamw`` passed uncalled is named).
      ValueError: from ``init``, for a parameter of ``dtype``'s width in another
        format (bfloat16 parameters with float16 masters: none would be kept); from
        ``update``, called without ``params``, or with a parameter narrower than
        ``dtype`` that ``init`` saw wider (and so kept no master of).

    >>> import jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> tx = jaxscale.master_weights(optax.sgd(1e-3))
    >>> state = tx.init(params)
    >>> for _ in range(10):  # each step is a tenth of bfloat16's ulp at 1.0
    ...     updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> params["w"].tolist()  # 0.99 to bfloat16's nearest; without masters it stays 1.0
    [0.98828125, 0.98828125]
    >>> jaxscale.master_params(state, params)["w"].tolist()  # 1 - 10 * 1e-3 in float32
    [0.9900001287460327, 0.9900001287460327]
    """
    inner = validated_inner(inner, "master_weights")
    master_dtype = floating_dtype(dtype, "dtype")

    def kept(leaf: Any) -> bool:
        return is_narrower(leaf, master_dtype)

    def init_fn(params: optax.Params) -> MasterWeightsState:
        _require_wider(params, master_dtype)
        masters = jax.tree.map(lambda p: p.astype(master_dtype) if kept(p) else None, params)
        inner_state = inner.init(_with_masters(masters, params))
        require_no_writer_inside(inner_state, "master_weights")
        return MasterWeightsState(masters, inner_state)

    def update_fn(
        updates: optax.Updates,
        state: MasterWeightsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MasterWeightsState]:
        require_params(params, "master_weights")
        _require_masters_of_narrow_parameters(state.masters, params, master_dtype)
        # computed on the arrays alone, the results put back into the variables that
        # held the gradients and the old masters (held_like)
        given_updates, given_masters = updates, state.masters
        updates, params, masters = values_of(updates), values_of(params), values_of(state.masters)

        def widened(grad: Any) -> Any:
            return grad.astype(master_dtype)

        if _mirrors(masters, updates):
            grads = map_with_optional(lambda m, g: g if m is None else widened(g), masters, updates)
        else:  # gradients of part of the parameters (optax.lookahead's of its fast ones)
            grads = jax.tree.map(lambda g: widened(g) if kept(g) else g, updates)

        def step(inner_updates: Any, masters: Any) -> tuple[Any, Any]:
            """The new masters, and each new parameter (``inner``'s update for a parameter
            that has no master)."""
            masters = map_with_optional(
                lambda m, u: None if m is None else m + u.astype(master_dtype),
                masters,
                inner_updates,
            )
            written = map_with_optional(
                lambda m, u, p: u if m is None else m.astype(p.dtype),
                masters,
                inner_updates,
                params,
            )
            return written, masters

        # Computed in the slice loop of an inner low_precision_state, where it has one
        # and the gradients are the step's own (passed to it, they cannot be written
        # into, and the update is computed on whole arrays after the loop anyway)
        passed = all(is_staged_argument(leaf) for leaf in jax.tree.leaves(updates))
        handed = FinishedStep(step, masters)
        with (
            derived_elementwise(grads, updates, widened),
            finishing(handed) if not passed else contextlib.nullcontext(),
        ):
            inner_updates, inner_state = inner.update(
                grads, state.inner_state, _with_masters(masters, params), **extra_args
            )
        if handed.finished(inner_updates):
            written, masters = handed.written, handed.new_beside
        else:
            written, masters = step(inner_updates, masters)

        def to_update(master: Any, written: Any, param: Any) -> Any:
            if master is None:
                return written  # inner's update
            return written.astype(master_dtype) - param.astype(master_dtype)

        new_updates = map_with_optional(to_update, masters, written, params)
        return held_like(given_updates, new_updates), MasterWeightsState(
            held_like(given_masters, masters), inner_state
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _mirrors(masters: Any, updates: Any) -> bool:
    """Whether ``updates`` has the parameters' structure (``masters`` has ``None`` where
    a parameter has no master)."""
    is_none = lambda node: node is None  # noqa: E731
    wanted: Any = jax.tree.structure(masters, is_leaf=is_none)  # (a PyTreeDef)
    given = jax.tree.structure(jax.tree.map(lambda _: None, updates), is_leaf=is_none)
    return bool(wanted == given)


def _require_wider(params: Any, dtype: np.dtype) -> None:
    """A ValueError for a floating parameter as wide as ``dtype`` in another format."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        leaf_dtype = getattr(leaf, "dtype", None)
        if (
            leaf_dtype is not None
            and jnp.issubdtype(leaf_dtype, jnp.floating)
            and np.dtype(leaf_dtype) != dtype
            and np.dtype(leaf_dtype).itemsize == dtype.itemsize
        ):
            raise ValueError(
                f"master_weights keeps masters wider than the parameters, but parameter "
                f"{jax.tree_util.keystr(path)} is {np.dtype(leaf_dtype).name}, as wide as the "
                f"masters' {dtype.name}: it would keep none; use dtype=jnp.float32"
            )


def _require_masters_of_narrow_parameters(masters: Any, params: Any, dtype: np.dtype) -> None:
    """A ValueError for a parameter narrower than ``dtype`` that has no master."""
    for (path, master), param in zip(
        jax.tree_util.tree_leaves_with_path(masters, is_leaf=lambda n: n is None),
        jax.tree.leaves(params, is_leaf=lambda n: n is None),
        strict=False,
    ):
        if master is None and is_narrower(param, dtype):
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} is {param.dtype}, narrower than "
                f"{dtype.name}, but master_weights' init saw it wider and kept no master of it: "
                "call init on the parameters in the dtypes you train them in"
            )


def _with_masters(masters: Any, params: Any) -> Any:
    return map_with_optional(lambda m, p: p if m is None else m, masters, params)


def _as_master_weights_state(node: Any) -> MasterWeightsState | None:
    """``node`` as a :class:`MasterWeightsState`: the state, or the mapping of its fields
    that ``nnx.state`` makes of it (with each array in a variable)."""
    if isinstance(node, MasterWeightsState):
        return node
    keys = getattr(node, "keys", None)
    if callable(keys) and set(keys()) == set(MasterWeightsState._fields):
        return MasterWeightsState(node["masters"], node["inner_state"])
    return None


def master_params(opt_state: Any, params: optax.Params) -> optax.Params:
    """``params`` with each parameter that :func:`master_weights` keeps a master of
    replaced by that master: the parameters at full precision.

    Args:
      opt_state: the state of a :func:`master_weights` transform, or any optimizer
        state that holds exactly one (inside :func:`jaxscale.grad_scaler`,
        ``optax.chain``, a ``flax.nnx.Optimizer``'s ``opt_state``).
      params: the parameters the optimizer updates.

    Returns:
      A tree like ``params``, masters where kept (in the masters' dtype); Flax NNX
      variables (an ``nnx.State``, an ``nnx.Optimizer``'s state) are read to arrays.

    Raises:
      ValueError: when ``opt_state`` holds no master_weights state or more than one.

    >>> import jax, jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.array([1.0], jnp.bfloat16), "n": jnp.array([2.0])}
    >>> state = jaxscale.grad_scaler(jaxscale.master_weights(optax.adam(1e-3))).init(params)
    >>> jax.tree.map(lambda x: x.dtype.name, jaxscale.master_params(state, params))
    {'n': 'float32', 'w': 'float32'}
    """
    found = [
        state
        for state in map(
            _as_master_weights_state,
            jax.tree_util.tree_leaves(
                opt_state, is_leaf=lambda node: _as_master_weights_state(node) is not None
            ),
        )
        if state is not None
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected one master_weights state in the {type(opt_state).__name__} given, found "
            f"{len(found) or 'none'}: pass the state of an optimizer built with "
            "jaxscale.master_weights(...)"
            + (", or the sub-state that holds the one you mean" if found else "")
        )
    return _with_masters(values_of(found[0].masters), values_of(params))
