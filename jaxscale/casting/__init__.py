"""Casting: PyTorch's op-level autocast as a JAX function transform (jax only).

:func:`autocast` traces a function to a jaxpr and evaluates it anew with PyTorch's
CUDA autocast policy, the table :data:`POLICY` from primitive to precision, or with its
CPU policy, :data:`CPU_POLICY`.
"""

from jaxscale.casting._autocast import autocast as autocast
from jaxscale.casting._custom_fwd import custom_fwd as custom_fwd
from jaxscale.casting._float8 import quantize_float8 as quantize_float8
from jaxscale.casting._float8_matmul import MX_RECIPES as MX_RECIPES
from jaxscale.casting._float8_matmul import RECIPES as RECIPES
from jaxscale.casting._float8_matmul import Cast as Cast
from jaxscale.casting._float8_matmul import Float8Recipe as Float8Recipe
from jaxscale.casting._float8_matmul import MXRecipe as MXRecipe
from jaxscale.casting._float8_report import Float8Report as Float8Report
from jaxscale.casting._float8_report import MatmulError as MatmulError
from jaxscale.casting._float8_report import float8_report as float8_report
from jaxscale.casting._matmul_site import MatmulSite as MatmulSite
from jaxscale.casting._matmul_site import auto_filter as auto_filter
from jaxscale.casting._matmul_site import exclude_layers as exclude_layers
from jaxscale.casting._matmul_site import exclude_names as exclude_names
from jaxscale.casting._mx import dequantize_mx as dequantize_mx
from jaxscale.casting._mx import quantize_mx as quantize_mx
from jaxscale.casting._nvfp4 import dequantize_nvfp4 as dequantize_nvfp4
from jaxscale.casting._nvfp4 import nvfp4_per_tensor_scale as nvfp4_per_tensor_scale
from jaxscale.casting._nvfp4 import quantize_nvfp4 as quantize_nvfp4
from jaxscale.casting._nvfp4 import random_hadamard_transform as random_hadamard_transform
from jaxscale.casting._nvfp4_matmul import NVFP4_RECIPES as NVFP4_RECIPES
from jaxscale.casting._nvfp4_matmul import NVFP4Recipe as NVFP4Recipe
from jaxscale.casting._policy import AS_TRACED as AS_TRACED
from jaxscale.casting._policy import CPU_POLICY as CPU_POLICY
from jaxscale.casting._policy import POLICY as POLICY
from jaxscale.casting._policy import UNSUPPORTED_HIGHER_ORDER as UNSUPPORTED_HIGHER_ORDER
from jaxscale.casting._policy import Precision as Precision
from jaxscale.casting._policy import Row as Row
from jaxscale.casting._policy import register_policy as register_policy
from jaxscale.casting._policy import row_for as row_for
from jaxscale.casting._region import get_autocast_dtype as get_autocast_dtype
from jaxscale.casting._region import is_autocast_enabled as is_autocast_enabled

__all__ = [
    "AS_TRACED",
    "CPU_POLICY",
    "MX_RECIPES",
    "NVFP4_RECIPES",
    "POLICY",
    "RECIPES",
    "UNSUPPORTED_HIGHER_ORDER",
    "Cast",
    "Float8Recipe",
    "Float8Report",
    "MXRecipe",
    "MatmulError",
    "MatmulSite",
    "NVFP4Recipe",
    "Precision",
    "Row",
    "auto_filter",
    "autocast",
    "custom_fwd",
    "dequantize_mx",
    "dequantize_nvfp4",
    "exclude_layers",
    "exclude_names",
    "float8_report",
    "get_autocast_dtype",
    "is_autocast_enabled",
    "nvfp4_per_tensor_scale",
    "quantize_float8",
    "quantize_mx",
    "quantize_nvfp4",
    "random_hadamard_transform",
    "register_policy",
    "row_for",
]
