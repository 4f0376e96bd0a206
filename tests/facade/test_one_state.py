"""One state behind both interfaces: the facade and the transform keep the same ScalerState.

Every opt-in of the transform exists on the facade with the same trajectory; the
extra state round-trips through jaxscale's own checkpoints; and a skipped step
leaves an Optax schedule where it was, in every interface.
"""

from __future__ import annotations

import pathlib
import pickle

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from support import third_party

import jaxscale
from jaxscale import GradScaler

SCENARIOS = 500
PARAMS = {"w": jnp.array([0.5, -1.0, 2.0])}
FIELDS = ("scale", "growth_tracker", "overflow_streak", "found_inf", "skipped_steps")


def bits(tree):
    return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def random_options(rng):
    """Random hyperparameters, opt-ins included, valid for both interfaces."""
    options = {
        "growth_factor": 2.0 if rng.random() < 0.3 else float(rng.uniform(1.1, 3.0)),
        "backoff_factor": 0.5 if rng.random() < 0.3 else float(rng.uniform(0.1, 0.9)),
        "growth_interval": int(rng.integers(1, 4)),
        "hysteresis": int(rng.choice([1, 1, 2, 3])),
        "dynamic": bool(rng.random() < 0.85),
    }
    low = float(2.0 ** rng.integers(-4, 4)) if rng.random() < 0.4 else None
    high = float(2.0 ** rng.integers(6, 12)) if rng.random() < 0.4 else None
    options["min_scale"], options["max_scale"] = low, high
    init = float(np.float32(2.0 ** rng.uniform(-3, 10)))
    if low is not None:
        init = max(init, low)
    if high is not None:
        init = min(init, high)
    options["init_scale"] = init
    return options


@jax.jit
def scaled_grads(params, scaled_one, poison):
    """Gradients of ``scale(loss)``: the scaled loss is ``loss * scale(1.0)`` exactly."""
    return jax.grad(lambda p: jnp.sum(p["w"] ** 2) * poison * scaled_one)(params)


@pytest.mark.randomized
def test_facade_and_transform_follow_one_trajectory_over_random_scenarios():
    tx_inner = third_party.optimizer(optax.sgd(0.05))
    poisons = [np.inf, -np.inf, np.nan]
    totals = {"steps": 0, "skipped": 0, "hysteresis": 0, "static": 0, "grew": 0, "clamped": 0}
    for seed in range(SCENARIOS):
        rng = np.random.default_rng(seed)
        options = random_options(rng)
        tx = jaxscale.grad_scaler(tx_inner, **options)
        scaler = GradScaler(**options)
        params_t, opt_state = PARAMS, tx.init(PARAMS)
        params_f, inner_state = PARAMS, tx_inner.init(PARAMS)
        for _ in range(int(rng.integers(4, 14))):
            poison = poisons[rng.integers(3)] if rng.random() < 0.35 else 1.0
            grads_t = scaled_grads(params_t, jaxscale.scale(jnp.float32(1.0), opt_state), poison)
            updates, opt_state = tx.update(grads_t, opt_state, params_t)
            params_t = optax.apply_updates(params_t, updates)

            grads_f = scaled_grads(params_f, scaler.scale(jnp.float32(1.0)), poison)
            params_f, inner_state = scaler.step(tx_inner, grads_f, inner_state, params_f)
            scaler.update()

            context = f"scenario {seed}: {options}"
            transform_state = opt_state.scaler
            facade_state = scaler._scaler_state
            for field in FIELDS:
                assert bits(getattr(facade_state, field)) == bits(
                    getattr(transform_state, field)
                ), (field, context)
            assert bits(params_f) == bits(params_t), context
            assert scaler.found_inf() is bool(jaxscale.found_inf(opt_state))
            totals["steps"] += 1
            totals["skipped"] += scaler.found_inf()
            totals["hysteresis"] += int(facade_state.overflow_streak) > 0
        totals["static"] += not options["dynamic"]
        totals["grew"] += scaler.get_scale() > options["init_scale"]
        totals["clamped"] += scaler.get_scale() in (options["min_scale"], options["max_scale"])
    # every opt-in was exercised
    assert totals["steps"] > 3000
    assert min(totals.values()) >= 50, totals


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("hysteresis", 0, ValueError, "hysteresis must be an integer in [1, 2**31 - 1], got 0"),
        ("hysteresis", 1.5, TypeError, "hysteresis must be an integer, got float 1.5"),
        ("dynamic", 1, TypeError, "dynamic must be a bool, got int 1"),
    ],
)
def test_facade_opt_ins_are_validated_like_the_transform(option, value, error, message):
    for build in (lambda: GradScaler(**{option: value}),
                  lambda: jaxscale.grad_scaler(optax.sgd(0.1), **{option: value})):  # fmt: skip
        with pytest.raises(error, match="^" + message.replace("[", r"\[").replace("*", r"\*")):
            build()


def test_static_scale_on_the_facade_skips_but_never_moves():
    scaler = GradScaler(init_scale=128.0, growth_interval=1, dynamic=False)
    tx = third_party.optimizer(optax.sgd(0.1))
    params, state = PARAMS, tx.init(PARAMS)
    for poison in [1.0, np.inf, 1.0, 1.0]:
        grads = jax.grad(lambda p, z=poison: scaler.scale(jnp.sum(p["w"]) * z))(params)
        before = params
        params, state = scaler.step(tx, grads, state, params)
        scaler.update()
        assert scaler.get_scale() == 128.0
        assert (bits(params) == bits(before)) is (poison != 1.0)
    assert scaler.skipped_steps() == 1
    assert scaler._get_growth_tracker() == 0


