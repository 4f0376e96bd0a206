"""grad_scaler: the Optax transform, its skip semantics and its composition with optax."""

import contextlib
import copy
import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec
from support import machine, third_party

import jaxscale

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.array([0.5, -0.0, 0.0])}
X = jnp.linspace(0.0, 1.0, 8).reshape(2, 4)


def adam(learning_rate):
    return third_party.optimizer(optax.adam(learning_rate))


def sgd(learning_rate):
    return third_party.optimizer(optax.sgd(learning_rate))


def loss_fn(params, x=X):
    return jnp.mean((x @ params["w"] + params["b"][None, :]) ** 2)


def assert_close(got, expected, of_largest=0.0):
    """Equal to 1e-6 relative: for results of two differently compiled programs. With
    ``of_largest``, each element may also differ by that fraction of its leaf's largest
    magnitude (for an update that amplifies a rounding difference in a whole leaf)."""
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        e = np.asarray(e, np.float64)
        atol = max(1e-12, of_largest * float(np.abs(e).max(initial=0.0)))
        np.testing.assert_allclose(np.asarray(g, np.float64), e, rtol=1e-6, atol=atol)


def bits(tree):
    """A tree's leaves as raw bytes: equality means bitwise equality (-0.0 != 0.0)."""
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def scaled_grads(params, opt_state, poison=False):
    grads = jax.grad(lambda p: jaxscale.scale(loss_fn(p), opt_state))(params)
    return jax.tree.map(lambda g: jnp.where(poison, jnp.full_like(g, jnp.inf), g), grads)


def make_step(tx):
    @jax.jit
    def step(params, opt_state, poison):
        grads = scaled_grads(params, opt_state, poison)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, updates

    return step


def test_finite_step_is_the_inner_step_on_true_gradients():
    tx = jaxscale.grad_scaler(adam(1e-2), init_scale=2.0**10)
    opt_state = tx.init(PARAMS)
    new_params, new_state, _ = make_step(tx)(PARAMS, opt_state, False)

    inner = adam(1e-2)
    true_grads = jax.grad(loss_fn)(PARAMS)
    updates, inner_state = inner.update(true_grads, inner.init(PARAMS), PARAMS)
    assert_close(new_params, optax.apply_updates(PARAMS, updates))
    assert_close(new_state.inner_state, inner_state)
    assert not bool(jaxscale.found_inf(new_state))
    assert int(new_state.scaler.growth_tracker) == 1


def test_skipped_step_changes_nothing_but_the_scale():
    tx = jaxscale.grad_scaler(adam(1e-2), init_scale=2.0**10)
    step = make_step(tx)
    params, opt_state, _ = step(PARAMS, tx.init(PARAMS), False)  # Adam count is now 1
    new_params, new_state, updates = step(params, opt_state, True)
    assert bits(new_params) == bits(params)  # including the -0.0 bias entry
    assert np.signbit(np.asarray(new_params["b"])[1])
    assert bits(new_state.inner_state) == bits(opt_state.inner_state)
    assert int(new_state.inner_state[0].count) == 1  # Adam's step count did not advance
    assert all((np.asarray(u) == 0).all() for u in jax.tree.leaves(updates))
    assert bool(jaxscale.found_inf(new_state))
    assert float(jaxscale.get_scale(new_state)) == 2.0**9
    assert int(jaxscale.skipped_steps(new_state)) == 1


def test_a_skipped_step_emits_negative_zero_updates_that_keep_a_negative_zero_parameter():
    # -0.0 + -0.0 is -0.0, where -0.0 + 0.0 would be +0.0: only -0.0 updates leave
    # every parameter bitwise as it was.
    tx = jaxscale.grad_scaler(adam(1e-2), init_scale=2.0**10)
    new_params, _, updates = make_step(tx)(PARAMS, tx.init(PARAMS), True)
    assert all(np.signbit(np.asarray(u)).all() for u in jax.tree.leaves(updates))
    assert bits(new_params) == bits(PARAMS)
    assert np.signbit(np.asarray(new_params["b"])[1])
    assert float(new_params["b"][1]) == 0.0


