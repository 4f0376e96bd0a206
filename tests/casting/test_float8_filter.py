"""autocast(..., float8=recipe, float8_filter=keep): which matmuls run in the recipe.

A refused matmul runs as the autocast dtype says, its forward and both backward
matmuls together; the site a filter is told of names the matmul as each framework
names a layer; a scan over stacked layers is split where the filter's answer changes.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.model_training import matmul_dtypes

import jaxscale
from jaxscale.casting import MatmulSite, auto_filter, exclude_layers, exclude_names

BF16, F32 = jnp.bfloat16, jnp.float32
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(16, 32)), F32)


def float8_matmuls(fn, *args):
    """How many float8 matmuls ``jax.grad`` of ``fn``'s sum runs (forward and backward)."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a).astype(F32))))(*args)
    return sum(n for kinds, n in matmul_dtypes(jaxpr).items() if "float8" in kinds[0])


def recorded(fn, *args, **options):
    """The sites ``fn`` shows a filter that records them and refuses none."""
    sites: list[MatmulSite] = []

    def record(site):
        sites.append(site)
        return True

    jaxscale.autocast(fn, dtype=BF16, float8="rowwise", float8_filter=record, **options)(*args)
    return sites


# -- what a site names, in each framework --------------------------------------------------


def test_a_plain_function_names_its_weights_by_argument_path_and_its_scopes():
    params = {"body": jnp.ones((32, 32)), "lm_head": jnp.ones((32, 16))}

    def model(params, x):
        with jax.named_scope("block"):
            h = jnp.tanh(x @ params["body"])
        return h @ params["lm_head"]

    body, head = recorded(model, params, X)
    assert body.name_stack == "block"
    assert head.name_stack == ""
    assert body.weight == "[0]['body']"
    assert head.weight == "[0]['lm_head']"
    first = model.__code__.co_firstlineno
    assert body.source == f"tests/casting/test_float8_filter.py:{first + 2}"
    assert head.source == f"tests/casting/test_float8_filter.py:{first + 3}"
    assert body.shapes == ((16, 32), (32, 32))
    assert head.dims == (16, 32, 16)
    assert (body.index, head.index) == (0, 1)
    assert body.layer is None
    assert body.layers is None
    assert body.names == ("block", "0", "body")


def test_a_weight_made_whole_on_explicit_mesh_axes_keeps_its_path():
    # FSDP on explicit axes gathers each weight itself before its matmul; the gathered
    # value is still the argument (it had no path, and the input was taken for the weight)
    from jax.sharding import AxisType, reshard
    from jax.sharding import PartitionSpec as P
    from support import machine

    mesh = machine.mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))

    def model(params, x):
        h = jnp.tanh(x @ reshard(params["body"], P()))
        return h @ reshard(params["lm_head"], P())

    with jax.set_mesh(mesh):
        params = {
            "body": jax.device_put(jnp.ones((32, 32)), P("fsdp")),
            "lm_head": jax.device_put(jnp.ones((32, 16)), P("fsdp")),
        }
        body, head = recorded(model, params, jax.device_put(X, P("fsdp")))
    assert body.weight == "[0]['body']"
    assert head.weight == "[0]['lm_head']"


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, name="body")(x)
        return nn.Dense(16, name="lm_head")(x)


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(32, 32, rngs=rngs)
        self.lm_head = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.lm_head(jnp.tanh(self.body(x)))


class EquinoxModel(eqx.Module):
    body: eqx.nn.Linear
    lm_head: eqx.nn.Linear

    def __init__(self, key):
        body, head = jax.random.split(key)
        self.body = eqx.nn.Linear(32, 32, key=body)
        self.lm_head = eqx.nn.Linear(32, 16, key=head)

    def __call__(self, x):
        return jax.vmap(self.lm_head)(jnp.tanh(jax.vmap(self.body)(x)))


def haiku_model(x):
    x = jnp.tanh(hk.Linear(32, name="body")(x))
    return hk.Linear(16, name="lm_head")(x)


