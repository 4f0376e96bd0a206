"""unscale_and_check, all_finite and scale_outputs: the per-leaf arithmetic."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support import machine

from jaxscale import all_finite, scale_outputs, unscale_and_check
from jaxscale.core import _scaling, correctly_rounded_reciprocal, inverse_scale

MODES = ["eager", "jit"]


def call(fn, mode, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_pytorch_unscale_test_numbers(mode, dtype):
    # PyTorch's test_grad_scaling_unscale: inv_scale 0.25 (scale 4), grads of 4.0 -> 1.0.
    grads = [jnp.full((10, 10), 4.0, dtype), jnp.full((10, 10), 4.0, dtype)]
    unscaled, found_inf = call(unscale_and_check, mode, grads, jnp.float32(4.0))
    assert not bool(found_inf)
    for g in unscaled:
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.ones((10, 10), np.float32))
    grads[1] = grads[1].at[2, 2].set(jnp.inf)
    _, found_inf = call(unscale_and_check, mode, grads, jnp.float32(4.0))
    assert bool(found_inf)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_each_non_finite_kind_is_found(mode, bad):
    grads = {"a": jnp.ones(5, jnp.float16), "b": jnp.array([1.0, bad, 3.0], jnp.float32)}
    unscaled, found_inf = call(unscale_and_check, mode, grads, jnp.float32(2.0))
    assert bool(found_inf)
    # unscaled values are still returned, as PyTorch unscales in place regardless
    np.testing.assert_array_equal(
        np.asarray(unscaled["b"]), np.array([0.5, bad / 2, 1.5], np.float32)
    )


def test_check_is_on_scaled_values_so_overflow_after_unscaling_is_not_found(torch_reference):
    # scale < 1 makes inv_scale > 1: a finite float16 value can overflow when unscaled.
    # PyTorch checks the scaled values, reports no inf, and returns inf. So does jaxscale.
    grads = [np.array([60000.0, 1.0], np.float16)]
    unscaled, found_inf = unscale_and_check([jnp.asarray(grads[0])], jnp.float32(0.5))
    expected, expected_found = torch_reference.unscale(grads, np.float32(0.5))
    assert bool(found_inf) is expected_found is False
    np.testing.assert_array_equal(np.asarray(unscaled[0]), expected[0])
    assert np.isinf(np.asarray(unscaled[0])[0])


@pytest.mark.parametrize("mode", MODES)
def test_non_floating_leaves_and_none_pass_through(mode):
    int_grad = jax.grad(lambda x, n: x * 2.0, argnums=(0, 1), allow_int=True)(1.0, 3)[1]
    assert int_grad.dtype == jax.dtypes.float0
    grads = {"f": jnp.full(3, 8.0), "i": jnp.arange(3), "b": jnp.array([True]), "none": None}
    unscaled, found_inf = call(unscale_and_check, mode, grads, jnp.float32(4.0))
    assert unscaled["none"] is None
    np.testing.assert_array_equal(unscaled["i"], np.arange(3))
    np.testing.assert_array_equal(unscaled["b"], [True])
    np.testing.assert_array_equal(unscaled["f"], np.full(3, 2.0, np.float32))
    assert not bool(found_inf)
    unscaled, _ = unscale_and_check({"n": int_grad}, jnp.float32(4.0))  # float0 passes eagerly
    assert unscaled["n"].dtype == jax.dtypes.float0


@pytest.mark.parametrize("mode", MODES)
def test_empty_tree_is_all_finite(mode):
    for tree in [{}, [], (), None]:
        unscaled, found_inf = call(unscale_and_check, mode, tree, jnp.float32(4.0))
        assert unscaled == tree
        assert not bool(found_inf)
        assert bool(all_finite(tree))


def test_float64_leaves_compute_in_float64(torch_reference):
    with jax.enable_x64(True):
        g = np.array([3.0, 1e300, np.nextafter(1.0, 2.0)], np.float64)
        unscaled, found_inf = unscale_and_check([jnp.asarray(g)], jnp.float32(3.0))
        expected, expected_found = torch_reference.unscale([g], np.float32(3.0))
        assert unscaled[0].dtype == jnp.float64
        assert not bool(found_inf)
        assert not expected_found
        np.testing.assert_array_equal(np.asarray(unscaled[0]), expected[0])


def test_complex_leaves_are_rejected_naming_the_leaf():
    with pytest.raises(
        TypeError, match=r"leaf \['w'\]: complex arrays are not supported, got dtype complex64"
    ):
        unscale_and_check({"w": jnp.ones(2, jnp.complex64)}, jnp.float32(2.0))


def test_non_array_leaves_are_rejected_naming_the_leaf():
    with pytest.raises(TypeError, match=r"leaf \[1\]: expected an array, got str 'x'"):
        all_finite([jnp.ones(2), "x"])


def test_inverse_scale_equals_pytorch_double_reciprocal(torch_reference):
    rng = np.random.default_rng(0)
    # every normal float32 up to 2**126 (beyond it the reciprocal is a subnormal)
    scales = rng.integers(0x00800000, 0x7E800000, 200_000, dtype=np.uint32).view(np.float32)
    got = np.asarray(jax.jit(jax.vmap(inverse_scale))(jnp.asarray(scales)))
    expected = (1.0 / scales.astype(np.float64)).astype(np.float32)
    assert (got.view(np.uint32) == expected.view(np.uint32)).all()
    for scale in scales[:20]:
        assert inverse_scale(jnp.float32(scale)) == torch_reference.inverse_scale(scale)


def test_the_gpu_reciprocal_equals_pytorch_double_reciprocal(torch_reference):
    # What inverse_scale computes off the CPU, where XLA's float32 division is not
    # correctly rounded: integer long division, run here so the CPU suite checks it.
    rng = np.random.default_rng(1)
    scales = rng.integers(0x00800000, 0x7E800000, 200_000, dtype=np.uint32).view(np.float32)
    edges = [1.0, 3.0, 0.1, 2.0**-126, 1.5 * 2.0**-126, 2.0**125, 2.0**126, 1.9999999, 65536.0]
    scales = np.concatenate([scales, np.asarray(edges, np.float32)])
    scales = np.concatenate([scales, np.nextafter(scales, np.float32(np.inf))])
    expected = (1.0 / scales.astype(np.float64)).astype(np.float32)
    scales, expected = scales[expected >= 2.0**-126], expected[expected >= 2.0**-126]  # normal
    got = np.asarray(jax.jit(correctly_rounded_reciprocal)(jnp.asarray(scales)))
    assert (got.view(np.uint32) == expected.view(np.uint32)).all()
    assert correctly_rounded_reciprocal(jnp.float32(3.0)) == torch_reference.inverse_scale(3.0)


def _pytorch_reciprocal_bits(torch_reference, scales: np.ndarray) -> np.ndarray:
    return torch_reference.inverse_scale(scales).view(np.uint32)


def _reciprocals_checked_against_pytorch(torch_reference, patterns: np.ndarray) -> np.ndarray:
    """The GPU reciprocal of the float32 scales with these bit ``patterns``, asserted
    bit for bit against PyTorch's double reciprocal; returned for further checks."""
    scales = patterns.view(np.float32)
    got = np.asarray(jax.jit(correctly_rounded_reciprocal)(jnp.asarray(scales)))
    np.testing.assert_array_equal(
        got.view(np.uint32), _pytorch_reciprocal_bits(torch_reference, scales)
    )
    return got


