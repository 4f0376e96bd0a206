"""The Optax transform: ``grad_scaler(inner)`` and the helpers that find its state."""

from jaxscale.transform._grad_scaler import GradScalerState as GradScalerState
from jaxscale.transform._grad_scaler import grad_scaler as grad_scaler
from jaxscale.transform._lookup import found_inf as found_inf
from jaxscale.transform._lookup import get_scale as get_scale
from jaxscale.transform._lookup import last_overflow_origin as last_overflow_origin
from jaxscale.transform._lookup import metrics as metrics
from jaxscale.transform._lookup import scale as scale
from jaxscale.transform._lookup import skipped_steps as skipped_steps

__all__ = [
    "GradScalerState",
    "found_inf",
    "get_scale",
    "grad_scaler",
    "last_overflow_origin",
    "metrics",
    "scale",
    "skipped_steps",
]
