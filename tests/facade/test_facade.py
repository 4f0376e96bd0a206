"""GradScaler: PyTorch's API, driving nnx.Optimizer, Linen TrainState and optax."""

import inspect
import io
import pickle
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from support import machine, third_party
from support.model_training import SMALL_X, SMALL_Y, SmallMLP, small_mlp_loss

from jaxscale import GradScaler

NOT_SCALED = (
    "This may indicate your script did not use scaler.scale(loss or outputs) "
    "earlier in the iteration."
)


MLP, X, Y, loss_fn = SmallMLP, SMALL_X, SMALL_Y, small_mlp_loss


def exactly(message):
    """A regex for ``message`` verbatim: nothing before it, and after it at most the note
    JAX appends to errors raised while tracing."""
    return "^" + re.escape(message) + r"(\n-+\nFor simplicity, JAX has removed .*)?$"


def new_nnx(tx=None):
    model = MLP(nnx.Rngs(0))
    tx = tx or third_party.optimizer(optax.adam(1e-2))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def values(tree):
    return [np.asarray(x).copy() for x in jax.tree.leaves(nnx.as_pure(nnx.state(tree)))]


def bits(tree):
    """A tree's leaves as raw bytes: equality means bitwise equality (-0.0 != 0.0)."""
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def snapshot(scaler):
    """Everything a failed call must leave unchanged."""
    return (
        scaler.get_scale(),
        scaler._get_growth_tracker(),
        scaler._rule,
        scaler._iteration.scale_called,
        {k: (r.stage, r.found_inf) for k, r in scaler._iteration.optimizers.items()},
    )


def poisoned(grads):
    return jax.tree.map(lambda g: jnp.full_like(g, jnp.inf), grads)


# -- construction --------------------------------------------------------------------


def test_signature_matches_pytorch(torch):
    ours = inspect.signature(GradScaler.__init__).parameters
    theirs = inspect.signature(torch.amp.GradScaler.__init__).parameters
    positional = [name for name, p in ours.items() if p.kind is not p.KEYWORD_ONLY]
    assert positional == list(theirs)
    extensions = [name for name, p in ours.items() if p.kind is p.KEYWORD_ONLY]
    assert extensions == [
        "min_scale",
        "max_scale",
        "axis_name",
        "hysteresis",
        "dynamic",
        "record_overflow_origin",
    ]
    for name in ["init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"]:
        assert ours[name].default == theirs[name].default
    assert ours["device"].default is None  # PyTorch's is "cuda"; None follows JAX's backend


def test_device_none_and_cpu_are_enabled():
    assert GradScaler().is_enabled()
    assert GradScaler("cpu").is_enabled()


@pytest.mark.parametrize(
    ("device", "name"), [("cuda", "CUDA"), ("gpu", "CUDA"), ("cuda:0", "CUDA"), ("tpu", "TPU")]
)
def test_missing_accelerator_warns_and_disables_as_pytorch(device, name):
    platform = "tpu" if name == "TPU" else "gpu"
    if machine.has_platform(platform):  # run on that accelerator: nothing is missing
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert GradScaler(device).is_enabled()
        return
    with pytest.warns(
        UserWarning,
        match=f"^jaxscale.GradScaler is enabled, but {name} is not available.  Disabling.$",
    ):
        scaler = GradScaler(device)
    assert not scaler.is_enabled()
    assert scaler.get_scale() == 1.0


def test_disabled_on_purpose_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not GradScaler("cuda", enabled=False).is_enabled()


def test_disabled_scaler_skips_factor_checks_as_pytorch():
    assert not GradScaler(growth_factor=0.5, enabled=False).is_enabled()


# -- scale ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_scale_keeps_containers(mode):
    # PyTorch's test_grad_scaling_scale, with a dict added.
    scaler = GradScaler(init_scale=2.0)
    t = jnp.full((1,), 4.0)
    outputs = (t, (t, t), [t, (t, t)], {"a": t})
    scale = jax.jit(scaler.scale) if mode == "jit" else scaler.scale
    scaled = scale(outputs)
    assert jax.tree.structure(scaled) == jax.tree.structure(outputs)
    assert isinstance(scaled[2], list)
    assert all(float(x[0]) == 8.0 for x in jax.tree.leaves(scaled))