def scripted_run(tx, script, mode):
    """Train through ``script`` (True = poison the gradients) with jit per step or one lax.scan."""
    opt_state = tx.init(PARAMS)
    if mode == "scan":

        def body(carry, poison):
            params, opt_state = carry
            grads = scaled_grads(params, opt_state, poison)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, opt_state), (params, opt_state)

        _, history = jax.lax.scan(body, (PARAMS, opt_state), jnp.asarray(script))
        return [jax.tree.map(lambda h, i=i: h[i], history) for i in range(len(script))]
    step = make_step(tx)
    params, history = PARAMS, []
    for poison in script:
        params, opt_state, _ = step(params, opt_state, poison)
        history.append((params, opt_state))
    return history


@pytest.mark.parametrize("mode", ["jit", "scan"])
def test_long_scripted_run_skips_exactly_the_poisoned_steps(mode, torch_reference):
    rng = np.random.default_rng(5)
    script = rng.random(300) < 0.2
    tx = jaxscale.grad_scaler(
        adam(1e-3), init_scale=2.0**8, growth_interval=7, growth_factor=1.5, backoff_factor=0.3
    )
    history = scripted_run(tx, script, mode)

    expected_scales, expected_trackers = torch_reference.update_scale_trajectory(
        2.0**8, script.astype(float), 1.5, 0.3, 7
    )
    scales = np.array([np.asarray(s.scaler.scale) for _, s in history])
    assert scales.view(np.uint32).tolist() == expected_scales.view(np.uint32).tolist()
    assert [int(s.scaler.growth_tracker) for _, s in history] == expected_trackers.tolist()

    # Reference: plain Adam, run only on the unpoisoned steps, on the same unscaled gradients.
    inner = adam(1e-3)
    params, inner_state, scaler_states = (
        PARAMS,
        inner.init(PARAMS),
        [tx.init(PARAMS)] + [s for _, s in history],
    )
    for t, poison in enumerate(script):
        before = (bits(params), bits(inner_state))
        if not poison:
            grads = jax.grad(lambda p, t=t: jaxscale.scale(loss_fn(p), scaler_states[t]))(params)
            grads, _ = jaxscale.unscale_and_check(grads, jaxscale.get_scale(scaler_states[t]))
            updates, inner_state = inner.update(grads, inner_state, params)
            params = optax.apply_updates(params, updates)
        got_params, got_state = history[t]
        np.testing.assert_allclose(
            np.asarray(got_params["w"]), np.asarray(params["w"]), rtol=1e-6, atol=1e-7
        )
        assert int(got_state.inner_state[0].count) == int(inner_state[0].count)
        if poison:
            previous = history[t - 1] if t else (PARAMS, tx.init(PARAMS))
            assert bits(got_params) == bits(previous[0])
            assert bits(got_state.inner_state) == bits(previous[1].inner_state)
            assert before[0] == bits(params)
    assert int(jaxscale.skipped_steps(history[-1][1])) == int(script.sum())


def test_one_compilation_serves_a_run_in_which_the_scale_changes():
    traces = []
    tx = jaxscale.grad_scaler(adam(1e-3), init_scale=4.0, growth_interval=2)

    @jax.jit
    def step(params, opt_state, poison):
        traces.append(1)
        grads = scaled_grads(params, opt_state, poison)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = PARAMS, tx.init(PARAMS)
    scales = set()
    for t in range(60):
        params, opt_state = step(params, opt_state, jnp.asarray(t % 5 == 4))
        scales.add(float(jaxscale.get_scale(opt_state)))
    assert len(scales) > 3
    assert len(traces) == 1
    assert step._cache_size() == 1


