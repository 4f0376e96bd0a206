"""Was the step skipped, which leaf overflowed, and what to log: found_inf, skipped_steps,
nonfinite_leaves/nonfinite_paths and metrics, for the facade and the transform."""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support import paths, third_party

import jaxscale
from jaxscale import GradScaler

X, Y = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2), jnp.ones((4, 2))
EXAMPLES = paths.EXAMPLES


def world():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.sgd(0.1)), wrt=nnx.Param)
    return model, optimizer, GradScaler(init_scale=2.0**10, growth_interval=100)


def iteration(model, optimizer, scaler, poison):
    """One PyTorch-style iteration; returns the flags seen before and after update()."""
    grads = nnx.grad(lambda m: scaler.scale(jnp.mean((m(X) - Y) ** 2) * poison))(model)
    grads = scaler.unscale_(optimizer, grads)
    during = scaler.found_inf(optimizer), scaler.found_inf()
    scaler.step(optimizer, model, grads)
    scaler.update()
    after = scaler.found_inf(optimizer), scaler.found_inf(), scaler.skipped_steps()
    return during, after


POISONS = [1.0, np.inf, 1.0, np.nan, np.nan, 1.0]


@pytest.mark.parametrize("mode", ["eager", "nnx.jit"])
def test_found_inf_and_skipped_steps_follow_each_iteration(mode):
    model, optimizer, scaler = world()
    run = nnx.jit(iteration) if mode == "nnx.jit" else iteration
    skipped = 0
    for poison in POISONS:
        during, after = run(model, optimizer, scaler, jnp.float32(poison))
        bad = not np.isfinite(poison)
        skipped += bad
        assert [bool(f) for f in during] == [bad, bad]
        assert [bool(f) for f in after[:2]] == [bad, bad]
        assert int(after[2]) == skipped
        # outside the traced function: Python values, from the state
        assert scaler.found_inf() is bad
        assert scaler.found_inf(optimizer) is bad  # the iteration stepped one optimizer
        assert scaler.skipped_steps() == skipped
    assert skipped == 3


def test_inside_jit_they_are_traced_arrays():
    model, optimizer, scaler = world()

    @nnx.jit
    def step(model, optimizer, scaler):
        iteration(model, optimizer, scaler, jnp.float32(1.0))
        flag, count = scaler.found_inf(), scaler.skipped_steps()
        assert isinstance(flag, jax.core.Tracer)
        assert isinstance(count, jax.core.Tracer)
        return flag, count

    flag, count = step(model, optimizer, scaler)
    assert flag.dtype == jnp.bool_
    assert count.dtype == jnp.int32


def test_two_optimizers_each_report_their_own_flag():
    model_a, optimizer_a, scaler = world()
    model_b, optimizer_b, _ = world()

    @nnx.jit
    def step(model_a, optimizer_a, model_b, optimizer_b, scaler):
        def grads_of(model, poison):
            return nnx.grad(lambda m: scaler.scale(jnp.mean(m(X) ** 2) * poison))(model)

        scaler.step(optimizer_a, model_a, grads_of(model_a, jnp.float32(1.0)))
        scaler.step(optimizer_b, model_b, grads_of(model_b, jnp.float32(jnp.inf)))
        scaler.update()
        return scaler.found_inf(optimizer_a), scaler.found_inf(optimizer_b), scaler.found_inf()

    flags = step(model_a, optimizer_a, model_b, optimizer_b, scaler)
    assert [bool(f) for f in flags] == [False, True, True]
    assert scaler.found_inf() is True
    assert scaler.skipped_steps() == 1  # one iteration, however many optimizers skipped
    with pytest.raises(RuntimeError, match=r"^found_inf\(optimizer\): this optimizer's"):
        scaler.found_inf(optimizer_a)  # two optimizers' flags stayed in the traced function


