"""jaxscale: dynamic loss scaling for float16 training in JAX, with PyTorch GradScaler semantics."""

from typing import TYPE_CHECKING, Any

from jaxscale._finite import all_finite as all_finite
from jaxscale._lookup import found_inf as found_inf
from jaxscale._lookup import get_scale as get_scale
from jaxscale._lookup import scale as scale
from jaxscale._lookup import skipped_steps as skipped_steps
from jaxscale._scaling import scale_outputs as scale_outputs
from jaxscale._state import ScalerState as ScalerState
from jaxscale._state import init_scaler_state as init_scaler_state
from jaxscale._transform import GradScalerState as GradScalerState
from jaxscale._transform import grad_scaler as grad_scaler
from jaxscale._unscale import unscale_and_check as unscale_and_check
from jaxscale._update_rule import update_scale as update_scale

if TYPE_CHECKING:
    from jaxscale._facade import GradScaler as GradScaler
    from jaxscale._facade import ScalerVariable as ScalerVariable

__version__ = "0.1.0"

__all__ = [
    "GradScaler",
    "GradScalerState",
    "ScalerState",
    "ScalerVariable",
    "__version__",
    "all_finite",
    "found_inf",
    "get_scale",
    "grad_scaler",
    "init_scaler_state",
    "scale",
    "scale_outputs",
    "skipped_steps",
    "unscale_and_check",
    "update_scale",
]


def __getattr__(name: str) -> Any:
    # The facade needs flax; importing it on first use keeps the core and the Optax
    # transform importable without flax.
    if name in ("GradScaler", "ScalerVariable"):
        from jaxscale import _facade

        return getattr(_facade, name)
    raise AttributeError(f"module 'jaxscale' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
