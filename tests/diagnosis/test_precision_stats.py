"""jaxscale.precision_stats reports the ranges each matmul and convolution works in."""

from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from support import machine

import jaxscale

F16, F32 = jnp.float16, jnp.float32


def line_of(fn, marker="# <- measured"):
    lines, first = inspect.getsourcelines(fn)
    found = [first + i for i, text in enumerate(lines) if marker in text]
    assert len(found) == 1
    # the path as jaxscale shows a user's file: relative to the working directory
    return f"{os.path.relpath(__file__)}:{found[0]}"


def values(stats):
    return {key: {name: float(v) for name, v in figures.items()} for key, figures in stats.items()}


def projection(w, x):
    return x @ w  # <- measured


def test_operand_and_output_ranges_of_a_float16_matmul():
    w = jnp.array([[300.0, -2.0], [300.0, 1e-5]], F32)
    x = jnp.array([[1.0, 1.0], [1e-6, 0.0]], F32)
    out, stats = jax.jit(jaxscale.precision_stats(jaxscale.autocast(projection)))(w, x)
    np.testing.assert_array_equal(out, jax.jit(jaxscale.autocast(projection))(w, x))
    key = f"{line_of(projection)} dot_general forward (float16)"
    assert list(stats) == [key]
    figures = values(stats)[key]
    assert figures["lhs_amax"] == 1.0
    assert figures["rhs_amax"] == 300.0
    assert figures["out_amax"] == 600.0
    # outputs 600, -2, 3e-4 and -2e-6: the last below float16's smallest normal, 6.1e-5
    assert figures["underflow"] == 0.25
    assert figures["overflow"] == 0.0


def test_a_module_closed_over_by_jax_jit():
    # read only, as a plain call may: its parameters are not written back
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = jnp.array([[1.0, 1.0], [1e-6, 0.0]], F32)
    out, stats = jax.jit(lambda x: jaxscale.precision_stats(jaxscale.autocast(model))(x))(x)
    np.testing.assert_array_equal(out, jaxscale.autocast(model)(x))
    (key,) = stats
    assert key.endswith("dot_general forward (float16)")
    assert values(stats)[key]["lhs_amax"] == 1.0


def test_overflow_fraction_and_the_finite_amax():
    w = jnp.array([[4e4, 1.0], [4e4, 1.0]], F32)
    _, stats = jaxscale.precision_stats(jaxscale.autocast(projection))(w, jnp.ones((1, 2)))
    figures = values(stats)[f"{line_of(projection)} dot_general forward (float16)"]
    assert figures["overflow"] == 0.5  # 8e4 is inf in float16
    assert figures["out_amax"] == 2.0


def test_forward_and_backward_matmuls_are_apart_and_numbered():
    def loss(w, x):
        return jnp.sum(projection(w, x) ** 2)

    _, stats = jaxscale.precision_stats(jax.grad(loss, argnums=(0, 1)))(
        jnp.ones((3, 3)), jnp.ones((2, 3))
    )
    where = line_of(projection)
    assert sorted(stats) == [
        f"{where} dot_general backward (float32)",
        f"{where} dot_general backward (float32) #2",
        f"{where} dot_general forward (float32)",
    ]


def test_a_loop_accumulates_over_its_iterations():
    def unrolled_growth(w, x):
        def layer(h, _):
            return h @ w, None  # <- measured

        return lax.scan(layer, x, None, length=3)[0]

    _, stats = jax.jit(jaxscale.precision_stats(unrolled_growth))(
        2.0 * jnp.eye(2), jnp.ones((1, 2))
    )
    figures = values(stats)[f"{line_of(unrolled_growth)} dot_general forward (float32)"]
    assert figures["out_amax"] == 8.0  # the last iteration's 2 ** 3
    assert figures["lhs_amax"] == 4.0


def test_convolutions_are_measured():
    def conv(x, k):
        return lax.conv(x, k, (1, 1), "SAME")  # <- measured

    _, stats = jaxscale.precision_stats(conv)(jnp.ones((1, 1, 4, 4)), 0.5 * jnp.ones((1, 1, 3, 3)))
    figures = values(stats)[f"{line_of(conv)} conv_general_dilated forward (float32)"]
    assert figures["out_amax"] == 4.5
    assert figures["rhs_amax"] == 0.5


def test_bad_argument():
    with pytest.raises(TypeError, match="precision_stats expects a callable, got str 'f'"):
        jaxscale.precision_stats("f")


# -- float8 matmuls --------------------------------------------------------------------------

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def float8_projection(x, w):
    x8, x_scale = jaxscale.quantize_float8(x, E4M3)
    w8, w_scale = jaxscale.quantize_float8(w, E4M3)
    dims = (((1,), (0,)), ((), ()))
    product = lax.dot_general(x8, w8, dims, preferred_element_type=F32)  # <- measured
    return product / (x_scale * w_scale)


