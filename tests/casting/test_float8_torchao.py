"""Float8 against torchao on the CPU: the quantization bit for bit, a linear layer to the
rounding of its float8 matmuls.

torchao's ``hp_tensor_to_float8_dynamic`` is the reference for
``jaxscale.quantize_float8`` (data bytes and scale bits), over random and edge-case
tensors in float32, bfloat16 and float16, per tensor and per row, with and without
power-of-two scales. torchao's ``Float8Linear`` (``convert_to_float8_training``) is the
reference for ``autocast(..., float8=recipe)`` on ``x @ w.T``: output and both
gradients.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxscale

with warnings.catch_warnings():  # torchao's import warns about its optional GPU kernels
    warnings.simplefilter("ignore")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

TORCH_DTYPES = {
    jnp.float32: torch.float32,
    jnp.bfloat16: torch.bfloat16,
    jnp.float16: torch.float16,
}
FLOAT8 = {jnp.float8_e4m3fn: torch.float8_e4m3fn, jnp.float8_e5m2: torch.float8_e5m2}


def torchao_quantize(x: np.ndarray, dtype, float8, axis, power_of_2):
    tensor = torch.from_numpy(np.array(x, np.float32)).to(TORCH_DTYPES[dtype])
    granularity = ScalingGranularity.TENSORWISE if axis is None else ScalingGranularity.AXISWISE
    result = hp_tensor_to_float8_dynamic(
        tensor, FLOAT8[float8], LinearMMConfig(), scaling_granularity=granularity,
        axiswise_dim=axis, round_scales_to_power_of_2=power_of_2,
    )  # fmt: skip
    return result._data.view(torch.uint8).numpy(), result._scale.numpy()


def tensors(seed: int):
    """Random tensors and edge cases: zeros, a zero row, tiny and huge magnitudes,
    values near the float8 maxima, subnormals, amax making a scale just below a power
    of two."""
    rng = np.random.default_rng(seed)
    shape = ((8, 32), (3, 5))[seed % 2]  # two shapes: one compilation each
    kind = (seed // 2) % 8
    if kind == 0:
        return rng.normal(size=shape) * 10.0 ** rng.uniform(-8, 8)
    if kind == 1:
        x = rng.normal(size=shape)
        x[0] = 0.0  # a row of zeros: amax 0, scale from the 1e-12 floor
        return x
    if kind == 2:
        return np.zeros(shape)
    if kind == 3:  # amax with a significand just above 1.75: scales just below 2**k
        x = rng.uniform(-1, 1, size=shape)
        x.flat[0] = 1.75 * (1 + rng.integers(1, 40) * 2.0**-23) * 2.0 ** rng.integers(-20, 20)
        return x
    if kind == 4:
        return rng.normal(size=shape) * 1e-42  # float32 subnormals (amax below 1e-12)
    if kind == 5:
        return rng.uniform(440, 460, size=shape) * rng.choice([-1, 1], size=shape)
    if kind == 6:
        return rng.normal(size=shape) * 60000.0  # near float16's maximum
    return rng.standard_cauchy(size=shape)


CONFIGS = [
    (dtype, float8, axis, power_of_2)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
    for float8 in (jnp.float8_e4m3fn, jnp.float8_e5m2)
    for axis in (None, 0, -1)
    for power_of_2 in (False, True)
]


@pytest.mark.parametrize(
    ("dtype", "float8", "axis", "power_of_2"),
    CONFIGS,
    ids=[f"{np.dtype(d).name}-{np.dtype(f).name}-axis{a}-pow2{p}" for d, f, a, p in CONFIGS],
)
def test_quantize_float8_is_torchaos_bit_for_bit(dtype, float8, axis, power_of_2):
    quantize = jax.jit(
        lambda x: jaxscale.quantize_float8(x, float8, axis=axis, power_of_2=power_of_2)
    )
    for seed in range(32):  # 36 configurations x 32 tensors: 1,152 comparisons
        x = tensors(seed + 100 * CONFIGS.index((dtype, float8, axis, power_of_2)))
        if dtype == jnp.float16:
            x = np.clip(x, -65000, 65000)
        x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # exactly representable
        data, scale = quantize(jnp.asarray(x, dtype))
        want_data, want_scale = torchao_quantize(x, dtype, float8, axis, power_of_2)
        np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), want_scale.view(np.uint32))
        np.testing.assert_array_equal(np.asarray(data).view(np.uint8), want_data)


def test_quantize_float8_examples_and_bad_input():
    _, scale = jaxscale.quantize_float8(jnp.array([[1.0, -2.0], [0.0, 0.0]]), axis=-1)
    assert scale.shape == (2, 1)
    np.testing.assert_array_equal(np.asarray(scale)[:, 0], [224.0, np.float32(448.0 / 1e-12)])
    with pytest.raises(ValueError, match="float8 dtype must be float8_e4m3fn or float8_e5m2"):
        jaxscale.quantize_float8(jnp.ones(2), jnp.float16)
    with pytest.raises(ValueError, match="expects a floating array, got int32"):
        jaxscale.quantize_float8(jnp.ones(2, jnp.int32))


# -- a linear layer: torchao's Float8Linear against autocast(..., float8=recipe) --------------

# Both sides quantize every operand to the same float8 bytes and scales (above). What
# remains is how each multiplies them out: float32 accumulation in different orders
# (far below bfloat16's resolution), then the scales applied and the result rounded to
# bfloat16 once (tensorwise), or rounded to bfloat16 before torchao's rowwise kernel
# multiplies the row scales in (twice). So outputs and gradients agree to two units in
# the last place of bfloat16, 2**-7 of the largest magnitude.
TOLERANCE = 2.0**-7


@functools.cache
def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm``, which torchao's rowwise recipes call,
    takes a scale per row (torch 2.13's does; older ones only one per tensor)."""
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)  # fmt: skip
    except RuntimeError:
        return False
    return True