def test_the_gpu_reciprocal_rounds_a_subnormal_result_once_as_pytorch(torch_reference):
    # Scales from 2**126 up have subnormal reciprocals. A GPU's float32 division is
    # off by an ulp there too, and may flush them; PyTorch's double reciprocal keeps
    # and rounds them. Random patterns of the binades above 2**126, and each binade's
    # edges.
    rng = np.random.default_rng(2)
    patterns = np.concatenate([
        rng.integers(0x7E800000, 0x7F800000, 200_000, dtype=np.uint32),
        np.uint32([0x7E800000, 0x7E800001, 0x7EFFFFFF, 0x7F000000, 0x7F000001, 0x7F7FFFFF]),
    ])  # fmt: skip
    got = _reciprocals_checked_against_pytorch(torch_reference, patterns)
    # 1/(1.5 * 2**126) lies between two subnormals; 1/2**127 is one exactly
    assert got[-2] == np.float32(2.0**-127)
    bits = np.asarray(correctly_rounded_reciprocal(jnp.float32(1.5 * 2.0**126))).view(np.uint32)
    assert 0 < bits < 0x800000  # subnormal (compared as bits: XLA's CPU flushes them)


def test_the_gpu_reciprocal_of_a_subnormal_scale_is_pytorchs(torch_reference):
    # A scale halved ~150 times from 65536 is subnormal: its reciprocal is a large normal
    # float (rounded like any other) or, below 2**-128, inf.
    patterns = np.concatenate([
        np.arange(1, 1 << 16, dtype=np.uint32),
        np.random.default_rng(3).integers(1, 0x800000, 100_000, dtype=np.uint32),
        np.uint32([0x200000, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF]),
    ])  # fmt: skip
    got = _reciprocals_checked_against_pytorch(torch_reference, patterns)
    assert np.isinf(got[:1000]).all()
    assert np.isfinite(got[-1])


