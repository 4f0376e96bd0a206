"""Multi-device training, gradient accumulation and composite optimizers.

On eight simulated CPU devices (``tests/conftest.py``): an inf or NaN held by one
device makes every device skip and back off identically, under ``jax.jit`` with
``NamedSharding`` (data- and model-parallel layouts), under ``shard_map`` and under
``pmap`` with ``axis_name``, for the Optax transform and for the ``GradScaler``
facade. Gradient accumulation through ``optax.MultiSteps`` is checked against
PyTorch's accumulation recipe.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from support import machine, third_party

import jaxscale
from jaxscale import GradScaler

DEVICES = 8
P = PartitionSpec


def bits(tree):
    return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def sgd(learning_rate):
    return third_party.optimizer(optax.sgd(learning_rate))


def assert_same_on_every_device(array):
    shards = [np.asarray(shard.data) for shard in array.addressable_shards]
    assert len(shards) == DEVICES
    for shard in shards[1:]:
        np.testing.assert_array_equal(shard, shards[0])


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(machine.devices(DEVICES)), ("data",))


# -- jax.jit with NamedSharding -------------------------------------------------------------------


def linear_loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"][None, :] - y) ** 2)


def data_parallel_batch(mesh, poison_row=None):
    """16 rows, two per device; ``poison_row`` puts an inf in one row (so on one device)."""
    x = np.linspace(-1.0, 1.0, 16 * 4, dtype=np.float32).reshape(16, 4)
    if poison_row is not None:
        x[poison_row, 2] = np.inf
    y = np.ones((16, 2), np.float32)
    sharding = NamedSharding(mesh, P("data"))
    return jax.device_put(x, sharding), jax.device_put(y, sharding)


@pytest.mark.parametrize("api", ["transform", "facade"])
def test_data_parallel_jit_one_poisoned_device_skips_everywhere(mesh, api):
    replicated = NamedSharding(mesh, P())
    params = jax.device_put({"w": jnp.full((4, 2), 0.1), "b": jnp.zeros(2)}, replicated)

    if api == "transform":
        tx = jaxscale.grad_scaler(sgd(0.1), init_scale=8.0)
        state = jax.device_put(tx.init(params), replicated)

        @jax.jit
        def step(params, state, x, y):
            grads = jax.grad(lambda p: jaxscale.scale(linear_loss(p, x, y), state))(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        def scale_of(state):
            return state.scaler.scale

    else:
        tx = sgd(0.1)
        scaler = GradScaler(init_scale=8.0)
        scaler.scale(jnp.float32(0.0))
        state = jax.device_put((tx.init(params), scaler), replicated)

        @jax.jit
        def step(params, state, x, y):
            opt_state, scaler = state
            grads = jax.grad(lambda p: scaler.scale(linear_loss(p, x, y)))(params)
            params, opt_state = scaler.step(tx, grads, opt_state, params)
            scaler.update()
            return params, (opt_state, scaler)

        def scale_of(state):
            return state[1].metrics()["scale"]

    new_params, new_state = step(params, state, *data_parallel_batch(mesh, poison_row=11))
    assert bits(new_params) == bits(params)
    assert float(scale_of(new_state)) == 4.0
    assert_same_on_every_device(scale_of(new_state))
    moved, moved_state = step(params, new_state, *data_parallel_batch(mesh))
    assert not np.array_equal(np.asarray(moved["w"]), np.asarray(params["w"]))
    assert_same_on_every_device(scale_of(moved_state))


@pytest.mark.parametrize("api", ["transform", "facade"])
def test_model_parallel_jit_a_nan_in_one_parameter_shard_skips_every_shard(mesh, api):
    """Parameters and gradients sharded over the devices: each holds 4 of 32 entries."""
    sharded = NamedSharding(mesh, P("data"))
    params = jax.device_put(jnp.ones(32), sharded)
    grads = jax.device_put(jnp.full(32, 8.0).at[21].set(jnp.nan), sharded)  # device 5 only

    if api == "transform":
        tx = jaxscale.grad_scaler(sgd(0.1), init_scale=8.0)

        @jax.jit
        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state.scaler.scale

        new_params, scale = step(params, tx.init(params), grads)
    else:
        tx = sgd(0.1)
        scaler = GradScaler(init_scale=8.0)
        scaler.scale(jnp.float32(0.0))

        @jax.jit
        def step(params, opt_state, scaler, grads):
            params, _ = scaler.step(tx, grads, opt_state, params)
            scaler.update()
            return params, scaler.get_scale()

        new_params, scale = step(params, tx.init(params), scaler, grads)

    assert bits(new_params) == bits(params)
    assert new_params.sharding.is_equivalent_to(sharded, 1)
    assert float(scale) == 4.0
    assert_same_on_every_device(scale)


# -- shard_map and pmap with axis_name ------------------------------------------------------------


def per_device_grads(poisoned_device):
    """(8, 4) gradients of the scaled loss, one row per device; one device's row is NaN."""
    grads = np.full((DEVICES, 4), 8.0, np.float32)
    if poisoned_device is not None:
        grads[poisoned_device, 1] = np.nan
    return jnp.asarray(grads)