def torchao_linear(recipe, w, x, cotangent):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe != "tensorwise" and not cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no row scales")

    layer = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
    layer[0].weight = torch.nn.Parameter(torch.from_numpy(np.array(w)).to(torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    inputs = torch.from_numpy(np.array(x)).to(torch.bfloat16).requires_grad_()
    out = layer(inputs)
    out.backward(torch.from_numpy(np.array(cotangent)).to(torch.bfloat16))
    as_numpy = lambda t: t.detach().float().numpy()  # noqa: E731
    return as_numpy(out), as_numpy(inputs.grad), as_numpy(layer[0].weight.grad)


def jaxscale_linear(recipe, w, x, cotangent):
    def linear(w, x):
        return x @ w.T  # nnx.Linear's and torch.nn.Linear's matmul

    fn = jaxscale.autocast(linear, dtype=jnp.bfloat16, float8=recipe)
    w, x = jnp.asarray(w, jnp.bfloat16), jnp.asarray(x, jnp.bfloat16)
    out, pullback = jax.vjp(fn, w, x)
    grad_w, grad_x = pullback(jnp.asarray(cotangent, jnp.bfloat16))
    as_numpy = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return as_numpy(out), as_numpy(grad_x), as_numpy(grad_w)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_linear_layer_matches_torchaos_float8_linear(recipe, seed):
    rng = np.random.default_rng(seed)
    m, k, n = 32, 64, 48
    w = rng.normal(size=(n, k)) * 0.2
    x = rng.normal(size=(m, k)) * rng.uniform(0.1, 10, size=(m, 1))  # rows of different scales
    cotangent = rng.normal(size=(m, n)) * 1e-3
    ours = jaxscale_linear(recipe, w, x, cotangent)
    theirs = torchao_linear(recipe, w, x, cotangent)
    for name, got, want in zip(("output", "grad_input", "grad_weight"), ours, theirs, strict=True):
        scale = np.max(np.abs(want))
        np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE * scale, err_msg=name)


def test_the_float8_product_is_rescaled_as_cublas_does():
    # The float32 product of the float8 operands times (1/scale_a)·(1/scale_b), each
    # inverse rounded to float32 and their product too: cuBLAS's scaled-matmul epilogue,
    # what torch._scaled_mm runs on a GPU. Operands whose products sum exactly in any
    # order leave the rescale as the only rounding. (torch's CPU _scaled_mm instead
    # scales each operand first, (a·ia) @ (b·ib): it differs in the last bit of about
    # 70% of these results; a GPU computes the epilogue.)
    from jaxscale.casting._float8_matmul import RECIPES, _mm

    rng = np.random.default_rng(11)

    def operand(shape, magnitude):
        # float8 codes of 112 to 448 after scaling (every code's lowest bit at 2**3 or
        # above): K = 16 products sum exactly in float32
        values = rng.choice([-1.0, 1.0], shape) * rng.uniform(0.25, 1.0, shape)
        values.flat[0] = 1.0
        return (values * magnitude).astype(np.float32)

    mismatched_by_division = 0
    for _ in range(10):
        a, b = operand((32, 16), rng.uniform(0.1, 10)), operand((16, 48), rng.uniform(0.1, 10))
        recipe = RECIPES["tensorwise"]
        ours = np.asarray(_mm(jnp.asarray(a), jnp.asarray(b), recipe.input, recipe.weight,
                              recipe, jnp.float32))  # fmt: skip
        a8, scale_a = jaxscale.quantize_float8(jnp.asarray(a))
        b8, scale_b = jaxscale.quantize_float8(jnp.asarray(b))
        a_t = torch.from_numpy(np.array(a8).view(np.uint8)).view(torch.float8_e4m3fn).float()
        b_t = torch.from_numpy(np.array(b8).view(np.uint8)).view(torch.float8_e4m3fn).float()
        inverse_a = torch.tensor(float(scale_a)).reciprocal()
        inverse_b = torch.tensor(float(scale_b)).reciprocal()
        product = a_t.double() @ b_t.double()  # exact
        assert torch.equal(product.float().double(), product)
        expected = (product.float() * (inverse_a * inverse_b)).numpy()
        np.testing.assert_array_equal(ours, expected)
        divided = (product.float() / (torch.tensor(float(scale_a)) * float(scale_b))).numpy()
        mismatched_by_division += int(np.sum(divided != expected))
    assert mismatched_by_division > 0  # the test can tell the two rescales apart


def test_power_of_two_scales_at_the_boundary_where_float32_log2_rounds_up():
    # amax a few ulps above 28 makes a scale a few ulps below 16 (448 / 28): torchao's
    # float32 log2 of it rounds to 4.0 for the first ones, so the scale is 16, and 8 after
    # them. Every amax from 28 up to 40 ulps above, one row each.
    steps = np.arange(0, 41, dtype=np.int32)
    amax = (np.float32(28.0).view(np.int32) + steps).view(np.float32)
    x = np.zeros((steps.size, 16), np.float32)
    x[:, 0] = amax
    for power_of_2 in (True, False):
        _, expected = torchao_quantize(x, jnp.float32, jnp.float8_e4m3fn, -1, power_of_2)
        _, ours = jaxscale.quantize_float8(jnp.asarray(x), axis=-1, power_of_2=power_of_2)
        np.testing.assert_array_equal(np.asarray(ours).reshape(-1), expected.reshape(-1))
    rounded = np.asarray(jaxscale.quantize_float8(jnp.asarray(x), axis=-1, power_of_2=True)[1])
    assert set(rounded.reshape(-1).tolist()) == {16.0, 8.0}  # both sides of the boundary