def test_found_inf_before_any_step_and_when_disabled():
    _, optimizer, scaler = world()
    assert scaler.found_inf() is False
    assert scaler.skipped_steps() == 0
    with pytest.raises(RuntimeError, match="not checked in this iteration"):
        scaler.found_inf(optimizer)
    disabled = GradScaler(enabled=False)
    assert disabled.found_inf() is False
    assert disabled.found_inf(optimizer) is False
    assert disabled.skipped_steps() == 0


# -- which leaf -----------------------------------------------------------------------------------

TREE = {
    "dense": {"kernel": jnp.array([[1.0, np.inf]]), "bias": jnp.zeros(2)},
    "norm": {"scale": jnp.array([np.nan], jnp.bfloat16), "count": jnp.int32(3)},
    "half": jnp.array([65504.0], jnp.float16),
    "skip": None,
}


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_nonfinite_leaves_flags_each_leaf(mode):
    fn = jax.jit(jaxscale.nonfinite_leaves) if mode == "jit" else jaxscale.nonfinite_leaves
    flags = fn(TREE)
    assert jax.tree.structure(flags) == jax.tree.structure(TREE)
    assert flags["skip"] is None
    got = {jax.tree_util.keystr(p): bool(v) for p, v in jax.tree_util.tree_leaves_with_path(flags)}
    assert got == {
        "['dense']['bias']": False,
        "['dense']['kernel']": True,
        "['half']": False,
        "['norm']['count']": False,
        "['norm']['scale']": True,
    }


def test_nonfinite_leaves_checks_every_element_of_large_float32_leaves():
    # large leaves are folded before their check on CPU; an inf anywhere counts
    for position in [0, 12_345, 65_535]:
        leaf = jnp.zeros(65_536).at[position].set(-np.inf)
        assert bool(jax.jit(jaxscale.nonfinite_leaves)({"w": leaf})["w"])
    assert not bool(jaxscale.nonfinite_leaves({"w": jnp.full(65_536, 3e38)})["w"])


def test_nonfinite_paths_names_the_culprits():
    assert jaxscale.nonfinite_paths(TREE) == ["['dense']['kernel']", "['norm']['scale']"]
    # the jitted flags work as input too
    assert jaxscale.nonfinite_paths(jax.jit(jaxscale.nonfinite_leaves)(TREE)) == [
        "['dense']['kernel']",
        "['norm']['scale']",
    ]
    assert jaxscale.nonfinite_paths({"w": jnp.ones(3)}) == []


def test_nonfinite_paths_on_a_tree_of_floats_and_a_boolean_mask():
    # a mask among gradients or activations is a value, not a flag: only floats are read
    tree = {"mask": jnp.array([True, False]), "w": jnp.array([1.0, jnp.inf]), "b": jnp.ones(2)}
    assert jaxscale.nonfinite_paths(tree) == ["['w']"]
    assert jaxscale.nonfinite_paths({"mask": jnp.array([True]), "b": jnp.ones(2)}) == []


def test_the_checks_read_the_references_of_a_reference_mode_model():
    with nnx.var_defaults(ref=True):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    assert bool(jaxscale.all_finite(nnx.state(model)))
    assert jaxscale.nonfinite_paths(nnx.state(model)) == []
    model.bias[...] = jnp.array([0.0, jnp.nan])
    assert not bool(jaxscale.all_finite(nnx.state(model)))
    assert not bool(jax.jit(lambda m: jaxscale.all_finite(nnx.state(m)))(model))
    assert jaxscale.nonfinite_paths(nnx.state(model)) == ["['bias'].value"]
    flags = jax.jit(jaxscale.nonfinite_leaves)(nnx.state(model))
    assert jaxscale.nonfinite_paths(flags) == ["['bias'].value"]
    assert isinstance(model.bias.get_raw_value(), jax.Ref)  # read, not replaced


def test_nonfinite_paths_refuses_to_run_inside_jit():
    with pytest.raises(TypeError, match="cannot run inside jit"):
        jax.jit(jaxscale.nonfinite_paths)(TREE)


