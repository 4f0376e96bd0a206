"""The core: pure, jittable functions on a :class:`ScalerState` (jax only, no optax, no flax).

Everything the Optax transform and the ``GradScaler`` facade do to the scale is
done here: the state, PyTorch's update rule and its double-precision rounding,
scaling, unscaling and the inf/NaN check, the skip of a step, and validation of
hyperparameters.
"""

from jaxscale.core import _validation as validation
from jaxscale.core._diagnostics import NonfiniteRecord as NonfiniteRecord
from jaxscale.core._diagnostics import ScaleWarning as ScaleWarning
from jaxscale.core._diagnostics import disabled_metrics as disabled_metrics
from jaxscale.core._diagnostics import empty_nonfinite_record as empty_nonfinite_record
from jaxscale.core._diagnostics import keep_overflow_record as keep_overflow_record
from jaxscale.core._diagnostics import nonfinite_leaves as nonfinite_leaves
from jaxscale.core._diagnostics import nonfinite_paths as nonfinite_paths
from jaxscale.core._diagnostics import scaler_metrics as scaler_metrics
from jaxscale.core._diagnostics import warn_about_scaled_loss as warn_about_scaled_loss
from jaxscale.core._diagnostics import warn_if_unhealthy as warn_if_unhealthy
from jaxscale.core._jaxprs import bind_equation as bind_equation
from jaxscale.core._leaves import floating_leaves as floating_leaves
from jaxscale.core._leaves import require_matching as require_matching
from jaxscale.core._rounding import multiply_as_double as multiply_as_double
from jaxscale.core._rule import ScaleUpdateRule as ScaleUpdateRule
from jaxscale.core._rule import update_scale as update_scale
from jaxscale.core._scaling import AxisName as AxisName
from jaxscale.core._scaling import all_finite as all_finite
from jaxscale.core._scaling import any_over_axis as any_over_axis
from jaxscale.core._scaling import correctly_rounded_reciprocal as correctly_rounded_reciprocal
from jaxscale.core._scaling import inverse_scale as inverse_scale
from jaxscale.core._scaling import scale_outputs as scale_outputs
from jaxscale.core._scaling import unscale as unscale
from jaxscale.core._scaling import unscale_and_check as unscale_and_check
from jaxscale.core._skip import run_unless as run_unless
from jaxscale.core._skip import skipped_updates_like as skipped_updates_like
from jaxscale.core._skip import update_unless as update_unless
from jaxscale.core._state import ScalerState as ScalerState
from jaxscale.core._state import init_scaler_state as init_scaler_state

__all__ = [
    "AxisName",
    "NonfiniteRecord",
    "ScaleUpdateRule",
    "ScaleWarning",
    "ScalerState",
    "all_finite",
    "any_over_axis",
    "bind_equation",
    "correctly_rounded_reciprocal",
    "disabled_metrics",
    "empty_nonfinite_record",
    "floating_leaves",
    "init_scaler_state",
    "inverse_scale",
    "keep_overflow_record",
    "multiply_as_double",
    "nonfinite_leaves",
    "nonfinite_paths",
    "require_matching",
    "run_unless",
    "scale_outputs",
    "scaler_metrics",
    "skipped_updates_like",
    "unscale",
    "unscale_and_check",
    "update_scale",
    "update_unless",
    "validation",
    "warn_about_scaled_loss",
    "warn_if_unhealthy",
]
