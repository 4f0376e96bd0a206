"""The PyTorch-style facade for Flax loops: ``GradScaler`` and its optimizer adapters."""

from jaxscale.facade._grad_scaler import GradScaler as GradScaler
from jaxscale.facade._grad_scaler import ScalerVariable as ScalerVariable

__all__ = ["GradScaler", "ScalerVariable"]