@pytest.mark.parametrize("error", [1, 2, 3, 40])
def test_the_gpu_reciprocal_corrects_a_float_division_off_by_a_few_ulps(
    monkeypatch, error, torch_reference
):
    # XLA's float32 division is correctly rounded on the CPU, so the corrections are
    # exercised here by a division whose estimate of the quotient is off by up to
    # `error` ulps either way, as a GPU's can be by one or two, and whose estimate of
    # the remainder's ratio to the divisor (rounded to the steps from the estimate to
    # the quotient) is off by up to 0.45, which makes it round the wrong way
    def off(numerator, denominator):
        exact = numerator / denominator
        pattern = lax.bitcast_convert_type(denominator, jnp.uint32)
        whole = (pattern % (2 * error + 1)).astype(jnp.float32) - error
        fraction = jnp.where(pattern % 2 == 0, 0.45, -0.45)
        return exact + jnp.where(jnp.abs(exact) > 2.0**22, whole, fraction)

    monkeypatch.setattr(_scaling, "_float_quotient", off)
    rng = np.random.default_rng(error)
    patterns = np.concatenate([
        rng.integers(1, 0x7F800000, 200_000, dtype=np.uint32),
        rng.integers(0x7E800000, 0x7F800000, 20_000, dtype=np.uint32),
        np.uint32([0x3F800000, 0x3F800001, 0x3FFFFFFF, 0x7F7FFFFF, 0x00000001, 0x00800000]),
    ])  # fmt: skip
    _reciprocals_checked_against_pytorch(torch_reference, patterns)


def test_the_reciprocal_off_the_cpu_is_the_exact_one_in_a_kernel_of_its_own(torch_reference):
    scales = np.float32([65536.0, 3.0, 0.1, 1.5 * 2.0**126, 1e-45, 0.0, np.inf, np.nan])
    got = np.asarray(jax.jit(_scaling._reciprocal_off_the_cpu)(jnp.asarray(scales[0])))
    assert got == np.float32(2.0**-16)
    for scale in scales[:-1]:
        got = np.asarray(jax.jit(_scaling._reciprocal_off_the_cpu)(jnp.float32(scale)))
        np.testing.assert_array_equal(
            got.view(np.uint32), _pytorch_reciprocal_bits(torch_reference, scale[None])[0]
        )
    # a NaN stays a NaN, with the platform's bits: a GPU's max gives CUDA's canonical
    # NaN, 0x7FFFFFFF, where the CPU keeps 0x7FC00000
    assert np.isnan(jax.jit(_scaling._reciprocal_off_the_cpu)(jnp.float32(np.nan)))
    hlo = jax.jit(_scaling._reciprocal_off_the_cpu).lower(jnp.float32(3.0)).as_text()
    assert "stablehlo.reduce" in hlo


