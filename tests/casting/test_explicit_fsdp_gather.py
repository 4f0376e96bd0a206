"""A weight that a program on explicit mesh axes gathers itself, ``reshard(w, P())`` (FSDP
as JAX's explicit sharding writes it), moves as float8 under the float8 recipes and as
MX under ``MXRecipe(all_gather_in_mx=True)``: autocast quantizes the shards and gathers
the float8 data and scales, where the program's gather moved the weight in its dtype.
Without a recipe, the shards are cast to the autocast dtype and gathered in it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, reshard
from jax.sharding import PartitionSpec as P
from support import machine

import jaxscale
from jaxscale.casting import MXRecipe

BF16 = jnp.bfloat16
MX = MXRecipe("mxfp8", all_gather_in_mx=True)
MX_HP = MXRecipe("mxfp8_wgrad_with_hp", wgrad_with_hp=True, all_gather_in_mx=True)
RECIPES = {
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_with_gw_hp": "rowwise_with_gw_hp",
    "mxfp8 in mx": MX,
    "mxfp8_wgrad_with_hp in mx": MX_HP,
}

# One process (XLA's dump flags are read when it starts) compiles each case's gradient
# step and reads its collectives from the HLO after SPMD partitioning, before XLA:CPU
# widens float8 collectives to float16 (a GPU does not). "behind a barrier": the
# program's own gather, which autocast cannot see through an optimization barrier.
_CENSUS = """
import json, os, pathlib, re, sys, tempfile
root = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count=8 --xla_dump_to={root} "
    "--xla_dump_hlo_pass_re=spmd-partitioning " + sys.argv[1]
)
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P, reshard
import jaxscale
from jaxscale.casting import MXRecipe

RECIPES = {
    "tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_with_gw_hp": "rowwise_with_gw_hp",
    "mxfp8 in mx": MXRecipe("mxfp8", all_gather_in_mx=True),
    "mxfp8_wgrad_with_hp in mx": MXRecipe(
        "mxfp8_wgrad_with_hp", wgrad_with_hp=True, all_gather_in_mx=True),
    "mxfp8": "mxfp8",
    "no recipe": None,
}
CASES = [(name, axis, "") for name in RECIPES for axis in (0, 1)]
CASES += [("rowwise", 0, "behind a barrier"), ("mxfp8 in mx", 0, "behind a barrier")]
CASES += [("rowwise", 0, "cast to bfloat16"), ("no recipe", 0, "behind a barrier")]
PATTERN = re.compile(
    r"= (\\w+)\\[([0-9,]*)\\]\\{[0-9,]*\\} "
    r"(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)\\("
)

mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
found = {}
with jax.set_mesh(mesh):
    for name, axis, variant in CASES:
        def loss(w, x):
            whole = reshard(w, P())
            if variant == "behind a barrier":
                whole = jax.lax.optimization_barrier(whole)
            if variant == "cast to bfloat16":
                whole, x = whole.astype(jnp.bfloat16), x.astype(jnp.bfloat16)
            return jnp.sum(jnp.tanh(x @ whole.T).astype(jnp.float32))

        w = jax.device_put(jnp.ones((512, 256)), P("fsdp") if axis == 0 else P(None, "fsdp"))
        x = jax.device_put(jnp.ones((64, 256)), P("fsdp"))
        step = jax.jit(jax.grad(
            jaxscale.autocast(loss, dtype=jnp.bfloat16, float8=RECIPES[name]), argnums=(0, 1)
        ))
        before = set(pathlib.Path(root).glob("*after_spmd-partitioning*"))
        step.lower(w, x).compile()
        texts = [p.read_text() for p in set(pathlib.Path(root).glob("*after_spmd-partitioning*"))
                 - before]
        found[f"{name} axis {axis} {variant}".strip()] = sorted(
            [m.group(3), m.group(1), [int(d) for d in m.group(2).split(",") if d]]
            for text in texts for m in PATTERN.finditer(text)
        )
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def collectives():
    """Each case's collectives as ``[kind, dtype, shape]``, compiled for inspection
    only: it never runs."""
    return machine.census(_CENSUS)


