"""Validation of static hyperparameters, with errors that name the bad value.

Hyperparameters are static Python numbers: they shape the compiled step and never
live in the state. Each checker accepts Python and NumPy numbers and concrete
0-d arrays, returns a plain ``float`` or ``int``, and raises ``TypeError`` for a
value of the wrong kind or ``ValueError`` for a value out of range.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import numpy as np

from jaxscale._src.jaxprs import is_traced

INT32_MAX = 2**31 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _describe(value: Any) -> str:
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value)


def _as_scalar(name: str, value: Any) -> Any:
    """Unwrap a concrete 0-d array to a Python scalar; reject everything non-numeric."""
    if is_traced(value):
        raise TypeError(
            f"{name} must be a concrete Python number, not a traced array; "
            "hyperparameters are static configuration"
        )
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        if np.shape(value) != ():
            raise TypeError(f"{name} must be a scalar number, got {_describe(value)}")
        value = np.asarray(value).item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return value


def as_float(name: str, value: Any) -> float:
    """``value`` as a finite Python float."""
    number = float(_as_scalar(name, value))
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number!r}")
    return number


def as_int(name: str, value: Any) -> int:
    """``value`` as a Python int; floats, even integral ones, are rejected."""
    number = _as_scalar(name, value)
    if not isinstance(number, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(number).__name__} {number!r}")
    return int(number)


def as_bool(name: str, value: Any) -> bool:
    """``value`` itself when it is a Python bool; anything else (even 0 or 1) is rejected."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def int32_count(name: str, value: Any) -> int:
    """A counter's starting value: an integer in ``[0, 2**31)``."""
    number = as_int(name, value)
    if not 0 <= number <= INT32_MAX:
        raise ValueError(f"{name} must be in [0, 2**31), got {number!r}")
    return number


def growth_factor(value: Any) -> float:
    number = as_float("growth_factor", value)
    if number <= 1.0:
        raise ValueError(f"growth_factor must be > 1.0, got {number!r}")
    return number


def backoff_factor(value: Any) -> float:
    number = as_float("backoff_factor", value)
    if not 0.0 < number < 1.0:
        raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {number!r}")
    return number


def growth_interval(value: Any) -> int:
    number = as_int("growth_interval", value)
    if not 1 <= number <= INT32_MAX:
        raise ValueError(f"growth_interval must be an integer in [1, 2**31 - 1], got {number!r}")
    return number


def hysteresis(value: Any) -> int:
    number = as_int("hysteresis", value)
    if not 1 <= number <= INT32_MAX:
        raise ValueError(f"hysteresis must be an integer in [1, 2**31 - 1], got {number!r}")
    return number


def positive_float32(name: str, value: Any) -> float:
    """A positive number that stays positive and finite when rounded to float32."""
    number = as_float(name, value)
    rounded = float(np.float32(number)) if abs(number) <= _FLOAT32_MAX else math.inf
    if not (number > 0.0 and 0.0 < rounded < math.inf):
        raise ValueError(
            f"{name} must be positive and finite in float32 "
            f"(about 1.4e-45 to 3.4e38), got {number!r}"
        )
    return number


def scale_bounds(min_scale: Any, max_scale: Any) -> tuple[float | None, float | None]:
    low = None if min_scale is None else positive_float32("min_scale", min_scale)
    high = None if max_scale is None else positive_float32("max_scale", max_scale)
    if low is not None and high is not None and low > high:
        raise ValueError(
            f"min_scale must be <= max_scale, got min_scale={low!r} > max_scale={high!r}"
        )
    return low, high


def init_scale_within(init_scale: Any, low: float | None, high: float | None) -> float:
    number = positive_float32("init_scale", init_scale)
    if low is not None and number < low:
        raise ValueError(f"init_scale must be >= min_scale={low!r}, got {number!r}")
    if high is not None and number > high:
        raise ValueError(f"init_scale must be <= max_scale={high!r}, got {number!r}")
    return number


def optimizer_problem(inner: Any, wrapper: str) -> TypeError | None:
    """Why ``inner`` is not an Optax optimizer a ``wrapper`` can wrap (``None`` if it is):
    a factory passed uncalled (``optax.adam`` for ``optax.adam(1e-3)``) is named."""
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return None
    if callable(inner):
        name = getattr(inner, "__qualname__", getattr(inner, "__name__", repr(inner)))
        return TypeError(
            f"{wrapper} wraps an Optax optimizer, got the function {name}: call it first, "
            f"e.g. jaxscale.{wrapper}(optax.adamw(1e-3))"
        )
    return TypeError(
        f"{wrapper} wraps an Optax optimizer (an object with init and update), got "
        f"{type(inner).__name__} {inner!r}"
    )


def dtype_name(dtype: Any) -> str | None:
    """The name of a dtype given as an object or as its name (``jnp.bfloat16``,
    ``np.dtype("float16")``, ``"bfloat16"``, ``"float8_e4m3fn"``), or a string that names
    none (lowercased, for a caller's own names); ``None`` for anything else."""
    if isinstance(dtype, str):
        try:
            return np.dtype(dtype).name
        except TypeError:
            return dtype.lower()
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def dtype_choice(dtype: Any, choices: dict[str, str]) -> str | None:
    """The entry of ``choices`` (names to what they mean) that ``dtype`` names, given as a
    dtype object or its name; ``None`` where it names none."""
    name = dtype_name(dtype)
    return None if name is None else choices.get(name)