def test_disabled_scale_returns_its_input():
    loss = jnp.float32(3.0)
    assert GradScaler(enabled=False).scale(loss) is loss


# -- misuse: PyTorch's messages, nothing changed -----------------------------------------------


def scaled_grads(scaler, model):
    return nnx.grad(lambda m: scaler.scale(loss_fn(m)))(model)


@pytest.mark.parametrize("method", ["unscale_", "step", "update"])
def test_calls_before_any_scale_raise_pytorch_message(method):
    scaler = GradScaler()
    model, optimizer = new_nnx()
    grads = nnx.grad(loss_fn)(model)
    call = {
        "unscale_": lambda: scaler.unscale_(optimizer, grads),
        "step": lambda: scaler.step(optimizer, model, grads),
        "update": lambda: scaler.update(),
    }[method]
    before = snapshot(scaler)
    with pytest.raises(
        AssertionError, match=exactly(f"Attempted {method} but _scale is None.  {NOT_SCALED}")
    ):
        call()
    assert snapshot(scaler) == before


def misuse_cases():
    """(name, setup calls, offending call, error, message) for an nnx optimizer."""
    return [
        ("second unscale_", ["unscale_"], "unscale_", RuntimeError,
         "unscale_() has already been called on this optimizer since the last update()."),
        ("unscale_ after step", ["step"], "unscale_", RuntimeError,
         "unscale_() is being called after step()."),
        ("second step", ["step"], "step", RuntimeError,
         "step() has already been called since the last update()."),
        ("update with nothing recorded", [], "update", AssertionError,
         "No inf checks were recorded prior to update."),
        ("step with a closure", [], "step_closure", RuntimeError,
         "Closure use is not currently supported if GradScaler is enabled."),
    ]  # fmt: skip


def apply_calls(scaler, model, optimizer, grads, calls):
    for call in calls:
        if call == "unscale_":
            grads = scaler.unscale_(optimizer, grads)
        elif call == "step":
            scaler.step(optimizer, model, grads)
        elif call == "step_closure":
            scaler.step(optimizer, model, grads, closure=lambda: None)
        else:
            scaler.update()


@pytest.mark.parametrize(
    ("name", "setup", "offending", "error", "message"), misuse_cases(), ids=lambda c: str(c)
)
def test_misuse_raises_pytorch_message_and_changes_nothing(name, setup, offending, error, message):
    scaler = GradScaler()
    model, optimizer = new_nnx()
    grads = scaled_grads(scaler, model)
    apply_calls(scaler, model, optimizer, grads, setup)
    before, params = snapshot(scaler), values(model)
    with pytest.raises(error, match=exactly(message)):
        apply_calls(scaler, model, optimizer, grads, [offending])
    assert snapshot(scaler) == before
    assert all(np.array_equal(a, b) for a, b in zip(values(model), params, strict=True))


@pytest.mark.parametrize(
    ("name", "setup", "offending", "error", "message"), misuse_cases(), ids=lambda c: str(c)
)
def test_misuse_raises_at_trace_time_under_nnx_jit(name, setup, offending, error, message):
    scaler = GradScaler(init_scale=64.0)
    model, optimizer = new_nnx()

    @nnx.jit(static_argnums=3)
    def run(model, optimizer, scaler, calls):
        apply_calls(scaler, model, optimizer, scaled_grads(scaler, model), calls)

    params = values(model)
    with pytest.raises(error, match=exactly(message)):
        run(model, optimizer, scaler, (*setup, offending))
    assert all(np.array_equal(a, b) for a, b in zip(values(model), params, strict=True))
    assert (scaler.get_scale(), scaler._get_growth_tracker()) == (64.0, 0)
    # the aborted trace leaves nothing behind: a correct step works at once
    run(model, optimizer, scaler, ("step", "update"))
    assert scaler._get_growth_tracker() == 1


