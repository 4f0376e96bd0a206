"""MX weights all-gathered as MX (``MXRecipe(all_gather_in_mx=True)``): what a sharded
step's collectives carry, and that the sharded step computes what one device does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import machine

import jaxscale
from jaxscale.casting import MXRecipe

BF16 = jnp.bfloat16
MX = MXRecipe("mxfp8", all_gather_in_mx=True)
MX_HP = MXRecipe("mxfp8_wgrad_with_hp", wgrad_with_hp=True, all_gather_in_mx=True)

# One process (XLA's dump flags are read when it starts) compiles an FSDP step for every
# case and reads each one's collectives from the HLO after SPMD partitioning, before
# XLA:CPU widens float8 collectives to float16 (a GPU does not).
_CENSUS = """
import json, os, pathlib, re, sys, tempfile
root = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count=8 --xla_dump_to={root} "
    "--xla_dump_hlo_pass_re=spmd-partitioning " + sys.argv[1]
)
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxscale
from jaxscale.casting import MXRecipe

mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
FLOAT8 = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
MX = MXRecipe("mxfp8", all_gather_in_mx=True)
MX_HP = MXRecipe("mxfp8_wgrad_with_hp", wgrad_with_hp=True, all_gather_in_mx=True)
ROWS, COLUMNS, CUT = (512, 256, 0), (512, 256, 1), (512, 128, 1)
CASES = [
    *[(name, name, layout) for name in FLOAT8 for layout in (ROWS, COLUMNS)],
    ("mxfp8", "mxfp8", ROWS),
    *[(name, recipe, layout) for name, recipe in [("mxfp8 in mx", MX),
      ("mxfp8_wgrad_with_hp in mx", MX_HP)] for layout in (ROWS, COLUMNS)],
    ("mxfp8 in mx", MX, CUT),
]
PATTERN = re.compile(
    r"= (\\w+)\\[([0-9,]*)\\]\\{[0-9,]*\\} "
    r"(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)\\("
)

def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w.T).astype(jnp.float32))

found = {}
for name, recipe, (n, k, axis) in CASES:
    spec = P("fsdp") if axis == 0 else P(None, "fsdp")
    w = jax.device_put(jnp.ones((n, k)), NamedSharding(mesh, spec))
    x = jax.device_put(jnp.ones((64, k)), NamedSharding(mesh, P("fsdp")))
    step = jax.jit(jax.grad(
        jaxscale.autocast(loss, dtype=jnp.bfloat16, float8=recipe), argnums=(0, 1)
    ))
    before = set(pathlib.Path(root).glob("*after_spmd-partitioning*"))
    step.lower(w, x).compile()
    texts = [p.read_text() for p in set(pathlib.Path(root).glob("*after_spmd-partitioning*"))
             - before]
    found[f"{name} {n}x{k} axis {axis}"] = sorted(
        [m.group(3), m.group(1), [int(d) for d in m.group(2).split(",") if d]]
        for text in texts for m in PATTERN.finditer(text)
    )
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def collectives():
    """For each recipe and FSDP layout (a (N, K) weight sharded along axis 0 or 1 over
    8 devices, the batch sharded too): each collective of the step as ``[kind, dtype,
    shape]``, compiled for inspection only: it never runs."""
    return machine.census(_CENSUS)


def gathers(found, case):
    return [(dtype, shape) for kind, dtype, shape in found[case] if kind == "all-gather"]