@pytest.mark.parametrize(
    "inner",
    [
        third_party.optimizer(optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))),
        third_party.optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)),
        third_party.optimizer(
            optax.chain(
                optax.clip_by_global_norm(0.05),
                optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
            )
        ),
    ],
    ids=["clip+sgd", "inject_hyperparams(adam)", "clip+inject_hyperparams(adamw)"],
)
def test_inner_chains_see_true_gradients(inner):
    tx = jaxscale.grad_scaler(inner, init_scale=2.0**12)
    new_params, new_state, _ = make_step(tx)(PARAMS, tx.init(PARAMS), False)
    updates, expected_state = inner.update(jax.grad(loss_fn)(PARAMS), inner.init(PARAMS), PARAMS)
    assert_close(new_params, optax.apply_updates(PARAMS, updates))
    assert_close(new_state.inner_state, expected_state)


def test_clipping_inside_sees_unscaled_norm():
    # With clipping outside the scaler the scaled norm (x 2**12) would always clip.
    inner = third_party.optimizer(optax.chain(optax.clip_by_global_norm(1e6), optax.sgd(1.0)))
    tx = jaxscale.grad_scaler(inner, init_scale=2.0**12)
    new_params, _, _ = make_step(tx)(PARAMS, tx.init(PARAMS), False)
    true_grads = jax.grad(loss_fn)(PARAMS)
    assert_close(new_params, jax.tree.map(lambda p, g: p - g, PARAMS, true_grads))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_parameter_dtypes_are_kept(dtype):
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    tx = jaxscale.grad_scaler(adam(1e-2), init_scale=2.0**4)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, poison):
        grads = jax.grad(lambda p: jaxscale.scale(loss_fn(p, X.astype(dtype)), opt_state))(params)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.full_like(g, jnp.inf), g), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
        return optax.apply_updates(params, updates), opt_state

    warns = contextlib.nullcontext()
    if np.dtype(dtype).itemsize == 2:  # a float16 or bfloat16 loss: the porting trap
        warns = pytest.warns(jaxscale.ScaleWarning, match=f"given a {np.dtype(dtype).name} loss")
    with warns:  # warned once, when the step is traced
        for poison in [False, True, False]:
            new_params, new_state = step(params, opt_state, poison)
            assert all(p.dtype == dtype for p in jax.tree.leaves(new_params))
            assert jax.tree.map(lambda x: (x.shape, x.dtype), new_state) == jax.tree.map(
                lambda x: (x.shape, x.dtype), opt_state
            )
            params, opt_state = new_params, new_state


def test_extra_args_are_forwarded_to_inner():
    def scale_by_extra_arg():
        def update_fn(updates, state, params=None, *, factor, **extra_args):
            del params, extra_args
            return jax.tree.map(lambda u: u * factor, updates), state

        return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)

    tx = jaxscale.grad_scaler(
        third_party.optimizer(optax.chain(scale_by_extra_arg(), optax.sgd(1.0))), init_scale=4.0
    )
    opt_state = tx.init(PARAMS)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 8.0), PARAMS)
    updates, _ = jax.jit(tx.update)(grads, opt_state, PARAMS, factor=jnp.float32(3.0))
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.full((4, 3), -6.0, np.float32))


def test_disabled_is_a_passthrough_with_zero_overhead():
    inner = adam(1e-2)
    tx = jaxscale.grad_scaler(inner, enabled=False)
    opt_state = tx.init(PARAMS)
    grads = jax.grad(loss_fn)(PARAMS)
    updates, new_state = tx.update(grads, opt_state, PARAMS)
    expected, expected_state = inner.update(grads, inner.init(PARAMS), PARAMS)
    assert bits(updates) == bits(expected)
    assert bits(new_state.inner_state) == bits(expected_state)
    assert float(jaxscale.get_scale(opt_state)) == 1.0
    assert not bool(jaxscale.found_inf(new_state))
    loss = jnp.float32(0.5)
    assert jaxscale.scale(loss, opt_state) is loss

    def count_equations(transform, state):
        return len(jax.make_jaxpr(lambda g, s: transform.update(g, s, PARAMS))(grads, state).eqns)

    assert count_equations(tx, opt_state) == count_equations(inner, inner.init(PARAMS))