def framework_models():
    linen = LinenModel()
    variables = linen.init(jax.random.key(0), X)
    nnx_model = NNXModel(nnx.Rngs(0))
    equinox = EquinoxModel(jax.random.key(0))
    haiku = hk.without_apply_rng(hk.transform(haiku_model))
    haiku_params = haiku.init(jax.random.key(0), X)
    return {
        "linen": (linen.apply, (variables, X)),
        "nnx": (nnx_model, (X,)),
        "equinox": (equinox, (X,)),
        "haiku": (haiku.apply, (haiku_params, X)),
    }


@pytest.mark.parametrize(
    ("framework", "name_stack", "weight"),
    [
        ("linen", "LinenModel/lm_head", "[0]['params']['lm_head']['kernel']"),
        ("nnx", "", "<fn>['lm_head']['kernel'].value"),
        ("equinox", "vmap(eqx.nn.Linear)", "<fn>.lm_head.weight"),
        ("haiku", "lm_head", "[0]['lm_head']['w']"),
    ],
)
def test_each_framework_names_its_output_head(framework, name_stack, weight):
    fn, args = framework_models()[framework]
    body, head = recorded(fn, *args)
    assert head.name_stack == name_stack
    assert head.weight == weight
    assert "lm_head" in head.names
    assert "lm_head" not in body.names
    assert head.dims == (16, 32, 16)  # as a linear layer: N is the head's 16 outputs


@pytest.mark.parametrize("framework", ["linen", "nnx", "equinox", "haiku"])
def test_exclude_names_keeps_the_head_in_bfloat16_in_every_framework(framework):
    fn, args = framework_models()[framework]
    everything = jaxscale.autocast(fn, dtype=BF16, float8="rowwise")
    filtered = jaxscale.autocast(
        fn, dtype=BF16, float8="rowwise", float8_filter=exclude_names("lm_head")
    )
    plain = jaxscale.autocast(fn, dtype=BF16)
    if framework == "nnx":  # differentiate the input: the module is the function
        everything, filtered, plain = ((lambda x, f=f: f(x)) for f in (everything, filtered, plain))
    assert float8_matmuls(everything, *args) == 6
    assert float8_matmuls(filtered, *args) == 3  # the body's three; the head's none
    # the head's result is bfloat16's own: the body's float8 output times the head
    # in bfloat16, as a nested autocast(float8=None) around the head would compute
    assert filtered(*args).dtype == BF16
    assert not np.array_equal(filtered(*args), everything(*args))
    assert not np.array_equal(filtered(*args), plain(*args))


def test_a_refused_matmul_runs_forward_and_backward_as_the_dtype_says():
    w = jnp.asarray(RNG.normal(size=(32, 48)) * 0.1, F32)

    def layer(w, x):
        return x @ w

    refused = jaxscale.autocast(layer, dtype=BF16, float8="rowwise",
                                float8_filter=lambda site: False)  # fmt: skip
    plain = jaxscale.autocast(layer, dtype=BF16)
    loss = lambda f: lambda w, x: jnp.sum(f(w, x).astype(F32) ** 2)  # noqa: E731
    np.testing.assert_array_equal(refused(w, X), plain(w, X))
    for got, want in zip(jax.grad(loss(refused), argnums=(0, 1))(w, X),
                         jax.grad(loss(plain), argnums=(0, 1))(w, X), strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
    assert float8_matmuls(refused, w, X) == 0


# -- layers of a stack -----------------------------------------------------------------------


def scanned(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


WS = jnp.asarray(RNG.normal(size=(6, 32, 32)) / np.sqrt(32), F32)


@pytest.mark.parametrize("reverse", [False, True])
def test_exclude_layers_splits_a_scan_and_keeps_its_ends_in_bfloat16(reverse):
    def stack(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws, reverse=reverse)[0]

    keep = exclude_layers(first=1, last=2)
    fn = jaxscale.autocast(stack, dtype=BF16, float8="rowwise", float8_filter=keep)
    jaxpr = jax.make_jaxpr(fn)(WS, X)
    lengths = [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert lengths == ([2, 3, 1] if reverse else [1, 3, 2])

    def by_hand(ws, x):  # the three scans written out, each under its own autocast
        pieces = [(ws[:1], None), (ws[1:4], "rowwise"), (ws[4:], None)]
        for layers, float8 in reversed(pieces) if reverse else pieces:
            x = jaxscale.autocast(stack, dtype=BF16, float8=float8)(layers, x)
        return x

    np.testing.assert_array_equal(jax.jit(fn)(WS, X), jax.jit(by_hand)(WS, X))
    # and the three matmuls of each of the 3 middle layers are float8, in the gradient too
    assert float8_matmuls(lambda ws, x: fn(ws, x), WS, X) == 3  # one per scan body's pass


def test_a_scan_asks_the_filter_about_each_layer():
    sites = recorded(scanned, WS, X)
    assert [(s.layer, s.layers) for s in sites if s.layer is not None][:6] == [
        (i, 6) for i in range(6)
    ]
    assert all(s.weight == "[0]" for s in sites)


def test_a_scan_the_filter_decides_alike_is_not_split():
    fn = jaxscale.autocast(scanned, dtype=BF16, float8="rowwise",
                           float8_filter=exclude_names("nothing"))  # fmt: skip
    jaxpr = jax.make_jaxpr(fn)(WS, X)
    assert [e.primitive.name for e in jaxpr.eqns].count("scan") == 1


def test_an_nnx_scan_stack_keeps_its_first_and_last_layers():
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.linear(x)), None

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Layer(nnx.Rngs(key))

    layers = make(jax.random.split(jax.random.key(0), 4))

    def forward(layers, x):
        return nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, 0))(x, layers)[0]

    keep = exclude_layers(first=1, last=1)
    fn = jaxscale.autocast(forward, dtype=BF16, float8="rowwise", float8_filter=keep)
    jaxpr = jax.make_jaxpr(lambda x: fn(layers, x))(X)
    text = str(jaxpr)
    assert "length=1" in text
    assert "length=2" in text
    assert fn(layers, X).shape == (16, 32)


