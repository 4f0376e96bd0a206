"""Where MX quantizers disagree with torchao's ``to_mx``: scale bytes block by block.

Quantizes one set of 10,240 float32 blocks of 32 to MXFP8 (float8_e4m3fn data, E8M0
scales) with jaxscale's ``quantize_mx``, JAX's own quantizer
(``jax._src.cudnn.scaled_matmul_stablehlo.quantize``, the one behind
``jax.nn.scaled_dot_general``) and qwix's ``mxfp8`` (when installed), and counts the
blocks whose scale byte differs from torchao 0.18's ``to_mx`` (RCEIL and FLOOR):

* 8,184 blocks of normal values, each block scaled by ``2**e``, ``e`` uniform in
  [-40, 40];
* 2,048 blocks whose largest magnitude is ``448·2**k`` or up to 16 float32 ulps either
  side of it, ``k`` in [-30, 33] (where a rounded and an exact ceiling of
  ``log2(amax / 448)`` part);
* 8 all-zero blocks.

    python -m benchmarks.mx_quantizers      # needs torch and torchao; qwix optional
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax.numpy as jnp
import numpy as np

import jaxscale

ZERO_BLOCKS, RANDOM_BLOCKS = 8, 8192


def blocks() -> tuple[np.ndarray, np.ndarray]:
    """The blocks, and for each boundary block its float32-ulp offset from 448·2**k."""
    rng = np.random.default_rng(0)
    exponents = rng.integers(-40, 41, (RANDOM_BLOCKS, 1))
    spread = (rng.standard_normal((RANDOM_BLOCKS, 32)) * np.exp2(exponents)).astype(np.float32)
    boundary, offsets = [], []
    for k in range(-30, 34):
        for offset in range(-16, 16):
            amax = np.float32(448 * 2.0**k)
            toward = np.float32(np.inf if offset > 0 else 0)
            for _ in range(abs(offset)):
                amax = np.nextafter(amax, toward, dtype=np.float32)
            block = (rng.random(32) * float(amax) * 0.9).astype(np.float32)
            block[rng.integers(32)] = amax
            boundary.append(block)
            offsets.append(offset)
    x = np.concatenate([spread, np.array(boundary, np.float32)])
    x[:ZERO_BLOCKS] = 0
    return x, np.array(offsets)


def torchao_scales(x: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    import torch
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

    scale, data = to_mx(torch.from_numpy(x), torch.float8_e4m3fn, 32, ScaleCalculationMode[mode])
    return scale.view(torch.uint8).numpy().reshape(-1), data.view(torch.uint8).numpy()


def jaxscale_scales(x: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    data, scale = jaxscale.quantize_mx(jnp.asarray(x), scale_mode=mode.lower())
    return np.asarray(scale.view(jnp.uint8)).reshape(-1), np.asarray(data.view(jnp.uint8))


def jax_scales(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from jax._src.cudnn import scaled_matmul_stablehlo as cudnn

    config = cudnn.BlockScaleConfig(
        mode="mxfp8", block_size=32, data_type=jnp.float8_e4m3fn,
        scale_type=jnp.float8_e8m0fnu, global_scale=None, infer_only=False,
    )  # fmt: skip
    data, scale = cudnn.quantize(jnp.asarray(x), config)
    return np.asarray(scale.view(jnp.uint8)).reshape(-1), np.asarray(data.view(jnp.uint8))


def qwix_scales(x: np.ndarray) -> np.ndarray | None:
    if importlib.util.find_spec("qwix") is None:
        return None
    from qwix._src.core import qarray

    how = qarray.HowToQuantize(qtype="mxfp8", channelwise_axes=(0,), tiled_axes={1: 32})
    scale = np.asarray(qarray.quantize(jnp.asarray(x), how).scale, np.float32).reshape(-1)
    return (np.log2(scale) + 127).astype(np.int64)  # qwix keeps the power of two as a float


def describe(name: str, scales: Any, reference: np.ndarray, offsets: np.ndarray) -> str:
    differ = scales != reference
    boundary = differ[RANDOM_BLOCKS:]
    by_offset = {int(o): int(boundary[offsets == o].sum()) for o in np.unique(offsets)}
    signs = sorted({int(d) for d in scales[differ].astype(int) - reference[differ].astype(int)})
    return (
        f"| {name} | {int(differ.sum())} | {int(differ[ZERO_BLOCKS:RANDOM_BLOCKS].sum())} "
        f"| {int(boundary.sum())} | {int(differ[:ZERO_BLOCKS].sum())} | {signs or '—'} "
        f"| {', '.join(f'{o:+d}: {n}' for o, n in by_offset.items() if n) or '—'} |"
    )


def main() -> None:
    x, offsets = blocks()
    print(f"{x.shape[0]} blocks of 32 float32 values\n")
    print(
        "| quantizer | blocks whose scale differs | spread | boundary | all-zero "
        "| byte difference | boundary blocks differing, by ulp offset from 448·2^k |"
    )
    print("|---|---|---|---|---|---|---|")
    references = {mode: torchao_scales(x, mode) for mode in ("RCEIL", "FLOOR")}
    for mode, (reference, reference_data) in references.items():
        ours, ours_data = jaxscale_scales(x, mode)
        print(describe(f"jaxscale `{mode.lower()}` vs torchao {mode}", ours, reference, offsets))
        assert (ours_data == reference_data).all()
    jax_scale, jax_data = jax_scales(x)
    print(describe("JAX's quantizer vs torchao RCEIL", jax_scale, references["RCEIL"][0], offsets))
    qwix = qwix_scales(x)
    for mode, (reference, _) in references.items():
        if qwix is not None:
            print(describe(f"qwix `mxfp8` vs torchao {mode}", qwix, reference, offsets))
    nan_zero = int((jax_data[:ZERO_BLOCKS] == 0xFF).sum())
    print(
        f"\nJAX's quantizer: {nan_zero} of {ZERO_BLOCKS * 32} elements of the all-zero blocks "
        "are NaN (0/0: the scale 2^-127 is flushed to zero on XLA:CPU)"
    )
    if qwix is not None:
        print(
            f"qwix: the all-zero blocks' scale bytes are {sorted(set(qwix[:ZERO_BLOCKS]))} "
            "(a scale of 1); torchao's are 0"
        )


if __name__ == "__main__":
    main()
