"""``GradScaler``: PyTorch's ``torch.amp.GradScaler`` API for Flax training loops."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import flax.errors
import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale._src import validation
from jaxscale._src.jaxprs import is_traced
from jaxscale._src.leaves import floating_leaves, noted_on_failure
from jaxscale.core import (
    AxisName,
    ScalerState,
    ScaleUpdateRule,
    all_finite,
    any_over_axis,
    init_scaler_state,
    inverse_scale,
    scale_outputs,
    unscale_and_check,
)
from jaxscale.core.shared import (
    ScaleWarning,
    disabled_metrics,
    empty_nonfinite_record,
    keep_overflow_record,
    scaler_metrics,
    unscale,
    warn_about_scaled_loss,
    warn_if_unhealthy,
    with_parameter_check,
)
from jaxscale.facade._iteration import Iteration, OptimizerRecord, Stage
from jaxscale.facade._optimizers import adapter_for
from jaxscale.facade._state_dict import STATE_DICT_KEYS, parse_state_dict

T = TypeVar("T")

_NOT_SCALED_HINT = (
    "This may indicate your script did not use scaler.scale(loss or outputs) "
    "earlier in the iteration."
)
_ACCELERATORS = {"cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "tpu": "tpu"}


def _held(kind: type[nnx.Variable], value: Any) -> Any:
    """A variable of ``kind`` holding the tree ``value``; in Flax's reference mode
    (``nnx.var_defaults(ref=True)``) the tree with each leaf in a variable of its own,
    a reference written in place as the model's and the optimizer's are (Flax makes
    references of arrays, not of trees)."""
    if nnx.var_defaults().ref:
        return nnx.data(jax.tree.map(kind, value))
    return kind(value)


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


def _read(held: Any) -> Any:
    """The tree that :func:`_held` holds, as arrays."""
    if _is_variable(held):
        return held.get_value()
    return jax.tree.map(lambda variable: variable[...], held, is_leaf=_is_variable)


def _write(held: Any, value: Any) -> None:
    """Set what :func:`_held` holds to ``value``, or say in jaxscale's terms why a
    trace may not.

    Flax refuses to set a variable created outside the function being traced; for a
    scaler that means the scaler was closed over instead of passed in. Variables of
    references are written through them, which any trace may do.
    """
    if not _is_variable(held):
        variables = jax.tree.leaves(held, is_leaf=_is_variable)
        for variable, leaf in zip(variables, jax.tree.leaves(value), strict=True):
            variable[...] = leaf
        return
    try:
        held.set_value(value)
    except flax.errors.TraceContextError as error:
        raise RuntimeError(
            "GradScaler.update() cannot record the new scale: the scaler was created outside "
            "the function being traced (jax.jit, jax.grad, ...) and is used inside it without "
            "being passed in. Pass the scaler to the jitted function and return it: with "
            "jax.jit, `params, opt_state, scaler = step(params, opt_state, scaler, batch)`; "
            "with nnx.jit, pass it in, `train_step(model, optimizer, scaler, x, y)`, and "
            "nnx.jit carries the new scale back. Nothing was changed."
        ) from error


class ScalerVariable(nnx.Variable):
    """The dynamic state of a :class:`GradScaler`: its core :class:`~jaxscale.ScalerState`
    (in Flax's reference mode, ``nnx.var_defaults(ref=True)``, one variable per field of
    the state, each holding a reference)."""


class OverflowOriginVariable(nnx.Variable):
    """Where the latest overflow of a :class:`GradScaler` was born (opt-in)."""


def _device_kind(device: Any) -> str:
    if device is None:
        return str(jax.default_backend())
    if callable(getattr(device, "init", None)) and callable(getattr(device, "update", None)):
        raise TypeError(
            "GradScaler takes no optimizer: pass it to scaler.step(optimizer, ...) at each "
            "step, or wrap an Optax optimizer as jaxscale.grad_scaler(optax.adam(...))"
        )
    if isinstance(device, float):
        raise TypeError(
            f"GradScaler's first argument is device, as in PyTorch, got the number {device!r}: "
            f"for the initial scale write GradScaler(init_scale={float(device)!r})"
        )
    if not isinstance(device, str):
        raise TypeError(
            f"device must be a string such as 'cpu' or 'cuda', got {type(device).__name__}"
        )
    kind = device.split(":")[0].lower()
    if kind != "cpu" and kind not in _ACCELERATORS:
        raise ValueError(f"device must be 'cpu', 'cuda', 'gpu' or 'tpu', got {device!r}")
    return kind


def _backend_available(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


class GradScaler(nnx.Pytree):
    """Dynamic loss scaling with the API and behaviour of ``torch.amp.GradScaler``.

    * ``scaler.scale(loss)`` multiplies a loss (or a tree of outputs) by the scale;
    * ``scaler.unscale_(optimizer, grads)`` returns the unscaled gradients and
      records whether any was inf/NaN (optional: for clipping or inspection);
    * ``scaler.step(optimizer, ...)`` unscales (unless ``unscale_`` ran), then runs
      the optimizer's update, or skips it when the gradients were not finite;
    * ``scaler.update()`` backs the scale off if any optimizer's step was skipped,
      or grows it after ``growth_interval`` consecutive finite iterations.

    Beyond PyTorch, ``scaler.found_inf()`` and ``scaler.skipped_steps()`` say
    whether and how often steps were skipped, and ``scaler.metrics()`` gives the
    state as arrays for a logger.

    The state is the core :class:`~jaxscale.ScalerState` (the one the Optax
    transform keeps) in a :class:`ScalerVariable`, so the scaler
    can be an argument of ``nnx.jit`` (updated in place) or of ``jax.jit`` (return
    it), and nothing in ``scale``/``unscale_``/``step``/``update`` waits on the host.
    The per-optimizer stages that PyTorch tracks between updates are Python state,
    checked at trace time: misuse raises PyTorch's errors before anything changes.
    Call ``scale``, ``unscale_``, ``step`` and ``update`` of one iteration in the
    same traced function (or all eagerly).

    ``step`` drives a ``flax.nnx.Optimizer`` (``scaler.step(optimizer, model, grads)``),
    a Linen ``TrainState`` (``state = scaler.step(state, grads=grads)``) or an Optax
    transformation (``updates, opt_state = scaler.step(tx, grads, opt_state, params)``).

    Args:
      device: ``None`` follows JAX's default backend; ``"cpu"`` works everywhere;
        ``"cuda"``/``"gpu"`` (or ``"tpu"``) without such a backend warns and
        disables the scaler, as PyTorch does for ``"cuda"``.
      init_scale: initial scale (positive, finite in float32).
      growth_factor: multiplies the scale after ``growth_interval`` finite steps.
      backoff_factor: multiplies the scale after a step with inf/NaN gradients.
      growth_interval: consecutive finite iterations before growth.
      enabled: if False, ``scale``/``unscale_``/``update`` do nothing, ``step``
        runs the optimizer's update as is, and ``get_scale()`` is 1.0.
      min_scale: keyword-only, not in PyTorch: a floor for backoff. Without it
        (PyTorch's rule) an overflow storm halves the scale down to 0.0, after
        which unscaling multiplies zero gradients by ``1/0`` and the parameters
        become NaN, in PyTorch and here alike.
      max_scale: keyword-only, not in PyTorch: a ceiling for growth.
      axis_name: keyword-only: the mapped axis name (or names) under
        ``shard_map``/``pmap`` over which the inf/NaN decision is shared, so that
        every device skips and backs off alike. Not needed under ``jax.jit`` with
        sharded arrays, where the check is global already.
      hysteresis: keyword-only, not in PyTorch: consecutive overflowing
        iterations before the scale backs off (1, the default, is PyTorch's
        rule); every overflowing step is still skipped.
      dynamic: keyword-only, not in PyTorch: if False, the scale stays at
        ``init_scale`` (a static loss scale); non-finite steps are still skipped.
      record_overflow_origin: keyword-only, not in PyTorch: keep where the inf or
        NaN of the latest skipped iteration was born, from the
        :func:`jaxscale.locate_nonfinite` report given to ``update`` (read it with
        :meth:`last_overflow_origin`). Off by default, and then it costs nothing.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import jaxscale
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> scaler = jaxscale.GradScaler(init_scale=1024.0)
    >>> @nnx.jit
    ... def train_step(model, optimizer, scaler, x, y):
    ...     def loss_fn(model):
    ...         return scaler.scale(jnp.mean((model(x) - y) ** 2))
    ...     grads = nnx.grad(loss_fn)(model)
    ...     scaler.step(optimizer, model, grads)
    ...     scaler.update()
    >>> train_step(model, optimizer, scaler, jnp.ones((4, 2)), jnp.zeros((4, 1)))
    >>> scaler.get_scale()
    1024.0
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        axis_name: AxisName | None = None,
        hysteresis: int = 1,
        dynamic: bool = True,
        record_overflow_origin: bool = False,
    ) -> None:
        validation.as_bool("enabled", enabled)
        validation.as_bool("record_overflow_origin", record_overflow_origin)
        platform = _ACCELERATORS.get(_device_kind(device))
        if enabled and platform is not None and not _backend_available(platform):
            name = "CUDA" if platform == "gpu" else platform.upper()
            warnings.warn(
                f"jaxscale.GradScaler is enabled, but {name} is not available.  Disabling.",
                stacklevel=2,
            )
            enabled = False
        self._enabled = enabled
        self._iteration = Iteration()
        if not enabled:
            return
        self._rule = _pytorch_checked_rule(
            growth_factor,
            backoff_factor,
            growth_interval,
            min_scale,
            max_scale,
            hysteresis,
            dynamic,
        )
        self._axis_name = axis_name
        scale = validation.init_scale_within(init_scale, self._rule.min_scale, self._rule.max_scale)
        self._state = _held(ScalerVariable, init_scaler_state(scale))
        self._origin = (
            _held(OverflowOriginVariable, empty_nonfinite_record())
            if record_overflow_origin
            else None
        )
        self._origin_report: tuple[type, Any] | None = None
        self._iteration.seen_state = self._state_leaves()

    @property
    def _scaler_state(self) -> ScalerState:
        return _read(self._state)

    def _set_scaler_state(self, state: ScalerState) -> None:
        _write(self._state, state)
        if any(is_traced(leaf) for leaf in jax.tree.leaves(state)):
            self._iteration.traced_update = True
        else:
            self._iteration.seen_state = self._state_leaves()
            self._iteration.traced_update = False

    def _state_leaves(self) -> tuple[Any, ...]:
        return tuple(jax.tree.leaves(self._scaler_state))

    def _warn_if_traced_update_was_lost(self) -> None:
        """Warn when ``update()`` was traced on a copy of this scaler since its state was
        last seen, and this scaler's state is still the very same arrays: the copy
        (``jax.jit`` traces one) was not returned, so this scaler never moves."""
        iteration = self._iteration
        if not iteration.traced_update:
            return
        leaves = self._state_leaves()
        if any(is_traced(leaf) for leaf in leaves):
            return
        lost = len(leaves) == len(iteration.seen_state) and all(
            a is b for a, b in zip(leaves, iteration.seen_state, strict=True)
        )
        iteration.seen_state, iteration.traced_update = leaves, False
        if lost:
            warnings.warn(
                ScaleWarning(
                    "GradScaler.update() was traced on a copy of this scaler (inside jax.jit "
                    "or another transform), and this scaler's state has not changed since: "
                    "if that function ran, the updated scaler was not returned, so this one "
                    "keeps its old scale and counts. Return the scaler from the jax.jit "
                    "function and use the returned one, or pass it to nnx.jit, which "
                    "updates it in place. (After only tracing it, with .lower(), "
                    "make_jaxpr or eval_shape, nothing is lost.)"
                ),
                stacklevel=3,
            )

    # -- the training-loop API --------------------------------------------------------

    def scale(self, outputs: T) -> T:
        """Multiply ``outputs`` (an array or a tree of arrays) by the scale.

        Returns the same structure, each floating leaf in its own dtype (the product
        is formed in float32; compute the loss in float32). Disabled: ``outputs``.
        """
        if not self._enabled:
            return outputs
        scaled = scale_outputs(outputs, self._scaler_state.scale)
        warn_about_scaled_loss(outputs, scaled, stacklevel=4)
        self._iteration.scale_called = True
        return scaled

    def unscale_(self, optimizer: Any, grads: T) -> T:
        """Return ``grads`` divided by the scale, and record inf/NaN for ``optimizer``.

        Call it at most once per optimizer per iteration, before ``step``, when you
        need the true gradients (clipping, logging). ``step`` then uses the
        ``found_inf`` recorded here and the gradients you pass it as they are.
        Arrays are immutable, so unlike PyTorch the unscaled gradients are returned:
        pass those to ``step``. Passing ``step`` the very gradients given here (the
        PyTorch habit of ignoring the result) raises, since they are still scaled.
        """
        if not self._enabled:
            return grads
        self._check_scale_called("unscale_")
        record = self._iteration.record(optimizer)
        if record.stage is Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if record.stage is Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        unscaled, _ = unscale_and_check(grads, self._scaler_state.scale)
        found_inf = self._found_inf(grads)
        record = OptimizerRecord(Stage.UNSCALED, found_inf, tuple(floating_leaves(grads)))
        self._iteration.store(optimizer, record)
        return unscaled

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` ran) and run the optimizer's update, unless inf/NaN.

        The update is traced either way; a skipped step leaves the parameters and
        the optimizer state exactly as they were. Returns the updates of an
        ``nnx.Optimizer`` (``-0.0`` when skipped; the model and optimizer change in
        place), the new or unchanged ``TrainState``, or for an Optax
        transformation the new or unchanged ``(params, opt_state)``.
        """
        adapter = adapter_for(optimizer)
        if not self._enabled:
            return adapter.step(optimizer, args, kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_called("step")
        grads = adapter.grads(args, kwargs)
        mismatch = adapter.check_grads(optimizer, args, kwargs)
        record = self._iteration.record(optimizer)
        if record.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        _refuse_still_scaled(record, grads)
        found_inf, prepare = record.found_inf, _unchanged
        if record.stage is Stage.READY:
            found_inf = self._found_inf(grads)
            prepare = functools.partial(unscale, inv_scale=inverse_scale(self._scaler_state.scale))
        if found_inf is None:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        with noted_on_failure(mismatch):
            result = adapter.step_unless(found_inf, optimizer, args, kwargs, prepare)
        self._iteration.store(optimizer, OptimizerRecord(Stage.STEPPED, found_inf))
        return result

    def update(self, new_scale: Any = None, *, nonfinite_report: Any = None) -> None:
        """Update the scale for the next iteration, and clear the per-optimizer records.

        Backs off once if any optimizer's gradients held inf/NaN this iteration,
        else grows after ``growth_interval`` consecutive finite iterations.
        ``new_scale`` (a float, or an array with one element) sets the scale instead
        (the growth tracker is kept, as PyTorch does). Either way the iteration's
        ``found_inf`` is recorded and, when true, counted in :meth:`skipped_steps`.

        ``nonfinite_report`` (keyword-only, for a scaler built with
        ``record_overflow_origin=True``): this iteration's
        :func:`jaxscale.locate_nonfinite` report; when the iteration overflowed, its
        origin is kept for :meth:`last_overflow_origin`.
        """
        if not self._enabled:
            return
        self._check_scale_called("update")
        if nonfinite_report is not None and self._origin is None:
            raise ValueError(
                "update() was given nonfinite_report=, but this GradScaler keeps no overflow "
                "origin; build it with GradScaler(..., record_overflow_origin=True)"
            )
        found_infs = [
            r.found_inf for r in self._iteration.optimizers.values() if r.found_inf is not None
        ]
        state = self._scaler_state
        if new_scale is not None:
            scale = _as_new_scale(new_scale, state.scale)
            found_inf = functools.reduce(operator.or_, found_infs, jnp.asarray(False))
            state = self._rule.record(state, found_inf)._replace(scale=scale)
        else:
            if not found_infs and self._iteration.dropped_stale:
                self._iteration.dropped_stale = False  # explained once
                raise RuntimeError(
                    "No inf checks were recorded prior to update() in this trace: unscale_() or "
                    "step() last ran in another traced function, which returned without calling "
                    "update(). Call scale, unscale_, step and update of one iteration in the same "
                    "jitted function, or all outside jit."
                )
            if not found_infs:
                raise AssertionError("No inf checks were recorded prior to update.")
            state = self._rule.apply(state, functools.reduce(operator.or_, found_infs))
        if nonfinite_report is not None and self._origin is not None:
            kept = keep_overflow_record(
                _read(self._origin), state.found_inf, nonfinite_report.record
            )
            _write(self._origin, kept)
            self._origin_report = (type(nonfinite_report), nonfinite_report.origins)
        self._set_scaler_state(state)
        self._iteration.finish()

    def last_overflow_origin(self) -> Any:
        """Where the inf or NaN of the latest skipped iteration was born, as a
        :class:`jaxscale.NonfiniteReport` (``describe()`` gives one line for a log).

        For a scaler built with ``record_overflow_origin=True`` whose ``update`` is given
        each iteration's :func:`jaxscale.locate_nonfinite` report.

        Raises:
          ValueError: if the scaler keeps no overflow origin, or no report was given yet.
        """
        if not self._enabled or self._origin is None:
            raise ValueError(
                "this GradScaler keeps no overflow origin; build it with "
                "GradScaler(..., record_overflow_origin=True)"
            )
        if self._origin_report is None:
            raise ValueError(
                "no nonfinite_report was given to update() yet: pass "
                "scaler.update(nonfinite_report=report) with the report of "
                "jaxscale.locate_nonfinite"
            )
        report_type, origins = self._origin_report
        record = _read(self._origin)
        return report_type(type(record)(*record), origins)

    # -- was it skipped? ----------------------------------------------------------------

    def found_inf(self, optimizer: Any = None) -> Any:
        """Whether gradients held an inf or NaN, so that the step was (or will be) skipped.

        ``found_inf(optimizer)`` is that optimizer's flag: from this iteration once
        ``unscale_`` or ``step`` has checked its gradients, otherwise from the
        iteration the last ``update()`` ended. ``found_inf()`` is any optimizer's:
        this iteration's flags once one is recorded, otherwise the last
        ``update()``'s (kept in the state, so it is there after a jitted step
        returns). A Python bool outside ``jit``, a traced bool inside; False when
        disabled.

        Outside the traced function that ran the iteration, per-optimizer flags are
        gone (they were traced values); when that iteration stepped a single
        optimizer, its flag is the state's ``found_inf`` and is returned.

        Raises:
          RuntimeError: for an optimizer with no flag to report: not checked this
            iteration, and the last ``update()`` ran in another traced function
            after stepping several optimizers (or none).
        """
        if not self._enabled:
            return False
        self._warn_if_traced_update_was_lost()
        flags = self._iteration.optimizers
        if optimizer is None:
            recorded = [r.found_inf for r in flags.values() if r.found_inf is not None]
            if recorded:
                return _concrete(functools.reduce(operator.or_, recorded), bool)
            return _concrete(self._scaler_state.found_inf, bool)
        record = flags.get(id(optimizer))
        if record is not None and record.found_inf is not None:
            return _concrete(record.found_inf, bool)
        known, flag = self._iteration.finished_flag(optimizer)
        if known:
            return False if flag is None else _concrete(flag, bool)
        if len(self._iteration.finished_ids) == 1:
            # The last iteration checked one optimizer, so its flag is the state's. The
            # identity cannot be checked here: jit traces a copy of the optimizer.
            return _concrete(self._scaler_state.found_inf, bool)
        raise RuntimeError(
            "found_inf(optimizer): this optimizer's gradients were not checked in this "
            "iteration, nor by the last update() in this traced function. Ask inside the "
            "function that stepped it, or call found_inf() for any optimizer's flag."
        )

    def skipped_steps(self) -> Any:
        """How many iterations ``update()`` has ended with a skipped step (saturating at
        ``2**31 - 1``). A Python int outside ``jit``, a traced int32 inside; 0 when disabled."""
        if not self._enabled:
            return 0
        self._warn_if_traced_update_was_lost()
        return _concrete(self._scaler_state.skipped_steps, int)

    def metrics(
        self,
        *,
        params: Any = None,
        warn_below: float | None = None,
        warn_above: float | None = None,
    ) -> dict[str, jax.Array]:
        """The scaler's state as a dict of arrays, ready for a logger.

        Keys: ``scale``, ``found_inf`` (the last ``update()``'s), ``skipped_steps``,
        ``growth_tracker`` and ``overflow_streak``; with ``params`` (the parameters, or
        an NNX model) ``params_finite`` too, whether every parameter is finite. Building
        the dict reads nothing back to the host: return it from the jitted step and log
        it. With ``warn_below``/``warn_above`` (outside ``jit`` only) a
        :class:`~jaxscale.ScaleWarning` is issued when the scale is below, or at or
        above, the threshold (as :func:`jaxscale.metrics`), naming non-finite
        parameters as the cause when they are.
        """
        values = scaler_metrics(self._scaler_state) if self._enabled else disabled_metrics()
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        values = with_parameter_check(values, params)
        warn_if_unhealthy(values, warn_below, warn_above, params)
        return values

    # -- getters and setters ------------------------------------------------------------

    def get_scale(self) -> Any:
        """The scale: a Python float, or a traced array inside ``jit``; 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        self._warn_if_traced_update_was_lost()
        return _concrete(self._scaler_state.scale, float)

    def get_growth_factor(self) -> float:
        return self._rule.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._rule = dataclasses.replace(self._rule, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self._rule.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._rule = dataclasses.replace(self._rule, backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self._rule.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._rule = dataclasses.replace(self._rule, growth_interval=new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def _get_growth_tracker(self) -> Any:
        if not self._enabled:
            return 0
        return _concrete(self._scaler_state.growth_tracker, int)

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's state dict: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval`` and ``_growth_tracker`` as Python numbers; ``{}`` when disabled.

        Call it after ``update()``, outside ``jit``.
        """
        if not self._enabled:
            return {}
        values = [
            self.get_scale(),
            self._rule.growth_factor,
            self._rule.backoff_factor,
            self._rule.growth_interval,
            self._get_growth_tracker(),
        ]
        return dict(zip(STATE_DICT_KEYS, values, strict=True))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from ``torch.amp.GradScaler.state_dict()``.

        Every entry is validated before any is applied: a rejected dict changes nothing.
        PyTorch's dict has no place for jaxscale's own counters, so
        ``overflow_streak``, ``found_inf`` and ``skipped_steps`` restart from their
        initial values; checkpoint the scaler with Orbax, ``flax.serialization`` or
        pickle to keep them.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        parsed = parse_state_dict(state_dict)
        rule = dataclasses.replace(
            self._rule,
            growth_factor=parsed.growth_factor,
            backoff_factor=parsed.backoff_factor,
            growth_interval=parsed.growth_interval,
        )
        state = init_scaler_state(parsed.scale, parsed.growth_tracker)
        self._warn_if_traced_update_was_lost()
        self._rule = rule
        self._set_scaler_state(state)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            if self._iteration.optimizers:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            # As in PyTorch, an unpickled scaler starts as if scale() was never called.
            state["_iteration"] = Iteration()
        return state

    # -- helpers ------------------------------------------------------------------------

    def _check_scale_called(self, funcname: str) -> None:
        if not self._iteration.scale_called:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _NOT_SCALED_HINT)

    def _found_inf(self, grads: Any) -> jax.Array | None:
        """Whether ``grads`` hold an inf or NaN; None when there is no floating leaf
        (PyTorch records no check then)."""
        if not floating_leaves(grads):
            return None
        return any_over_axis(jnp.logical_not(all_finite(grads)), self._axis_name)


# Flax's Pytree metaclass defines __call__(*args, **kwargs), which inspect.signature (and
# so help(), the API reference and IDEs that ask it) would show instead of __init__'s.
_INIT_SIGNATURE = inspect.signature(GradScaler.__init__)
GradScaler.__signature__ = _INIT_SIGNATURE.replace(  # type: ignore[attr-defined]
    parameters=list(_INIT_SIGNATURE.parameters.values())[1:],
    return_annotation=inspect.Signature.empty,
)


def _unchanged(grads: T) -> T:
    return grads


def _concrete(value: jax.Array, kind: Callable[[Any], T]) -> Any:
    """``kind(value)`` (a Python number) outside ``jit``; the traced array itself inside."""
    return value if is_traced(value) else kind(value)


def _refuse_still_scaled(record: OptimizerRecord, grads: Any) -> None:
    """Raise when ``step`` is given gradients that ``unscale_`` was given, not its result.

    In PyTorch ``unscale_`` divides ``.grad`` in place and its result can be
    ignored; here it returns new arrays, and the gradients it was given are still
    multiplied by the scale. Every floating leaf ``unscale_`` returns is a new
    array, so any leaf identical to one it was given is still scaled.
    """
    if not record.scaled_leaves:
        return
    given = {id(leaf) for leaf in record.scaled_leaves}
    if any(id(leaf) in given for leaf in floating_leaves(grads)):
        raise RuntimeError(
            "step() was given the gradients that unscale_() was given for this optimizer; "
            "they are still scaled. unscale_() returns the unscaled gradients (arrays are "
            "immutable): grads = scaler.unscale_(optimizer, grads), then pass those to step()."
        )


def _pytorch_checked_rule(
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    min_scale: Any = None,
    max_scale: Any = None,
    hysteresis: Any = 1,
    dynamic: Any = True,
) -> ScaleUpdateRule:
    """Validate the factors with PyTorch's own messages first, then jaxscale's stricter checks."""
    growth_factor = validation.as_float("growth_factor", growth_factor)
    backoff_factor = validation.as_float("backoff_factor", backoff_factor)
    if growth_factor <= 1.0:
        raise AssertionError("The growth factor must be > 1.0.")
    if backoff_factor >= 1.0:
        raise AssertionError("The backoff factor must be < 1.0.")
    return ScaleUpdateRule.from_arguments(locals())


def _as_new_scale(new_scale: Any, current: jax.Array) -> jax.Array:
    """A float32 scalar from ``update(new_scale=...)``: a float or a one-element float array.

    PyTorch's message for the wrong kind; beyond PyTorch, a concrete value must be
    positive and finite in float32 (a NaN or zero scale would silently poison every
    later step), and an array on another device is moved to the scale's device.
    """
    reason = "new_scale should be a float or a 1-element float array."
    if isinstance(new_scale, float):
        value = jnp.asarray(new_scale, jnp.float32)
    elif isinstance(new_scale, jax.Array) or is_traced(new_scale):
        if new_scale.size != 1:
            raise AssertionError(reason + f" Got an array of shape {tuple(new_scale.shape)}.")
        if not jnp.issubdtype(new_scale.dtype, jnp.floating):
            raise AssertionError(reason + f" Got dtype {new_scale.dtype}.")
        value = new_scale.reshape(()).astype(jnp.float32)
    else:
        raise AssertionError(reason + f" Got {type(new_scale).__name__} {new_scale!r}.")
    if is_traced(value):
        return value  # a traced value cannot be inspected: taken as it is
    number = float(value)
    if not (math.isfinite(number) and number > 0.0):
        raise ValueError(f"new_scale must be positive and finite in float32, got {number!r}")
    if not is_traced(current):
        value = jax.device_put(value, current.sharding)
    return value