def test_static_scale_never_changes_but_still_skips():
    tx = jaxscale.grad_scaler(sgd(0.1), init_scale=128.0, dynamic=False, growth_interval=1)
    history = scripted_run(tx, np.array([False, True, False, False, True]), "jit")
    assert [float(s.scaler.scale) for _, s in history] == [128.0] * 5
    assert bits(history[1][0]) == bits(history[0][0])
    assert int(jaxscale.skipped_steps(history[-1][1])) == 2


def test_hysteresis_and_bounds_are_wired_through():
    tx = jaxscale.grad_scaler(
        sgd(0.1), init_scale=64.0, hysteresis=2, min_scale=16.0, growth_interval=1000
    )
    history = scripted_run(tx, np.array([True, True, True, True, False]), "jit")
    assert [float(s.scaler.scale) for _, s in history] == [64.0, 32.0, 16.0, 16.0, 16.0]
    assert [bool(jaxscale.found_inf(s)) for _, s in history] == [True, True, True, True, False]


def test_state_structure_is_stable_for_scan_and_cond():
    tx = jaxscale.grad_scaler(adam(1e-3))
    opt_state = tx.init(PARAMS)
    grads = jax.grad(loss_fn)(PARAMS)

    def signature(tree):
        return jax.tree.structure(tree), [
            (x.shape, x.dtype, getattr(x, "weak_type", False)) for x in jax.tree.leaves(tree)
        ]

    _, new_state = jax.jit(tx.update)(grads, opt_state, PARAMS)
    assert signature(new_state) == signature(opt_state)
    updated = jax.lax.cond(
        jnp.asarray(True), lambda s: tx.update(grads, s, PARAMS)[1], lambda s: s, opt_state
    )
    assert signature(updated) == signature(opt_state)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"init_scale": 0.0}, ValueError, r"init_scale must be positive and finite in float32"),
        ({"init_scale": float("nan")}, ValueError, r"init_scale must be finite, got nan"),
        (
            {"init_scale": 8.0, "max_scale": 4.0},
            ValueError,
            r"init_scale must be <= max_scale=4.0, got 8.0",
        ),
        (
            {"init_scale": 1.0, "min_scale": 4.0},
            ValueError,
            r"init_scale must be >= min_scale=4.0, got 1.0",
        ),
        ({"growth_factor": 0.5}, ValueError, r"growth_factor must be > 1.0, got 0.5"),
        (
            {"backoff_factor": 1.5},
            ValueError,
            r"backoff_factor must be in the open interval \(0, 1\), got 1.5",
        ),
        (
            {"growth_interval": -3},
            ValueError,
            r"growth_interval must be an integer in \[1, 2\*\*31 - 1\], got -3",
        ),
        ({"enabled": 1}, TypeError, r"enabled must be a bool, got int 1"),
        ({"dynamic": "yes"}, TypeError, r"dynamic must be a bool, got str 'yes'"),
    ],
)
def test_bad_hyperparameters_are_rejected_once_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        jaxscale.grad_scaler(sgd(0.1), **kwargs)


