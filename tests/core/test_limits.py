"""The counters at their limits: growth_tracker and skipped_steps saturate at 2**31 - 1.

A wrapped counter would turn negative: a tracker of -2**31 would need four billion
finite steps to grow again. Checked on the core rule, through the transform's
state, and through the facade (``load_state_dict`` and restored state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from jaxscale import GradScaler, init_scaler_state, update_scale

MAX = 2**31 - 1
PARAMS = {"w": jnp.ones(2)}


def run_rule(state, flags, mode, **rule):
    def step(s, f):
        return update_scale(s, f, **rule)

    if mode == "jit":
        step = jax.jit(step)
    history = []
    for flag in flags:
        state = step(state, jnp.asarray(flag))
        history.append(state)
    return history


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_growth_tracker_saturates_instead_of_wrapping(mode):
    history = run_rule(init_scaler_state(8.0, growth_tracker=MAX), [False] * 3, mode)
    assert [int(s.growth_tracker) for s in history] == [MAX, MAX, MAX]
    assert [float(s.scale) for s in history] == [8.0, 8.0, 8.0]


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("start", [MAX - 1, MAX])
def test_the_largest_growth_interval_grows_exactly_once(mode, start):
    history = run_rule(
        init_scaler_state(8.0, growth_tracker=start), [False] * 4, mode, growth_interval=MAX
    )
    assert [float(s.scale) for s in history] == [16.0] * 4
    assert [int(s.growth_tracker) for s in history] == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_skipped_steps_saturates_in_the_core(mode):
    state = init_scaler_state(8.0, skipped_steps=MAX - 1)
    history = run_rule(state, [True, True, False, True], mode)
    assert [int(s.skipped_steps) for s in history] == [MAX, MAX, MAX, MAX]
    assert [bool(s.found_inf) for s in history] == [True, True, False, True]


@pytest.mark.parametrize("value", [-1, 2**31])
def test_counters_outside_int32_are_refused(value):
    for name in ["skipped_steps", "growth_tracker"]:
        message = rf"^{name} must be in \[0, 2\*\*31\), got {value}$"
        with pytest.raises(ValueError, match=message):
            init_scaler_state(**{name: value})


def test_skipped_steps_saturates_in_the_transform_state():
    tx = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=8.0)
    opt_state = tx.init(PARAMS)
    opt_state = opt_state._replace(scaler=init_scaler_state(8.0, skipped_steps=MAX))
    update = jax.jit(tx.update)
    for _ in range(2):
        _, opt_state = update({"w": jnp.full(2, np.inf)}, opt_state, PARAMS)
    assert int(jaxscale.skipped_steps(opt_state)) == MAX
    assert float(jaxscale.get_scale(opt_state)) == 2.0


def test_the_facade_saturates_from_a_loaded_state_dict_and_from_restored_state():
    scaler = GradScaler(init_scale=8.0)
    state_dict = {**scaler.state_dict(), "_growth_tracker": MAX}
    scaler.load_state_dict(state_dict)
    tx = optax.sgd(0.1)
    opt_state = tx.init(PARAMS)

    def iteration(scaler, poison):
        grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"]) * poison))(PARAMS)
        scaler.step(tx, grads, opt_state, PARAMS)
        scaler.update()

    iteration(scaler, 1.0)
    assert scaler._get_growth_tracker() == MAX
    assert scaler.state_dict()["_growth_tracker"] == MAX
    scaler._set_scaler_state(init_scaler_state(8.0, skipped_steps=MAX))  # as a checkpoint would
    iteration(scaler, np.inf)
    assert scaler.skipped_steps() == MAX
    assert scaler.get_scale() == 4.0