FLOAT8 = {"f8e4m3fn", "f8e5m2"}
LAYOUTS = ["512x256 axis 0", "512x256 axis 1"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_recipe_gathers_operands_in_float8(collectives, layout):
    # XLA gathers whichever operand is cheaper to move (here the activations, for some
    # recipes and layouts); under every recipe what it moves is float8, scales aside
    for recipe in ["tensorwise", "rowwise"]:
        large = {dtype for dtype, shape in gathers(collectives, f"{recipe} {layout}")
                 if np.prod(shape) > 1024}  # fmt: skip
        assert large, recipe
        assert large <= FLOAT8, recipe
    # with a high-precision weight gradient, the activations it reads are gathered so
    large = [(dtype, shape) for dtype, shape in gathers(collectives, f"rowwise_with_gw_hp {layout}")
             if np.prod(shape) > 1024]  # fmt: skip
    assert {dtype for dtype, _ in large} <= FLOAT8 | {"bf16"}
    assert {dtype for dtype, _ in large} & FLOAT8
    for recipe in ["mxfp8 in mx", "mxfp8_wgrad_with_hp in mx"]:
        # the whole weight twice, as torchao quantizes it: blocked along K for the
        # forward matmul and along N for the input gradient's; data and scales each time
        assert sorted(gathers(collectives, f"{recipe} {layout}")) == [
            ("f8e4m3fn", [256, 512]), ("f8e4m3fn", [256, 512]),
            ("f8e8m0fnu", [8, 512]), ("f8e8m0fnu", [256, 16]),
        ], recipe  # fmt: skip


def test_without_the_option_mx_gathers_dequantized_values(collectives):
    assert {dtype for dtype, _ in gathers(collectives, "mxfp8 512x256 axis 0")} == {"bf16"}


def test_a_gather_in_mx_moves_about_half_of_bfloat16s_bytes(collectives):
    sizes = {"bf16": 2, "f8e4m3fn": 1, "f8e8m0fnu": 1}
    moved = {tuple(shape): sizes[dtype] * int(np.prod(shape))
             for dtype, shape in gathers(collectives, "mxfp8 in mx 512x256 axis 0")}  # fmt: skip
    forward = moved[(256, 512)] + moved[(8, 512)]  # the weight blocked along K, and its scales
    assert forward / (2 * 512 * 256) == pytest.approx((1 + 1 / 32) / 2)  # 0.516


def test_a_shard_boundary_inside_a_block_moves_only_each_blocks_maximum(collectives):
    # K = 128 over 8 devices: 16 elements a shard, half of a 32-block. Each device
    # reduces its part; an all-reduce of one float32 per block and row gives the block's
    # maximum (and one flag for its non-finite values); the high-precision weight never
    # moves, and the gathers still carry float8 data and scales.
    found = collectives["mxfp8 in mx 512x128 axis 1"]
    assert {dtype for kind, dtype, _ in found if kind == "all-gather"} == {
        "f8e4m3fn", "f8e8m0fnu"
    }  # fmt: skip
    reduced = [(dtype, shape) for kind, dtype, shape in found if kind == "all-reduce"]
    assert ("f32", [128, 1]) in reduced  # the forward's blocks along K: one per row
    large = [shape for dtype, shape in reduced if np.prod(shape) > 512]
    assert large == [[128, 512]]  # only the weight gradient's sum over the sharded batch


def fsdp_loss(w, x):
    return jnp.sum(jnp.tanh(x @ w.T).astype(jnp.float32))


def sharded_and_alone(recipe, n, k, axis):
    """The layer's output and both gradients, with the weight sharded along ``axis`` and
    the batch over 8 devices, and on one device."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    w = jax.random.normal(jax.random.key(0), (n, k))
    x = jax.random.normal(jax.random.key(1), (64, k))

    def layer(w, x):
        out = x @ w.T
        return jnp.sum(jnp.tanh(out).astype(jnp.float32)), out

    step = jax.jit(jax.grad(
        jaxscale.autocast(layer, dtype=BF16, float8=recipe), argnums=(0, 1), has_aux=True
    ))  # fmt: skip
    spec = P("fsdp") if axis == 0 else P(None, "fsdp")
    sharded = (
        jax.device_put(w, NamedSharding(mesh, spec)),
        jax.device_put(x, NamedSharding(mesh, P("fsdp"))),
    )
    return step(*sharded), step(*jax.device_put((w, x), jax.devices()[0]))


@pytest.mark.parametrize(
    ("recipe", "n", "k", "axis"),
    [(MX, 512, 256, 0), (MX, 512, 128, 1), (MX_HP, 512, 256, 1)],
    ids=["mxfp8-rows", "mxfp8-columns-cutting-blocks", "mxfp8_wgrad_with_hp-columns"],
)
def test_the_sharded_step_computes_what_one_device_does(recipe, n, k, axis):
    ((grad_w, grad_x), out), ((grad_w_1, grad_x_1), out_1) = sharded_and_alone(recipe, n, k, axis)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_1))
    np.testing.assert_array_equal(np.asarray(grad_x), np.asarray(grad_x_1))
    # The weight gradient sums over the batch, which the devices split: each device's
    # partial sum is rounded to bfloat16 before they are added, as in any data-parallel
    # step, so it differs from one device's single sum by rounding
    scale = np.max(np.abs(np.asarray(grad_w_1, np.float32)))
    np.testing.assert_allclose(
        np.asarray(grad_w, np.float32), np.asarray(grad_w_1, np.float32), atol=0.01 * scale
    )


def test_on_one_device_the_option_changes_nothing():
    w = jax.random.normal(jax.random.key(0), (96, 64))
    x = jax.random.normal(jax.random.key(1), (32, 64))
    results = []
    for recipe in ("mxfp8", MX):
        step = jax.jit(jax.value_and_grad(
            jaxscale.autocast(fsdp_loss, dtype=BF16, float8=recipe), argnums=(0, 1)
        ))  # fmt: skip
        results.append(jax.tree.leaves(step(w, x)))
    for plain, gathered in zip(*results, strict=True):
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(gathered))
    # a one-device program is the plain dequantization, which jax.export serializes
    exported = jax.export.export(
        jax.jit(jaxscale.autocast(fsdp_loss, dtype=BF16, float8=MX)), platforms=["cuda"]
    )(jax.ShapeDtypeStruct(w.shape, w.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert "CustomSPMDPartitioning" not in exported.mlir_module()


def test_under_vmap_the_weight_is_dequantized_as_without_the_option():
    w = jax.random.normal(jax.random.key(0), (3, 96, 64))
    x = jax.random.normal(jax.random.key(1), (3, 32, 64))

    def batched(recipe):
        layer = jaxscale.autocast(lambda w, x: x @ w.T, dtype=BF16, float8=recipe)
        grads = jax.grad(jaxscale.autocast(fsdp_loss, dtype=BF16, float8=recipe), argnums=(0, 1))
        return jax.vmap(layer)(w, x), jax.vmap(grads)(w, x)

    for plain, gathered in zip(
        jax.tree.leaves(batched("mxfp8")), jax.tree.leaves(batched(MX)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(gathered))


def test_a_program_without_a_mesh_is_told_what_to_shard_with():
    from jaxscale.casting._mx_gather import _replicated

    # the mesh XLA's partitioner reports when the program's inputs name none
    no_mesh = jax.sharding.Mesh(np.empty((0,), object), ("devices",))
    with pytest.raises(ValueError, match=r"shard its inputs with jax\.sharding\.NamedSharding"):
        _replicated(no_mesh)
