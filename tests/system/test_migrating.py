"""Loops written for Flax's ``DynamicScale`` and for jmp, ported to jaxscale line by line.

Each test runs the peer library itself, in the loop its own examples write (Flax's
ImageNet example masks parameters and optimizer state with ``jnp.where``; jmp's users
pick between new and old with ``select_tree``), and the same loop ported as the
README's "Moving from Flax's `DynamicScale` or jmp" says. Skipped steps and scales
are asserted exactly; parameters bitwise where the two programs round alike (jmp's
loop) and to float32 rounding where XLA fuses them differently (Flax's); where the
rules differ, the difference is asserted as measured.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from flax.training import train_state
from flax.training.dynamic_scale import DynamicScale
from support import machine

import jaxscale

pytestmark = pytest.mark.usefixtures("under_standard_promotion")

F16, F32 = jnp.float16, jnp.float32
# The loss of the third step is multiplied by this: its float32 value stays finite, but
# the float16 logits' gradient overflows, as a loss spike does in a float16 model.
SPIKE = 1e30


class HalfPrecisionNet(nn.Module):
    """Float16 compute set by hand on every layer, as Flax's ImageNet ResNet does."""

    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.Dense(16, dtype=F16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=F16)(x)
        return nn.Dense(3, dtype=F16)(nn.relu(x))


class TrainState(train_state.TrainState):
    batch_stats: dict
    dynamic_scale: DynamicScale | None = None


def _batches(count=6):
    rng = np.random.default_rng(0)
    for step in range(count):
        x = jnp.asarray(rng.normal(size=(8, 4)), F32)
        labels = jnp.asarray(rng.integers(0, 3, 8), jnp.int32)
        yield x, labels, jnp.float32(SPIKE if step == 2 else 1.0)


def _loss(state, params, batch):
    x, labels, spike = batch
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, x, train=True, mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), labels).mean()
    return loss * spike, updates


def _new_state(tx, dynamic_scale=None):
    model = HalfPrecisionNet()
    variables = model.init(jax.random.key(0), jnp.ones((1, 4)), train=False)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=tx,
        dynamic_scale=dynamic_scale,
    )


@jax.jit
def _flax_step(state, batch):
    # as Flax's ImageNet example: value_and_grad of the DynamicScale, then jnp.where
    grad_fn = state.dynamic_scale.value_and_grad(
        lambda params: _loss(state, params, batch), has_aux=True
    )
    dynamic_scale, is_fin, (_, updates), grads = grad_fn(state.params)
    new = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    keep = functools.partial(jnp.where, is_fin)
    return new.replace(
        opt_state=jax.tree.map(keep, new.opt_state, state.opt_state),
        params=jax.tree.map(keep, new.params, state.params),
        dynamic_scale=dynamic_scale,
    ), ~is_fin


@jax.jit
def _ported_step(state, batch):
    def scaled_loss(params):
        loss, updates = _loss(state, params, batch)
        return jaxscale.scale(loss, state.opt_state), updates

    grads, updates = jax.grad(scaled_loss, has_aux=True)(state.params)
    new = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return new, jaxscale.found_inf(new.opt_state)


def _requires_every_rounding():
    # Both loops round float16 values the same way only where XLA keeps every rounding
    # a program writes; a GPU's XLA drops some between operations it fuses, and two
    # programs that fuse differently can then differ in value, or even in whether a
    # float16 product overflowed.
    if not machine.keeps_every_rounding():
        pytest.skip(
            "compares two programs' float16 roundings: run with "
            "XLA_FLAGS=--xla_allow_excess_precision=false on this platform"
        )


def _same_to_rounding(ours, theirs):
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_a_dynamic_scale_loop_ported_to_grad_scaler_trains_alike():
    _requires_every_rounding()
    sgd = optax.sgd(0.05, momentum=0.9)
    flax_state = _new_state(sgd, DynamicScale())
    ported = _new_state(jaxscale.grad_scaler(sgd))
    skipped, scales = [], []
    for batch in _batches():
        flax_state, flax_skipped = _flax_step(flax_state, batch)
        ported, ported_skipped = _ported_step(ported, batch)
        assert bool(flax_skipped) == bool(ported_skipped)
        skipped.append(bool(ported_skipped))
        scales.append(float(jaxscale.get_scale(ported.opt_state)))
        assert float(flax_state.dynamic_scale.scale) == scales[-1]
        # The same unscaled gradients (bitwise: the scale is a power of two) and the
        # same skip. XLA fuses the two programs differently and rounds momentum's
        # multiply-add once or twice accordingly: Flax's step and the same step with no
        # scaler at all differ by as much, so parameters agree to float32 rounding.
        jax.tree.map(np.testing.assert_array_equal, ported.batch_stats, flax_state.batch_stats)
        for ours, theirs in [
            (ported.params, flax_state.params),
            (ported.opt_state.inner_state, flax_state.opt_state),
        ]:
            jax.tree.map(_same_to_rounding, ours, theirs)
    assert skipped == [False, False, True, False, False, False]
    assert scales == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0, 32768.0]
    assert int(jaxscale.skipped_steps(ported.opt_state)) == 1