def sharded_step(axis_name):
    """A model-parallel step: each of 4 devices holds and updates its own parameter shard."""
    mesh = Mesh(np.array(machine.devices(4)), ("model",))
    tx = jaxscale.grad_scaler(sgd(0.1), init_scale=8.0, axis_name=axis_name)
    shard, replicated = PartitionSpec("model"), PartitionSpec()
    # the scaler's state is replicated only when the skip decision is shared
    state_spec = replicated if axis_name else shard

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(shard, state_spec, shard),
        out_specs=(shard, state_spec),
        check_vma=axis_name is not None,
    )
    def step(params, opt_state, grads):
        if axis_name is None:
            opt_state = jax.tree.map(lambda x: x[0], opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        if axis_name is None:
            opt_state = jax.tree.map(lambda x: x[None], opt_state)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def test_axis_name_shares_the_skip_decision_under_shard_map():
    tx, step = sharded_step("model")
    params = jnp.ones(8)
    grads = jnp.full(8, 8.0).at[5].set(jnp.nan)  # only the device holding entries 4-5 sees a NaN
    new_params, new_state = step(params, tx.init(params), grads)
    assert bits(new_params) == bits(params)  # every shard skipped
    assert float(jaxscale.get_scale(new_state)) == 4.0
    assert bool(jaxscale.found_inf(new_state))
    new_params, new_state = step(params, tx.init(params), jnp.full(8, 8.0))
    np.testing.assert_array_equal(np.asarray(new_params), np.full(8, 0.9, np.float32))


def test_without_axis_name_each_device_decides_alone():
    tx, step = sharded_step(None)
    params = jnp.ones(8)
    per_device_state = jax.tree.map(lambda x: jnp.stack([x] * 4), tx.init(params))
    grads = jnp.full(8, 8.0).at[5].set(jnp.nan)
    new_params, new_state = step(params, per_device_state, grads)
    np.testing.assert_array_equal(np.asarray(new_state.scaler.scale), [8.0, 8.0, 4.0, 8.0])
    np.testing.assert_array_equal(
        np.asarray(new_params)[[0, 4, 5]], np.array([0.9, 1.0, 1.0], np.float32)
    )


def test_enabled_transform_rejects_the_state_of_a_disabled_one():
    disabled_state = jaxscale.grad_scaler(sgd(0.1), enabled=False).init(PARAMS)
    tx = jaxscale.grad_scaler(sgd(0.1))
    with pytest.raises(
        ValueError, match="this grad_scaler is enabled but was given the state of a disabled one"
    ):
        tx.update(jax.grad(loss_fn)(PARAMS), disabled_state, PARAMS)


def test_params_with_non_array_leaves_and_none_gradients_are_accepted_as_in_optax():
    # An Equinox model passed whole as params holds functions and integer buffers;
    # gradients from eqx.filter_grad are None there, and for frozen parameters.
    params = {"w": jnp.ones(2), "act": jax.nn.relu, "frozen": jnp.ones(3), "steps": jnp.int32(3)}
    grads = {"w": jnp.full(2, 4.0), "act": None, "frozen": None, "steps": None}
    tx = jaxscale.grad_scaler(optax.sgd(1.0), init_scale=4.0)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])
    assert updates["frozen"] is None
    # per-example gradients (a leading batch axis) match their parameter too
    per_example = {"w": jnp.ones((5, 2))}
    tx.update(per_example, tx.init({"w": jnp.zeros((5, 2))}), {"w": params["w"]})
    with pytest.raises(ValueError, match=r"the gradient at \['w'\] has shape \(5, 3\)"):
        tx.update({"w": jnp.ones((5, 3))}, tx.init({"w": jnp.zeros((5, 3))}), {"w": params["w"]})


# Each optimizer as optax.contrib has it; muon and sophia came after the oldest optax
# jaxscale supports, which has no such optimizer to test.
#
# Muon's Newton-Schulz iteration amplifies rounding: under JAX 0.12 XLA compiles it
# differently inside the scaler's program than alone (on the same gradients, bit for bit),
# and the updates differ by 6e-8 where the largest is 5e-3. Its updates are compared to
# 1e-4 of each leaf's largest; every other optimizer's to 1e-6 of each element.
OF_LARGEST = {"muon": 1e-4}
BEYOND_ELEMENTWISE = {
    "muon": ("muon", lambda contrib: contrib.muon(1e-2), {}),
    "schedule_free_adamw": (
        "schedule_free_adamw",
        lambda contrib: contrib.schedule_free_adamw(1e-2),
        {},
    ),
    "prodigy": ("prodigy", lambda contrib: contrib.prodigy(1.0), {}),
    "sophia": ("sophia", lambda contrib: contrib.sophia(1e-2), {"obj_fn": loss_fn}),
    "adam+reduce_on_plateau": (
        "reduce_on_plateau",
        lambda contrib: optax.chain(optax.adam(1e-2), contrib.reduce_on_plateau()),
        {"value": jnp.float32(0.5)},
    ),
}


