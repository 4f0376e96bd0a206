"""Find a :func:`grad_scaler`'s state inside any nested optimizer state.

Optax nests states: ``optax.chain`` makes tuples, ``inject_hyperparams`` and
``MultiSteps`` wrap their inner state, and ``flax.nnx.Optimizer`` holds the tree
with ``nnx.Variable`` leaves. The helpers here walk any such pytree, find the one
:class:`GradScalerState`, and read it, unwrapping variables where needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale.core import ScalerState, scale_outputs
from jaxscale.core.shared import (
    NonfiniteRecord,
    disabled_metrics,
    scaler_metrics,
    warn_about_scaled_loss,
    warn_if_unhealthy,
    with_parameter_check,
)
from jaxscale.transform._grad_scaler import GradScalerState


def _array(leaf: Any) -> jax.Array:
    # flax.nnx.Variable (and its OptState subclasses) hold their array behind get_value().
    get_value = getattr(leaf, "get_value", None)
    return get_value() if callable(get_value) else leaf


def _as_grad_scaler_state(node: Any) -> GradScalerState | None:
    """``node`` as a :class:`GradScalerState`, if it is one.

    Besides the state itself, this recognises the mapping ``nnx.state`` makes of
    it (``nnx.split``/``nnx.merge`` loops and checkpoint restores hold that): a
    mapping with ``"scaler"`` (a mapping of :class:`ScalerState`'s fields) and
    ``"inner_state"``, or with ``"inner_state"`` alone for a disabled scaler.
    """
    if isinstance(node, GradScalerState):
        return node
    if not isinstance(node, Mapping) or "inner_state" not in node:
        return None
    keys = set(node.keys())
    if keys == {"inner_state"}:
        return GradScalerState(scaler=None, inner_state=node["inner_state"])
    scaler, origin = node.get("scaler"), node.get("overflow_origin")
    if not keys <= {"scaler", "inner_state", "overflow_origin"} or not isinstance(scaler, Mapping):
        return None
    if set(scaler.keys()) != set(ScalerState._fields):
        return None
    fields = {name: _array(scaler[name]) for name in ScalerState._fields}
    if isinstance(origin, Mapping):
        origin = NonfiniteRecord(*(_array(origin[name]) for name in NonfiniteRecord._fields))
    return GradScalerState(ScalerState(**fields), node["inner_state"], origin)


# the methods of jaxscale.GradScaler that answer what the helpers below answer
_FACADE_METHODS = ("get_scale", "found_inf", "skipped_steps", "metrics")


def find_state(opt_state: Any) -> GradScalerState:
    """Return the single :class:`GradScalerState` inside ``opt_state``.

    ``opt_state`` may be any nesting of Optax states, a ``flax.nnx.Optimizer``'s
    ``opt_state``, or the ``nnx.State`` that ``nnx.state(optimizer)["opt_state"]``
    gives.

    Raises:
      ValueError: if ``opt_state`` holds no grad_scaler state, or more than one
        (then pass the sub-state of the one you mean).
    """
    leaves = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda node: _as_grad_scaler_state(node) is not None
    )
    found = [state for state in map(_as_grad_scaler_state, leaves) if state is not None]
    if len(found) != 1:
        problem = "none" if not found else f"{len(found)}"
        if found:
            hint = "pass the sub-state that holds the one you mean"
        elif all(callable(getattr(opt_state, name, None)) for name in _FACADE_METHODS):
            # jaxscale.GradScaler, named by its methods: this layer sits below the facade
            hint = "a jaxscale.GradScaler answers this with its own methods: " + ", ".join(
                f"scaler.{name}()" for name in _FACADE_METHODS
            )
        else:
            hint = "pass the state of an optimizer built with jaxscale.grad_scaler(...)"
        raise ValueError(
            f"expected one grad_scaler state in the {type(opt_state).__name__} given, "
            f"found {problem}; {hint}"
        )
    return found[0]


def get_scale(opt_state: Any) -> jax.Array:
    """The current loss scale (float32 scalar) of the grad_scaler inside ``opt_state``.

    1.0 when the scaler was built with ``enabled=False``. Jittable.

    >>> import jax.numpy as jnp, optax, jaxscale
    >>> opt_state = jaxscale.grad_scaler(optax.adam(1e-3)).init({"w": jnp.zeros(2)})
    >>> jaxscale.get_scale(opt_state)
    Array(65536., dtype=float32)
    """
    state = find_state(opt_state)
    if state.scaler is None:
        return jnp.float32(1.0)
    return _array(state.scaler.scale)


def found_inf(opt_state: Any) -> jax.Array:
    """Whether the last update's gradients held an inf or NaN, so that it was skipped.

    A boolean scalar; False before the first update and when disabled. Jittable.
    """
    state = find_state(opt_state)
    if state.scaler is None:
        return jnp.asarray(False)
    return _array(state.scaler.found_inf)


def skipped_steps(opt_state: Any) -> jax.Array:
    """How many updates the grad_scaler inside ``opt_state`` has skipped (int32 scalar).

    Saturates at ``2**31 - 1``; 0 when disabled. Jittable.
    """
    state = find_state(opt_state)
    if state.scaler is None:
        return jnp.zeros((), jnp.int32)
    return _array(state.scaler.skipped_steps)


def metrics(
    opt_state: Any,
    *,
    params: Any = None,
    warn_below: float | None = None,
    warn_above: float | None = None,
) -> dict[str, jax.Array]:
    """The grad_scaler's state as a dict of arrays, ready for a logger.

    Keys: ``scale`` (float32), ``found_inf`` (bool, the last update was skipped),
    ``skipped_steps``, ``growth_tracker`` and ``overflow_streak`` (int32). The
    values are the state's own arrays: building the dict reads nothing back to
    the host, so it can be returned from a jitted step and logged
    asynchronously (TensorBoard, W&B, clu).

    Opt-in health check, outside ``jit`` only (it reads the scale): with
    ``warn_below`` a :class:`ScaleWarning` is issued when the scale is below it
    (overflows on many recent steps: a NaN source, a learning rate too high);
    with ``warn_above`` when it is at or above it (pass ``max_scale`` to learn
    that the scale sits at its ceiling).

    With ``params`` (the parameters the state updates), ``params_finite`` too: whether
    every parameter is finite, one read of the parameters (jittable, no host sync). A
    scale below ``warn_below`` with non-finite parameters is named as such: every step
    is then skipped for good (an update wrote inf or NaN; with float16 parameters
    Adam's ``eps=1e-8`` is 0).

    >>> import jax.numpy as jnp, optax, jaxscale
    >>> opt_state = jaxscale.grad_scaler(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
    >>> values = jaxscale.metrics(opt_state)
    >>> float(values["scale"]), bool(values["found_inf"]), int(values["skipped_steps"])
    (65536.0, False, 0)
    """
    state = find_state(opt_state)
    if state.scaler is None:
        values = disabled_metrics()
    else:
        values = {k: _array(v) for k, v in scaler_metrics(state.scaler).items()}
    values = with_parameter_check(values, params)
    warn_if_unhealthy(values, warn_below, warn_above, params)
    return values


def scale(loss_or_tree: Any, opt_state: Any) -> Any:
    """Multiply a loss (or any tree of floating arrays) by the current loss scale.

    Differentiate the result: its gradients are the scaled gradients that the
    :func:`grad_scaler` transform inside ``opt_state`` expects. Each leaf keeps its
    dtype (see :func:`scale_outputs`). When the scaler is disabled the input is
    returned unchanged.

    >>> import jax.numpy as jnp, optax, jaxscale
    >>> opt_state = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=8.0).init(jnp.zeros(2))
    >>> jaxscale.scale(jnp.float32(0.5), opt_state)
    Array(4., dtype=float32)
    """
    state = find_state(opt_state)
    if state.scaler is None:
        return loss_or_tree
    scaled = scale_outputs(loss_or_tree, _array(state.scaler.scale))
    warn_about_scaled_loss(loss_or_tree, scaled)
    return scaled


def last_overflow_origin(opt_state: Any, report: Any) -> Any:
    """Where the inf or NaN of the latest skipped step was born, as a report.

    For a :func:`grad_scaler` built with ``record_overflow_origin=True`` and given
    each step's :func:`jaxscale.locate_nonfinite` report (``nonfinite_report=``).
    ``report`` is any report of the same located function (the one this step
    returned): it supplies the table the stored origin indexes. Returns a
    :class:`jaxscale.NonfiniteReport`; its ``describe()`` is one line for a log,
    ``"no inf or NaN reached the outputs of this call"`` before any overflow.

    Raises:
      ValueError: if the scaler keeps no overflow origin.
    """
    state = find_state(opt_state)
    if state.overflow_origin is None:
        raise ValueError(
            "this grad_scaler keeps no overflow origin; build it with "
            "grad_scaler(..., record_overflow_origin=True)"
        )
    stored = type(report.record)(*(_array(v) for v in state.overflow_origin))
    return type(report)(stored, report.origins)