def test_exclude_layers_finds_a_list_of_layers_by_its_index():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(4)])

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    model = Stack(nnx.Rngs(0))
    sites = recorded(model, X)
    assert [s.list_index("layers") for s in sites] == [0, 1, 2, 3]
    keep = exclude_layers(first=1, last=1, count=4)
    assert [keep(s) for s in sites] == [False, True, True, False]
    with pytest.raises(ValueError, match=r"pass count=len\(model.layers\)"):
        exclude_layers(first=1)(sites[0])
    fn = jaxscale.autocast(model, dtype=BF16, float8="rowwise", float8_filter=keep)
    assert float8_matmuls(lambda x: fn(x), X) == 6  # two layers, three matmuls each


def test_a_layer_of_a_stacked_weight_taken_by_its_index_is_that_layer():
    # a stack of weights iterated in Python (not scanned): each matmul's weight is the
    # stacked argument's path and the layer's index, so a list filter finds the layers
    params = {"layers": jnp.asarray(RNG.normal(size=(4, 32, 32)) / 6, F32)}

    def stack(params, x):
        for w in params["layers"]:
            x = jnp.tanh(x @ w)
        return x

    sites = recorded(stack, params, X)
    assert [s.weight for s in sites] == [f"[0]['layers'][{i}]" for i in range(4)]
    assert [s.list_index("layers") for s in sites] == [0, 1, 2, 3]
    keep = exclude_layers(first=1, last=1, count=4)
    fn = jaxscale.autocast(stack, dtype=BF16, float8="rowwise", float8_filter=keep)
    assert float8_matmuls(lambda x: fn(params, x), X) == 6  # two layers, three matmuls each
    # a part of a layer (rows of it) is not the layer
    half = recorded(lambda p, x: x[:, :16] @ p["layers"][1, :16], params, X)
    assert [s.weight for s in half] == [None]


class EquinoxBlocks(eqx.Module):
    """Equinox's idiom: a list attribute of blocks, each applied per example under vmap."""

    blocks: list

    def __init__(self, key):
        self.blocks = [eqx.nn.Linear(32, 32, key=k) for k in jax.random.split(key, 4)]

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(jax.vmap(block)(x))
        return x