def test_update_in_another_traced_function_is_explained():
    scaler = GradScaler()
    model, optimizer = new_nnx()

    @nnx.jit
    def step_only(model, optimizer, scaler):
        scaler.step(optimizer, model, scaled_grads(scaler, model))

    step_only(model, optimizer, scaler)
    with pytest.raises(
        RuntimeError, match=r"unscale_\(\) or step\(\) last ran in another traced function"
    ):
        scaler.update()
    with pytest.raises(
        AssertionError, match=exactly("No inf checks were recorded prior to update.")
    ):
        scaler.update()


def test_step_with_no_floating_gradients_raises_pytorch_message():
    scaler = GradScaler()
    scaler.scale(jnp.float32(1.0))
    tx = optax.sgd(0.1)
    with pytest.raises(AssertionError, match=r"^No inf checks were recorded for this optimizer.$"):
        scaler.step(tx, {"n": jnp.arange(3)}, tx.init({"n": jnp.zeros(3)}), {"n": jnp.arange(3)})


def test_unsupported_optimizer_is_named():
    scaler = GradScaler()
    scaler.scale(jnp.float32(1.0))
    with pytest.raises(
        TypeError,
        match=r"accept a flax\.nnx\.Optimizer, a flax TrainState or an optax "
        r"GradientTransformation, got dict",
    ):
        scaler.step({}, {"w": jnp.ones(2)})


@pytest.mark.parametrize(
    ("optimizer", "args", "message"),
    [
        (
            "nnx",
            ("model",),
            r"for a flax.nnx.Optimizer, call scaler.step\(optimizer, model, grads\)",
        ),
        (
            "trainstate",
            ("grads",),
            r"for a flax TrainState, call state = scaler.step\(state, grads=grads\)",
        ),
        (
            "optax",
            ("grads",),
            r"for an optax GradientTransformation, call params, opt_state = scaler.step",
        ),
    ],
)
def test_step_with_gradients_in_the_wrong_place_is_explained(optimizer, args, message):
    scaler = GradScaler()
    scaler.scale(jnp.float32(1.0))
    model, nnx_opt = new_nnx()
    grads = nnx.grad(loss_fn)(model)
    target = {
        "nnx": nnx_opt,
        "trainstate": train_state.TrainState.create(
            apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1)
        ),
        "optax": optax.sgd(0.1),
    }[optimizer]
    actual = {"model": model, "grads": grads}
    with pytest.raises(TypeError, match=message):
        scaler.step(target, *[actual[a] for a in args])


# -- the three optimizer kinds -------------------------------------------------------------------


def nnx_train_step(model, optimizer, scaler, poison):
    grads = scaled_grads(scaler, model)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
    scaler.step(optimizer, model, grads)
    scaler.update()


@pytest.mark.parametrize("mode", ["eager", "nnx.jit", "jax.jit"])
def test_nnx_optimizer_skips_and_backs_off(mode):
    scaler = GradScaler(init_scale=256.0, growth_interval=2)
    model, optimizer = new_nnx()
    if mode == "jax.jit":
        graphdef, state = nnx.split((model, optimizer, scaler))

        @jax.jit
        def pure_step(state, poison):
            model, optimizer, scaler = nnx.merge(graphdef, state)
            nnx_train_step(model, optimizer, scaler, poison)
            return nnx.state((model, optimizer, scaler))

        def step(poison):
            nonlocal state
            state = pure_step(state, poison)
            nnx.update((model, optimizer, scaler), state)
    else:
        runner = nnx.jit(nnx_train_step) if mode == "nnx.jit" else nnx_train_step

        def step(poison):
            runner(model, optimizer, scaler, jnp.asarray(poison))

    history = []
    for poison in [False, False, True, False]:
        before = values(model)
        step(poison)
        changed = not all(np.array_equal(a, b) for a, b in zip(values(model), before, strict=True))
        history.append(
            (scaler.get_scale(), scaler._get_growth_tracker(), changed, int(optimizer.step[...]))
        )
    assert history == [
        (256.0, 1, True, 1),
        (512.0, 0, True, 2),
        (256.0, 0, False, 2),
        (256.0, 1, True, 3),
    ]