def facade_step_on_device(params, opt_state, scaler, grads):
    params, opt_state = scaler.step(sgd(0.1), grads, opt_state, params)
    scaler.update()
    return params, opt_state, scaler


@pytest.mark.parametrize("poisoned_device", [None, 6])
def test_shard_map_facade_shares_the_decision(mesh, poisoned_device):
    scaler = GradScaler(init_scale=8.0, axis_name="data")
    scaler.scale(jnp.float32(0.0))
    params = jnp.ones(4)
    tx = sgd(0.1)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P(), P(), P("data")),
        out_specs=(P("data"), P(), P()),
    )
    def step(params, opt_state, scaler, grads):
        # Each device averages its own gradients with the others' (data parallel).
        grads = jax.lax.pmean(grads[0], "data")
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params[None], opt_state, scaler

    new_params, _, new_scaler = step(params, tx.init(params), scaler, per_device_grads(None))
    np.testing.assert_allclose(np.asarray(new_params), np.full((DEVICES, 4), 0.9), rtol=1e-6)
    new_params, _, new_scaler = step(
        params, tx.init(params), scaler, per_device_grads(poisoned_device)
    )
    if poisoned_device is None:
        assert new_scaler.get_scale() == 8.0
    else:
        np.testing.assert_array_equal(np.asarray(new_params), np.ones((DEVICES, 4), np.float32))
        assert new_scaler.get_scale() == 4.0


def test_shard_map_facade_without_pmean_still_skips_everywhere(mesh):
    """Per-device gradients that are never averaged: only ``axis_name`` makes the decision
    global, so a NaN on one device skips the update on all of them."""
    tx = sgd(0.1)
    scaler = GradScaler(init_scale=8.0, axis_name="data")
    scaler.scale(jnp.float32(0.0))

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P("data"), P(), P(), P("data")),
        out_specs=(P("data"), P()),
        check_vma=False,
    )
    def step(params, opt_state, scaler, grads):
        params, _ = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, scaler.get_scale()

    params = jnp.ones((DEVICES, 4))
    new_params, scale = step(params, tx.init(params[:1]), scaler, per_device_grads(2))
    np.testing.assert_array_equal(np.asarray(new_params), np.ones((DEVICES, 4), np.float32))
    assert float(scale) == 4.0


@pytest.mark.parametrize("api", ["transform", "facade"])
def test_pmap_shares_the_decision_with_axis_name(api):
    devices = machine.devices(DEVICES)
    params = jnp.ones((DEVICES, 4))  # replicated by hand: one copy per device
    grads = per_device_grads(3)

    if api == "transform":
        tx = jaxscale.grad_scaler(sgd(0.1), init_scale=8.0, axis_name="batch")
        state = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), tx.init(params[0]))

        @functools.partial(jax.pmap, axis_name="batch", devices=devices)
        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state.scaler.scale

        new_params, scales = step(params, state, grads)
    else:
        tx = sgd(0.1)
        scaler = GradScaler(init_scale=8.0, axis_name="batch")
        scaler.scale(jnp.float32(0.0))
        opt_state = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), tx.init(params[0]))
        scaler = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), scaler)  # one copy per device

        @functools.partial(jax.pmap, axis_name="batch", devices=devices)
        def step(params, opt_state, scaler, grads):
            params, _ = scaler.step(tx, grads, opt_state, params)
            scaler.update()
            return params, scaler.get_scale()

        new_params, scales = step(params, opt_state, scaler, grads)

    np.testing.assert_array_equal(np.asarray(new_params), np.ones((DEVICES, 4), np.float32))
    np.testing.assert_array_equal(np.asarray(scales), np.full(DEVICES, 4.0, np.float32))


# -- gradient accumulation with optax.MultiSteps --------------------------------------------------


def multi_steps(inner, every_k):
    """``optax.MultiSteps`` under standard promotion: it mixes int32 and float32 on purpose."""
    return third_party.optimizer(
        optax.MultiSteps(inner, every_k_schedule=every_k).gradient_transformation()
    )


X = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(6, 4)
Y = np.linspace(0.5, -0.5, 6, dtype=np.float32)


def micro_batch(i):
    rows = [(2 * i) % 6, (2 * i + 1) % 6]
    return X[rows], Y[rows]


def accumulation_plan():
    """Five accumulated steps of three micro-batches; inf in micro-batch 2 of step 1 and
    micro-batch 0 of step 3."""
    return [[(s, m) in {(1, 2), (3, 0)} for m in range(3)] for s in range(5)]


