"""Every way of training with loss scaling that the benchmarks compare, in one place.

Each recipe turns a loss ``loss(params, *batch)`` into a train step: the gradient of
the (scaled) loss, the inf/NaN check, the scale's update and Adam's update, skipped
when a gradient is not finite. jaxscale's interfaces are written as its README shows
them; the peers as their own documentation and examples show them:

* ``optax.apply_if_finite(adam, 10)``, Optax's wrapper (no loss scaling of its own);
* Flax's ``DynamicScale.value_and_grad`` followed by the ``jnp.where`` masking of
  Flax's ImageNet example;
* jmp's ``DynamicLossScale``: scale, grad, unscale, ``all_finite``, ``adjust``, then
  ``select_tree`` between the new and the old parameters and state.

A step is ``step(params, *state, *batch) -> (params, *state)``; :meth:`Recipe.stepper`
jits it with the parameters and the state donated, as a training loop does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training.dynamic_scale import DynamicScale

import jaxscale
from benchmarks.harness import JaxStepper

LEARNING_RATE = 1e-3
Loss = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A train step and the state it starts from."""

    init: Callable[[Any], tuple[Any, ...]]  # params -> the state after them
    step: Callable[..., tuple[Any, ...]]  # (params, *state, *batch) -> (params, *state)

    def stepper(self, params: Any, batch: tuple[Any, ...]) -> JaxStepper:
        """The step jitted with parameters and state donated, from fresh copies of ``params``."""
        params = jax.tree.map(jnp.copy, params)
        state = self.init(params)
        donated = tuple(range(1 + len(state)))
        step = jax.jit(self.step, donate_argnums=donated)
        return JaxStepper(step, (params, *state), batch)


def _adam() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


def _optax(tx: optax.GradientTransformation, loss: Loss, scaled: bool) -> Recipe:
    def step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any]:
        if scaled:
            grads = jax.grad(lambda p: jaxscale.scale(loss(p, *batch), opt_state))(params)
        else:
            grads = jax.grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return Recipe(lambda params: (tx.init(params),), step)


def plain(loss: Loss) -> Recipe:
    """Adam without loss scaling: the baseline."""
    return _optax(_adam(), loss, scaled=False)


def grad_scaler(loss: Loss) -> Recipe:
    """jaxscale's Optax transform around Adam."""
    return _optax(jaxscale.grad_scaler(_adam()), loss, scaled=True)


def apply_if_finite(loss: Loss) -> Recipe:
    """Optax's ``apply_if_finite`` around Adam."""
    return _optax(optax.apply_if_finite(_adam(), 10), loss, scaled=False)


def facade_triple(loss: Loss) -> Recipe:
    """jaxscale's PyTorch-style facade driving an Optax ``(tx, opt_state, params)`` triple."""
    tx = _adam()

    def step(params: Any, opt_state: Any, scaler: Any, *batch: Any) -> tuple[Any, Any, Any]:
        grads = jax.grad(lambda p: scaler.scale(loss(p, *batch)))(params)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    return Recipe(lambda params: (tx.init(params), jaxscale.GradScaler()), step)


def flax_dynamic_scale(loss: Loss) -> Recipe:
    """Flax's ``DynamicScale.value_and_grad``, then ``jnp.where`` on state and parameters."""
    tx = _adam()

    def step(params: Any, opt_state: Any, ds: Any, *batch: Any) -> tuple[Any, Any, Any]:
        ds, is_finite, _, grads = ds.value_and_grad(loss)(params, *batch)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = functools.partial(jnp.where, is_finite)
        return (
            jax.tree.map(keep, new_params, params),
            jax.tree.map(keep, new_opt_state, opt_state),
            ds,
        )

    return Recipe(lambda params: (tx.init(params), DynamicScale()), step)


def jmp_loss_scale(loss: Loss) -> Recipe:
    """jmp's ``DynamicLossScale``: scale, grad, unscale, check, adjust, ``select_tree``."""
    import jmp  # optional: only this recipe needs it

    tx = _adam()

    def step(params: Any, opt_state: Any, loss_scale: Any, *batch: Any) -> tuple[Any, Any, Any]:
        grads = jax.grad(lambda p: loss_scale.scale(loss(p, *batch)))(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_params, new_opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return new_params, new_opt_state, loss_scale

    return Recipe(
        lambda params: (tx.init(params), jmp.DynamicLossScale(jnp.float32(2.0**15))), step
    )


BASELINE = "optax.adam (baseline)"
RECIPES: dict[str, Callable[[Loss], Recipe]] = {
    BASELINE: plain,
    "jaxscale.grad_scaler(adam)": grad_scaler,
    "jaxscale.GradScaler, optax triple": facade_triple,
    "optax.apply_if_finite(adam)": apply_if_finite,
    "flax DynamicScale + jnp.where masking": flax_dynamic_scale,
    "jmp.DynamicLossScale + select_tree": jmp_loss_scale,
}
# Their per-leaf chains of reductions and selects take minutes and several GB to
# compile at 500 leaves on 2 cores: run only up to MAX_LEAVES_FOR_SLOW leaves.
SLOW_TO_COMPILE = ["flax DynamicScale + jnp.where masking", "jmp.DynamicLossScale + select_tree"]
MAX_LEAVES_FOR_SLOW = 100


class ParamLeaves(nnx.Module):
    """A dict of arrays as an NNX module: one ``nnx.Param`` per leaf (copies)."""

    def __init__(self, params: dict[str, jax.Array]):
        self.leaves = nnx.Dict({k: nnx.Param(jnp.copy(v)) for k, v in params.items()})

    def values(self) -> dict[str, jax.Array]:
        return {k: v[...] for k, v in self.leaves.items()}


def nnx_step(loss: Loss, with_scaler: bool) -> Callable[..., None]:
    """``nnx.Optimizer``'s step on a :class:`ParamLeaves` model, with or without
    ``jaxscale.GradScaler``: ``step(model, optimizer, [scaler,] *batch)``, in place."""

    def plain(model: ParamLeaves, optimizer: nnx.Optimizer, *batch: Any) -> None:
        optimizer.update(model, nnx.grad(lambda m: loss(m.values(), *batch))(model))

    def scaled(model: ParamLeaves, optimizer: nnx.Optimizer, scaler: Any, *batch: Any) -> None:
        grads = nnx.grad(lambda m: scaler.scale(loss(m.values(), *batch)))(model)
        scaler.step(optimizer, model, grads)
        scaler.update()

    return scaled if with_scaler else plain


def given_gradients(params: Any, grads: Any) -> jax.Array:
    """A loss whose gradient with respect to ``params`` is exactly ``grads``.

    ``sum(p * stop_gradient(g))`` is linear in ``p``: the backward pass is a
    multiplication of ``g`` by the loss's cotangent (the loss scale, for a scaled
    loss), fused into whatever reads it. So a step on it measures the optimizer and
    the scaler on gradients read from memory, as when they come from a backward pass.
    """
    return sum(
        (jnp.sum(p * jax.lax.stop_gradient(g)) for p, g in zip(
            jax.tree.leaves(params), jax.tree.leaves(grads), strict=True
        )),
        start=jnp.float32(0.0),
    )  # fmt: skip
