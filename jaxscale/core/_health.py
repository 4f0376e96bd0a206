"""What a training loop asks a loss scaler: which leaf overflowed, and is the scale healthy.

``nonfinite_leaves`` is jittable and answers per leaf; ``nonfinite_paths`` reads
that answer on the host and names the leaves. ``scaler_metrics`` turns a
:class:`ScalerState` into a dict of arrays for a logger, and
``warn_if_unhealthy`` is the opt-in check made when such a dict is read, never
inside the step.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._src import leaves as _leaves
from jaxscale._src.jaxprs import is_traced
from jaxscale.core._scaling import leaf_is_finite
from jaxscale.core._state import ScalerState

METRIC_NAMES = ("scale", "found_inf", "skipped_steps", "growth_tracker", "overflow_streak")


class ScaleWarning(UserWarning):
    """The loss scale left the range a run asked to be warned about."""


def nonfinite_leaves(tree: Any) -> Any:
    """A tree like ``tree`` with one boolean scalar per leaf: whether it holds an inf or NaN.

    Non-floating leaves (integers, booleans, ``float0``) are ``False``; ``None``
    stays ``None``. Jittable: log it, or pass it to :func:`nonfinite_paths` outside
    ``jit`` to name the culprits.

    >>> import jax.numpy as jnp
    >>> from jaxscale import nonfinite_leaves
    >>> nonfinite_leaves({"w": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2), "n": jnp.int32(3)})
    {'b': Array(False, dtype=bool), 'n': Array(False, dtype=bool), 'w': Array(True, dtype=bool)}

    A mutable array reference (``jax.new_ref``, a variable's value in Flax's reference
    mode) is checked for the value it holds.
    """

    def check(path: Any, leaf: Any) -> jax.Array:
        try:
            floating = _leaves.is_floating(leaf)
        except TypeError as error:
            raise TypeError(f"leaf {jax.tree_util.keystr(path) or '<root>'}: {error}") from None
        if not floating:
            return jnp.asarray(False)
        return jnp.logical_not(leaf_is_finite(leaf))

    return jax.tree_util.tree_map_with_path(check, _leaves.read_references(tree))


def nonfinite_paths(tree: Any) -> list[str]:
    """The paths (``jax.tree_util.keystr`` form) of the leaves of ``tree`` holding an inf or NaN.

    ``tree`` is a tree of arrays (gradients, parameters, activations), or the
    result of :func:`nonfinite_leaves` (a tree whose leaves are all booleans is
    read as those flags). It runs on the host and reads the arrays,
    so call it outside ``jit``: return the gradients (or their
    ``nonfinite_leaves``) from the jitted step and ask here.

    Raises:
      TypeError: when called on traced values, inside ``jit``.

    >>> import jax.numpy as jnp
    >>> from jaxscale import nonfinite_paths
    >>> grads = {"dense": {"kernel": jnp.array([1.0, jnp.inf]), "bias": jnp.zeros(2)}}
    >>> nonfinite_paths(grads)
    ["['dense']['kernel']"]
    """
    tree = _leaves.read_references(tree)
    leaves = jax.tree_util.tree_leaves(tree)
    if any(is_traced(leaf) for leaf in leaves):
        raise TypeError(
            "nonfinite_paths reads values on the host and cannot run inside jit; return "
            "jaxscale.nonfinite_leaves(tree) from the jitted function and call it outside"
        )
    if leaves and all(getattr(leaf, "dtype", None) == np.bool_ for leaf in leaves):
        flags = jax.device_get(tree)
    else:
        flags = jax.device_get(nonfinite_leaves(tree))
    return [
        jax.tree_util.keystr(path)
        for path, flag in jax.tree_util.tree_flatten_with_path(flags)[0]
        if bool(np.asarray(flag).any())
    ]


def scaler_metrics(state: ScalerState) -> dict[str, jax.Array]:
    """The state's fields as a dict of arrays, for a logger; no host synchronisation."""
    return {name: getattr(state, name) for name in METRIC_NAMES}


def disabled_metrics() -> dict[str, jax.Array]:
    """The metrics of a disabled scaler: scale 1, nothing found, nothing skipped."""
    return {
        "scale": jnp.float32(1.0),
        "found_inf": jnp.asarray(False),
        "skipped_steps": jnp.zeros((), jnp.int32),
        "growth_tracker": jnp.zeros((), jnp.int32),
        "overflow_streak": jnp.zeros((), jnp.int32),
    }


def parameters_finite(params: Any) -> jax.Array:
    """Whether every floating leaf of ``params`` is finite (a bool scalar; jittable, no
    host synchronisation): one read of the parameters, made only when asked."""
    flags = jax.tree.leaves(nonfinite_leaves(params))
    if not flags:
        return jnp.asarray(True)
    return jnp.logical_not(jnp.any(jnp.stack(flags)))


def with_parameter_check(metrics: dict[str, Any], params: Any) -> dict[str, Any]:
    """``metrics`` with ``params_finite`` added when ``params`` is given."""
    if params is None:
        return metrics
    return {**metrics, "params_finite": parameters_finite(params)}