def test_facade_accumulation_recipe_matches_pytorch(torch):
    """PyTorch's recipe: several micro-batches, gradients summed, one step and update. The
    scale stays fixed across micro-batches and an inf in any of them skips the whole step."""
    tx = third_party.optimizer(optax.adam(0.05))
    scaler = GradScaler(init_scale=2.0**10, growth_interval=2)
    params = {"w": jnp.array([0.3, -0.2, 0.1, 0.4])}
    opt_state = tx.init(params)
    weight = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.1, 0.4]))
    torch_opt = torch.optim.Adam([weight], lr=0.05)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    @jax.jit
    def accumulated_step(params, opt_state, scaler, xs, ys, poisons):
        grads = jax.tree.map(jnp.zeros_like, params)
        for x, y, poison in zip(xs, ys, poisons, strict=True):

            def loss(p, x=x, y=y, poison=poison):
                return scaler.scale(jnp.mean((x @ p["w"] - y) ** 2) * poison / 3.0)

            grads = jax.tree.map(jnp.add, grads, jax.grad(loss)(params))
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    micro = 0
    for plan in accumulation_plan():
        batches = [micro_batch(micro + m) for m in range(3)]
        micro += 3
        poisons = [np.float32(np.inf if poisoned else 1.0) for poisoned in plan]
        scaler.scale(jnp.float32(0.0))  # scale() opens the iteration, as the loss does in torch
        xs, ys = zip(*batches, strict=True)
        params, opt_state, scaler = accumulated_step(params, opt_state, scaler, xs, ys, poisons)
        torch_opt.zero_grad()
        for (x, y), poison in zip(batches, poisons, strict=True):
            residual = torch.from_numpy(x) @ weight - torch.from_numpy(y)
            torch_scaler.scale((residual**2).mean() * float(poison) / 3.0).backward()
        torch_scaler.step(torch_opt)
        torch_scaler.update()
        assert scaler.get_scale() == torch_scaler.get_scale()
        np.testing.assert_allclose(
            np.asarray(params["w"]), weight.detach().numpy(), rtol=1e-5, atol=1e-6
        )
    assert scaler.get_scale() == 2.0**10 / 4  # two backoffs; never two finite steps in a row


def test_scaler_around_multisteps_drops_only_the_overflowing_micro_batch():
    """``grad_scaler(optax.MultiSteps(tx, k))``, the way to combine the two in Optax. Each
    micro-batch is checked on its own: an overflowing one never reaches the accumulator,
    the scale backs off at once, and the accumulated step waits for k finite micro-batches,
    each unscaled with the scale it was computed with."""
    tx = jaxscale.grad_scaler(multi_steps(sgd(0.1), 3), init_scale=8.0)
    params = {"w": jnp.ones(2)}
    opt_state = tx.init(params)
    scales = []
    for poison in [1.0, np.inf, 1.0, 1.0]:
        scale = jaxscale.get_scale(opt_state)
        grads = {"w": jnp.full(2, poison, jnp.float32) * scale}  # true gradient 1.0
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        scales.append(float(jaxscale.get_scale(opt_state)))
    assert scales == [8.0, 4.0, 4.0, 4.0]
    np.testing.assert_allclose(np.asarray(params["w"]), np.full(2, 0.9), rtol=1e-6)


def test_multisteps_inside_the_scaler_is_poisoned_by_optax_after_an_overflow():
    """``optax.MultiSteps(grad_scaler(tx), k)`` keeps the scale fixed across micro-batches
    and skips the whole step on an overflow, but MultiSteps resets its accumulator as
    ``0 * acc``, which is NaN after an inf: every later step is skipped too. Documented in
    the README; this test notices if optax changes."""
    tx = multi_steps(jaxscale.grad_scaler(sgd(0.1), init_scale=8.0), 3)
    params = {"w": jnp.ones(2)}
    opt_state = tx.init(params)
    scales = []
    for poison in [np.inf, 1.0, 1.0, 1.0, 1.0, 1.0]:
        grads = {"w": jnp.full(2, poison, jnp.float32)}
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        scales.append(float(jaxscale.get_scale(opt_state)))
    assert scales == [8.0, 8.0, 4.0, 4.0, 4.0, 2.0]  # the second step overflows too
    np.testing.assert_array_equal(np.asarray(params["w"]), np.ones(2, np.float32))
    assert bool(jnp.isnan(opt_state.acc_grads["w"]).all())


# -- composite optimizers -------------------------------------------------------------------------


def test_multi_transform_partitions_skip_together():
    """One scaler around ``optax.multi_transform``: an inf in one partition's gradients
    skips every partition, as one PyTorch optimizer with several parameter groups."""
    inner = optax.multi_transform(
        {"fast": sgd(1.0), "slow": third_party.optimizer(optax.adam(1e-3))},
        {"encoder": "slow", "head": "fast"},
    )
    tx = jaxscale.grad_scaler(inner, init_scale=4.0)
    params = {"encoder": jnp.ones(3), "head": jnp.ones(2)}
    opt_state = tx.init(params)
    grads = {"encoder": jnp.full(3, 4.0), "head": jnp.array([4.0, jnp.inf])}
    updates, new_state = tx.update(grads, opt_state, params)
    assert bits(optax.apply_updates(params, updates)) == bits(params)
    assert bits(new_state.inner_state) == bits(opt_state.inner_state)
    grads = {"encoder": jnp.full(3, 2.0), "head": jnp.full(2, 2.0)}
    updates, _ = tx.update(grads, new_state, params)
    np.testing.assert_allclose(np.asarray(updates["head"]), [-1.0, -1.0])
