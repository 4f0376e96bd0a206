"""What the layers above the core use from it beyond its API (``jaxscale.core.__all__``).

The transform and the facade keep the same state and report the same things, so
they share the core's unscale without the check, its metrics and warnings, and the
record of where an overflow came from (which ``locate_nonfinite`` also reads).
These names may change between releases; the other layers import them from here,
never from the core's private modules.
"""

from jaxscale.core._health import NonfiniteRecord as NonfiniteRecord
from jaxscale.core._health import ScaleWarning as ScaleWarning
from jaxscale.core._health import disabled_metrics as disabled_metrics
from jaxscale.core._health import empty_nonfinite_record as empty_nonfinite_record
from jaxscale.core._health import keep_overflow_record as keep_overflow_record
from jaxscale.core._health import scaler_metrics as scaler_metrics
from jaxscale.core._health import warn_about_scaled_loss as warn_about_scaled_loss
from jaxscale.core._health import warn_if_unhealthy as warn_if_unhealthy
from jaxscale.core._health import with_parameter_check as with_parameter_check
from jaxscale.core._scaling import unscale as unscale