def test_a_list_named_otherwise_is_found_by_name_and_its_name_suggested():
    model = EquinoxBlocks(jax.random.key(0))
    keep = exclude_layers(first=1, last=1, name="blocks", count=4)
    fn = jaxscale.autocast(model, dtype=BF16, float8="rowwise", float8_filter=keep)
    assert float8_matmuls(fn, X) == 6  # blocks[1] and blocks[2], three matmuls each
    # the default name finds no layer: refused, naming the list the weights are in
    unnamed = jaxscale.autocast(model, dtype=BF16, float8="rowwise",
                                float8_filter=exclude_layers(first=1, last=1, count=4))  # fmt: skip
    with pytest.raises(ValueError, match=r"found none of the function's 4 float8 matmuls in a "
                       r"layer.*lists named 'blocks': pass name='blocks'"):  # fmt: skip
        unnamed(X)
    # a position beyond the count given is a wrong count, not a layer to keep
    keep = exclude_layers(last=1, name="blocks", count=3)
    short = jaxscale.autocast(model, dtype=BF16, float8="rowwise", float8_filter=keep)
    with pytest.raises(ValueError, match=r"blocks\[3\], beyond count=3 layers"):
        short(X)


def test_a_function_without_layers_is_refused_for_a_layer_filter():
    fn = jaxscale.autocast(lambda w, x: jnp.tanh(x @ w) @ w, dtype=BF16, float8="rowwise",
                           float8_filter=exclude_layers(first=1))  # fmt: skip
    with pytest.raises(ValueError, match=r"a layer is an iteration of a lax\.scan over stacked"):
        fn(jnp.ones((32, 32)), X)


def test_a_weights_argument_position_is_not_a_layer_index():
    # Haiku's module "layers" (a name stack) beside its weight "[0]['layers']['w']": the
    # 0 is the function's first argument, not layer 0 of a list
    site = MatmulSite("layers", "[0]['layers']['w']", "", ((16, 32), (32, 32)), (16, 32, 32), 0)
    assert site.list_index("layers") is None
    assert site.list_names() == ()
    numbered = MatmulSite("block_2", "[0]['block_2']['w']", "", ((16, 32), (32, 32)),
                          (16, 32, 32), 0)  # fmt: skip
    assert numbered.list_index("block") == 2
    assert numbered.list_names() == ("block",)


def test_haikus_numbered_modules_are_suggested_by_their_name():
    def forward(x):
        for i in range(4):
            x = jax.nn.relu(hk.Linear(32, name=f"block_{i}")(x))
        return hk.Linear(16, name="head")(x)

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(0), X)
    unnamed = exclude_layers(first=1, count=4)
    fn = jaxscale.autocast(model.apply, dtype=BF16, float8="rowwise", float8_filter=unnamed)
    with pytest.raises(ValueError, match=r"in lists named 'block': pass name='block'$"):
        fn(params, X)
    keep = exclude_layers(first=1, name="block", count=4)
    fn = jaxscale.autocast(model.apply, dtype=BF16, float8="rowwise", float8_filter=keep)
    assert float8_matmuls(lambda x: fn(params, x), X) == 12  # blocks 1-3 and the head


class HaikuBlock(hk.Module):
    def __call__(self, x):
        return x + hk.Linear(32)(jax.nn.relu(hk.Linear(32)(x)))


def test_haikus_first_instance_of_a_module_is_layer_0():
    # Haiku names a module's instances block, block_1, block_2, ...: the first has no
    # number, and was taken for a matmul in no layer (kept in the recipe)
    def forward(x):
        for _ in range(4):
            x = HaikuBlock()(x)
        return hk.Linear(16, name="head")(x)

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(0), X)
    assert sorted(params)[:3] == [
        "haiku_block/linear",
        "haiku_block/linear_1",
        "haiku_block_1/linear",
    ]
    keep = exclude_layers(first=1, last=1, name="haiku_block", count=4)
    fn = jaxscale.autocast(model.apply, dtype=BF16, float8="rowwise", float8_filter=keep)
    assert float8_matmuls(lambda x: fn(params, x), X) == 15  # blocks 1 and 2 and the head


def test_a_haiku_module_holding_the_layers_is_not_taken_for_the_first():
    # a module named as the list, its layers numbered under another name: reading every
    # matmul under it as layer 0 would keep them all out of the recipe without a word
    def forward(x):
        return hk.Sequential([hk.Linear(32) for _ in range(4)], name="layers")(x)

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(0), X)
    keep = exclude_layers(first=1, count=4)
    fn = jaxscale.autocast(model.apply, dtype=BF16, float8="rowwise", float8_filter=keep)
    refused = r"'layers' have no numbered sibling \(layers_1, layers_2, \.\.\.\), so 'layers' holds"
    with pytest.raises(ValueError, match=refused):
        fn(params, X)


