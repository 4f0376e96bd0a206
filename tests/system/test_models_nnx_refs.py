"""Flax NNX in its reference mode (``nnx.var_defaults(ref=True)``), trained as Flax's
own tests train it: each variable holds a ``jax.Ref``, the step is a plain
``jax.jit`` that writes the model and the optimizer in place, and the gradient is
taken of the parameters' values (``nnx.with_vars(params, ref=False)``).

A reference is an input of the program autocast evaluates and never one of its
outputs; BatchNorm's statistics are written through their references in their own
float32. The scaler skips a step bitwise through references as it does through
arrays. Flax's hijax mode is refused with a clear error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.model_training import assert_all_matmuls_in, assert_trains_like

import jaxscale

pytestmark = pytest.mark.usefixtures("under_standard_promotion")

# Flax 0.12.8 renamed vars_as to with_vars (and deprecated the old name)
with_vars = getattr(nnx, "with_vars", None) or nnx.vars_as


class Regressor(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.hidden(x))))


def _data() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(1), (64, 8))
    return x, jnp.sin(jnp.sum(x, axis=-1, keepdims=True))


def _reference_mode(tx: optax.GradientTransformation) -> tuple[Regressor, nnx.Optimizer]:
    with nnx.var_defaults(ref=True):
        model = Regressor(nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _is_ref(variable: nnx.Variable) -> bool:
    return isinstance(variable.get_raw_value(), jax.Ref)


def _optax_step():
    """Flax's reference-mode step, with ``jaxscale.grad_scaler`` as the optimizer."""

    @jax.jit
    def step(model, optimizer, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        opt_state = nnx.state(optimizer, nnx.OptState)

        def loss_fn(params):
            model = nnx.merge(graphdef, params, rest)
            loss = jnp.mean((jaxscale.autocast(model)(x) - y) ** 2)
            return jaxscale.scale(loss, opt_state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(with_vars(params, ref=False))
        optimizer.update(params, grads)
        return loss

    return step


def _float32_curve(x, y, steps: int) -> list[float]:
    """The same model and data in Flax's default mode, float32, with Flax's own loop."""
    model = Regressor(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, x, y)) for _ in range(steps)]


def test_reference_mode_trains_under_autocast_with_grad_scaler():
    x, y = _data()
    model, optimizer = _reference_mode(jaxscale.grad_scaler(optax.adam(1e-2)))
    step = _optax_step()
    curve = [float(step(model, optimizer, x, y)) for _ in range(60)]
    assert_trains_like(_float32_curve(x, y, 60), curve, rtol=0.1, label="reference mode")
    # the variables still hold references, the statistics in float32
    assert _is_ref(model.hidden.kernel)
    assert _is_ref(model.norm.mean)
    assert model.norm.mean[...].dtype == jnp.float32
    assert model.norm.var[...].dtype == jnp.float32
    opt_state = nnx.state(optimizer, nnx.OptState)
    assert int(optimizer.step[...]) == 60 - jaxscale.skipped_steps(opt_state)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, x):
        return jaxscale.autocast(nnx.merge(graphdef, params, rest))(x)

    assert_all_matmuls_in(jnp.float16, jax.make_jaxpr(forward)(with_vars(params, ref=False), x))


def test_the_statistics_are_written_through_their_references_in_float32():
    x, _ = _data()
    with nnx.var_defaults(ref=True):
        model = Regressor(nnx.Rngs(0))
    reference = Regressor(nnx.Rngs(0))  # the default mode, for the expected values
    mean_ref = model.norm.mean.get_raw_value()

    @jax.jit
    def forward(model, x):
        return jaxscale.autocast(model)(x)

    forward(model, x)
    jaxscale.autocast(model)(x)  # eagerly as well
    nnx.jit(lambda model, x: jaxscale.autocast(model)(x))(reference, x)
    jaxscale.autocast(reference)(x)

    assert model.norm.mean.get_raw_value() is mean_ref  # the same reference, written
    assert model.norm.mean[...].dtype == jnp.float32
    np.testing.assert_array_equal(model.norm.mean[...], reference.norm.mean[...])
    np.testing.assert_array_equal(model.norm.var[...], reference.norm.var[...])
    assert float(jnp.max(jnp.abs(model.norm.mean[...]))) > 0  # they moved


def _trained_values(model, optimizer) -> list[np.ndarray]:
    """The parameters and Adam's moments (every array of the optimizer's state that is
    not a scalar count): what a skipped step must leave bitwise as it was. BatchNorm's
    statistics are not among them: a forward pass of an overflowing batch writes them,
    as in PyTorch, where the scaler skips the optimizer only."""
    leaves = jax.tree.leaves((nnx.state(model, nnx.Param), nnx.state(optimizer, nnx.OptState)))
    return [np.asarray(leaf[...]) for leaf in leaves if np.ndim(leaf[...]) > 0]