def _scales_over_finite_steps(growth_interval, steps=7):
    params = {"w": jnp.ones(3)}
    loss = lambda p: jnp.sum(p["w"] ** 2)  # noqa: E731
    dynamic_scale = DynamicScale(growth_interval=growth_interval)
    tx = jaxscale.grad_scaler(optax.sgd(0.0), growth_interval=growth_interval)
    opt_state = tx.init(params)
    flax_scales, ours = [], []
    for _ in range(steps):
        dynamic_scale = dynamic_scale.value_and_grad(loss)(params).dynamic_scale
        flax_scales.append(float(dynamic_scale.scale))
        grads = jax.grad(lambda p, state: jaxscale.scale(loss(p), state))(params, opt_state)
        _, opt_state = tx.update(grads, opt_state, params)
        ours.append(float(jaxscale.get_scale(opt_state)))
    return flax_scales, ours


def test_the_scale_grows_one_step_sooner_than_dynamic_scale_grew_it():
    # PyTorch's rule grows the scale at the end of the growth_interval-th finite step;
    # DynamicScale at the end of the next one. growth_interval = N + 1 keeps its timing.
    flax_scales, ours = _scales_over_finite_steps(growth_interval=2)
    assert ours == [65536.0, 131072.0, 131072.0, 262144.0, 262144.0, 524288.0, 524288.0]
    assert flax_scales == [65536.0, 65536.0, 131072.0, 131072.0, 131072.0, 262144.0, 262144.0]
    flax_scales_at_3, _ = _scales_over_finite_steps(growth_interval=3)
    _, ours_at_4 = _scales_over_finite_steps(growth_interval=3 + 1)
    assert ours_at_4 == flax_scales_at_3


def _jmp_loop(params, batches, period):
    # as jmp's README writes it: the loss scaled, the gradients unscaled and checked,
    # the scale adjusted, and the new state selected against the old
    tx = optax.adam(1e-2)

    def scaled_loss(params, loss_scale, batch):
        return loss_scale.scale(_regression_loss(params, batch))

    def apply_optimizer(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def step(params, opt_state, loss_scale, batch):
        grads = loss_scale.unscale(jax.grad(scaled_loss)(params, loss_scale, batch))
        grads_finite = jmp.all_finite(grads)
        new = jmp.select_tree(
            grads_finite, apply_optimizer(params, opt_state, grads), (params, opt_state)
        )
        return *new, loss_scale.adjust(grads_finite)

    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**15), period=period)
    opt_state, trajectory = tx.init(params), []
    for batch in batches:
        params, opt_state, loss_scale = step(params, opt_state, loss_scale, batch)
        trajectory.append((params, float(loss_scale.loss_scale)))
    return trajectory


def _ported_jmp_loop(params, batches, period):
    tx = jaxscale.grad_scaler(
        optax.adam(1e-2), init_scale=2.0**15, growth_interval=period, min_scale=1.0
    )

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: jaxscale.scale(_regression_loss(p, batch), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state, trajectory = tx.init(params), []
    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
        trajectory.append((params, float(jaxscale.get_scale(opt_state))))
    return trajectory


def _regression_loss(params, batch):
    x, y, spike = batch
    prediction = (x.astype(F16) @ params["w"].astype(F16)).astype(F32) + params["b"]
    return jnp.mean((prediction - y) ** 2) * spike


def test_a_jmp_loop_ported_to_grad_scaler_trains_alike():
    _requires_every_rounding()
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(4, 2)), F32), "b": jnp.zeros(2, F32)}
    batches = [
        (
            jnp.asarray(rng.normal(size=(8, 4)), F32),
            jnp.asarray(rng.normal(size=(8, 2)), F32),
            jnp.float32(SPIKE if step == 4 else 1.0),
        )
        for step in range(8)
    ]
    theirs = _jmp_loop(params, batches, period=3)
    ours = _ported_jmp_loop(params, batches, period=3)
    # jmp grows on the period-th finite step, as PyTorch, and halves on an overflow:
    # the third step's float16 weight gradient overflows at 2**15 by itself, the fifth
    # is the spike, and the eighth ends three finite steps
    assert [scale for _, scale in ours] == [s for _, s in theirs] == [
        32768.0, 32768.0, 16384.0, 16384.0, 8192.0, 8192.0, 8192.0, 16384.0,
    ]  # fmt: skip
    # the same float16 forward and backward, bit for bit (the scales above say so); Adam's
    # float32 arithmetic to its last bit: the two steps are different programs, which
    # XLA may compile to different float32 roundings (JAX 0.12.1's CPU backend does,
    # by an ulp, in a step whose update it fuses into the parameter's addition)
    for (ours_params, _), (their_params, _) in zip(ours, theirs, strict=True):
        for ours_leaf, their_leaf in zip(jax.tree.leaves(ours_params),
                                         jax.tree.leaves(their_params), strict=True):  # fmt: skip
            np.testing.assert_array_max_ulp(np.asarray(ours_leaf), np.asarray(their_leaf), 2)


def test_jmp_forgets_its_minimum_scale_through_jit_and_grad_scaler_keeps_it():
    # the README's comparison: jmp's pytree flattening drops min_loss_scale
    loss_scale = jmp.DynamicLossScale(jnp.float32(8.0), min_loss_scale=jnp.float32(4.0))
    through_jit = jax.jit(lambda s: s)(loss_scale)
    assert float(through_jit.min_loss_scale) == 1.0
    assert float(through_jit.adjust(jnp.bool_(False)).adjust(jnp.bool_(False)).loss_scale) == 2.0

    tx = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=8.0, min_scale=4.0)
    params = {"w": jnp.ones(2)}
    opt_state = jax.jit(lambda s: s)(tx.init(params))
    inf_grads = {"w": jnp.full(2, jnp.inf)}
    for _ in range(2):
        _, opt_state = jax.jit(tx.update)(inf_grads, opt_state, params)
    assert float(jaxscale.get_scale(opt_state)) == 4.0