def lost_by_the_cast(values, dtype):
    """NumPy's count: elements non-zero that the float8 cast makes zero or subnormal."""
    data, _ = jaxscale.quantize_float8(jnp.asarray(values), dtype)
    data = np.asarray(data).astype(np.float32)
    return np.mean((np.asarray(values) != 0) & (np.abs(data) < float(jnp.finfo(dtype).tiny)))


def test_a_float8_matmul_reports_what_each_operands_cast_lost():
    # x's amax is 448, so its scale is 1 and its values are cast as they are. e4m3's
    # smallest normal is 2**-6: 2**-7 and 2**-9 become subnormal, 2**-11 becomes zero,
    # 0 stays 0 (nothing lost), and 448, 1, 0.5 and 2**-6 are kept.
    row = [448.0, 1.0, 2.0**-7, 2.0**-9, 2.0**-11, 0.0, 0.5, 2.0**-6] * 2
    x = jnp.asarray([row] * 16, F32)
    w = jnp.full((16, 16), 2.0**-12, F32).at[3, 5].set(-2.0)  # scale 224: nothing lost
    out, stats = jaxscale.precision_stats(float8_projection)(x, w)
    np.testing.assert_array_equal(out, float8_projection(x, w))
    key = f"{line_of(float8_projection)} dot_general forward (float8_e4m3fn @ float8_e4m3fn)"
    assert list(stats) == [key]
    figures = values(stats)[key]
    assert figures["lhs_float8_underflow"] == 3 / 8  # 2**-7, 2**-9, 2**-11 of 8
    assert figures["lhs_float8_underflow"] == lost_by_the_cast(x, E4M3)
    assert figures["rhs_float8_underflow"] == 0.0
    # the figures of the values the casts were given, and of the output with the
    # scales divided out: not the float8 data's 448s
    assert figures["lhs_amax"] == 448.0
    assert figures["rhs_amax"] == 2.0
    assert figures["out_amax"] == float(jnp.max(jnp.abs(out)))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_autocast_float8_recipes_name_each_matmuls_float8_types(recipe):
    def loss(w, x):
        return jnp.mean(projection(w.T, x).astype(F32) ** 2)

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(48, 64)) * 0.1, F32)
    x = jnp.asarray(rng.standard_t(2, size=(32, 64)), F32)  # heavy tails: outliers
    grad = jax.grad(jaxscale.autocast(loss, dtype=jnp.bfloat16, float8=recipe))
    got, stats = jax.jit(jaxscale.precision_stats(grad))(w, x)
    if machine.keeps_every_rounding():
        np.testing.assert_array_equal(got, jax.jit(grad)(w, x))
    line = line_of(projection)
    kinds = {key.removeprefix(line + " ").split(" #")[0] for key in stats}
    expected = {
        "tensorwise": {
            "dot_general forward (float8_e4m3fn @ float8_e4m3fn)",
            "dot_general backward (float8_e5m2 @ float8_e4m3fn)",  # grad_output @ weight
            "dot_general backward (float8_e4m3fn @ float8_e5m2)",  # input.T @ grad_output
        },
        "rowwise": {
            "dot_general forward (float8_e4m3fn @ float8_e4m3fn)",
            "dot_general backward (float8_e4m3fn @ float8_e4m3fn)",
        },
        "rowwise_with_gw_hp": {
            "dot_general forward (float8_e4m3fn @ float8_e4m3fn)",
            "dot_general backward (float8_e4m3fn @ float8_e4m3fn)",
            "dot_general backward (bfloat16)",  # the weight gradient in high precision
        },
    }[recipe]
    assert kinds == expected
    forward = values(stats)[f"{line} dot_general forward (float8_e4m3fn @ float8_e4m3fn)"]
    # the input is quantized along its rows (rowwise) or as a whole (tensorwise)
    axis = None if recipe == "tensorwise" else 1
    data, _ = jaxscale.quantize_float8(x, E4M3, axis=axis, power_of_2=recipe != "tensorwise")
    tiny = float(jnp.finfo(E4M3).tiny)
    lost = np.mean((np.asarray(x) != 0) & (np.abs(np.asarray(data).astype(np.float32)) < tiny))
    assert forward["lhs_float8_underflow"] == pytest.approx(lost, abs=0)
    assert lost > 0  # the heavy tails put some of x below float8's normal range
    # amaxes of the high-precision operands (float32 or their bfloat16 rounding, as
    # autocast hands them to the cast), the output with the scales divided out
    np.testing.assert_allclose(forward["lhs_amax"], np.max(np.abs(x)), rtol=2**-8)
    np.testing.assert_allclose(forward["rhs_amax"], np.max(np.abs(w)), rtol=2**-8)
    np.testing.assert_allclose(forward["out_amax"], np.max(np.abs(x @ w.T)), rtol=0.05)
    for key, figures in values(stats).items():
        if "@" in key:
            assert 0.0 <= figures["lhs_float8_underflow"] < 1.0, key
            assert 0.0 <= figures["rhs_float8_underflow"] < 1.0, key
        else:
            assert "lhs_float8_underflow" not in figures, key


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_wgrad_with_hp"])
def test_autocast_mx_recipes_show_their_mx_operands_and_what_their_blocks_lost(recipe):
    def loss(w, x):
        return jnp.mean(projection(w.T, x).astype(F32) ** 2)

    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.normal(size=(64, 64)) * 0.1, F32)
    x = jnp.asarray(rng.standard_t(1, size=(32, 64)), F32)  # Cauchy: blocks far apart
    grad = jax.grad(jaxscale.autocast(loss, dtype=jnp.bfloat16, float8=recipe))
    got, stats = jax.jit(jaxscale.precision_stats(grad))(w, x)
    if machine.keeps_every_rounding():
        np.testing.assert_array_equal(got, jax.jit(grad)(w, x))
    line = line_of(projection)
    mx = "mx float8_e4m3fn @ mx float8_e4m3fn"
    kinds = {key.removeprefix(line + " ").split(" #")[0] for key in stats}
    assert (
        kinds
        == {
            "mxfp8": {f"dot_general forward ({mx})", f"dot_general backward ({mx})"},
            "mxfp8_wgrad_with_hp": {
                f"dot_general forward ({mx})",
                f"dot_general backward ({mx})",
                "dot_general backward (bfloat16)",  # the weight gradient from bfloat16
            },
        }[recipe]
    )
    forward = values(stats)[f"{line} dot_general forward ({mx})"]
    # x is quantized in blocks of 32 along its rows (the contracting axis), as autocast
    # hands it over: rounded to bfloat16
    x16 = x.astype(jnp.bfloat16)
    data, _ = jaxscale.quantize_mx(x16, axis=1)
    tiny = float(jnp.finfo(E4M3).tiny)
    lost = np.mean((np.asarray(x16) != 0) & (np.abs(np.asarray(data).astype(np.float32)) < tiny))
    assert lost > 0.01  # a block's outlier pushes its small values below e4m3's normals
    assert forward["lhs_float8_underflow"] == pytest.approx(lost, abs=0)
    assert forward["lhs_amax"] == float(jnp.max(jnp.abs(x16)))
    np.testing.assert_allclose(forward["rhs_amax"], np.max(np.abs(w)), rtol=2**-8)
    table = jaxscale.format_precision_stats(stats)
    assert table.splitlines()[0].endswith("lhs to float8 lost  rhs to float8 lost")
    assert f"{100 * lost:.2f}%" in table


