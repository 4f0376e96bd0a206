"""``grad_scaler``: dynamic loss scaling as an Optax transform wrapping any optimizer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from jaxscale._src import validation
from jaxscale._src.deferred import derived_elementwise
from jaxscale._src.leaves import noted_on_failure, optax_params_mismatch
from jaxscale.core import (
    AxisName,
    ScalerState,
    ScaleUpdateRule,
    all_finite,
    any_over_axis,
    init_scaler_state,
    inverse_scale,
    update_unless,
)
from jaxscale.core.shared import (
    NonfiniteRecord,
    empty_nonfinite_record,
    keep_overflow_record,
    unscale,
)


class GradScalerState(NamedTuple):
    """State of :func:`grad_scaler`.

    Attributes:
      scaler: the :class:`ScalerState` (scale, trackers, the last step's
        ``found_inf`` and the count of skipped steps); ``None`` when the
        transform was built with ``enabled=False``.
      inner_state: the wrapped transform's state, untouched by skipped updates.
      overflow_origin: with ``record_overflow_origin=True``, where the inf or NaN of
        the latest skipped step was born (read it with
        :func:`jaxscale.last_overflow_origin`); else ``None``.
    """

    scaler: ScalerState | None
    inner_state: Any
    overflow_origin: NonfiniteRecord | None = None


def _name_where_the_attribute_is(self: GradScalerState, name: str) -> Any:
    """``GradScalerState.__getattr__``: only reached for a name that is not a field.

    Code written for the unwrapped optimizer reads its state's attributes
    (``opt_state.hyperparams`` of ``inject_hyperparams``,
    ``schedule_free_eval_params(opt_state, params)``): the error names where they
    now are, and stays an ``AttributeError`` so that ``getattr`` with a default and
    ``hasattr`` behave as before.
    """
    if not name.startswith("__") and hasattr(self.inner_state, name):
        raise AttributeError(
            f"GradScalerState has no attribute {name!r}: it wraps the optimizer's state, "
            f"which has it; read opt_state.inner_state.{name} (and pass "
            "opt_state.inner_state to helpers written for the unwrapped optimizer)",
            name=name,
            obj=self,
        )
    raise AttributeError(f"'GradScalerState' object has no attribute {name!r}", name=name, obj=self)


# Set after the class: in its body a type checker would accept every attribute name
setattr(GradScalerState, "__getattr__", _name_where_the_attribute_is)  # noqa: B010


def grad_scaler(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    axis_name: AxisName | None = None,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
    dynamic: bool = True,
    record_overflow_origin: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wrap an Optax optimizer with dynamic loss scaling, as ``torch.amp.GradScaler``.

    The returned transform's ``update`` takes the gradients of the *scaled* loss
    (``jaxscale.scale(loss, opt_state)``) and:

    1. checks them for inf/NaN (over all devices of ``axis_name`` when given;
       under ``jax.jit`` with sharded arrays the check is global already);
    2. when all are finite, unscales them and runs ``inner.update``, so clipping
       and everything else inside ``inner`` sees the true gradients;
    3. when not, emits zero updates (``-0.0``, so parameters stay bitwise equal)
       and keeps ``inner``'s state exactly as it was: the step is skipped, like
       PyTorch not calling ``optimizer.step()``. The skip is a select that XLA
       updates in place, with no branch for the host to decide (see
       :func:`jaxscale.core.run_unless`). An Optax schedule inside ``inner``
       reads ``inner``'s own step count, which a skipped step does not advance;
    4. updates the scale by PyTorch's rule (:func:`update_scale`) and records
       ``found_inf`` and the count of skipped steps.

    All of it runs inside the caller's ``jit``: no host synchronisation, and no
    recompilation when the scale changes. Extra arguments to ``update`` are
    forwarded to ``inner``.

    Args:
      inner: the optimizer to wrap (any ``optax.GradientTransformation``).
      init_scale: initial scale (positive, finite in float32).
      growth_factor: factor applied after ``growth_interval`` finite steps (> 1).
      backoff_factor: factor applied after an overflow, in (0, 1).
      growth_interval: consecutive finite steps before growth (int >= 1).
      enabled: if False, the transform is ``inner`` plus a state wrapper: no
        check, no unscaling, and :func:`scale` returns the loss unchanged.
      axis_name: the mapped axis name (or names) under ``shard_map``/``pmap``
        over which the inf/NaN decision is shared, so every device skips alike.
      min_scale: optional floor for backoff (off by default, as PyTorch).
      max_scale: optional ceiling for growth (off by default, as PyTorch).
      hysteresis: consecutive overflows before the scale backs off (1, the
        default, is PyTorch's rule); every overflowing step is still skipped.
      dynamic: if False, the scale stays at ``init_scale`` (a static loss scale);
        non-finite steps are still skipped.
      record_overflow_origin: if True, ``update`` takes the report of
        :func:`jaxscale.locate_nonfinite` as the extra argument
        ``nonfinite_report=`` and keeps, in the state, where the inf or NaN of the
        latest skipped step was born (:func:`jaxscale.last_overflow_origin`). Off
        by default, and then it costs nothing.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`GradScalerState`.

    Raises:
      TypeError, ValueError: for a hyperparameter of the wrong kind or out of
        range, naming it.

    >>> import jax, jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> tx = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=1024.0)
    >>> opt_state = tx.init(params)
    >>> def loss_fn(p):
    ...     return jnp.sum(p["w"] ** 2)
    >>> @jax.jit
    ... def train_step(params, opt_state):
    ...     grads = jax.grad(lambda p: jaxscale.scale(loss_fn(p), opt_state))(params)
    ...     updates, opt_state = tx.update(grads, opt_state, params)
    ...     return optax.apply_updates(params, updates), opt_state
    >>> params, opt_state = train_step(params, opt_state)
    >>> params["w"], float(jaxscale.get_scale(opt_state))
    (Array([ 0.8, -1.6], dtype=float32), 1024.0)
    """
    problem = validation.optimizer_problem(inner, "grad_scaler")
    if problem is not None:
        raise problem
    inner = optax.with_extra_args_support(inner)
    rule = ScaleUpdateRule.from_arguments(locals())
    init_scale = validation.init_scale_within(init_scale, rule.min_scale, rule.max_scale)
    record_origin = validation.as_bool("record_overflow_origin", record_overflow_origin)
    if not validation.as_bool("enabled", enabled):
        return _passthrough(inner)

    def init_fn(params: optax.Params) -> GradScalerState:
        return GradScalerState(
            scaler=init_scaler_state(init_scale),
            inner_state=inner.init(params),
            overflow_origin=empty_nonfinite_record() if record_origin else None,
        )

    def update_fn(
        updates: optax.Updates,
        state: GradScalerState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, GradScalerState]:
        _require_own_state(state)
        if state.scaler is None:
            raise ValueError(
                "this grad_scaler is enabled but was given the state of a disabled one "
                "(built with enabled=False); initialise the state with this transform's init"
            )
        report = extra_args.pop("nonfinite_report", None)
        if report is not None and not record_origin:
            raise ValueError(
                "update() was given nonfinite_report=, but this grad_scaler keeps no overflow "
                "origin; build it with grad_scaler(..., record_overflow_origin=True)"
            )
        mismatch = None if params is None else optax_params_mismatch(updates, params)
        found_inf = any_over_axis(jnp.logical_not(all_finite(updates)), axis_name)
        inv_scale = inverse_scale(state.scaler.scale)

        def inner_update(grads: optax.Updates, inner_state: Any) -> tuple[optax.Updates, Any]:
            # unscaling here, inside the skip, fuses it into inner's own pass (or into
            # each slice of a state updated in place)
            unscaled = unscale(grads, inv_scale=inv_scale)
            with derived_elementwise(unscaled, grads, _unscaled, inv_scale):
                return inner.update(unscaled, inner_state, params, **extra_args)

        # A skipped step emits -0.0 updates and keeps the inner state exactly as it was.
        with noted_on_failure(mismatch), _state_of_other_parameters_named():
            new_updates, new_inner_state = update_unless(
                found_inf, inner_update, updates, state.inner_state
            )
        origin = state.overflow_origin
        if origin is not None and report is not None:
            origin = keep_overflow_record(origin, found_inf, report.record)
        return new_updates, GradScalerState(
            scaler=rule.apply(state.scaler, found_inf),
            inner_state=new_inner_state,
            overflow_origin=origin,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _require_own_state(state: Any) -> None:
    if not isinstance(state, GradScalerState):
        raise TypeError(
            f"grad_scaler's update was given a {type(state).__name__}, not the state its init "
            "returns: initialise with tx = jaxscale.grad_scaler(inner); opt_state = "
            "tx.init(params), and pass that opt_state (inner's own state is its inner_state)"
        )


@contextlib.contextmanager
def _state_of_other_parameters_named() -> Iterator[None]:
    """JAX's pytree-structure error from inside the optimizer, which means its state was
    built for other parameters, said in those words (JAX's message kept below)."""
    try:
        yield
    except ValueError as error:
        if "pytree structure" not in str(error) and "tree structure" not in str(error):
            raise
        raise ValueError(
            "the optimizer state does not fit these gradients and parameters: it was built "
            "by init for parameters of another structure. Initialise it with the parameters "
            f"you train: opt_state = tx.init(params). (JAX: {str(error).splitlines()[0]})"
        ) from error


def _passthrough(
    inner: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its state wrapped in a :class:`GradScalerState` marked disabled."""

    def init_fn(params: optax.Params) -> GradScalerState:
        return GradScalerState(None, inner.init(params))

    def update_fn(
        updates: optax.Updates,
        state: GradScalerState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, GradScalerState]:
        _require_own_state(state)
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        return updates, state._replace(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _unscaled(grads: Any, inv_scale: Any) -> Any:
    return unscale(grads, inv_scale=inv_scale)
