"""The optimizers :class:`GradScaler` can step, and how each one skips a step.

PyTorch's ``scaler.step(optimizer)`` finds the gradients on the parameters and
skips by not calling ``optimizer.step()``. In JAX the gradients are an argument
and a traced step always runs, so each supported optimizer gets an adapter that
says where its gradients are among ``step``'s arguments, how to run its update,
and how to make a skipped update change nothing:

* ``flax.nnx.Optimizer``: ``scaler.step(optimizer, model, grads, **kwargs)`` runs
  ``optimizer.update(model, grads, **kwargs)`` and returns its updates; a skipped
  step restores the model's and the optimizer's variables.
* ``flax.training.train_state.TrainState``: ``scaler.step(state, grads=grads)``
  returns ``state.apply_gradients(grads=grads)``, or ``state`` itself when skipped.
* an Optax transformation: ``scaler.step(tx, grads, opt_state, params)`` returns
  ``(updates, opt_state)`` as ``tx.update`` does; a skipped step returns ``-0.0``
  updates and the unchanged ``opt_state``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from flax.training import train_state

from jaxscale._skip import keep_unless, mask_updates

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


class Adapter:
    """How to find the gradients in ``step``'s arguments and how to run or skip a step."""

    name: str

    def grads(self, args: Args, kwargs: Kwargs) -> Any:
        raise NotImplementedError

    def with_grads(self, args: Args, kwargs: Kwargs, grads: Any) -> tuple[Args, Kwargs]:
        raise NotImplementedError

    def step(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        """Run the optimizer's update unconditionally."""
        raise NotImplementedError

    def step_unless(self, found_inf: jax.Array, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        """Run the update, then undo its effect when ``found_inf`` is true."""
        raise NotImplementedError


def _usage_error(name: str, usage: str) -> TypeError:
    return TypeError(f"scaler.step and scaler.unscale_ take a {name} as {usage}")


class NnxOptimizerAdapter(Adapter):
    """``optimizer.update(model, grads, /, **kwargs)``: grads are the second positional argument."""

    name = "flax.nnx.Optimizer"
    usage = "scaler.step(optimizer, model, grads)"

    def grads(self, args: Args, kwargs: Kwargs) -> Any:
        if len(args) < 2:
            raise _usage_error(self.name, self.usage)
        return args[1]

    def with_grads(self, args: Args, kwargs: Kwargs, grads: Any) -> tuple[Args, Kwargs]:
        return (args[0], grads, *args[2:]), kwargs

    def step(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return optimizer.update(*args, **kwargs)

    def step_unless(self, found_inf: jax.Array, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        model = args[0]
        # as_pure copies the arrays out: nnx.state alone would hold the Variables
        # themselves, which the update then changes in place.
        before = nnx.as_pure((nnx.state(model), nnx.state(optimizer)))
        updates = self.step(optimizer, args, kwargs)
        after = nnx.as_pure((nnx.state(model), nnx.state(optimizer)))
        kept_model, kept_optimizer = keep_unless(found_inf, before, after)
        nnx.update(model, kept_model)
        nnx.update(optimizer, kept_optimizer)
        return mask_updates(found_inf, updates)


class TrainStateAdapter(Adapter):
    """``state.apply_gradients(*, grads, **kwargs)``: grads are a keyword argument."""

    name = "flax TrainState"
    usage = "state = scaler.step(state, grads=grads)"

    def grads(self, args: Args, kwargs: Kwargs) -> Any:
        if args or "grads" not in kwargs:
            raise _usage_error(self.name, self.usage)
        return kwargs["grads"]

    def with_grads(self, args: Args, kwargs: Kwargs, grads: Any) -> tuple[Args, Kwargs]:
        return args, {**kwargs, "grads": grads}

    def step(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return optimizer.apply_gradients(*args, **kwargs)

    def step_unless(self, found_inf: jax.Array, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return keep_unless(found_inf, optimizer, self.step(optimizer, args, kwargs))


class OptaxAdapter(Adapter):
    """``tx.update(updates, state, params=None, **extra_args)``: grads come first."""

    name = "optax GradientTransformation"
    usage = "updates, opt_state = scaler.step(tx, grads, opt_state, params)"

    def grads(self, args: Args, kwargs: Kwargs) -> Any:
        if len(args) < 2:
            raise _usage_error(self.name, self.usage)
        return args[0]

    def with_grads(self, args: Args, kwargs: Kwargs, grads: Any) -> tuple[Args, Kwargs]:
        return (grads, *args[1:]), kwargs

    def step(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return optimizer.update(*args, **kwargs)

    def step_unless(self, found_inf: jax.Array, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        updates, new_state = self.step(optimizer, args, kwargs)
        return mask_updates(found_inf, updates), keep_unless(found_inf, args[1], new_state)


_ADAPTERS: list[tuple[Callable[[Any], bool], Adapter]] = [
    (lambda o: isinstance(o, nnx.Optimizer), NnxOptimizerAdapter()),
    (lambda o: isinstance(o, train_state.TrainState), TrainStateAdapter()),
    (lambda o: isinstance(o, optax.GradientTransformation), OptaxAdapter()),
]


def adapter_for(optimizer: Any) -> Adapter:
    """The adapter for ``optimizer``; ``TypeError`` naming its type if none fits."""
    for accepts, adapter in _ADAPTERS:
        if accepts(optimizer):
            return adapter
    raise TypeError(
        "scaler.step and scaler.unscale_ accept a flax.nnx.Optimizer, a flax TrainState or an "
        f"optax GradientTransformation, got {type(optimizer).__name__}"
    )
