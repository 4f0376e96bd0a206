"""Casting: PyTorch's op-level autocast as a JAX function transform (jax only).

:func:`autocast` traces a function to a jaxpr and evaluates it anew with PyTorch's
CUDA autocast policy, the table :data:`POLICY` from primitive to precision.
"""

from jaxscale.casting._autocast import autocast as autocast
from jaxscale.casting._float8 import quantize_float8 as quantize_float8
from jaxscale.casting._float8_matmul import RECIPES as RECIPES
from jaxscale.casting._float8_matmul import Cast as Cast
from jaxscale.casting._float8_matmul import Float8Recipe as Float8Recipe
from jaxscale.casting._policy import AS_TRACED as AS_TRACED
from jaxscale.casting._policy import POLICY as POLICY
from jaxscale.casting._policy import UNSUPPORTED_HIGHER_ORDER as UNSUPPORTED_HIGHER_ORDER
from jaxscale.casting._policy import Precision as Precision
from jaxscale.casting._policy import Row as Row

__all__ = [
    "AS_TRACED",
    "POLICY",
    "RECIPES",
    "UNSUPPORTED_HIGHER_ORDER",
    "Cast",
    "Float8Recipe",
    "Precision",
    "Row",
    "autocast",
    "quantize_float8",
]