def test_a_grad_scaler_step_that_overflows_is_skipped_bitwise_through_references():
    x, y = _data()
    model, optimizer = _reference_mode(
        jaxscale.grad_scaler(optax.adam(1e-2), init_scale=1024.0, growth_interval=2)
    )
    step = _optax_step()
    step(model, optimizer, x, y)
    before = _trained_values(model, optimizer)
    assert len(before) == 6 * 3  # two kernels, two biases, BatchNorm's two, and moments
    step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
    for old, new in zip(before, _trained_values(model, optimizer), strict=True):
        np.testing.assert_array_equal(new, old)
    opt_state = nnx.state(optimizer, nnx.OptState)
    assert jaxscale.get_scale(opt_state) == 512.0
    assert jaxscale.skipped_steps(opt_state) == 1
    step(model, optimizer, x, y)
    assert not np.array_equal(_trained_values(model, optimizer)[0], before[0])


def test_the_grad_scaler_facade_steps_and_skips_a_reference_mode_optimizer():
    """``GradScaler`` built in reference mode, with a reference-mode ``nnx.Optimizer``:
    each field of its state a reference, written in place by a plain ``jax.jit`` step
    (nothing returned) and by ``nnx.jit``."""
    x, y = _data()
    with nnx.var_defaults(ref=True):
        model = Regressor(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        scaler = jaxscale.GradScaler(
            init_scale=1024.0, growth_interval=3, record_overflow_origin=True
        )
    held = jax.tree.leaves(nnx.state(scaler, jaxscale.ScalerVariable))
    assert len(held) == 5
    assert all(isinstance(leaf, jax.Ref) for leaf in held)

    def body(model, optimizer, scaler, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params):
            model = nnx.merge(graphdef, params, rest)
            return scaler.scale(jnp.mean((jaxscale.autocast(model)(x) - y) ** 2))

        located = jaxscale.locate_nonfinite(jax.grad(loss_fn))
        grads, report = located(with_vars(params, ref=False))
        scaler.step(optimizer, params, grads)
        scaler.update(nonfinite_report=report)

    steps = {"jax.jit": jax.jit(body), "nnx.jit": nnx.jit(body)}
    kernel_ref = model.hidden.kernel.get_raw_value()
    scales, moved, counts = [], [], []
    for i in range(10):
        before = np.asarray(model.hidden.kernel[...])
        batch = x.at[0, 0].set(jnp.inf) if i in (4, 8) else x
        steps["jax.jit" if i < 6 else "nnx.jit"](model, optimizer, scaler, batch, y)
        scales.append(scaler.get_scale())
        moved.append(not np.array_equal(before, model.hidden.kernel[...]))
        counts.append(int(optimizer.step[...]))
    # PyTorch's rule: growth after 3 finite steps, backoff and a skip on each overflow
    assert scales == [
        1024.0,
        1024.0,
        2048.0,
        2048.0,
        1024.0,
        1024.0,
        1024.0,
        2048.0,
        1024.0,
        1024.0,
    ]
    assert moved == [True] * 4 + [False] + [True] * 3 + [False, True]
    assert counts == [1, 2, 3, 4, 4, 5, 6, 7, 7, 8]
    assert model.hidden.kernel.get_raw_value() is kernel_ref
    assert jax.tree.leaves(nnx.state(scaler, jaxscale.ScalerVariable))[0] is held[0]
    origin = scaler.last_overflow_origin().describe()
    assert origin == "a value the function closes over, shape (64, 8): inf (float32)"
    assert scaler.state_dict()["_growth_tracker"] == 1
    scaler.load_state_dict({**scaler.state_dict(), "scale": 8.0})
    assert scaler.get_scale() == 8.0


def test_a_reference_mode_nnx_optimizer_is_skipped_bitwise_by_the_facade():
    x, y = _data()
    with nnx.var_defaults(ref=True):
        model = Regressor(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    scaler = jaxscale.GradScaler()

    @jax.jit
    def step(model, optimizer, scaler, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        grads = jax.grad(
            lambda p: scaler.scale(
                jnp.mean((jaxscale.autocast(nnx.merge(graphdef, p, rest))(x) - y) ** 2)
            )
        )(with_vars(params, ref=False))
        scaler.step(optimizer, params, grads)
        scaler.update()
        return scaler

    before = _trained_values(model, optimizer)
    scaler = step(model, optimizer, scaler, x.at[3, 1].set(jnp.nan), y)
    assert scaler.get_scale() == 32768.0
    for old, new in zip(before, _trained_values(model, optimizer), strict=True):
        np.testing.assert_array_equal(new, old)
    assert int(optimizer.step[...]) == 0
    scaler = step(model, optimizer, scaler, x, y)  # a finite step is written in place
    assert int(optimizer.step[...]) == 1
    assert not np.array_equal(_trained_values(model, optimizer)[0], before[0])


def test_hijax_mode_is_refused_with_a_clear_error():
    with nnx.var_defaults(hijax=True):
        model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    before = np.asarray(model.kernel[...])
    with pytest.raises(NotImplementedError, match=r"hijax mode \(nnx.var_defaults\(hijax=True\)\)"):
        jaxscale.autocast(model)(jnp.ones((3, 4)))
    np.testing.assert_array_equal(model.kernel[...], before)