def test_linens_numbered_layers_are_found_too():
    site = MatmulSite("Model/layers_3/Dense_0", None, "", ((16, 32), (32, 32)), (16, 32, 32), 0)
    assert site.list_index("layers") == 3
    assert not exclude_layers(last=1, count=4)(site)
    assert exclude_layers(last=1, count=5)(site)


# -- torchao's automatic filter --------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_auto_filter_is_torchaos(recipe, torch):
    from torchao.float8 import _auto_filter_for_recipe

    theirs = _auto_filter_for_recipe(recipe, ["skip"])
    ours = auto_filter(recipe, exclude=("skip",))
    sizes = [16, 1000, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    for k in sizes:
        for n in sizes:
            for name in ("layers.0.mlp", "skip_layer.proj"):
                module = torch.nn.Linear(k, n, device="meta")
                site = MatmulSite("", f"[0]['{name}']", "", ((16, k), (k, n)), (16, k, n), 0)
                assert ours(site) is theirs(module, name), (recipe, k, n, name)


# -- mistakes are named --------------------------------------------------------------------


def test_bad_filters_are_named():
    with pytest.raises(TypeError, match="float8_filter must be a function of a"):
        jaxscale.autocast(scanned, dtype=BF16, float8="rowwise", float8_filter="lm_head")
    with pytest.raises(ValueError, match="no recipe is given"):
        jaxscale.autocast(scanned, dtype=BF16, float8_filter=exclude_names("x"))
    answer = jaxscale.autocast(lambda w, x: x @ w, dtype=BF16, float8="rowwise",
                               float8_filter=lambda site: jnp.bool_(True))  # fmt: skip
    with pytest.raises(TypeError, match="float8_filter must return a Python bool"):
        answer(jnp.ones((32, 32)), X)
    with pytest.raises(TypeError, match="non-empty strings"):
        exclude_names("")
    # a filter of no names would keep every matmul in the recipe without a word
    with pytest.raises(
        TypeError, match=r'needs at least one pattern, e.g. exclude_names\("lm_head"\)'
    ):
        exclude_names()
    with pytest.raises(ValueError, match="first must be an int >= 0"):
        exclude_layers(first=-1)
    with pytest.raises(ValueError, match="torchao's thresholds"):
        auto_filter("mxfp8")


def test_the_filter_works_with_every_recipe():
    w = jnp.asarray(RNG.normal(size=(32, 32)) * 0.1, F32)
    x = jnp.concatenate([X, X])  # 32 rows: an MX block
    for recipe in [*jaxscale.casting.RECIPES, *jaxscale.casting.MX_RECIPES, "nvfp4"]:
        options = {"key": jax.random.key(0)} if recipe == "nvfp4" else {}
        fn = jaxscale.autocast(lambda w, x: jnp.tanh(x @ w) @ w, dtype=BF16, float8=recipe,
                               float8_filter=lambda site: site.index == 0, **options)  # fmt: skip
        plain = jaxscale.autocast(lambda w, x: jnp.tanh(x @ w) @ w, dtype=BF16)
        assert fn(w, x).shape == plain(w, x).shape
        assert not np.array_equal(fn(w, x), plain(w, x)), recipe


def test_the_cuda_lowering_of_a_split_scan_and_of_nvfp4_waits_on_nothing():
    keep = exclude_layers(first=1, last=1)

    def step(ws, x, key):
        fn = jaxscale.autocast(scanned, dtype=BF16, float8="nvfp4", float8_filter=keep, key=key)
        return jax.grad(lambda ws: jnp.sum(fn(ws, x).astype(F32) ** 2))(ws)

    report = jaxscale.lowering_report(jax.jit(step), WS, X, jax.random.key(0), platform="cuda")
    assert report.loops == report.counted_loops  # the scans: a fixed trip count
    assert report.data_conditionals == 0
    assert report.host_transfers == 0