@pytest.mark.parametrize(
    ("name", "make", "extra_args"),
    [
        pytest.param(name, make, extra_args, id=name)
        for name, (needs, make, extra_args) in BEYOND_ELEMENTWISE.items()
        if hasattr(optax.contrib, needs)
    ],
)
def test_optimizers_whose_update_computes_more_than_elementwise(name, make, extra_args):
    # Newton-Schulz matmuls (muon), an averaged iterate (schedule-free), global dot
    # products (prodigy), a Hessian estimate from a function of the parameters
    # (sophia), a state driven by an extra argument (reduce_on_plateau).
    inner = third_party.optimizer(make(optax.contrib))
    tx = jaxscale.grad_scaler(inner, init_scale=2.0**10)

    @jax.jit
    def step(params, opt_state, poison):
        grads = scaled_grads(params, opt_state, poison)
        return tx.update(grads, opt_state, params, **extra_args)

    opt_state = tx.init(PARAMS)
    updates, new_state = step(PARAMS, opt_state, False)
    grads = jax.grad(loss_fn)(PARAMS)
    reference = jax.jit(functools.partial(inner.update, **extra_args))
    expected, expected_state = reference(grads, inner.init(PARAMS), PARAMS)
    assert_close(updates, expected, of_largest=OF_LARGEST.get(name, 0.0))
    assert_close(new_state.inner_state, expected_state, of_largest=OF_LARGEST.get(name, 0.0))
    skipped, skipped_state = step(PARAMS, new_state, True)
    assert bits(skipped_state.inner_state) == bits(new_state.inner_state)
    assert all(np.signbit(np.asarray(u)).all() for u in jax.tree.leaves(skipped))
    assert float(jaxscale.get_scale(skipped_state)) == 2.0**9


def test_lookahead_takes_its_fast_and_slow_parameters_as_params():
    # optax.lookahead's update takes gradients of the fast parameters and params
    # holding both: the two trees differ in structure, as Optax allows.
    def lookahead():
        return third_party.optimizer(
            optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
        )

    tx = jaxscale.grad_scaler(lookahead(), init_scale=2.0**10)

    @jax.jit
    def step(params, opt_state, poison):
        grads = scaled_grads(params.fast, opt_state, poison)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def reference_step(params, opt_state):
        updates, opt_state = lookahead().update(jax.grad(loss_fn)(params.fast), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = reference = optax.LookaheadParams.init_synced(PARAMS)
    opt_state, reference_state = tx.init(params), lookahead().init(params)
    for _ in range(3):  # through a synchronisation of the slow parameters
        params, opt_state = step(params, opt_state, False)
        reference, reference_state = reference_step(reference, reference_state)
    assert_close(params, reference)
    assert_close(opt_state.inner_state, reference_state)
    skipped_params, skipped_state = step(params, opt_state, True)
    assert bits(skipped_params) == bits(params)
    assert bits(skipped_state.inner_state) == bits(opt_state.inner_state)
    assert float(jaxscale.get_scale(skipped_state)) == 2.0**9


def test_gradients_of_another_structure_are_named_when_the_optimizer_fails_on_them():
    tx = jaxscale.grad_scaler(adam(1e-2), init_scale=4.0)
    opt_state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"no gradient for parameter \['b'\]") as error:
        tx.update({"w": jnp.ones((4, 3))}, opt_state, PARAMS)
    # the optimizer's own error, with the mismatch named in a note
    assert error.value.__notes__ == [
        "the gradients do not match the parameters' tree structure: no gradient for parameter ['b']"
    ]
    # a shape mismatch is raised before the optimizer runs
    with pytest.raises(ValueError, match=r"the gradient at \['b'\] has shape \(2,\)"):
        tx.update({"w": jnp.ones((4, 3)), "b": jnp.ones(2)}, opt_state, PARAMS)


