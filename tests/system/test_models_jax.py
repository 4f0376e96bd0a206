"""Plain JAX and Optax programs, as people write them without a module system.

Parameters are dicts, the optimizer is Optax's, and the features are the ones
plain-JAX training loops use: per-example gradients (differentially private SGD),
gradient accumulation with ``optax.MultiSteps``, a top-k mixture of experts,
frozen leaves and a learning-rate schedule inside the scaler,
``jax.nn.dot_product_attention`` with padding, and data parallelism with
``shard_map`` and ``pmap``.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import machine
from support.model_training import (
    PRECISIONS,
    assert_all_matmuls_in,
    assert_trains_like,
    equations,
    run_steps,
)

import jaxscale

pytestmark = pytest.mark.usefixtures("under_standard_promotion")

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


def init_mlp(seed, sizes=(8, 32, 32, 1)):
    rng = np.random.default_rng(seed)
    return [
        {
            "w": jnp.asarray(rng.normal(size=(m, n)) / np.sqrt(m), F32),
            "b": jnp.zeros((n,), F32),
        }
        for m, n in itertools.pairwise(sizes)
    ]


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def mse(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def _regression(seed, batch=16):
    x = np.random.default_rng(seed).normal(size=(batch, 8))
    return jnp.asarray(x, F32), jnp.asarray(np.sin(x[:, :2].sum(-1, keepdims=True)), F32)


DATA = [_regression(seed) for seed in range(15)]


def loss_for(precision):
    return mse if precision is None else jaxscale.autocast(mse, dtype=precision)


# -- differentially private SGD: per-example gradients -----------------------------------------


def per_example_gradients(precision, params, opt_state, x, y):
    loss_fn = loss_for(precision)

    def scaled_example_loss(params, x, y):
        loss = loss_fn(params, x[None], y[None])
        return (loss if precision is None else jaxscale.scale(loss, opt_state)), loss

    return jax.vmap(jax.grad(scaled_example_loss, has_aux=True), in_axes=(None, 0, 0))(params, x, y)


def dp_step(tx, precision):
    def step(carry, batch):
        params, opt_state = carry
        per_example, losses = per_example_gradients(precision, params, opt_state, *batch)
        updates, opt_state = tx.update(per_example, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jnp.mean(losses)

    return step


def dp_aggregate(**kwargs):
    """optax's per-example clipping and noise (its key argument is newer than its seed)."""
    aggregate = optax.contrib.differentially_private_aggregate
    if "key" in inspect.signature(aggregate).parameters:
        return aggregate(**kwargs, key=jax.random.key(0))
    return aggregate(**kwargs, seed=0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_dp_sgd_per_example_gradients_clip_what_float32_clips(precision):
    def make_tx(precision):
        tx = optax.chain(dp_aggregate(l2_norm_clip=1.0, noise_multiplier=0.0), optax.adam(1e-2))
        return tx if precision is None else jaxscale.grad_scaler(tx, init_scale=2.0**10)

    reference_tx, tx = make_tx(None), make_tx(precision)
    params = init_mlp(0)
    _, reference = run_steps(
        jax.jit(dp_step(reference_tx, None)), (params, reference_tx.init(params)), DATA
    )
    (_, opt_state), losses = run_steps(
        jax.jit(dp_step(tx, precision)), (params, tx.init(params)), DATA
    )
    # the clipping inside the wrapped optimizer sees unscaled per-example gradients
    assert_trains_like(reference, losses, rtol=0.05, label=np.dtype(precision).name)
    assert int(jaxscale.skipped_steps(opt_state)) == 0
    # the model's matmuls, forward and backward, per example (the aggregation's own
    # sums over the batch are the optimizer's, outside autocast, in float32)
    jaxpr = jax.make_jaxpr(functools.partial(per_example_gradients, precision))(
        params, tx.init(params), *DATA[0]
    )
    assert_all_matmuls_in(precision, jaxpr)


# -- gradient accumulation with optax.MultiSteps -----------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_multisteps_accumulates_under_one_scale(precision):
    def make_tx(precision):
        inner = optax.adam(1e-2)
        if precision is not None:
            inner = jaxscale.grad_scaler(inner, init_scale=2.0**10)
        return optax.MultiSteps(inner, every_k_schedule=3)

    def make_step(tx, precision):
        loss_fn = loss_for(precision)

        def step(carry, batch):
            params, opt_state = carry

            def scaled(params):
                loss = loss_fn(params, *batch)
                return (loss if precision is None else jaxscale.scale(loss, opt_state)), loss

            grads, loss = jax.grad(scaled, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return step

    params = init_mlp(1)
    reference_tx, tx = make_tx(None), make_tx(precision)
    _, reference = run_steps(
        jax.jit(make_step(reference_tx, None)), (params, reference_tx.init(params)), DATA
    )
    (_, opt_state), losses = run_steps(
        jax.jit(make_step(tx, precision)), (params, tx.init(params)), DATA
    )
    assert_trains_like(reference, losses, rtol=0.05, label=np.dtype(precision).name)
    assert int(jaxscale.skipped_steps(opt_state)) == 0
    assert float(jaxscale.get_scale(opt_state)) == 2.0**10


# -- a mixture of experts: top-k routing, gathered weights, scatter-add combine --------------

EXPERTS, TOP_K, MODEL_WIDTH, EXPERT_WIDTH, TOKENS = 4, 2, 8, 16, 32


def init_moe(seed):
    rng = np.random.default_rng(seed)
    return {
        "router": jnp.asarray(rng.normal(size=(MODEL_WIDTH, EXPERTS)) * 0.1, F32),
        "up": jnp.asarray(rng.normal(size=(EXPERTS, MODEL_WIDTH, EXPERT_WIDTH)) / 3, F32),
        "down": jnp.asarray(rng.normal(size=(EXPERTS, EXPERT_WIDTH, MODEL_WIDTH)) / 4, F32),
    }


def moe_layer(params, x):
    """Each token to its ``TOP_K`` experts: their weights gathered per routed token,
    the outputs weighted by the renormalised gate and summed back per token with
    ``jax.ops.segment_sum`` (a scatter-add)."""
    gates, experts = jax.lax.top_k(jax.nn.softmax(x @ params["router"], axis=-1), TOP_K)
    gates = gates / gates.sum(axis=-1, keepdims=True)
    token = jnp.repeat(jnp.arange(x.shape[0]), TOP_K)
    expert = experts.reshape(-1)
    hidden = jax.nn.gelu(jnp.einsum("nd,ndh->nh", x[token], params["up"][expert]))
    routed = jnp.einsum("nh,nhd->nd", hidden, params["down"][expert]) * gates.reshape(-1, 1)
    return x + jax.ops.segment_sum(routed, token, num_segments=x.shape[0])


def moe_loss(params, x, target):
    return jnp.mean((moe_layer(params, x) - target) ** 2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_top_k_mixture_of_experts_routes_and_trains_like_float32(precision):
    x = jnp.asarray(np.random.default_rng(3).normal(size=(TOKENS, MODEL_WIDTH)), F32)
    target = jnp.roll(x, 1, axis=-1)
    loss_fn = jaxscale.autocast(moe_loss, dtype=precision)

    def make_step(tx, loss_fn, scaled):
        def step(carry, _):
            params, opt_state = carry

            def objective(params):
                loss = loss_fn(params, x, target)
                return (jaxscale.scale(loss, opt_state) if scaled else loss), loss

            grads, loss = jax.grad(objective, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return jax.jit(step)

    params, plain_tx = init_moe(0), optax.adam(3e-3)
    tx = jaxscale.grad_scaler(optax.adam(3e-3), init_scale=2.0**10)
    steps = range(40)
    _, reference = run_steps(
        make_step(plain_tx, moe_loss, False), (params, plain_tx.init(params)), steps
    )
    (_, opt_state), losses = run_steps(
        make_step(tx, loss_fn, True), (params, tx.init(params)), steps
    )
    assert_trains_like(reference, losses, rtol=0.1, label=np.dtype(precision).name)
    assert int(jaxscale.skipped_steps(opt_state)) == 0
    jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(params, x, target)
    assert_all_matmuls_in(precision, jaxpr)
    # the combine and the gathers' gradients are scatter-adds: run as traced, in float32
    scatters = [e for e in equations(jaxpr) if e.primitive.name == "scatter-add"]
    assert scatters
    assert {str(v.aval.dtype) for e in scatters for v in e.outvars} == {"float32"}


# -- frozen parameters and a scheduled learning rate inside the scaler --------------------------


def test_frozen_leaves_and_a_schedule_keep_still_through_a_skipped_step():
    labels = [{"w": "frozen", "b": "frozen"}, {"w": "trained", "b": "trained"}]
    schedule = optax.linear_schedule(1e-2, 0.0, transition_steps=100)
    inner = optax.multi_transform(
        {
            "trained": optax.inject_hyperparams(optax.adamw)(learning_rate=schedule),
            "frozen": optax.set_to_zero(),
        },
        labels,
    )
    tx = jaxscale.grad_scaler(inner, init_scale=2.0**10)
    params = init_mlp(2, sizes=(8, 16, 1))
    loss_fn = jaxscale.autocast(mse)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jaxscale.scale(loss_fn(p, x, y), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for x, y in DATA[:5]:
        params, opt_state = step(params, opt_state, x, y)
    assert (
        np.asarray(params[0]["w"]).tobytes()
        == np.asarray(init_mlp(2, sizes=(8, 16, 1))[0]["w"]).tobytes()
    )
    assert int(jaxscale.skipped_steps(opt_state)) == 0
    inner_before = [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(opt_state.inner_state)]
    params_before = [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(params)]
    x, y = DATA[5]
    params, opt_state = step(params, opt_state, x.at[0, 0].set(jnp.inf), y)
    assert int(jaxscale.skipped_steps(opt_state)) == 1
    assert [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(params)] == params_before
    # the schedule's count and the injected learning rate did not move either
    assert [
        np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(opt_state.inner_state)
    ] == inner_before
    trained = opt_state.inner_state.inner_states["trained"].inner_state
    assert int(trained.count) == 5
    np.testing.assert_allclose(float(trained.hyperparams["learning_rate"]), schedule(4), rtol=1e-6)


# -- attention with padding: every fill constant a user writes ---------------------------------

FILLS = {
    "finfo(float32).min": float(jnp.finfo(F32).min),
    "-1e9": -1e9,
    "-1e30": -1e30,
    "-inf": -np.inf,
}


def padded_attention_inputs():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 4, 2, 8)), F32)  # batch, length, heads, head_dim
    valid = jnp.array([[True, True, True, False], [True, True, False, False]])
    return q, valid


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("fill", list(FILLS))
def test_a_hand_written_mask_fill_is_no_nan_where_pytorch_has_none(precision, fill):
    q, valid = padded_attention_inputs()
    value = FILLS[fill]

    def attention(q, valid):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, q)
        mask = valid[:, None, :, None] & valid[:, None, None, :]
        weights = jax.nn.softmax(jnp.where(mask, logits, value), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, q)

    out = np.asarray(jaxscale.autocast(attention, dtype=precision)(q, valid), np.float32)
    expected = np.asarray(attention(q, valid))
    if fill == "-inf":
        # -inf - (-inf) is NaN in float32 too: an intended -inf is kept, never clipped
        np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
        return
    assert np.all(np.isfinite(out)), out
    np.testing.assert_allclose(out, expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_jax_nn_dot_product_attention_with_a_padding_mask(precision):
    q, valid = padded_attention_inputs()
    mask = valid[:, None, :, None] & valid[:, None, None, :]

    def attention(q, mask):
        return jax.nn.dot_product_attention(q, q, q, mask=mask)

    out = np.asarray(jaxscale.autocast(attention, dtype=precision)(q, mask), np.float32)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, attention(q, mask), rtol=0.05, atol=0.05)
    assert_all_matmuls_in(
        precision, jax.make_jaxpr(jaxscale.autocast(attention, dtype=precision))(q, mask)
    )


# -- data parallelism: shard_map and pmap --------------------------------------------------------


def test_shard_map_data_parallel_training_with_autocast_inside():
    mesh = machine.mesh((4,), ("data",))
    tx = jaxscale.grad_scaler(optax.adam(1e-2), init_scale=2.0**10, axis_name="data")
    loss_fn = jaxscale.autocast(mse)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P(), P()),
    )
    def step(params, opt_state, x, y):
        def scaled(params):
            loss = loss_fn(params, x, y)
            return jaxscale.scale(loss, opt_state), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    params = init_mlp(2)
    opt_state = tx.init(params)
    losses = []
    for x, y in DATA:
        x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    reference_tx = optax.adam(1e-2)

    @jax.jit
    def reference_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mse)(params, x, y)
        updates, opt_state = reference_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ref_params, ref_state, reference = init_mlp(2), reference_tx.init(init_mlp(2)), []
    for x, y in DATA:
        ref_params, ref_state, loss = reference_step(ref_params, ref_state, x, y)
        reference.append(float(loss))
    assert_trains_like(reference, losses, rtol=0.05, label="shard_map float16")
    assert int(jaxscale.skipped_steps(opt_state)) == 0


def test_pmap_data_parallel_step_with_autocast_inside():
    devices = machine.devices(2)
    tx = jaxscale.grad_scaler(optax.adam(1e-2), init_scale=2.0**10, axis_name="batch")
    loss_fn = jaxscale.autocast(mse)

    @functools.partial(jax.pmap, axis_name="batch", devices=devices)
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jaxscale.scale(loss_fn(p, x, y), opt_state))(params)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = init_mlp(3)

    def replicate(tree):
        return jax.tree.map(lambda leaf: jnp.stack([leaf] * len(devices)), tree)

    params_r, opt_state_r = replicate(params), replicate(tx.init(params))
    x, y = DATA[0]
    params_r, opt_state_r = step(params_r, opt_state_r, x.reshape(2, 8, 8), y.reshape(2, 8, 1))
    # every device took the same step
    for leaf in jax.tree.leaves(params_r):
        np.testing.assert_array_equal(leaf[0], leaf[1])
    assert not np.any(np.asarray(jaxscale.found_inf(opt_state_r)))
