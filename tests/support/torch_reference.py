"""PyTorch's own loss-scaling kernels (CPU build), driven with NumPy inputs.

The comparison tests take their expected values from here: whatever PyTorch
computes is the specification jaxscale must match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

TORCH_DTYPES = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch tensor holding exactly ``array``'s values (bfloat16 via its float32 bits)."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


def to_numpy(tensor: torch.Tensor, like: np.ndarray) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.to(torch.float32).numpy().astype(like.dtype)
    return tensor.numpy()


def update_scale_trajectory(
    init_scale: float,
    found_infs: Sequence[float],
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    init_tracker: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(scales float32[n], trackers int32[n]) after each ``torch._amp_update_scale_`` call."""
    scale = torch.full((), init_scale, dtype=torch.float32)
    tracker = torch.full((), init_tracker, dtype=torch.int32)
    scales, trackers = [], []
    for found_inf in found_infs:
        torch._amp_update_scale_(
            scale,
            tracker,
            torch.full((), float(found_inf), dtype=torch.float32),
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        scales.append(scale.item())
        trackers.append(tracker.item())
    return np.array(scales, np.float32), np.array(trackers, np.int32)


def unscale(grads: Sequence[np.ndarray], scale: np.float32) -> tuple[list[np.ndarray], bool]:
    """GradScaler.unscale_'s arithmetic: ``_amp_foreach_non_finite_check_and_unscale_``.

    The inverse scale is computed as GradScaler does: ``scale.double().reciprocal().float()``.
    Grads are grouped by dtype, as GradScaler groups them.
    """
    inv_scale = torch.full((), float(scale), dtype=torch.float32).double().reciprocal().float()
    found_inf = torch.zeros((), dtype=torch.float32)
    tensors = [to_torch(g) for g in grads]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
    return [to_numpy(t, g) for t, g in zip(tensors, grads, strict=True)], bool(found_inf.item())


def inverse_scale(scale: Any) -> Any:
    """PyTorch's ``scale.double().reciprocal().float()``: a float32 scalar for a scalar
    ``scale``, a float32 array for an array of scales."""
    scales = torch.from_numpy(np.array(scale, np.float32, ndmin=1))
    inv = scales.double().reciprocal().float().numpy()
    return np.float32(inv[0]) if np.ndim(scale) == 0 else inv