def test_quantize_mx_and_dequantize_mx_work_in_calls_named_for_precision_stats():
    from jaxscale.casting._mx_gather import dequantize_whole
    from jaxscale.diagnosis._stats import MX_DEQUANTIZE, MX_QUANTIZE

    jaxpr = jax.make_jaxpr(lambda x: jaxscale.dequantize_mx(*jaxscale.quantize_mx(x)))(jnp.ones(32))
    names = [e.params["name"] for e in jaxpr.eqns if e.primitive.name == "jit"]
    assert names == [MX_QUANTIZE, "dequantize_mx_blocks"]
    # a weight made whole as MX before it is dequantized (MXRecipe's all_gather_in_mx)
    whole = jax.make_jaxpr(
        lambda x: dequantize_whole(*jaxscale.quantize_mx(x, axis=0), jnp.bfloat16, 0)
    )(jnp.ones((32, 4)))
    names = [e.params["name"] for e in whole.eqns if e.primitive.name == "jit"]
    assert names == [MX_QUANTIZE, "dequantize_mx_whole"]
    assert set(MX_DEQUANTIZE) == {"dequantize_mx_blocks", "dequantize_mx_whole"}


@pytest.mark.parametrize("all_gather_in_mx", [False, True])
def test_an_mx_weight_gathered_as_mx_is_reported_as_mx(all_gather_in_mx):
    recipe = jaxscale.casting.MXRecipe("mxfp8", all_gather_in_mx=all_gather_in_mx)

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w.T).astype(F32))

    w, x = (
        jax.random.normal(jax.random.key(0), (96, 64)),
        jax.random.normal(jax.random.key(1), (32, 64)),
    )
    _, stats = jax.jit(
        jaxscale.precision_stats(
            jax.grad(jaxscale.autocast(loss, dtype=jnp.bfloat16, float8=recipe))
        )
    )(w, x)
    formats = [key.split("(")[1].split(")")[0] for key in stats]
    assert formats == ["mx float8_e4m3fn @ mx float8_e4m3fn"] * 3


