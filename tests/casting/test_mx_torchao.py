"""MXFP8 against torchao on the CPU: ``quantize_mx`` bit for bit with ``to_mx`` (RCEIL and
FLOOR), and the MX recipes with ``MXFP8Linear(kernel_preference=EMULATED)``.

The edge cases are the ones where a float computation on XLA's CPU would part from
PyTorch's: ``amax`` exactly ``448·2**k`` and its float32 neighbours (torchao's RCEIL
takes a rounded ``log2``), subnormal ``amax`` and elements (XLA flushes subnormals to
zero), all-zero blocks, and blocks holding an infinity or a NaN.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxscale

with warnings.catch_warnings():  # torchao's import warns about its optional GPU kernels
    warnings.simplefilter("ignore")
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

MODES = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}


def blocks(seed: int = 0) -> np.ndarray:
    """11,828 blocks of 32 float32 values: random magnitudes over the whole range, and
    for every k from -140 to 119 an amax of 448·2**k and its three float32 neighbours on
    either side, then zeros, infinities, a NaN and subnormals."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(32) * 10.0 ** rng.uniform(-44, 38) for _ in range(10_000)]
    for k in range(-140, 120):
        target = np.float32(448 * 2.0**k)
        for step in range(-3, 4):
            row = rng.uniform(-0.5, 0.5, 32) * float(target)
            row[0] = (target.view(np.int32) + step).view(np.float32)
            rows.append(row)
    special = np.ones((8, 32))
    special[0] = 0.0
    special[1, 3], special[2, 3], special[3, 5] = np.inf, -np.inf, np.nan
    special[4] = rng.uniform(-1, 1, 32) * 1e-40  # subnormal amax
    special[5] = rng.uniform(-1, 1, 32) * 1e-44
    special[6, :16] = 1e-40  # subnormal elements beside normal ones
    special[7] = -special[7]
    rows += list(special)
    return np.asarray(rows, np.float32)


ELEMENTS = {"e4m3": (jnp.float8_e4m3fn, torch.float8_e4m3fn),
            "e5m2": (jnp.float8_e5m2, torch.float8_e5m2)}  # fmt: skip


@pytest.mark.parametrize("element", list(ELEMENTS))
@pytest.mark.parametrize("scale_mode", list(MODES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_mx_is_torchaos_to_mx_bit_for_bit(scale_mode, dtype, element):
    ours_element, torch_element = ELEMENTS[element]
    x = blocks()
    tensor = torch.from_numpy(x).to(torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32)
    scale, data = to_mx(tensor, torch_element, 32, MODES[scale_mode])
    values = jnp.asarray(tensor.float().numpy()).astype(dtype)
    ours_data, ours_scale = jax.jit(
        lambda v: jaxscale.quantize_mx(v, ours_element, scale_mode=scale_mode)
    )(values)
    assert x.shape[0] == 11_828
    assert ours_scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(
        np.asarray(ours_scale).view(np.uint8).reshape(-1),
        scale.view(torch.uint8).numpy().reshape(-1),
    )
    # the data's bytes; a NaN only needs to be a NaN
    ours = np.asarray(ours_data)
    theirs = data.view(torch.uint8).numpy()
    nan = np.isnan(ours.astype(np.float32))
    np.testing.assert_array_equal(nan, np.isnan(data.float().numpy()))
    np.testing.assert_array_equal(ours.view(np.uint8)[~nan], theirs[~nan])


@pytest.mark.parametrize("axis", [0, 1])
def test_blocks_along_another_axis_are_torchaos_on_the_transpose(axis):
    x = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    moved = np.ascontiguousarray(np.moveaxis(x, axis, -1))
    scale, data = to_mx(torch.from_numpy(moved), torch.float8_e4m3fn, 32, MODES["rceil"])
    ours_data, ours_scale = jaxscale.quantize_mx(x, axis=axis)
    expected_shape = list(x.shape)
    expected_shape[axis] //= 32
    assert ours_scale.shape == tuple(expected_shape)
    np.testing.assert_array_equal(
        np.moveaxis(np.asarray(ours_scale).view(np.uint8), axis, -1),
        scale.view(torch.uint8).numpy(),
    )
    np.testing.assert_array_equal(
        np.moveaxis(np.asarray(ours_data).view(np.uint8), axis, -1),
        data.view(torch.uint8).numpy(),
    )


def torchao_mx_linear(x, w, g, wgrad_with_hp):
    layer = MXFP8Linear(
        w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16,
        kernel_preference=KernelPreference.EMULATED, wgrad_with_hp=wgrad_with_hp,
    )  # fmt: skip
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w).to(torch.bfloat16))
    inputs = torch.from_numpy(x).to(torch.bfloat16).requires_grad_(True)
    out = layer(inputs)
    out.backward(torch.from_numpy(g).to(torch.bfloat16))
    return [t.float().detach().numpy() for t in (out, inputs.grad, layer.weight.grad)]


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_wgrad_with_hp"])
def test_a_linear_layer_is_torchaos_mxfp8_linear(recipe):
    rng = np.random.default_rng(2)

    def operand(rows, columns):
        # bfloat16 values (both libraries quantize the same numbers), whose magnitudes
        # vary by powers of two along both axes, so that blocks along one axis have other
        # scales than blocks along the other
        values = rng.standard_normal((rows, columns))
        values *= 2.0 ** rng.integers(-6, 7, (rows, 1)) * 2.0 ** rng.integers(-6, 7, (1, columns))
        return values.astype(jnp.bfloat16).astype(np.float32)

    x, w, g = operand(64, 128), operand(96, 128), operand(64, 96)
    expected = torchao_mx_linear(x, w, g, recipe == "mxfp8_wgrad_with_hp")

    layer = jaxscale.autocast(lambda x, w: x @ w.T, dtype=jnp.bfloat16, float8=recipe)
    out, vjp = jax.vjp(layer, jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    grads = vjp(jnp.asarray(g, jnp.bfloat16))
    # the bounds the recipe's arithmetic allows: 2**-7 of the largest magnitude, and per
    # element one bfloat16 ulp plus 2**-15 of the sum of the products' magnitudes (a
    # blocking along the wrong axis passes the first and fails the second)
    magnitudes = [
        np.abs(x) @ np.abs(w).T, np.abs(g) @ np.abs(w), np.abs(g).T @ np.abs(x)
    ]  # fmt: skip
    for ours, theirs, size in zip((out, *grads), expected, magnitudes, strict=True):
        ours = np.asarray(ours, np.float32)
        assert np.abs(ours - theirs).max() <= 2.0**-7 * np.abs(theirs).max()
        ulp = np.spacing(np.abs(theirs).astype(jnp.bfloat16)).astype(np.float32)
        assert np.all(np.abs(ours - theirs) <= ulp + 2.0**-15 * size)
    # measured: the output and the input's gradient are torchao's bit for bit
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected[0])
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32), expected[1])
