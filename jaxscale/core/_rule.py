"""The loss-scale update rule, as ``torch._amp_update_scale_``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale._src import validation as _validation
from jaxscale.core._rounding import decompose_factor, multiply_as_double, multiply_by_power_of_two
from jaxscale.core._state import ScalerState


@dataclasses.dataclass(frozen=True)
class ScaleUpdateRule:
    """Validated, hashable hyperparameters of the update rule (static configuration).

    See :func:`update_scale` for the meaning of each field. Constructing one
    validates every field and raises ``TypeError``/``ValueError`` naming the bad
    value; numbers are normalised to Python ``float``/``int``.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1
    dynamic: bool = True

    def __post_init__(self) -> None:
        low, high = _validation.scale_bounds(self.min_scale, self.max_scale)
        normalised = {
            "growth_factor": _validation.growth_factor(self.growth_factor),
            "backoff_factor": _validation.backoff_factor(self.backoff_factor),
            "growth_interval": _validation.growth_interval(self.growth_interval),
            "min_scale": low,
            "max_scale": high,
            "hysteresis": _validation.hysteresis(self.hysteresis),
            "dynamic": _validation.as_bool("dynamic", self.dynamic),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> ScaleUpdateRule:
        """The rule whose fields are the arguments of the same names (a ``locals()``):
        how :func:`update_scale`, ``grad_scaler`` and ``GradScaler``, which take the
        options one by one, each build theirs."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})

    def record(self, state: ScalerState, found_inf: Any) -> ScalerState:
        """``state`` with this step's ``found_inf`` recorded and, when true, counted as skipped."""
        found_inf = _as_found_inf(found_inf)
        skipped = jnp.asarray(state.skipped_steps, jnp.int32)
        return state._replace(
            found_inf=_written_over(state.found_inf, found_inf),
            skipped_steps=jnp.where(found_inf, _saturating_add(skipped), skipped),
        )

    def apply(self, state: ScalerState, found_inf: Any) -> ScalerState:
        """The new state after a step whose gradients were (``found_inf``) or were not finite."""
        found_inf = _as_found_inf(found_inf)
        counted = self.record(state, found_inf)
        if not self.dynamic:
            return counted
        scale = jnp.asarray(state.scale, jnp.float32)
        tracker = jnp.asarray(state.growth_tracker, jnp.int32)

        if self.hysteresis == 1:
            # PyTorch's rule: every overflow backs off, and the streak stays 0. Written
            # as a constant, it costs the compiled step no kernel of its own.
            backs_off = found_inf
            new_streak = _written_over(state.overflow_streak, jnp.zeros((), jnp.int32))
        else:
            # The streak holds the overflows tolerated so far (at most hysteresis - 1),
            # so streak + 1 cannot overflow.
            overflows = jnp.asarray(state.overflow_streak, jnp.int32) + 1
            backs_off = found_inf & (overflows >= self.hysteresis)
            new_streak = jnp.where(found_inf, jnp.minimum(overflows, self.hysteresis - 1), 0)
        backed_off, grown = self._backed_off_and_grown(scale, found_inf)
        if self.min_scale is not None:
            backed_off = jnp.maximum(backed_off, jnp.float32(self.min_scale))

        successful = _saturating_add(tracker)
        reaches_interval = ~found_inf & (successful == self.growth_interval)
        grows = reaches_interval & jnp.isfinite(grown)
        if self.max_scale is not None:
            grown = jnp.minimum(grown, jnp.float32(self.max_scale))

        new_scale = jnp.where(backs_off, backed_off, jnp.where(grows, grown, scale))
        new_tracker = jnp.where(found_inf | reaches_interval, 0, successful)
        return counted._replace(
            scale=new_scale,
            growth_tracker=new_tracker.astype(jnp.int32),
            overflow_streak=new_streak.astype(jnp.int32),
        )

    def _backed_off_and_grown(
        self, scale: jax.Array, found_inf: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """``scale`` times the backoff factor and times the growth factor, each rounded as
        PyTorch's double arithmetic rounds it.

        Only the first is used after an overflow and only the second after a finite
        step, so when both factors are powers of two (PyTorch's defaults) one product,
        by the factor of the step's outcome, serves for both: the scale's update is
        compiled into every train step.
        """
        backoff = decompose_factor(self.backoff_factor)
        growth = decompose_factor(self.growth_factor)
        if backoff[0] == growth[0] == 1:
            moved = multiply_by_power_of_two(scale, jnp.where(found_inf, backoff[1], growth[1]))
            return moved, moved
        return (
            multiply_as_double(scale, self.backoff_factor),
            multiply_as_double(scale, self.growth_factor),
        )


def _written_over(old: Any, new: jax.Array) -> jax.Array:
    """``new``, computed as if it read ``old``: ``new | (old & 0)``, which XLA folds to ``new``.

    A state field that the step writes without reading would otherwise be an
    argument that nothing reads, and ``jax.jit`` drops those. Its donated buffer
    is then lost: the field's output takes a fresh buffer on every call, and the
    donated inputs left are paired with outputs of their type in order, so a
    later field (the optimizer's step count) moves too. On a GPU a moved buffer
    is costly: each kernel that reads it, here one per gradient leaf reading the
    skip decision, has its CUDA-graph node rewritten before every step.
    """
    old = jnp.asarray(old, new.dtype)
    return new | (old & jnp.zeros((), new.dtype))


def _saturating_add(count: jax.Array) -> jax.Array:
    """``count + 1``, staying at ``2**31 - 1`` instead of wrapping to a negative count."""
    return jnp.where(count < _validation.INT32_MAX, count + 1, count)


def _as_found_inf(found_inf: Any) -> jax.Array:
    """A boolean scalar; PyTorch's float ``found_inf`` (0.0 or a count) is true when nonzero."""
    found_inf = jnp.asarray(found_inf)
    if found_inf.shape != ():
        raise ValueError(f"found_inf must be a scalar, got shape {found_inf.shape}")
    if found_inf.dtype == jnp.bool_:
        return found_inf
    return found_inf != 0


def update_scale(
    state: ScalerState,
    found_inf: Any,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
    dynamic: bool = True,
) -> ScalerState:
    """Return the state after one step, by PyTorch's ``_amp_update_scale_`` rule.

    With the default ``min_scale``, ``max_scale`` and ``hysteresis`` the rule is
    PyTorch's exactly::

        if found_inf:
            scale = round_f32(scale * backoff_factor)     # no floor
            growth_tracker = 0
        else:
            successful = growth_tracker + 1
            if successful == growth_interval:             # exact equality
                candidate = round_f32(scale * growth_factor)
                if isfinite(candidate):                   # never grow to inf
                    scale = candidate
                growth_tracker = 0                        # reset even if refused
            else:
                growth_tracker = successful

    ``round_f32(scale * f)`` is the product computed in double precision and
    rounded to float32, bit-identical to PyTorch for any factors without
    ``jax_enable_x64`` (see :func:`jaxscale.core.multiply_as_double`).

    The opt-in extensions change the rule as follows:

    * ``min_scale``: a backed-off scale is raised to at least ``min_scale``.
    * ``max_scale``: a grown scale is lowered to at most ``max_scale``.
    * ``hysteresis=n``: the scale backs off on the ``n``-th consecutive
      overflowing step and on every consecutive one after it; the ``n - 1``
      before it are tolerated (still skipped, scale kept). ``overflow_streak``
      counts consecutive overflows, saturating at ``n - 1``; a finite step resets
      it, and ``growth_tracker`` is reset on every overflow. ``n=1`` is PyTorch's
      rule and keeps ``overflow_streak`` at 0.
    * ``dynamic=False``: a static loss scale; ``scale``, ``growth_tracker`` and
      ``overflow_streak`` never change.

    Whatever the options, ``found_inf`` records this step's flag and
    ``skipped_steps`` counts it when it is true (saturating at ``2**31 - 1``, as
    ``growth_tracker`` does).

    Args:
      state: the current :class:`ScalerState`.
      found_inf: whether this step's gradients held an inf or NaN: a boolean
        scalar, or a number that is nonzero when they did (as PyTorch's float
        ``found_inf``).
      growth_factor: factor applied on growth; a finite number > 1.
      backoff_factor: factor applied on overflow; in (0, 1).
      growth_interval: consecutive finite steps before growth; an int >= 1.
      min_scale: optional floor for backoff (positive; float32 comparison).
      max_scale: optional ceiling for growth (positive; float32 comparison).
      hysteresis: consecutive overflows before backing off; an int >= 1.
      dynamic: if False, the scale is static (only the counters move).

    Returns:
      The new :class:`ScalerState`. Jittable; hyperparameters are static.

    >>> import jax.numpy as jnp
    >>> from jaxscale import init_scaler_state, update_scale
    >>> state = init_scaler_state(4.0)
    >>> kw = dict(growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    >>> state = update_scale(state, False, **kw)
    >>> int(state.growth_tracker), float(state.scale)
    (1, 4.0)
    >>> state = update_scale(state, False, **kw)
    >>> int(state.growth_tracker), float(state.scale)
    (0, 8.0)
    >>> state = update_scale(state, True, **kw)
    >>> int(state.growth_tracker), float(state.scale)
    (0, 2.0)
    """
    return ScaleUpdateRule.from_arguments(locals()).apply(state, found_inf)
