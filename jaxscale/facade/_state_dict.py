"""PyTorch's GradScaler state dict: its keys, and validation before anything is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from jaxscale._src import validation

STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class ParsedStateDict(NamedTuple):
    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    growth_tracker: int


def _plain_number(name: str, value: Any) -> Any:
    """Python numbers from torch tensors too (``torch.load`` may hand back 0-d tensors)."""
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None)
    if callable(item) and callable(numel) and not isinstance(value, (int, float)):
        if numel() != 1:
            raise TypeError(
                f"state_dict[{name!r}] must be a number, got a tensor of {numel()} elements"
            )
        return item()
    return value


def parse_state_dict(state_dict: Mapping[str, Any]) -> ParsedStateDict:
    """Validate a GradScaler state dict (jaxscale's or PyTorch's) without applying it.

    Raises:
      TypeError: if ``state_dict`` is not a mapping or a value is of the wrong kind.
      KeyError: if a key is missing.
      ValueError: for unknown keys or values out of range (a scale that is not
        positive and finite in float32, a growth factor <= 1, a backoff factor
        outside (0, 1), a growth interval < 1, a negative growth tracker).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    missing = [key for key in STATE_DICT_KEYS if key not in state_dict]
    if missing:
        raise KeyError(
            f"GradScaler state_dict is missing {missing}; expected keys {list(STATE_DICT_KEYS)}"
        )
    unknown = sorted(str(key) for key in state_dict if key not in STATE_DICT_KEYS)
    if unknown:
        raise ValueError(
            f"GradScaler state_dict has unknown keys {unknown}; expected {list(STATE_DICT_KEYS)}"
        )
    values = {key: _plain_number(key, state_dict[key]) for key in STATE_DICT_KEYS}
    tracker = validation.int32_count("_growth_tracker", values["_growth_tracker"])
    return ParsedStateDict(
        scale=validation.positive_float32("scale", values["scale"]),
        growth_factor=validation.growth_factor(values["growth_factor"]),
        backoff_factor=validation.backoff_factor(values["backoff_factor"]),
        growth_interval=validation.growth_interval(values["growth_interval"]),
        growth_tracker=tracker,
    )