def test_nonfinite_paths_finds_the_poisoned_layer_of_the_flagship_model():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import char_lm
    finally:
        sys.path.remove(str(EXAMPLES))
    dataset = char_lm.Dataset.load()
    config = char_lm.Config(steps=1, width=32, layers=2, heads=2)
    model, _, _ = char_lm.build(config, dataset)
    x, y = next(dataset.batches("train", 2, config.seq_len, seed=0))
    with third_party.standard_promotion():
        # under jit: one compilation, where eagerly each operation compiles its own
        grads = nnx.jit(nnx.grad(lambda m: char_lm.loss_fn(m, x, y)))(model)
    assert jaxscale.nonfinite_paths(grads) == []
    # an overflow in one named layer: the second block's MLP up-projection
    kernel = grads["blocks"][1]["up"]["kernel"]
    kernel[...] = kernel[...].at[3, 5].set(np.inf)
    # keystr form; an nnx.Variable's array is its child "value"
    assert jaxscale.nonfinite_paths(grads) == ["['blocks'][1]['up']['kernel'].value"]


def test_error_for_a_non_array_leaf_names_it():
    with pytest.raises(TypeError, match=r"^leaf \['w'\]: expected an array, got str"):
        jaxscale.nonfinite_leaves({"w": "text"})


# -- metrics ---------------------------------------------------------------------------

KEYS = {"scale", "found_inf", "skipped_steps", "growth_tracker", "overflow_streak"}