def test_nnx_skip_restores_every_adam_moment():
    scaler = GradScaler(init_scale=256.0)
    model, optimizer = new_nnx()
    nnx_train_step(model, optimizer, scaler, False)
    before = values(optimizer)
    nnx_train_step(model, optimizer, scaler, True)
    assert all(np.array_equal(a, b) for a, b in zip(values(optimizer), before, strict=True))


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_nnx_step_returns_the_optimizers_updates_or_negative_zeros_when_skipped(mode):
    scale = 256.0

    def scaled_step(model, optimizer, poison):
        scaler = GradScaler(init_scale=scale)
        grads = scaled_grads(scaler, model)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
        return scaler.step(optimizer, model, grads)

    def plain_step(model, optimizer):
        # the scale is a power of two: unscaling the scaled gradients is exact
        return optimizer.update(model, nnx.grad(loss_fn)(model))

    if mode == "jax.jit":
        scaled_step, plain_step = nnx.jit(scaled_step), nnx.jit(plain_step)
    expected = plain_step(*new_nnx())
    model, optimizer = new_nnx()
    taken = scaled_step(model, optimizer, jnp.asarray(False))
    assert jax.tree.structure(taken) == jax.tree.structure(expected)
    for ours, theirs in zip(jax.tree.leaves(taken), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(ours, theirs)
        assert np.any(np.asarray(ours) != 0)
    skipped = scaled_step(model, optimizer, jnp.asarray(True))
    assert jax.tree.structure(skipped) == jax.tree.structure(expected)
    for update, like in zip(jax.tree.leaves(skipped), jax.tree.leaves(expected), strict=True):
        assert (update.shape, update.dtype) == (like.shape, like.dtype)
        assert np.all(np.asarray(update) == 0)
        assert np.all(np.signbit(update))
    # distinct buffers, as optimizer.update returns them: each can be donated
    pointers = [u.unsafe_buffer_pointer() for u in jax.tree.leaves(skipped)]
    assert len(set(pointers)) == len(pointers)


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_linen_train_state(mode):
    tx = third_party.optimizer(optax.adam(1e-2))
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones((2, 2))}, tx=tx)
    scaler = GradScaler(init_scale=64.0, growth_interval=1)

    def train_step(state, scaler, poison):
        grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] ** 2)))(state.params)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
        state = scaler.step(state, grads=grads)
        scaler.update()
        return state, scaler

    step = jax.jit(train_step) if mode == "jax.jit" else train_step
    state1, scaler = step(state, scaler, jnp.asarray(False))
    assert int(state1.step) == 1
    assert scaler.get_scale() == 128.0
    state2, scaler = step(state1, scaler, jnp.asarray(True))
    assert int(state2.step) == 1
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool((a == b).all()), state2.params, state1.params)
    )
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_optax_triple_applies_the_update_like_pytorch_step(mode):
    tx = third_party.optimizer(optax.adam(0.5))
    params = {"w": jnp.array([1.0, -0.0])}
    scaler = GradScaler(init_scale=4.0)

    def train_step(params, opt_state, scaler, poison):
        grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))(params)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    step = jax.jit(train_step) if mode == "jax.jit" else train_step
    stepped, opt_state, scaler = step(params, tx.init(params), scaler, jnp.asarray(False))
    # Adam's first step is lr * sign(g), up to its float32 bias corrections
    np.testing.assert_allclose(np.asarray(stepped["w"]), [0.5, -0.5], rtol=1e-5)
    skipped, skipped_state, scaler = step(stepped, opt_state, scaler, jnp.asarray(True))
    assert np.asarray(skipped["w"]).tobytes() == np.asarray(stepped["w"]).tobytes()
    assert int(skipped_state[0].count) == 1
    assert scaler.get_scale() == 2.0


