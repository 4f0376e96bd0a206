"""jaxscale: PyTorch's automatic mixed precision for JAX.

Loss scaling in three layers, each usable on its own: :mod:`jaxscale.core` (pure
functions on a :class:`ScalerState`), :mod:`jaxscale.transform` (the Optax
transform :func:`grad_scaler`) and :mod:`jaxscale.facade` (PyTorch's
:class:`GradScaler` for Flax loops); and :mod:`jaxscale.casting`, whose
:func:`autocast` is PyTorch's op-level autocast as a function transform; and
:mod:`jaxscale.optim`, Optax transforms for parameters and optimizer state in low
precision (master weights, stochastic rounding, Kahan summation, 8-bit state).
"""

from jaxscale.casting import autocast as autocast
from jaxscale.casting import custom_fwd as custom_fwd
from jaxscale.casting import dequantize_mx as dequantize_mx
from jaxscale.casting import dequantize_nvfp4 as dequantize_nvfp4
from jaxscale.casting import float8_report as float8_report
from jaxscale.casting import get_autocast_dtype as get_autocast_dtype
from jaxscale.casting import is_autocast_enabled as is_autocast_enabled
from jaxscale.casting import nvfp4_per_tensor_scale as nvfp4_per_tensor_scale
from jaxscale.casting import quantize_float8 as quantize_float8
from jaxscale.casting import quantize_mx as quantize_mx
from jaxscale.casting import quantize_nvfp4 as quantize_nvfp4
from jaxscale.casting import random_hadamard_transform as random_hadamard_transform
from jaxscale.core import ScalerState as ScalerState
from jaxscale.core import ScaleWarning as ScaleWarning
from jaxscale.core import all_finite as all_finite
from jaxscale.core import init_scaler_state as init_scaler_state
from jaxscale.core import nonfinite_leaves as nonfinite_leaves
from jaxscale.core import nonfinite_paths as nonfinite_paths
from jaxscale.core import scale_outputs as scale_outputs
from jaxscale.core import unscale_and_check as unscale_and_check
from jaxscale.core import update_scale as update_scale
from jaxscale.diagnosis import LoweringReport as LoweringReport
from jaxscale.diagnosis import NonfiniteReport as NonfiniteReport
from jaxscale.diagnosis import format_precision_stats as format_precision_stats
from jaxscale.diagnosis import locate_nonfinite as locate_nonfinite
from jaxscale.diagnosis import lowering_report as lowering_report
from jaxscale.diagnosis import precision_stats as precision_stats
from jaxscale.facade import GradScaler as GradScaler
from jaxscale.facade import ScalerVariable as ScalerVariable
from jaxscale.optim import BlockQuantized as BlockQuantized
from jaxscale.optim import KahanSummationState as KahanSummationState
from jaxscale.optim import LowPrecisionState as LowPrecisionState
from jaxscale.optim import MasterWeightsState as MasterWeightsState
from jaxscale.optim import StochasticRoundingState as StochasticRoundingState
from jaxscale.optim import dequantize_blockwise as dequantize_blockwise
from jaxscale.optim import kahan_summation as kahan_summation
from jaxscale.optim import low_precision_state as low_precision_state
from jaxscale.optim import master_params as master_params
from jaxscale.optim import master_weights as master_weights
from jaxscale.optim import quantize_blockwise as quantize_blockwise
from jaxscale.optim import stochastic_round as stochastic_round
from jaxscale.optim import stochastic_rounding as stochastic_rounding
from jaxscale.transform import GradScalerState as GradScalerState
from jaxscale.transform import found_inf as found_inf
from jaxscale.transform import get_scale as get_scale
from jaxscale.transform import grad_scaler as grad_scaler
from jaxscale.transform import last_overflow_origin as last_overflow_origin
from jaxscale.transform import metrics as metrics
from jaxscale.transform import scale as scale
from jaxscale.transform import skipped_steps as skipped_steps

__version__ = "0.1.0"

__all__ = [
    "BlockQuantized",
    "GradScaler",
    "GradScalerState",
    "KahanSummationState",
    "LowPrecisionState",
    "LoweringReport",
    "MasterWeightsState",
    "NonfiniteReport",
    "ScaleWarning",
    "ScalerState",
    "ScalerVariable",
    "StochasticRoundingState",
    "__version__",
    "all_finite",
    "autocast",
    "custom_fwd",
    "dequantize_blockwise",
    "dequantize_mx",
    "dequantize_nvfp4",
    "float8_report",
    "format_precision_stats",
    "found_inf",
    "get_autocast_dtype",
    "get_scale",
    "grad_scaler",
    "init_scaler_state",
    "is_autocast_enabled",
    "kahan_summation",
    "last_overflow_origin",
    "locate_nonfinite",
    "low_precision_state",
    "lowering_report",
    "master_params",
    "master_weights",
    "metrics",
    "nonfinite_leaves",
    "nonfinite_paths",
    "nvfp4_per_tensor_scale",
    "precision_stats",
    "quantize_blockwise",
    "quantize_float8",
    "quantize_mx",
    "quantize_nvfp4",
    "random_hadamard_transform",
    "scale",
    "scale_outputs",
    "skipped_steps",
    "stochastic_round",
    "stochastic_rounding",
    "unscale_and_check",
    "update_scale",
]