# -- checkpoints of the extra state ---------------------------------------------------------------


def trained_scaler():
    """A facade with hysteresis mid-streak: every field away from its initial value."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.sgd(0.1)), wrt=nnx.Param)
    scaler = GradScaler(init_scale=64.0, growth_interval=5, hysteresis=3)

    @nnx.jit
    def step(model, optimizer, scaler, poison):
        grads = nnx.grad(lambda m: scaler.scale(jnp.sum(m(jnp.ones((1, 2)))) * poison))(model)
        scaler.step(optimizer, model, grads)
        scaler.update()

    for poison in [1.0, np.inf, np.inf, 1.0, np.inf, np.inf, 1.0, 1.0, np.inf, np.inf]:
        step(model, optimizer, scaler, jnp.float32(poison))
    state = scaler._scaler_state
    assert int(state.overflow_streak) == 2
    assert bool(state.found_inf)
    assert int(state.skipped_steps) == 6
    assert int(state.growth_tracker) == 0
    return scaler


@pytest.mark.parametrize("method", ["orbax", "flax.serialization", "pickle"])
def test_extra_state_round_trips_through_jaxscale_checkpoints(method, tmp_path: pathlib.Path):
    scaler = trained_scaler()
    fresh = GradScaler(init_scale=64.0, growth_interval=5, hysteresis=3)
    if method == "orbax":
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "ckpt", nnx.state(scaler))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(fresh))
        with ocp.StandardCheckpointer() as checkpointer:
            nnx.update(fresh, checkpointer.restore(tmp_path / "ckpt", abstract))
    elif method == "flax.serialization":
        data = flax.serialization.to_bytes(nnx.to_pure_dict(nnx.state(scaler)))
        state = nnx.state(fresh)
        nnx.replace_by_pure_dict(
            state, flax.serialization.from_bytes(nnx.to_pure_dict(state), data)
        )
        nnx.update(fresh, state)
    else:
        fresh = pickle.loads(pickle.dumps(scaler))
    assert bits(fresh._scaler_state) == bits(scaler._scaler_state)
    assert fresh.state_dict() == scaler.state_dict()
    # and it goes on identically: the third overflow in a row backs off
    for s in (scaler, fresh):
        grads = jax.grad(lambda p, s=s: s.scale(jnp.sum(p["w"]) * jnp.inf))(PARAMS)
        s.step(optax.sgd(0.1), grads, optax.sgd(0.1).init(PARAMS), PARAMS)
        s.update()
    assert fresh.get_scale() == scaler.get_scale() == 32.0
    assert bits(fresh._scaler_state) == bits(scaler._scaler_state)


def test_the_pytorch_state_dict_carries_pytorchs_fields_and_restarts_the_rest():
    scaler = trained_scaler()
    state_dict = scaler.state_dict()
    assert list(state_dict) == [
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    ]
    loaded = GradScaler(hysteresis=3)
    loaded.load_state_dict(state_dict)
    state = loaded._scaler_state
    assert float(state.scale) == scaler.get_scale()
    assert (int(state.overflow_streak), bool(state.found_inf), int(state.skipped_steps)) == (
        0,
        False,
        0,
    )


# -- learning-rate schedules: a skipped step does not advance them ---------------------

SCHEDULE = optax.linear_schedule(1.0, 0.0, transition_steps=10)
POISONS = [1.0, np.inf, np.inf, 1.0]  # two skipped steps among four


def learning_rate_after(count):
    return float(SCHEDULE(count))


def sgd_with_schedule():
    return third_party.optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE))


def test_schedule_count_of_the_transform_skips_with_the_step():
    tx = jaxscale.grad_scaler(sgd_with_schedule(), init_scale=4.0)
    params, opt_state = PARAMS, tx.init(PARAMS)
    for poison in POISONS:
        grads = jax.grad(lambda p, s=opt_state, z=poison: jaxscale.scale(jnp.sum(p["w"]) * z, s))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    inner = opt_state.inner_state
    assert int(inner.count) == 2  # PyTorch's scheduler.step() would have counted 4
    assert float(inner.hyperparams["learning_rate"]) == learning_rate_after(1)


def test_schedule_count_of_the_facade_skips_with_the_step():
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, sgd_with_schedule(), wrt=nnx.Param)
    scaler = GradScaler(init_scale=4.0)

    @nnx.jit
    def step(model, optimizer, scaler, poison):
        grads = nnx.grad(lambda m: scaler.scale(jnp.sum(m(jnp.ones((1, 3)))) * poison))(model)
        scaler.step(optimizer, model, grads)
        scaler.update()

    for poison in POISONS:
        step(model, optimizer, scaler, jnp.float32(poison))
    assert int(optimizer.step[...]) == 2
    assert int(optimizer.opt_state.count[...]) == 2
    assert scaler.skipped_steps() == 2


def test_schedule_count_of_train_state_and_optax_triple_skip_with_the_step():
    tx = sgd_with_schedule()
    state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    params, opt_state = PARAMS, tx.init(PARAMS)
    scaler = GradScaler(init_scale=4.0)
    for poison in POISONS:
        grads = jax.grad(lambda p, z=poison: scaler.scale(jnp.sum(p["w"]) * z))(PARAMS)
        state = scaler.step(state, grads=grads)
        scaler.update()
        grads = jax.grad(lambda p, z=poison: scaler.scale(jnp.sum(p["w"]) * z))(params)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
    assert int(state.step) == 2
    assert int(state.opt_state.count) == 2
    assert int(opt_state.count) == 2