def test_transform_metrics_are_the_state_arrays_and_need_no_host_sync():
    tx = jaxscale.grad_scaler(third_party.optimizer(optax.sgd(0.1)), init_scale=8.0)
    params = {"w": jnp.ones(2)}

    @jax.jit
    def step(params, opt_state, poison):
        grads = jax.grad(lambda p: jaxscale.scale(jnp.sum(p["w"]) * poison, opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jaxscale.metrics(opt_state)

    opt_state = tx.init(params)
    _, opt_state, values = step(params, opt_state, jnp.float32(np.inf))
    assert set(values) == KEYS
    assert {k: v.item() for k, v in values.items()} == {
        "scale": 4.0,
        "found_inf": True,
        "skipped_steps": 1,
        "growth_tracker": 0,
        "overflow_streak": 0,
    }
    # building the dict adds no operation: the jitted step returns the state's own arrays
    jaxpr = jax.make_jaxpr(jaxscale.metrics)(opt_state)
    assert jaxpr.eqns == []


def test_facade_metrics_match_the_transform_keys_and_values():
    model, optimizer, scaler = world()
    nnx.jit(iteration)(model, optimizer, scaler, jnp.float32(np.inf))
    values = scaler.metrics()
    assert set(values) == KEYS
    assert float(values["scale"]) == 512.0
    assert bool(values["found_inf"])
    assert int(values["skipped_steps"]) == 1
    disabled = GradScaler(enabled=False).metrics()
    assert {k: v.item() for k, v in disabled.items()} == {
        "scale": 1.0,
        "found_inf": False,
        "skipped_steps": 0,
        "growth_tracker": 0,
        "overflow_streak": 0,
    }


def test_opt_in_warnings_when_the_scale_is_out_of_range():
    scaler = GradScaler(init_scale=0.5)
    with pytest.warns(jaxscale.ScaleWarning, match=r"^the loss scale 0.5 is below 1:"):
        scaler.metrics(warn_below=1.0)
    scaler = GradScaler(init_scale=2.0**20, max_scale=2.0**20)
    with pytest.warns(jaxscale.ScaleWarning, match=r"^the loss scale 1.04858e\+06 is at or above"):
        scaler.metrics(warn_above=2.0**20)
    opt_state = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=4.0).init(jnp.zeros(1))
    with pytest.warns(jaxscale.ScaleWarning, match="below 8"):
        jaxscale.metrics(opt_state, warn_below=8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxscale.metrics(opt_state, warn_below=1.0, warn_above=8.0)  # in range: silent
        jaxscale.metrics(opt_state)  # no thresholds: never reads the scale


def test_a_scale_exactly_at_a_threshold():
    # below warn_below warns, at it does not; at warn_above warns, below it does not
    opt_state = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=4.0).init(jnp.zeros(1))
    scaler = GradScaler(init_scale=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxscale.metrics(opt_state, warn_below=4.0)
        scaler.metrics(warn_below=4.0)
        jaxscale.metrics(opt_state, warn_above=np.nextafter(np.float32(4.0), np.float32(5.0)))
    with pytest.warns(jaxscale.ScaleWarning, match="below 4.00001"):
        jaxscale.metrics(opt_state, warn_below=4.00001)
    with pytest.warns(jaxscale.ScaleWarning, match="at or above 4"):
        scaler.metrics(warn_above=4.0)


def test_thresholds_inside_jit_raise_instead_of_syncing():
    opt_state = jaxscale.grad_scaler(optax.sgd(0.1)).init(jnp.zeros(1))
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda s: jaxscale.metrics(s, warn_below=1.0))(opt_state)


def float16_adam_run(steps=5):
    """float16 parameters under grad_scaler(adam): Adam's eps=1e-8 is 0 in float16, so
    the first update writes NaN into the parameters, and every later step is skipped."""
    params = {"w": jax.random.normal(jax.random.key(0), (16, 16)).astype(jnp.float16)}
    x = jax.random.normal(jax.random.key(1), (8, 16)).astype(jnp.float16)
    tx = jaxscale.grad_scaler(third_party.optimizer(optax.adam(1e-3)))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss = lambda p: jaxscale.scale(jnp.mean((x @ p["w"]).astype(jnp.float32) ** 2), state)  # noqa: E731
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        with third_party.standard_promotion():
            params = optax.apply_updates(params, updates)
        return params, state, jaxscale.metrics(state, params=params)

    for _ in range(steps):
        params, state, values = step(params, state)
    return params, state, values


def test_metrics_say_whether_the_parameters_are_finite_without_a_host_sync():
    params, state, values = float16_adam_run()
    assert set(values) == KEYS | {"params_finite"}
    assert not bool(values["params_finite"])
    assert int(values["skipped_steps"]) == 4  # every step after the first
    jaxpr = jax.make_jaxpr(lambda s, p: jaxscale.metrics(s, params=p))(state, params)
    assert {e.primitive.name for e in jaxpr.eqns}.isdisjoint({"callback", "pure_callback"})
    fine = jaxscale.metrics(state, params={"w": jnp.ones(2), "n": jnp.int32(1)})
    assert bool(fine["params_finite"])


def test_the_skip_storm_warning_names_parameters_that_hold_nan():
    params, state, _ = float16_adam_run()
    with pytest.warns(jaxscale.ScaleWarning, match=r"parameters themselves hold inf or NaN "
                      r"\(\['w'\]\).*eps=1e-8 is 0 in float16.*master_weights"):  # fmt: skip
        jaxscale.metrics(state, params=params, warn_below=2.0**16)
    with pytest.warns(jaxscale.ScaleWarning, match=r"pass params= to metrics\(\)"):
        jaxscale.metrics(state, warn_below=2.0**16)


def test_the_facade_checks_an_nnx_models_parameters():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    scaler = GradScaler(init_scale=0.5)
    assert bool(scaler.metrics(params=model)["params_finite"])
    model.kernel[...] = model.kernel[...].at[0, 0].set(jnp.nan)
    values = scaler.metrics(params=model)
    assert not bool(values["params_finite"])
    with pytest.warns(jaxscale.ScaleWarning, match=r"\['kernel'\]"):
        scaler.metrics(params=model, warn_below=1.0)