def _parameters_note(params: Any) -> str:
    """Why every step is skipped when the parameters themselves are not finite."""
    if params is None:
        return (
            " (pass params= to metrics() to learn whether the parameters themselves "
            "hold inf or NaN)"
        )
    culprits = nonfinite_paths(params)
    if not culprits:
        return ""
    shown = ", ".join(culprits[:3]) + (
        f" and {len(culprits) - 3} more" if len(culprits) > 3 else ""
    )
    return (
        f". The parameters themselves hold inf or NaN ({shown}), so every gradient does "
        "and every step is skipped, for good: an update wrote them. With float16 "
        "parameters an optimizer constant such as Adam's eps=1e-8 is 0 in float16 "
        "(0/0 is NaN): keep float32 masters with jaxscale.master_weights, or use eps >= "
        "1e-4; jaxscale.locate_nonfinite names the operation"
    )


def warn_if_unhealthy(
    metrics: dict[str, Any], warn_below: float | None, warn_above: float | None,
    params: Any = None,
) -> None:  # fmt: skip
    """Warn (:class:`ScaleWarning`) when the scale is below ``warn_below`` or at or above
    ``warn_above``. Reads the scale on the host, so only with a threshold given and
    only outside ``jit``; a traced scale with a threshold raises ``TypeError``. With
    ``params``, a scale below ``warn_below`` is explained by non-finite parameters when
    they are the cause."""
    if warn_below is None and warn_above is None:
        return
    scale = metrics["scale"]
    if is_traced(scale):
        raise TypeError(
            "warn_below/warn_above read the scale on the host; call metrics() with them "
            "outside jit (inside jit, call it without thresholds and log the arrays)"
        )
    value = float(scale)
    if warn_below is not None and value < warn_below:
        warnings.warn(
            f"the loss scale {value:g} is below {warn_below:g}: gradients have overflowed "
            "on many recent steps (a NaN in the model or data, or a learning rate too high)"
            + _parameters_note(params),
            ScaleWarning,
            stacklevel=3,
        )
    if warn_above is not None and value >= warn_above:
        warnings.warn(
            f"the loss scale {value:g} is at or above {warn_above:g}: no overflow for a long "
            "time; if this is max_scale the scale cannot grow further",
            ScaleWarning,
            stacklevel=3,
        )


class NonfiniteRecord(NamedTuple):
    """Where an inf or NaN was born, as arrays (the traced part of
    :class:`jaxscale.NonfiniteReport`): whether one was, which entry of the report's
    table, in which iteration of the innermost loop, and its kind (1 inf, 2 NaN)."""

    found: jax.Array  # bool[]
    entry: jax.Array  # int32[], -1 when nothing was found
    iteration: jax.Array  # int32[], -1 outside loops
    kind: jax.Array  # int32[], 0 when nothing was found


def empty_nonfinite_record() -> NonfiniteRecord:
    """The record of nothing found."""
    return NonfiniteRecord(
        jnp.asarray(False),
        jnp.asarray(-1, jnp.int32),
        jnp.asarray(-1, jnp.int32),
        jnp.asarray(0, jnp.int32),
    )


def keep_overflow_record(
    previous: NonfiniteRecord, found_inf: jax.Array, current: Any
) -> NonfiniteRecord:
    """``current`` (a report's record) where this step overflowed, else ``previous``:
    the origin of the latest overflow, kept in a scaler's state."""
    return NonfiniteRecord(
        *(
            jnp.where(found_inf, jnp.asarray(new, old.dtype), old)
            for old, new in zip(previous, tuple(current), strict=True)
        )
    )


_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def warn_about_scaled_loss(loss: Any, scaled: Any, stacklevel: int = 3) -> None:
    """Warn (:class:`ScaleWarning`) about the two ways a scaled loss silently goes wrong:
    a 0-d float16 or bfloat16 loss (PyTorch computes losses in float32 under autocast;
    scaled in its own dtype, a float16 loss overflows at 65504), and, outside ``jit``,
    a finite loss whose scaled value is not finite."""
    if not (hasattr(loss, "dtype") and np.ndim(loss) == 0):
        return
    dtype = np.dtype(loss.dtype)
    if dtype in _HALF:
        warnings.warn(
            f"scale() was given a {dtype.name} loss. Under PyTorch's autocast a loss is "
            "float32, and the scaled loss keeps the loss's dtype, which for float16 ends "
            "at 65504: compute the loss in float32 (a loss computed under "
            "jaxscale.autocast is) or scale loss.astype(jnp.float32)",
            ScaleWarning,
            stacklevel=stacklevel,
        )
    if is_traced(scaled) or is_traced(loss):
        return
    if bool(np.isfinite(np.asarray(loss, np.float64))) and not bool(
        np.isfinite(np.asarray(scaled, np.float64))
    ):
        warnings.warn(
            f"the scaled loss is {float(scaled)}: the loss {float(loss):g} times the scale "
            f"overflows {dtype.name}; every step would be skipped until the scale backs off "
            "far enough. Compute the loss in float32",
            ScaleWarning,
            stacklevel=stacklevel,
        )