def test_optax_triple_steps_lookahead_whose_params_hold_fast_and_slow_parameters():
    tx = third_party.optimizer(optax.lookahead(optax.sgd(0.5), sync_period=2, slow_step_size=0.5))
    params = optax.LookaheadParams.init_synced({"w": jnp.array([1.0, -0.0])})
    scaler = GradScaler(init_scale=4.0)

    @jax.jit
    def train_step(params, opt_state, scaler, poison):
        grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] ** 2)))(params.fast)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    opt_state = tx.init(params)
    params, opt_state, scaler = train_step(params, opt_state, scaler, jnp.asarray(False))
    np.testing.assert_array_equal(params.fast["w"], [0.0, 0.0])  # 1 - 0.5 * 2 * 1
    params, opt_state, scaler = train_step(params, opt_state, scaler, jnp.asarray(False))
    # the second fast step syncs: slow moves half-way to fast, and fast restarts there
    np.testing.assert_array_equal(params.slow["w"], [0.5, 0.0])
    np.testing.assert_array_equal(params.fast["w"], [0.5, 0.0])
    skipped, skipped_state, scaler = train_step(params, opt_state, scaler, jnp.asarray(True))
    assert bits(skipped) == bits(params)
    assert bits(skipped_state) == bits(opt_state)
    assert scaler.get_scale() == 2.0


def test_unscale_then_step_uses_the_recorded_decision():
    # found_inf is fixed at unscale_ time: grads made inf afterwards are stepped with.
    tx = optax.sgd(1.0)
    params = {"w": jnp.array([1.0])}
    scaler = GradScaler(init_scale=8.0)
    grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))(params)
    unscaled = scaler.unscale_(tx, grads)
    np.testing.assert_array_equal(np.asarray(unscaled["w"]), [1.0])
    stepped, _ = scaler.step(tx, {"w": jnp.array([jnp.inf])}, tx.init(params), params)
    assert np.isinf(np.asarray(stepped["w"])).all()


def test_two_optimizers_skip_separately_and_back_off_once():
    scaler = GradScaler(init_scale=128.0, growth_interval=1)
    tx0, tx1 = optax.sgd(1.0), optax.sgd(1.0)
    p0, p1 = {"w": jnp.array([1.0])}, {"w": jnp.array([2.0])}
    g = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))
    new0, _ = scaler.step(tx0, g(p0), tx0.init(p0), p0)
    new1, _ = scaler.step(tx1, poisoned(g(p1)), tx1.init(p1), p1)
    scaler.update()
    assert float(new0["w"][0]) == 0.0  # stepped: 1 - 1
    assert float(new1["w"][0]) == 2.0  # skipped
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize("overflowing", [0, 1])
def test_found_inf_between_step_and_update_is_any_optimizers(overflowing):
    # PyTorch sums the per-device found_inf of every optimizer: one overflow is enough
    scaler = GradScaler(init_scale=128.0)
    txs = [optax.sgd(1.0), optax.sgd(1.0)]
    params = [{"w": jnp.array([1.0])}, {"w": jnp.array([2.0])}]
    g = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))
    for i, (tx, p) in enumerate(zip(txs, params, strict=True)):
        grads = poisoned(g(p)) if i == overflowing else g(p)
        scaler.step(tx, grads, tx.init(p), p)
    assert scaler.found_inf() is True
    assert scaler.found_inf(txs[overflowing]) is True
    assert scaler.found_inf(txs[1 - overflowing]) is False
    scaler.update()
    assert scaler.found_inf() is True


def test_metrics_report_the_overflow_streak_apart_from_the_growth_tracker():
    scaler = GradScaler(init_scale=128.0, hysteresis=3)
    tx, params = optax.sgd(1.0), {"w": jnp.array([1.0])}
    g = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))
    for grads in (g(params), poisoned(g(params)), poisoned(g(params))):
        scaler.step(tx, grads, tx.init(params), params)
        scaler.update()
    metrics = scaler.metrics()
    assert int(metrics["overflow_streak"]) == 2  # two overflows tolerated so far
    assert int(metrics["growth_tracker"]) == 0
    assert float(metrics["scale"]) == 128.0


def test_disabled_step_runs_the_optimizer():
    scaler = GradScaler(enabled=False)
    model, optimizer = new_nnx()
    grads = poisoned(nnx.grad(loss_fn)(model))
    assert scaler.unscale_(optimizer, grads) is grads
    scaler.step(optimizer, model, grads)
    scaler.update()
    assert int(optimizer.step[...]) == 1
    assert scaler.state_dict() == {}


# -- update(new_scale), getters and setters ---------------------------------------


