"""Every interface skips by a select (GPU) exactly as by a loop (CPU, TPU).

On GPU ``run_unless`` makes a skipped step by selecting the old state back; on
CPU and TPU by a loop that runs the update zero times or once. These tests run
every interface both ways on the CPU, through a run with overflowing steps: the
same decisions and scales, the same values, and the skipped steps leave every
array bitwise unchanged.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import third_party
from flax import nnx
from flax.training import train_state
from test_facade import MLP, loss_fn

import jaxscale
from jaxscale.core import _skip
from jaxscale.facade import _optimizers

POISON = [False, False, True, False, True, False]


def forced(skip):
    """``run_unless`` with every traced skip made by ``skip``."""
    original = _skip.run_unless

    def run_unless(found_inf, fn, carry):
        if not isinstance(found_inf, jax.core.Tracer):
            return original(found_inf, fn, carry)
        return skip(found_inf, fn, carry)

    return run_unless


@pytest.fixture
def skip_as_on_gpu(monkeypatch):
    monkeypatch.setattr(_skip, "run_unless", forced(_skip.skip_by_select))
    monkeypatch.setattr(_optimizers, "run_unless", forced(_skip.skip_by_select))


def bits(tree):
    """The leaves as NumPy arrays: compared bit for bit within a run, closely across runs."""
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


def same_bits(a, b):
    return all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


def poisoned(grads, poison):
    return jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)


def run_nnx():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.adam(1e-2)), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(init_scale=256.0, growth_interval=2)

    @nnx.jit
    def step(model, optimizer, scaler, poison):
        grads = nnx.grad(lambda m: scaler.scale(loss_fn(m)))(model)
        scaler.step(optimizer, model, poisoned(grads, poison))
        scaler.update()

    history = []
    for poison in POISON:
        step(model, optimizer, scaler, jnp.asarray(poison))
        state = nnx.as_pure(nnx.state((model, optimizer)))
        history.append((bits(state), float(scaler.get_scale()), bool(scaler.found_inf())))
    return history


def flat_params():
    return {"w": jnp.linspace(-1.0, 1.0, 8), "b": jnp.full(3, 0.5)}


def quadratic(params):
    return sum(jnp.sum(p**2) for p in params.values())


def run_train_state():
    state = train_state.TrainState.create(
        apply_fn=None, params=flat_params(), tx=third_party.optimizer(optax.adam(1e-2))
    )
    scaler = jaxscale.GradScaler(init_scale=256.0, growth_interval=2)
    graphdef, scaler_state = nnx.split(scaler)

    @jax.jit
    def step(state, scaler_state, poison):
        scaler = nnx.merge(graphdef, scaler_state)
        grads = jax.grad(lambda p: scaler.scale(quadratic(p)))(state.params)
        state = scaler.step(state, grads=poisoned(grads, poison))
        scaler.update()
        return state, nnx.state(scaler)

    history = []
    for poison in POISON:
        state, scaler_state = step(state, scaler_state, jnp.asarray(poison))
        scale = float(nnx.merge(graphdef, scaler_state).get_scale())
        history.append((bits((state.params, state.opt_state, state.step)), scale))
    return history


def run_optax_triple():
    tx = third_party.optimizer(optax.adam(1e-2))
    params = flat_params()
    opt_state = tx.init(params)
    scaler = jaxscale.GradScaler(init_scale=256.0, growth_interval=2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, scaler, poison):
        grads = jax.grad(lambda p: scaler.scale(quadratic(p)))(params)
        params, opt_state = scaler.step(tx, poisoned(grads, poison), opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    history = []
    for poison in POISON:
        params, opt_state, scaler = step(params, opt_state, scaler, jnp.asarray(poison))
        history.append((bits((params, opt_state)), float(scaler.get_scale())))
    return history


def run_transform():
    tx = jaxscale.grad_scaler(
        third_party.optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
        init_scale=256.0,
        growth_interval=2,
    )
    params = flat_params()
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, poison):
        grads = jax.grad(lambda p: jaxscale.scale(quadratic(p), opt_state))(params)
        updates, opt_state = tx.update(poisoned(grads, poison), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, updates

    history = []
    for poison in POISON:
        params, opt_state, updates = step(params, opt_state, jnp.asarray(poison))
        scale = float(jaxscale.get_scale(opt_state))
        history.append((bits((params, opt_state.inner_state)), scale, bits(updates)))
    return history


RUNS = {
    "nnx.Optimizer": run_nnx,
    "TrainState": run_train_state,
    "optax triple": run_optax_triple,
    "grad_scaler transform": run_transform,
}


@pytest.fixture(scope="module")
def loop_histories():
    """Each interface's run with the skip as a CPU or TPU makes it (a loop)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_skip, "run_unless", forced(_skip.skip_by_loop))
        patch.setattr(_optimizers, "run_unless", forced(_skip.skip_by_loop))
        return {name: run() for name, run in RUNS.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_select_skips_as_the_loop_does(name, loop_histories, skip_as_on_gpu):
    selected = RUNS[name]()
    looped = loop_histories[name]
    # the same decisions and scales, step by step
    assert [h[1:2] for h in selected] == [h[1:2] for h in looped]
    # the same values (XLA may fuse the two programs' arithmetic differently: an ulp)
    for got, want in zip(selected, looped, strict=True):
        for x, y in zip(got[0], want[0], strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    # the poisoned steps (3rd and 5th) left every array bitwise unchanged; the others did not
    assert same_bits(selected[2][0], selected[1][0])
    assert same_bits(selected[4][0], selected[3][0])
    assert not same_bits(selected[1][0], selected[0][0])
    assert not same_bits(selected[3][0], selected[2][0])


def test_the_select_is_what_the_step_compiles_to_under_the_fixture(skip_as_on_gpu):
    tx = jaxscale.grad_scaler(optax.sgd(0.1))
    params = flat_params()

    def step(params, opt_state):
        updates, opt_state = tx.update(params, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    text = jax.jit(step).lower(params, tx.init(params)).as_text()
    assert "stablehlo.while" not in text