def test_the_gpu_reciprocal_of_zero_inf_and_nan(torch_reference):
    scales = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -2.0, -1.5 * 2.0**126])
    _reciprocals_checked_against_pytorch(torch_reference, scales.view(np.uint32))


@pytest.mark.parametrize("mode", MODES)
def test_scale_outputs_keeps_structure_and_dtypes(mode):
    outputs = {
        "loss": jnp.float32(0.25),
        "aux": [jnp.array([1.0, 2.0], jnp.bfloat16), (jnp.float16(3.0),)],
    }
    scaled = call(scale_outputs, mode, outputs, jnp.float32(1024.0))
    assert jax.tree.structure(scaled) == jax.tree.structure(outputs)
    assert float(scaled["loss"]) == 256.0
    assert scaled["aux"][0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(scaled["aux"][0], np.float32), [1024.0, 2048.0])
    assert scaled["aux"][1][0].dtype == jnp.float16
    assert float(scaled["aux"][1][0]) == 3072.0


def test_scale_outputs_rounds_once_from_float32():
    # A scale float16 cannot hold: multiplying in float32 and rounding once gives 28.11;
    # rounding the scale to float16 first would give 28.1.
    scaled = scale_outputs(jnp.float16(81.56), jnp.float32(0.34457194805145264))
    assert scaled.dtype == jnp.float16
    assert float(scaled) == float(np.float16(28.11))
    assert float(scaled) != float(np.float16(81.56) * np.float16(0.34457194805145264))


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (jnp.arange(3), r"can only scale floating arrays, got dtype int32 at <root>"),
        ({"loss": 1.0}, r"can only scale floating arrays, got float at \['loss'\]"),
        (["loss"], r"can only scale floating arrays, got str at \[0\]"),
    ],
)
def test_scale_outputs_rejects_non_floating(outputs, message):
    with pytest.raises(TypeError, match=message):
        scale_outputs(outputs, jnp.float32(2.0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize(
    "size", [2**17, 3 * 7 * 10_000, 131094, 131101], ids=["2**17", "210000", "131094", "prime"]
)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_large_leaves_are_checked_at_every_position(size, bad, dtype):
    # On CPU a large leaf's neighbouring elements are and-ed in groups of 8 (of 6 for
    # 131094, which 8 and 7 do not divide) before the reduction; a prime size is
    # checked element by element. Every lane of the first and the last groups, and
    # the middle.
    leaf = jnp.asarray(np.random.default_rng(size).normal(size=size), dtype)
    check = jax.jit(all_finite)
    assert bool(check({"w": leaf}))
    for position in [*range(16), size // 2, *range(size - 16, size)]:
        assert not bool(check({"w": leaf.at[position].set(bad)})), position


def _mixed_tree(count: int) -> dict:
    """``count`` leaves of one shape, beside leaves of other shapes and dtypes."""
    rng = np.random.default_rng(count)
    same = {
        f"layer{i:02d}": jnp.asarray(rng.normal(size=(64, 33)), jnp.float32) for i in range(count)
    }
    return {
        **same,
        "bias": jnp.ones(33, jnp.float16),
        "other": jnp.ones((64, 33), jnp.bfloat16),
        "scalar": jnp.float32(2.0),
        "large": jnp.ones(2**17, jnp.float32),
    }


@pytest.fixture
def one_cpu_device(monkeypatch):
    """The CPU check as a single-device process runs it: leaves of one shape grouped."""
    monkeypatch.setattr(_scaling, "_one_cpu_device", lambda: True)


@pytest.mark.parametrize("count", [1, 2, 8, 9, 17])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_leaves_checked_together_are_each_checked(one_cpu_device, count, bad):
    tree = _mixed_tree(count)
    check = jax.jit(all_finite)
    assert bool(check(tree))
    for name, leaf in tree.items():
        for index in {(0,) * leaf.ndim, tuple(n - 1 for n in leaf.shape)}:
            poisoned = {**tree, name: leaf.at[index].set(bad)}
            assert not bool(check(poisoned)), (name, index)


def test_leaves_of_one_shape_are_reduced_together_without_reduce_windows(one_cpu_device):
    # XLA's CPU backend splits a reduction of one operand into two reduce-window
    # kernels and a reduce (three kernels to compile per leaf); a reduction of
    # several operands is left whole. 16 leaves of one shape: two reductions of 8
    # leaves, each of two operands holding the integer maxima of four.
    cpu = machine.cpu_device()  # the CPU's program, whatever the default backend
    tree = {f"layer{i:02d}": jax.device_put(jnp.ones((64, 33)), cpu) for i in range(16)}
    text = jax.jit(all_finite).lower(tree).compile().as_text()
    assert text.count("reduce-window(") == 0
    assert re.findall(r"= (\([^)]*\)) reduce\(", text) == ["(s32[], s32[])"] * 2


# Per dtype: the largest finite value, the smallest subnormal and -0.0 (finite),
# and +inf, -inf and a NaN with a payload (not), in the grouped CPU check.
_EDGES = {
    jnp.float16: ([65504.0, -65504.0, 2.0**-24, -0.0], ["inf", "-inf", 0x7E01]),
    jnp.bfloat16: ([3.3895314e38, -3.3895314e38, 2.0**-133, -0.0], ["inf", "-inf", 0x7FC1]),
    jnp.float32: ([3.4028235e38, -3.4028235e38, 2.0**-149, -0.0], ["inf", "-inf", 0x7FC00001]),
}


def _nonfinite(dtype, value):
    if isinstance(value, str):
        return jnp.asarray(float(value), dtype)
    bits = jnp.int16 if jnp.dtype(dtype).itemsize == 2 else jnp.int32
    return jax.lax.bitcast_convert_type(jnp.asarray(value, bits), dtype)


@pytest.mark.parametrize("dtype", list(_EDGES), ids=lambda d: jnp.dtype(d).name)
def test_grouped_check_reads_each_dtype_at_its_edges(one_cpu_device, dtype):
    # The grouped check compares each value's magnitude bits with those of +inf:
    # the largest finite value is just below, every NaN above.
    finite, nonfinite = _EDGES[dtype]
    tree = {f"w{i}": jnp.ones((3, 5), dtype) for i in range(11)}
    check = jax.jit(all_finite)
    for value in finite:
        assert bool(check({**tree, "w3": tree["w3"].at[1, 2].set(value)})), value
    for value in nonfinite:
        for name in ("w0", "w7", "w10"):
            poisoned = {**tree, name: tree[name].at[2, 4].set(_nonfinite(dtype, value))}
            assert not bool(check(poisoned)), (value, name)


def test_grouped_check_of_float64_leaves(one_cpu_device):
    with jax.enable_x64(True):
        tree = {f"w{i}": jnp.ones(7, jnp.float64) for i in range(9)}
        check = jax.jit(all_finite)
        assert bool(check({**tree, "w4": tree["w4"].at[6].set(np.finfo(np.float64).max)}))
        assert bool(check({**tree, "w4": tree["w4"].at[6].set(5e-324)}))
        for bad in (np.inf, -np.inf, np.nan):
            assert not bool(check({**tree, "w8": tree["w8"].at[0].set(bad)})), bad


def test_grouped_check_of_float8_leaves_that_write_nan_as_negative_zero(one_cpu_device):
    # float8_e4m3fnuz has no -0.0: its bits are NaN, of magnitude zero. Such
    # formats are checked by their isfinite flags, in a tree with float32 leaves.
    dtype = jnp.float8_e4m3fnuz
    tree = {f"f8_{i}": jnp.ones((2, 3), dtype) for i in range(10)}
    tree |= {f"w{i}": jnp.ones(4, jnp.float32) for i in range(3)}
    check = jax.jit(all_finite)
    assert bool(check(tree))
    nan = jax.lax.bitcast_convert_type(jnp.uint8(0x80), dtype)
    for name in ("f8_0", "f8_9"):
        assert not bool(check({**tree, name: tree[name].at[1, 1].set(nan)})), name
    assert not bool(check({**tree, "w2": tree["w2"].at[3].set(np.inf)}))


def _chunky_tree() -> dict:
    """Leaves in chunks of every size from 8 down to 1 (shapes that repeat 8, 13, 3, 5,
    2 and 1 times), large leaves that other reductions pass their flags to, an empty
    leaf and scalars."""
    rng = np.random.default_rng(0)
    counts = {(4, 5): 8, (7,): 13, (3, 3): 3, (2, 6): 5, (9,): 2, (1,): 1, (): 2}
    tree = {
        f"{'x'.join(map(str, shape)) or 'scalar'}_{i}": jnp.asarray(
            rng.normal(size=shape), jnp.float32
        )
        for shape, count in counts.items()
        for i in range(count)
    }
    tree |= {f"large{i}": jnp.ones((2**17 + 8 * i,), jnp.float32) for i in range(3)}
    tree |= {f"single{i}": jnp.ones((10 + i,), jnp.float32) for i in range(6)}
    return tree | {"empty": jnp.ones((0, 3)), "half": jnp.ones((4, 5), jnp.float16)}


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_every_leaf_checked_in_a_tree_of_reductions_reaches_the_verdict(one_cpu_device, bad):
    # Each reduction takes the verdicts of two others into what it reduces
    # (reductions of one leaf to eight); a leaf whose verdict were dropped on the
    # way to the root would go unchecked.
    tree = _chunky_tree()
    check = jax.jit(all_finite)
    assert bool(check(tree))
    for name, leaf in tree.items():
        if leaf.size:
            last = tuple(n - 1 for n in leaf.shape)
            poisoned = {**tree, name: leaf.at[last].set(bad)}
            assert not bool(check(poisoned)), name
    assert bool(check({"empty": jnp.ones((0,))}))


def _widest_operation(tree: dict) -> int:
    """The most operands any operation of ``all_finite``'s compiled CPU program reads."""
    cpu = machine.cpu_device()
    text = jax.jit(all_finite).lower(jax.device_put(tree, cpu)).compile().as_text()
    entry = re.sub(r"/\*index=\d+\*/", "", text[text.index("ENTRY") :])
    return max(
        len(re.findall(r"%[\w.-]+", operands))
        for operands in re.findall(r"= [^=]*? [a-z-]+\(([^)]*)\)", entry)
    )


def test_the_checks_of_many_leaves_meet_in_a_tree_not_in_one_fusion(one_cpu_device):
    # One flag per leaf and-ed at the end would be one fusion with a parameter per
    # leaf, which XLA's CPU backend compiles in time growing faster than the number of
    # leaves (1.8 s at 1,000). In a tree of reductions no operation reads more than
    # 12 values (eight leaves and four verdicts), whatever the number of leaves.
    tree = {f"layer{i:03d}": jnp.ones((16, 16)) for i in range(200)}
    tree |= {f"bias{i:03d}": jnp.ones((16,)) for i in range(50)}
    tree |= {f"large{i}": jnp.ones(2**17) for i in range(20)}
    assert _widest_operation(tree) <= 12


def test_a_single_device_process_groups_its_checks():
    # The grouping is decided by the number of CPU devices: this suite runs with 8
    # simulated ones, so the default is tried in a process of its own.
    code = (
        "import jax, jax.numpy as jnp; from jaxscale import all_finite; "
        "tree = [jax.device_put(jnp.ones((100, 100)), jax.devices('cpu')[0]) for _ in range(8)]; "
        "text = jax.jit(all_finite).lower(tree).compile().as_text(); "
        "print(len(jax.devices('cpu')), text.count('reduce-window('), bool(all_finite(tree)))"
    )
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.stdout.split() == ["1", "0", "True"], result.stderr


def test_a_process_without_the_cpu_backend_checks_leaf_by_leaf(monkeypatch):
    # With JAX_PLATFORMS=cuda JAX loads no CPU backend and answers a question about
    # CPU devices with a RuntimeError; the check must not ask it an unguarded one.
    real_devices = jax.devices

    def devices_without_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return real_devices(backend)

    monkeypatch.setattr(jax, "devices", devices_without_cpu)
    assert _scaling._one_cpu_device() is False  # the check that is right for any sharding
    tree = {f"layer{i}": jnp.ones((64, 33)) for i in range(4)}
    check = jax.jit(all_finite)
    assert bool(check(tree))
    assert not bool(check({**tree, "layer2": tree["layer2"].at[5, 7].set(np.nan)}))


@pytest.mark.parametrize("shape", [(3, 128, 64), (128, 129), (64, 2048)])
def test_large_leaves_of_any_shape_are_checked(shape):
    leaf = jnp.ones(shape, jnp.float32)
    assert bool(jax.jit(all_finite)({"w": leaf}))
    last = tuple(n - 1 for n in shape)
    for index in [(0,) * len(shape), tuple(n // 2 for n in shape), last]:
        assert not bool(jax.jit(all_finite)({"w": leaf.at[index].set(np.nan)})), index


def test_leaves_of_one_shape_sharded_differently_are_not_gathered():
    # Several devices: each leaf is checked on its own, where it lies (a reduction of
    # several operands would first give them one sharding).
    mesh = Mesh(np.array(machine.devices(8)).reshape(2, 4), ("a", "b"))
    specs = {"rows": P("a"), "columns": P(None, "b"), "both": P("b", "a")}
    tree = {
        k: jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, s)) for k, s in specs.items()
    }
    text = jax.jit(all_finite).lower(tree).compile().as_text()
    assert re.findall(r"= \S+ (all-gather|all-to-all|collective-permute)", text) == []
    assert not bool(jax.jit(all_finite)({**tree, "both": tree["both"].at[3, 7].set(np.nan)}))


@pytest.mark.parametrize("spec", [P("a"), P(None, "b"), P("a", "b"), P("b", None)], ids=str)
def test_a_sharded_leaf_is_checked_where_it_lies(spec):
    # The check folds neighbours along the last axis, so each device folds its own
    # block: the only collective is the all-reduce of the verdict.
    mesh = Mesh(np.array(machine.devices(8)).reshape(2, 4), ("a", "b"))
    leaf = jax.device_put(jnp.ones((256, 2048)), NamedSharding(mesh, spec))
    text = jax.jit(all_finite).lower({"w": leaf}).compile().as_text()
    assert re.findall(r"= \S+ (all-gather|all-to-all|collective-permute)", text) == []
    assert bool(jax.jit(all_finite)({"w": leaf}))
    poisoned = jax.device_put(leaf.at[255, 2047].set(np.inf), NamedSharding(mesh, spec))
    assert not bool(jax.jit(all_finite)({"w": poisoned}))


def test_large_finite_values_are_not_mistaken_for_overflow():
    leaf = jnp.full(2**15, np.finfo(np.float32).max, jnp.float32)
    assert bool(jax.jit(all_finite)(leaf))
    assert bool(jax.jit(all_finite)(-leaf))
