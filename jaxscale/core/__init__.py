"""The core: pure, jittable functions on a :class:`ScalerState` (jax only, no optax, no flax).

Everything the Optax transform and the ``GradScaler`` facade do to the scale is
done here: the state, PyTorch's update rule and its double-precision rounding,
scaling, unscaling and the inf/NaN check, and the skip of a step. The names below
are the core's API; the helpers the other layers share (validation, metrics,
overflow records, jaxpr internals) are imported from their modules and may change.
"""

from jaxscale.core._health import ScaleWarning as ScaleWarning
from jaxscale.core._health import nonfinite_leaves as nonfinite_leaves
from jaxscale.core._health import nonfinite_paths as nonfinite_paths
from jaxscale.core._rounding import multiply_as_double as multiply_as_double
from jaxscale.core._rule import ScaleUpdateRule as ScaleUpdateRule
from jaxscale.core._rule import update_scale as update_scale
from jaxscale.core._scaling import AxisName as AxisName
from jaxscale.core._scaling import all_finite as all_finite
from jaxscale.core._scaling import any_over_axis as any_over_axis
from jaxscale.core._scaling import correctly_rounded_reciprocal as correctly_rounded_reciprocal
from jaxscale.core._scaling import inverse_scale as inverse_scale
from jaxscale.core._scaling import scale_outputs as scale_outputs
from jaxscale.core._scaling import unscale_and_check as unscale_and_check
from jaxscale.core._skip import run_unless as run_unless
from jaxscale.core._skip import skip_applied as skip_applied
from jaxscale.core._skip import skip_predicate as skip_predicate
from jaxscale.core._skip import skip_predicate_as as skip_predicate_as
from jaxscale.core._skip import update_unless as update_unless
from jaxscale.core._state import ScalerState as ScalerState
from jaxscale.core._state import init_scaler_state as init_scaler_state

__all__ = [
    "AxisName",
    "ScaleUpdateRule",
    "ScaleWarning",
    "ScalerState",
    "all_finite",
    "any_over_axis",
    "correctly_rounded_reciprocal",
    "init_scaler_state",
    "inverse_scale",
    "multiply_as_double",
    "nonfinite_leaves",
    "nonfinite_paths",
    "run_unless",
    "scale_outputs",
    "skip_applied",
    "skip_predicate",
    "skip_predicate_as",
    "unscale_and_check",
    "update_scale",
    "update_unless",
]
