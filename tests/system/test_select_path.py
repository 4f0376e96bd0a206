"""Every interface skips under jit, by a select, exactly as it does eagerly.

Under ``jit`` ``run_unless`` makes a skipped step by selecting the old state back
where the update computes the new one (on every platform); eagerly a Python
branch runs the update or not. These tests run every interface both ways through
a run with overflowing steps: the same decisions and scales, the same values,
and the skipped steps leave every array bitwise unchanged.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from support import third_party
from support.model_training import SmallMLP as MLP
from support.model_training import small_mlp_loss as loss_fn

import jaxscale

POISON = [False, False, True, False, True, False]


def eager(fn=None, **_):
    """Stands in for ``jax.jit``/``nnx.jit`` (with their keyword arguments): no tracing."""
    return fn if fn is not None else eager


def bits(tree):
    """The leaves as NumPy arrays: compared bit for bit within a run, closely across runs."""
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


def same_bits(a, b):
    return all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


def poisoned(grads, poison):
    return jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)


def run_nnx(jit=nnx.jit):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.adam(1e-2)), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(init_scale=256.0, growth_interval=2)

    @jit
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


def run_train_state(jit=jax.jit):
    state = train_state.TrainState.create(
        apply_fn=None, params=flat_params(), tx=third_party.optimizer(optax.adam(1e-2))
    )
    scaler = jaxscale.GradScaler(init_scale=256.0, growth_interval=2)
    graphdef, scaler_state = nnx.split(scaler)

    @jit
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


def run_optax_triple(jit=jax.jit):
    tx = third_party.optimizer(optax.adam(1e-2))
    params = flat_params()
    opt_state = tx.init(params)
    scaler = jaxscale.GradScaler(init_scale=256.0, growth_interval=2)

    @functools.partial(jit, donate_argnums=(0, 1))
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


def run_transform(jit=jax.jit):
    tx = jaxscale.grad_scaler(
        third_party.optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
        init_scale=256.0,
        growth_interval=2,
    )
    params = flat_params()
    opt_state = tx.init(params)

    @functools.partial(jit, donate_argnums=(0, 1))
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
def eager_histories():
    """Each interface's run without tracing: a Python branch decides every skip."""
    return {name: run(eager) for name, run in RUNS.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_select_skips_as_the_eager_branch_does(name, eager_histories):
    selected = RUNS[name]()
    branched = eager_histories[name]
    # the same decisions and scales, step by step
    assert [h[1:2] for h in selected] == [h[1:2] for h in branched]
    # the same values (XLA fuses a whole step, eagerly each operation runs alone: an ulp)
    for got, want in zip(selected, branched, strict=True):
        for x, y in zip(got[0], want[0], strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    # the poisoned steps (3rd and 5th) left every array bitwise unchanged; the others did not
    for history in (selected, branched):
        assert same_bits(history[2][0], history[1][0])
        assert same_bits(history[4][0], history[3][0])
        assert not same_bits(history[1][0], history[0][0])
        assert not same_bits(history[3][0], history[2][0])


def test_the_step_compiles_to_selects_not_loops():
    tx = jaxscale.grad_scaler(optax.sgd(0.1))
    params = flat_params()

    def step(params, opt_state):
        updates, opt_state = tx.update(params, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    text = jax.jit(step).lower(params, tx.init(params)).as_text()
    assert "stablehlo.while" not in text
    assert "stablehlo.select" in text