BYTES = {"f32": 4, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "u8": 1}


def gathered(found):
    """The all-gathers' ``(dtype, shape)`` and the bytes they move in all."""
    gathers = [(dtype, shape) for kind, dtype, shape in found if kind == "all-gather"]
    return gathers, sum(BYTES[dtype] * int(np.prod(shape)) for dtype, shape in gathers)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("name", list(RECIPES))
def test_a_weight_the_program_gathers_itself_moves_as_float8(collectives, name, axis):
    gathers, moved = gathered(collectives[f"{name} axis {axis}"])

    # Quantized where it lies, for the forward matmul and for the input gradient's (the
    # weight blocked or scaled along K, then along N): float8 data twice, and scales
    def elements(*dtypes):
        return sum(int(np.prod(shape)) for dtype, shape in gathers if dtype in dtypes)

    assert elements("f8e4m3fn") == 2 * 512 * 256, gathers
    if "mx" in name:  # one E8M0 scale per 32-block (gathered as its bits, or not)
        assert elements("f8e8m0fnu", "u8") == 2 * 512 * 256 // 32, gathers
        assert elements("f32", "bf16") == 0, gathers
    else:  # float32 scales, at most one per row of the weight in each quantization
        assert elements("f32") <= 2 * 512, gathers
        assert elements("bf16") == 0, gathers
    # where the program's own gather moved the float32 weight: 512 x 256 x 4 bytes
    assert moved <= 0.53 * 512 * 256 * 4, moved


@pytest.mark.parametrize("axis", [0, 1])
def test_without_a_recipe_the_weight_is_cast_where_it_lies_and_gathered_narrow(collectives, axis):
    # autocast's cast of the float32 weight to bfloat16 before the gather: half the
    # bytes (PyTorch FSDP's param_dtype), where the program's gather moved float32
    gathers, moved = gathered(collectives[f"no recipe axis {axis}"])
    assert [dtype for dtype, _ in gathers] == ["bf16"]
    assert moved == 512 * 256 * 2
    assert gathered(collectives["no recipe axis 0 behind a barrier"])[0] == [("f32", [512, 256])]


def test_a_weight_gathered_and_then_cast_is_cast_and_quantized_where_it_lies(collectives):
    gathers, _ = gathered(collectives["rowwise axis 0 cast to bfloat16"])
    assert sorted(shape for dtype, shape in gathers if dtype == "f8e4m3fn") == [
        [256, 512], [512, 256]
    ]  # fmt: skip
    assert {dtype for dtype, _ in gathers} == {"f8e4m3fn", "f32"}  # (the row scales)


def test_behind_a_barrier_the_programs_own_gather_moves_the_weight_in_its_dtype(collectives):
    for name in ["rowwise", "mxfp8 in mx"]:
        gathers, _ = gathered(collectives[f"{name} axis 0 behind a barrier"])
        assert gathers == [("f32", [512, 256])], name


def test_without_the_option_an_mx_recipe_leaves_the_programs_gather_as_it_is(collectives):
    # MX's blockwise quantization is not one XLA's partitioner moves a gather past: the
    # weight made whole as MX needs the option, and without it the program's gather stays
    for axis in (0, 1):
        gathers, _ = gathered(collectives[f"mxfp8 axis {axis}"])
        assert gathers == [("f32", [512, 256])]


