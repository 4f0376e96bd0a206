"""Low-precision parameters and optimizer state: Optax transforms (jax and optax; no flax).

The first technique of mixed precision: parameters in bfloat16 or float16 that still
learn, and optimizer state in bfloat16, float8 or 8 bits. The numerics are pure
functions, bit for bit torchao's: :func:`stochastic_round`, and the block-wise
quantizers :func:`quantize_blockwise` and :func:`dequantize_blockwise`. The
transforms wrap any Optax optimizer, as :func:`jaxscale.grad_scaler` does, and own
how a parameter or a state is written: :func:`master_weights`,
:func:`stochastic_rounding`, :func:`kahan_summation` and :func:`low_precision_state`.
They compose with each other and with :func:`jaxscale.grad_scaler`.
"""

from jaxscale.optim._blockwise import dequantize_blockwise as dequantize_blockwise
from jaxscale.optim._blockwise import quantize_blockwise as quantize_blockwise
from jaxscale.optim._kahan import KahanSummationState as KahanSummationState
from jaxscale.optim._kahan import kahan_summation as kahan_summation
from jaxscale.optim._low_precision_state import BlockQuantized as BlockQuantized
from jaxscale.optim._low_precision_state import LowPrecisionState as LowPrecisionState
from jaxscale.optim._low_precision_state import low_precision_state as low_precision_state
from jaxscale.optim._master_weights import MasterWeightsState as MasterWeightsState
from jaxscale.optim._master_weights import master_params as master_params
from jaxscale.optim._master_weights import master_weights as master_weights
from jaxscale.optim._stochastic_round import stochastic_round as stochastic_round
from jaxscale.optim._stochastic_rounding import StochasticRoundingState as StochasticRoundingState
from jaxscale.optim._stochastic_rounding import stochastic_rounding as stochastic_rounding

__all__ = [
    "BlockQuantized",
    "KahanSummationState",
    "LowPrecisionState",
    "MasterWeightsState",
    "StochasticRoundingState",
    "dequantize_blockwise",
    "kahan_summation",
    "low_precision_state",
    "master_params",
    "master_weights",
    "quantize_blockwise",
    "stochastic_round",
    "stochastic_rounding",
]
