"""The optimizers :class:`GradScaler` can step, and how each one skips a step.

PyTorch's ``scaler.step(optimizer)`` finds the gradients on the parameters and
skips by not calling ``optimizer.step()``. In JAX the gradients are an argument
and a traced step always runs, so each supported optimizer gets an adapter that
says where its gradients are among ``step``'s arguments, how to run its update,
and how to make a skipped update change nothing:

* ``flax.nnx.Optimizer``: ``scaler.step(optimizer, model, grads, **kwargs)`` runs
  ``optimizer.update(model, grads, **kwargs)`` and returns its updates (``-0.0``
  when skipped); a skipped step leaves the model's and the optimizer's variables
  as they were.
* ``flax.training.train_state.TrainState``: ``scaler.step(state, grads=grads)``
  returns ``state.apply_gradients(grads=grads)``, or ``state`` itself when skipped.
* an Optax transformation: ``scaler.step(tx, grads, opt_state, params)`` returns
  ``(params, opt_state)`` after ``tx.update`` and ``optax.apply_updates``, or the
  unchanged pair when skipped. Like PyTorch's ``step``, it applies the update.

Each update runs through :func:`~jaxscale.core.run_unless` (``nnx.Optimizer``'s
through :func:`~jaxscale.core.update_unless`, which returns its updates too): a
select that reads back what it selected, so the parameters and optimizer state
are updated in place, never copied, and the predicate stays off the host. The gradients are
prepared (unscaled) inside it, so the unscaling fuses into the optimizer's own
pass instead of writing the unscaled gradients out first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from jaxscale._src.jaxprs import is_ref
from jaxscale._src.leaves import optax_params_mismatch, read_references, require_matching
from jaxscale._src.stateful_call import variable_path
from jaxscale.core import run_unless, update_unless

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Prepare = Callable[[Any], Any]


class Adapter:
    """How to find the gradients in ``step``'s arguments and how to run or skip a step."""

    name: str

    def grads(self, args: Args, kwargs: Kwargs) -> Any:
        raise NotImplementedError

    def params(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        """The parameters the gradients must match."""
        raise NotImplementedError

    def check_grads(self, optimizer: Any, args: Args, kwargs: Kwargs) -> ValueError | None:
        """``ValueError`` unless the gradients match the parameters' shapes; a mismatch of
        tree structure is returned, for the step to name if the update fails on it
        (``optax_params_mismatch``)."""
        return optax_params_mismatch(self.grads(args, kwargs), self.params(optimizer, args, kwargs))

    def step(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        """Run the optimizer's update unconditionally."""
        raise NotImplementedError

    def step_unless(
        self, found_inf: jax.Array, optimizer: Any, args: Args, kwargs: Kwargs, prepare: Prepare
    ) -> Any:
        """Run the update on ``prepare(grads)`` unless ``found_inf``; a skip changes nothing."""
        raise NotImplementedError


def _update_in_place(nodes: Any, held: Any, new: Any) -> None:
    """``nnx.update(nodes, new)``, where ``held`` is ``nnx.split(nodes)``'s state: a
    variable that holds a reference is written through it (``nnx.update`` would put
    an array in the reference's place, and inside ``jax.jit`` only on a copy)."""
    through = set()
    for (path, leaf), value in zip(
        jax.tree_util.tree_flatten_with_path(held)[0], jax.tree.leaves(new), strict=True
    ):
        if is_ref(leaf):
            leaf[...] = value
            through.add(variable_path(path))
    if through:
        new = nnx.filter_state(new, lambda path, _: tuple(path) not in through)
    nnx.update(nodes, new)


def _usage_error(name: str, usage: str) -> TypeError:
    return TypeError(f"for {name}, call {usage}")


class NnxOptimizerAdapter(Adapter):
    """``optimizer.update(model, grads, /, **kwargs)``: grads are the second positional argument."""

    name = "a flax.nnx.Optimizer"
    usage = "scaler.step(optimizer, model, grads)"

    def grads(self, args: Args, kwargs: Kwargs) -> Any:
        if len(args) < 2:
            raise _usage_error(self.name, self.usage)
        return args[1]

    def params(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return nnx.state(args[0], optimizer.wrt)

    def check_grads(self, optimizer: Any, args: Args, kwargs: Kwargs) -> ValueError | None:
        """``ValueError`` unless the gradients match the parameters ``wrt`` selects."""
        grads = self.grads(args, kwargs)
        params = self.params(optimizer, args, kwargs)
        require_matching(nnx.as_pure(grads), nnx.as_pure(params))
        return None

    def step(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return optimizer.update(*args, **kwargs)

    def step_unless(
        self, found_inf: jax.Array, optimizer: Any, args: Args, kwargs: Kwargs, prepare: Prepare
    ) -> Any:
        model, grads = args[0], args[1]
        # In Flax's reference mode (``nnx.var_defaults(ref=True)``) the variables hold
        # references: the update runs on their values and its result is written back
        # through them, so that the skip decides what they hold.
        graphdef, held = nnx.split((model, optimizer))
        state = read_references(held)

        def update(grads: Any, state: Any) -> tuple[Any, Any]:
            model, optimizer = nnx.merge(graphdef, state)
            updates = optimizer.update(model, prepare(grads), **kwargs)
            return updates, read_references(nnx.state((model, optimizer)))

        # A skipped step's updates are -0.0; each update is selected against it where
        # it is computed, and when the caller ignores the updates XLA drops them.
        updates, new_state = update_unless(found_inf, update, grads, state)
        _update_in_place((model, optimizer), held, new_state)
        return updates


class TrainStateAdapter(Adapter):
    """``state.apply_gradients(*, grads, **kwargs)``: grads are a keyword argument."""

    name = "a flax TrainState"
    usage = "state = scaler.step(state, grads=grads)"

    def grads(self, args: Args, kwargs: Kwargs) -> Any:
        if args or "grads" not in kwargs:
            raise _usage_error(self.name, self.usage)
        return kwargs["grads"]

    def params(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return optimizer.params

    def step(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return optimizer.apply_gradients(*args, **kwargs)

    def step_unless(
        self, found_inf: jax.Array, optimizer: Any, args: Args, kwargs: Kwargs, prepare: Prepare
    ) -> Any:
        def update(state: Any) -> Any:
            return self.step(state, args, {**kwargs, "grads": prepare(kwargs["grads"])})

        return run_unless(found_inf, update, optimizer)


class OptaxAdapter(Adapter):
    """``tx.update(updates, state, params, **extra_args)`` then ``optax.apply_updates``."""

    name = "an optax GradientTransformation"
    usage = "params, opt_state = scaler.step(tx, grads, opt_state, params)"

    def grads(self, args: Args, kwargs: Kwargs) -> Any:
        if len(args) != 3:
            raise _usage_error(self.name, self.usage)
        return args[0]

    def params(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        return args[2]

    def step(self, optimizer: Any, args: Args, kwargs: Kwargs) -> Any:
        if len(args) != 3:
            raise _usage_error(self.name, self.usage)
        grads, opt_state, params = args
        arrays, others = _arrays_and_others(params)
        updates, opt_state = optimizer.update(grads, opt_state, arrays, **kwargs)
        return _combined(optax.apply_updates(arrays, updates), others), opt_state

    def step_unless(
        self, found_inf: jax.Array, optimizer: Any, args: Args, kwargs: Kwargs, prepare: Prepare
    ) -> Any:
        grads, opt_state, params = args
        arrays, others = _arrays_and_others(params)

        def update(carry: tuple[Any, Any]) -> tuple[Any, Any]:
            arrays, opt_state = carry
            return self.step(optimizer, (prepare(grads), opt_state, arrays), kwargs)

        arrays, opt_state = run_unless(found_inf, update, (arrays, opt_state))
        return _combined(arrays, others), opt_state


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def _arrays_and_others(params: Any) -> tuple[Any, Any]:
    """``params`` split, as ``equinox.partition(params, equinox.is_array)`` splits a model:
    a tree of its arrays (``None`` elsewhere) and a tree of its other leaves (an Equinox
    model's activation functions and static fields), ``None`` where there is none."""
    leaves = jax.tree.leaves(params)
    if all(_is_array(leaf) for leaf in leaves):
        return params, None
    arrays = jax.tree.map(lambda leaf: leaf if _is_array(leaf) else None, params)
    others = jax.tree.map(lambda leaf: None if _is_array(leaf) else leaf, params)
    return arrays, others


def _combined(arrays: Any, others: Any) -> Any:
    if others is None:
        return arrays
    return jax.tree.map(
        lambda a, o: o if a is None else a, arrays, others, is_leaf=lambda node: node is None
    )


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