def explicit_step(recipe, axis, barrier, tied=False):
    """The loss and both gradients of two layers whose weights the program gathers
    itself, on an explicit mesh of 8 devices, the weights sharded along ``axis`` and the
    batch along the same mesh axis. ``tied``: the second layer's gathered weight is also
    read outside a matmul (a penalty on it)."""
    mesh = machine.mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    spec = P("fsdp") if axis == 0 else P(None, "fsdp")
    host = [
        np.asarray(jax.random.normal(jax.random.key(i), shape)) / 16
        for i, shape in enumerate([(256, 128), (128, 256)])
    ]
    inputs = np.asarray(jax.random.normal(jax.random.key(9), (64, 128)))

    def loss(ws, x):
        h, penalty = x, 0.0
        for w in ws:
            whole = reshard(w, P())
            if barrier:
                whole = jax.lax.optimization_barrier(whole)
            h = jnp.tanh(h @ whole.T)
            if tied:
                penalty = jnp.sum(jnp.square(whole.astype(jnp.float32)))
        return jnp.sum(h.astype(jnp.float32)) + 1e-3 * penalty

    with jax.set_mesh(mesh):
        ws = [jax.device_put(w, spec) for w in host]
        x = jax.device_put(inputs, P("fsdp"))
        step = jax.jit(jax.value_and_grad(jaxscale.autocast(loss, dtype=BF16, float8=recipe)))
        value, grads = step(ws, x)
    return value, grads


@pytest.mark.parametrize(
    ("name", "tied"),
    [("rowwise", False), ("rowwise", True), ("mxfp8 in mx", False), (None, False)],
    ids=["rowwise", "rowwise, read outside the matmul too", "mxfp8 in mx", "no recipe"],
)
def test_the_step_computes_what_it_computed_with_the_programs_own_gather(name, tied):
    # the same values quantized in the same blocks, whole on every device before the
    # matmul: loss and gradients bit for bit, each gradient sharded as its weight
    for axis in (0, 1):
        recipe = RECIPES.get(name)
        value, grads = explicit_step(recipe, axis, barrier=False, tied=tied)
        expected_value, expected_grads = explicit_step(recipe, axis, barrier=True, tied=tied)
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected_value))
        for got, expected in zip(grads, expected_grads, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
            assert got.sharding.spec == expected.sharding.spec
            assert got.sharding.spec[axis] == "fsdp"


@pytest.mark.parametrize("name", ["mxfp8 in mx", "rowwise", None], ids=str)
def test_the_step_on_explicit_axes_exports_for_cuda(name):
    # the weight made whole by sharding constraints, not by a partitioning callback:
    # jax.export takes the program (on automatic axes it refuses MX's callback), and
    # what a GPU runs has no loop, conditional or callback
    mesh = machine.mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ reshard(w, P()).T).astype(jnp.float32))

    with jax.set_mesh(mesh):
        autocast = jaxscale.autocast(loss, dtype=BF16, float8=RECIPES.get(name))
        w = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=P("fsdp"))
        x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=P("fsdp"))
        module = jax.export.export(jax.jit(jax.grad(autocast)), platforms=["cuda"])(w, x)
        module = module.mlir_module()
    needed = {"mxfp8 in mx": ["f8E4M3FN", "f8E8M0FNU"], "rowwise": ["f8E4M3FN"], None: ["bf16"]}
    for dtype in needed[name]:
        assert dtype in module
    for absent in ["CustomSPMDPartitioning", "stablehlo.while", "stablehlo.case", "callback"]:
        assert absent not in module


def test_a_gathered_weight_widened_by_autocast_is_gathered_in_its_own_dtype():
    # only a narrowing cast moves before the gather: a bfloat16 weight that a float32
    # operation reads (softmax, under the bfloat16 policy) is gathered as bfloat16
    mesh = machine.mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))

    def penalty(w):
        return jnp.sum(jax.nn.log_softmax(reshard(w, P()), axis=-1))

    with jax.set_mesh(mesh):
        w = jax.ShapeDtypeStruct((512, 256), BF16, sharding=P("fsdp"))
        jaxpr = str(jax.make_jaxpr(jaxscale.autocast(penalty, dtype=BF16))(w))
    # the program's one gather, of the bfloat16 weight, and no float32 one
    resharded = re.findall(r"(\w+)\[([0-9@a-z,]*)\] = reshard", jaxpr)
    assert resharded == [("bf16", "512,256")]