def test_update_with_new_scale_keeps_the_tracker():
    scaler = GradScaler(init_scale=8.0, growth_interval=3)
    tx = optax.sgd(1.0)
    params = {"w": jnp.ones(1)}
    scaler.step(
        tx, jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))(params), tx.init(params), params
    )
    scaler.update()
    assert scaler._get_growth_tracker() == 1
    scaler.update(new_scale=3.5)
    assert scaler.get_scale() == 3.5
    assert scaler._get_growth_tracker() == 1
    scaler.update(jnp.array([0.25]))
    assert scaler.get_scale() == 0.25


def test_getters_setters_and_validation():
    scaler = GradScaler()
    assert (
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (2.0, 0.5, 2000)
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (3.0, 0.25, 7)
    with pytest.raises(ValueError, match=r"growth_factor must be > 1\.0, got 0\.5"):
        scaler.set_growth_factor(0.5)
    assert scaler.get_growth_factor() == 3.0


def test_get_scale_is_a_python_float_outside_jit_and_an_array_inside():
    scaler = GradScaler(init_scale=4.0)
    assert type(scaler.get_scale()) is float

    @jax.jit
    def read(scaler):
        return scaler.get_scale() * 2

    assert float(read(scaler)) == 8.0


# -- checkpoints ------------------------------------------------------------------


def test_state_dict_is_pytorchs(torch):
    ours = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    theirs = torch.amp.GradScaler(
        "cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2
    )
    assert ours.state_dict() == theirs.state_dict()
    assert [type(v) for v in ours.state_dict().values()] == [
        type(v) for v in theirs.state_dict().values()
    ]


def test_pytorch_state_dict_test_numbers():
    # PyTorch's test_grad_scaling_state_dict, both ways round, with and without a prior scale().
    for scaled_first in [True, False]:
        s0 = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = GradScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        if scaled_first:
            s1.scale(jnp.full((1,), 4.0))
        s1.load_state_dict(s0.state_dict())
        assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor()) == (3.0, 4.0, 0.5)
        assert (s1.get_growth_interval(), s1._get_growth_tracker()) == (2, 0)


def test_state_dicts_move_between_pytorch_and_jaxscale(torch):
    torch_scaler = torch.amp.GradScaler(
        "cpu", init_scale=16.0, growth_factor=1.5, growth_interval=3
    )
    torch_scaler.scale(torch.ones(()))
    torch_scaler._growth_tracker.fill_(2)
    buffer = io.BytesIO()
    torch.save({"scaler": torch_scaler.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    ours = GradScaler()
    ours.load_state_dict(checkpoint["scaler"])
    assert ours.state_dict() == torch_scaler.state_dict()

    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == torch_scaler.state_dict()


def test_pickling_at_iteration_boundaries():
    scaler = GradScaler(init_scale=8.0, growth_interval=3)
    tx = optax.sgd(1.0)
    params = {"w": jnp.ones(1)}
    grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))(params)
    scaler.step(tx, grads, tx.init(params), params)
    with pytest.raises(
        AssertionError, match="may only be pickled at the beginning of an iteration"
    ):
        pickle.dumps(scaler)
    scaler.update()
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.state_dict() == scaler.state_dict()
    # as in PyTorch, the restored scaler starts as if scale() had not been called
    with pytest.raises(AssertionError, match="Attempted update but _scale is None"):
        restored.update()


def test_nnx_jit_with_donated_model_optimizer_and_scaler():
    scaler = GradScaler(init_scale=256.0, growth_interval=2)
    model, optimizer = new_nnx()
    step = nnx.jit(nnx_train_step, donate_argnums=(0, 1, 2))
    history = []
    for poison in [False, False, True, False]:
        before = values(model)  # numpy copies: the donated arrays are consumed
        step(model, optimizer, scaler, jnp.asarray(poison))
        changed = not all(np.array_equal(a, b) for a, b in zip(values(model), before, strict=True))
        history.append((scaler.get_scale(), changed, int(optimizer.step[...])))
    assert history == [(256.0, True, 1), (512.0, True, 2), (256.0, False, 2), (256.0, True, 3)]