def test_a_float8_argument_has_no_cast_to_report():
    def given_float8(x8, w8):
        return lax.dot_general(x8, w8, (((1,), (0,)), ((), ())), preferred_element_type=F32)

    x8 = jnp.ones((16, 16), E4M3)
    _, stats = jaxscale.precision_stats(given_float8)(x8, x8)
    (figures,) = values(stats).values()
    assert np.isnan(figures["lhs_float8_underflow"])  # nothing measured, not "nothing lost"
    assert np.isnan(figures["rhs_float8_underflow"])


def test_float8_figures_accumulate_over_a_loop():
    x = jnp.asarray([[448.0, 2.0**-11] * 8] * 16, F32)  # half of x lost in the cast
    w = jnp.ones((16, 16), F32)

    def looped(x, w):
        return lax.fori_loop(0, 3, lambda i, acc: acc + float8_projection(x * (i + 1), w),
                             jnp.zeros((16, 16), F32))  # fmt: skip

    _, stats = jaxscale.precision_stats(looped)(x, w)
    (figures,) = values(stats).values()
    # iterations scale x by 1, 2, 3; the scale brings the amax back to 448 each time
    assert figures["lhs_float8_underflow"] == 0.5


def test_quantize_float8_casts_in_one_call_named_for_precision_stats():
    from jaxscale.diagnosis._stats import FLOAT8_CAST

    jaxpr = jax.make_jaxpr(lambda x: jaxscale.quantize_float8(x)[0])(jnp.ones(4))
    names = [e.params["name"] for e in jaxpr.eqns if e.primitive.name == "jit"]
    assert names.count(FLOAT8_CAST) == 1


# -- the printed form ------------------------------------------------------------------------


def test_the_printed_form_is_a_table_of_the_figures():
    w = jnp.array([[4e4, 1.0], [4e4, 1.0]], F32)
    _, stats = jax.jit(jaxscale.precision_stats(jaxscale.autocast(projection)))(w, jnp.ones((1, 2)))
    lines = jaxscale.format_precision_stats(stats).splitlines()
    assert lines[0].split() == [
        "matmul", "lhs", "amax", "rhs", "amax", "out", "amax", "underflow", "overflow",
    ]  # fmt: skip
    key = f"{line_of(projection)} dot_general forward (float16)"
    assert lines[1].startswith(key)
    assert lines[1][len(key) :].split() == ["1", "4e+04", "2", "0.00%", "50.00%"]
    # the columns line up: each figure ends where its title ends
    assert [len(line) for line in lines] == [len(lines[0])] * 2


def float8_and_half(w, x):
    h = jaxscale.autocast(lambda w, x: x @ w, float8="tensorwise")(w, x)
    y = jaxscale.autocast(lambda w, x: x @ w)(w, x)  # <- measured
    return jnp.sum(h.astype(F32)) + jnp.sum(y.astype(F32))


def test_the_float8_columns_appear_with_a_float8_matmul_and_dash_for_the_others():
    _, stats = jaxscale.precision_stats(float8_and_half)(
        jnp.full((32, 32), 3.0), jnp.ones((16, 32))
    )
    lines = jaxscale.format_precision_stats(stats).splitlines()
    assert lines[0].endswith("lhs to float8 lost  rhs to float8 lost")
    half = next(line for line in lines if "(float16)" in line)
    assert half.split()[-2:] == ["-", "-"]
    float8 = next(line for line in lines if "float8_e4m3fn @ float8_e4m3fn" in line)
    assert float8.split()[-2:] == ["0.00%", "0.00%"]
    # an operand not cast in the function: n/a
    figures = {"k": {**stats[next(iter(stats))], "lhs_float8_underflow": jnp.float32(np.nan),
                     "rhs_float8_underflow": jnp.float32(0.0)}}  # fmt: skip
    assert jaxscale.format_precision_stats(figures).splitlines()[1].split()[-2:] == ["n/a", "0.00%"]


def test_the_printed_form_refuses_traced_figures_and_names_the_fix():
    def inside(w, x):
        _, stats = jaxscale.precision_stats(jaxscale.autocast(projection))(w, x)
        return jaxscale.format_precision_stats(stats)

    with pytest.raises(TypeError, match="return the stats from the jitted function"):
        jax.jit(inside)(jnp.ones((2, 2)), jnp.ones((1, 2)))
    with pytest.raises(TypeError, match="expects the stats dict precision_stats returned"):
        jaxscale.format_precision_stats([1, 2])