def test_an_attribute_of_the_wrapped_state_is_named_where_it_now_is():
    # code written for the unwrapped optimizer reads its state's attributes
    tx = jaxscale.grad_scaler(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
    opt_state = tx.init(PARAMS)
    with pytest.raises(AttributeError, match=r"read opt_state\.inner_state\.hyperparams") as e:
        opt_state.hyperparams  # noqa: B018
    assert e.value.name == "hyperparams"
    assert float(opt_state.inner_state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    # still an AttributeError: hasattr and getattr with a default behave as before
    assert not hasattr(opt_state, "hyperparams")
    assert getattr(opt_state, "hyperparams", None) is None
    with pytest.raises(AttributeError, match=r"^'GradScalerState' object has no attribute 'lr'$"):
        opt_state.lr  # noqa: B018
    # and the state stays an ordinary pytree and NamedTuple
    for same in (copy.deepcopy(opt_state), pickle.loads(pickle.dumps(opt_state))):
        assert jax.tree.structure(same) == jax.tree.structure(opt_state)


def test_a_schedule_free_optimizer_evaluates_through_the_inner_state():
    with third_party.standard_promotion():  # optax's schedule-free code mixes dtypes
        _schedule_free_steps()


def _schedule_free_steps():
    def scaled_loss(params, opt_state, spike):
        return jaxscale.scale(loss_fn(params) * spike, opt_state)

    tx = jaxscale.grad_scaler(optax.contrib.schedule_free_adamw(0.1), init_scale=8.0)
    params, opt_state = PARAMS, tx.init(PARAMS)
    for spike in (1.0, jnp.inf, 1.0):
        grads = jax.grad(scaled_loss)(params, opt_state, spike)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert int(jaxscale.skipped_steps(opt_state)) == 1
    evaluated = optax.contrib.schedule_free_eval_params(opt_state.inner_state, params)
    # the same as the unwrapped optimizer's over the two finite steps
    plain = optax.contrib.schedule_free_adamw(0.1)
    plain_params, plain_state = PARAMS, plain.init(PARAMS)
    for _ in range(2):
        grads = jax.grad(loss_fn)(plain_params)
        updates, plain_state = plain.update(grads, plain_state, plain_params)
        plain_params = optax.apply_updates(plain_params, updates)
    assert_close(params, plain_params)
    assert_close(evaluated, optax.contrib.schedule_free_eval_params(plain_state, plain_params))
    with pytest.raises(AttributeError, match=r"opt_state\.inner_state\.b1"):
        optax.contrib.schedule_free_eval_params(opt_state, params)


def test_an_update_calling_a_jitted_helper_that_closes_over_an_array():
    # the helper's program holds the array as a constant of its own: it is kept whole,
    # not inlined into the update's equations
    table = jnp.arange(4.0)
    helper = jax.jit(lambda g: g * table)

    def update(updates, state, params=None):
        return jax.tree.map(helper, updates), state

    tx = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    scaled = jaxscale.grad_scaler(tx, init_scale=4.0)
    params = {"w": jnp.ones(4)}
    state = scaled.init(params)
    grads = {"w": jnp.full(4, 4.0)}  # the scaled gradient of a loss whose gradient is 1
    updates, state = jax.jit(scaled.update)(grads, state, params)
    np.testing.assert_array_equal(updates["w"], np.arange(4.0))
    assert not bool(jaxscale.found_inf(state))
