"""Every bad input jaxscale is tested with, what the user sees, and that nothing changed.

``CASES`` is the catalogue behind the errors guide's table "Bad input: what you see":
each row there is one case here, and ``test_readme_table_lists_every_case`` keeps
the two equal. A rejected call must raise the documented error and leave the
scaler, the model, the optimizer state and the parameters bitwise as they were;
an accepted call must do what its row says.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support import machine, paths, third_party

import jaxscale
from jaxscale import GradScaler


class Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


class World:
    """A training setup a few steps into a run, in the middle of an iteration.

    The scaler has grown its tracker and ``scale()`` has been called for the
    current iteration; the Optax transform's state has taken two steps.
    """

    def __init__(self) -> None:
        self.model = Model(nnx.Rngs(0))
        self.optimizer = nnx.Optimizer(
            self.model, third_party.optimizer(optax.adam(1e-2)), wrt=nnx.Param
        )
        self.scaler = GradScaler(init_scale=1024.0, growth_interval=10)
        x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
        for _ in range(3):
            grads = nnx.grad(lambda m: self.scaler.scale(jnp.mean(m(x) ** 2)))(self.model)
            self.scaler.step(self.optimizer, self.model, grads)
            self.scaler.update()
        self.grads = nnx.grad(lambda m: self.scaler.scale(jnp.mean(m(x) ** 2)))(self.model)
        self.tx = jaxscale.grad_scaler(third_party.optimizer(optax.adam(1e-2)))
        self.params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
        self.opt_state = self.tx.init(self.params)
        for _ in range(2):
            _, self.opt_state = self.tx.update(self.params, self.opt_state, self.params)

    def snapshot(self) -> Any:
        """Every bit a rejected call must leave as it was."""
        arrays = jax.tree.leaves(
            (
                nnx.as_pure(nnx.state((self.model, self.optimizer, self.scaler))),
                self.opt_state,
                self.params,
            )
        )
        iteration = self.scaler._iteration
        return (
            [(np.asarray(a).dtype, np.asarray(a).tobytes()) for a in arrays],
            self.scaler._rule,
            iteration.scale_called,
            {k: (r.stage, r.found_inf) for k, r in iteration.optimizers.items()},
        )


def other_device_scale() -> jax.Array:
    return jax.device_put(jnp.array(8.0, jnp.float32), machine.devices(2)[1])


# An Optax transformation's params may differ from its updates in structure (as
# optax.lookahead's do): a mismatch is named in a note when the optimizer fails on it.
NOTED = " (a note on the optimizer's own error)"


@dataclasses.dataclass(frozen=True)
class Case:
    area: str
    call: str  # what the user writes, as shown in docs/errors.md
    error: type[Exception] | None  # None: the input is accepted
    sees: str  # the message (a fragment of it), or what happens when accepted
    run: Callable[[World], Any]
    accepted: Callable[[World, Any], None] | None = None  # checks an accepted call's result

    @property
    def row(self) -> str:
        if self.error is None:
            return f"| {self.area} | `{self.call}` | accepted: {self.sees} |"
        outcome = f"`{self.error.__name__}`: {self.sees}"
        return f"| {self.area} | `{self.call}` | {outcome} |"


def _scaled_ones(world: World, result: Any) -> None:
    np.testing.assert_array_equal(result, np.full(3, 1024.0, np.float32))


def _same_empty_list(world: World, result: Any) -> None:
    assert result == []


def _moved_to_scale_device(world: World, result: Any) -> None:
    assert world.scaler.get_scale() == 8.0
    assert world.scaler._scaler_state.scale.devices() == {jax.devices()[0]}


def _int_leaf_untouched(world: World, result: Any) -> None:
    unscaled, found_inf = result
    assert unscaled["n"].dtype == jnp.int32
    assert int(unscaled["n"]) == 7
    assert not bool(found_inf)


def _none_leaf_kept(world: World, result: Any) -> None:
    unscaled, found_inf = result
    assert unscaled["skip"] is None
    assert not bool(found_inf)


def _empty_is_finite(world: World, result: Any) -> None:
    assert result == ({}, False)


def _both_empty_steps(world: World, result: Any) -> None:
    updates, state = result
    assert updates == {}
    assert int(state.inner_state[0].count) == 1


# fmt: off
CASES = [
    # -- hyperparameters -------------------------------------------------------------------------
    Case("constructor", "GradScaler(growth_factor=1.0)", AssertionError,
         "The growth factor must be > 1.0. (PyTorch's message)",
         lambda w: GradScaler(growth_factor=1.0)),
    Case("constructor", "GradScaler(backoff_factor=1.0)", AssertionError,
         "The backoff factor must be < 1.0. (PyTorch's message)",
         lambda w: GradScaler(backoff_factor=1.0)),
    Case("constructor", "GradScaler(backoff_factor=0.0)", ValueError,
         "backoff_factor must be in the open interval (0, 1), got 0.0",
         lambda w: GradScaler(backoff_factor=0.0)),
    Case("constructor", "GradScaler(backoff_factor=-0.5)", ValueError,
         "backoff_factor must be in the open interval (0, 1), got -0.5",
         lambda w: GradScaler(backoff_factor=-0.5)),
    Case("constructor", "GradScaler(init_scale=0.0)", ValueError,
         "init_scale must be positive and finite in float32",
         lambda w: GradScaler(init_scale=0.0)),
    Case("constructor", "GradScaler(init_scale=-1.0)", ValueError,
         "init_scale must be positive and finite in float32",
         lambda w: GradScaler(init_scale=-1.0)),
    Case("constructor", "GradScaler(init_scale=float('inf'))", ValueError,
         "init_scale must be finite, got inf",
         lambda w: GradScaler(init_scale=math.inf)),
    Case("constructor", "GradScaler(init_scale=float('nan'))", ValueError,
         "init_scale must be finite, got nan",
         lambda w: GradScaler(init_scale=math.nan)),
    Case("constructor", "GradScaler(init_scale=1e39)", ValueError,
         "init_scale must be positive and finite in float32",
         lambda w: GradScaler(init_scale=1e39)),
    Case("constructor", "GradScaler(growth_interval=0)", ValueError,
         "growth_interval must be an integer in [1, 2**31 - 1], got 0",
         lambda w: GradScaler(growth_interval=0)),
    Case("constructor", "GradScaler(growth_interval=-5)", ValueError,
         "growth_interval must be an integer in [1, 2**31 - 1], got -5",
         lambda w: GradScaler(growth_interval=-5)),
    Case("constructor", "GradScaler(growth_interval=2.5)", TypeError,
         "growth_interval must be an integer, got float 2.5",
         lambda w: GradScaler(growth_interval=2.5)),
    Case("constructor", "GradScaler(growth_interval=100.0)", TypeError,
         "growth_interval must be an integer, got float 100.0",
         lambda w: GradScaler(growth_interval=100.0)),
    Case("constructor", "GradScaler(growth_factor='2')", TypeError,
         "growth_factor must be a real number, got str '2'",
         lambda w: GradScaler(growth_factor="2")),
    Case("constructor", "GradScaler(growth_factor=jnp.array([2.0, 3.0]))", TypeError,
         "growth_factor must be a scalar number, got an array of shape (2,) and dtype float32",
         lambda w: GradScaler(growth_factor=jnp.array([2.0, 3.0]))),
    Case("constructor", "GradScaler(init_scale=jnp.ones(3))", TypeError,
         "init_scale must be a scalar number, got an array of shape (3,) and dtype float32",
         lambda w: GradScaler(init_scale=jnp.ones(3))),
    Case("constructor", "GradScaler(min_scale=8.0, max_scale=2.0)", ValueError,
         "min_scale must be <= max_scale, got min_scale=8.0 > max_scale=2.0",
         lambda w: GradScaler(min_scale=8.0, max_scale=2.0)),
    Case("constructor", "GradScaler(init_scale=1.0, min_scale=2.0)", ValueError,
         "init_scale must be >= min_scale=2.0, got 1.0",
         lambda w: GradScaler(init_scale=1.0, min_scale=2.0)),
    Case("constructor", "GradScaler(enabled='yes')", TypeError,
         "enabled must be a bool, got str 'yes'",
         lambda w: GradScaler(enabled="yes")),
    Case("constructor", "GradScaler('mps')", ValueError,
         "device must be 'cpu', 'cuda', 'gpu' or 'tpu', got 'mps'",
         lambda w: GradScaler("mps")),
    Case("constructor", "GradScaler(device=0)", TypeError,
         "device must be a string such as 'cpu' or 'cuda', got int",
         lambda w: GradScaler(device=0)),
    Case("transform", "grad_scaler(optax.sgd(0.1), growth_factor=1.0)", ValueError,
         "growth_factor must be > 1.0, got 1.0",
         lambda w: jaxscale.grad_scaler(optax.sgd(0.1), growth_factor=1.0)),
    Case("transform", "grad_scaler(optax.sgd(0.1), hysteresis=0)", ValueError,
         "hysteresis must be an integer in [1, 2**31 - 1], got 0",
         lambda w: jaxscale.grad_scaler(optax.sgd(0.1), hysteresis=0)),
    Case("transform", "grad_scaler(optax.sgd(0.1), init_scale=float('nan'))", ValueError,
         "init_scale must be finite, got nan",
         lambda w: jaxscale.grad_scaler(optax.sgd(0.1), init_scale=math.nan)),
    Case("setter", "scaler.set_growth_factor(0.5)", ValueError,
         "growth_factor must be > 1.0, got 0.5",
         lambda w: w.scaler.set_growth_factor(0.5)),
    Case("setter", "scaler.set_backoff_factor(1.5)", ValueError,
         "backoff_factor must be in the open interval (0, 1), got 1.5",
         lambda w: w.scaler.set_backoff_factor(1.5)),
    Case("setter", "scaler.set_growth_interval(0)", ValueError,
         "growth_interval must be an integer in [1, 2**31 - 1], got 0",
         lambda w: w.scaler.set_growth_interval(0)),
    Case("setter", "scaler.set_growth_interval('10')", TypeError,
         "growth_interval must be a real number, got str '10'",
         lambda w: w.scaler.set_growth_interval("10")),
    # -- scale() ---------------------------------------------------------------------------------
    Case("scale", "scaler.scale('loss')", TypeError,
         "can only scale floating arrays, got str at <root>",
         lambda w: w.scaler.scale("loss")),
    Case("scale", "scaler.scale(jnp.int32(3))", TypeError,
         "can only scale floating arrays, got dtype int32 at <root>",
         lambda w: w.scaler.scale(jnp.int32(3))),
    Case("scale", "scaler.scale({'loss': x, 'count': jnp.int32(1)})", TypeError,
         "can only scale floating arrays, got dtype int32 at ['count']",
         lambda w: w.scaler.scale({"loss": jnp.float32(1.0), "count": jnp.int32(1)})),
    Case("scale", "scaler.scale(jnp.ones(3))", None,
         "a non-scalar loss is scaled element by element, as PyTorch does",
         lambda w: w.scaler.scale(jnp.ones(3)), _scaled_ones),
    Case("scale", "scaler.scale([])", None,
         "an empty container comes back empty, as in PyTorch",
         lambda w: w.scaler.scale([]), _same_empty_list),
    # -- gradients -------------------------------------------------------------------------------
    Case("gradients", "scaler.step(optimizer, model, {'kernel': g})  # 'bias' missing",
         ValueError,
         "the gradients do not match the parameters' tree structure: "
         "no gradient for parameter ['linear']['bias']",
         lambda w: w.scaler.step(w.optimizer, w.model, _without_bias(w.grads))),
    Case("gradients", "tx.update({'w': g, 'b': g2, 'c': g3}, opt_state, params)", ValueError,
         "the gradients do not match the parameters' tree structure: "
         "a gradient at ['c'] with no parameter" + NOTED,
         lambda w: w.tx.update({"w": jnp.ones(3), "b": jnp.ones(2), "c": jnp.ones(1)},
                               w.opt_state, w.params)),
    Case("gradients", "tx.update({'w': jnp.ones(4), 'b': g}, opt_state, params)", ValueError,
         "the gradient at ['w'] has shape (4,), but its parameter has shape (3,)",
         lambda w: w.tx.update({"w": jnp.ones(4), "b": jnp.ones(2)}, w.opt_state, w.params)),
    Case("gradients", "tx.update({'w': g, 'b': jnp.ones(2, jnp.complex64)}, opt_state, params)",
         TypeError, "leaf ['b']: complex arrays are not supported, got dtype complex64",
         lambda w: w.tx.update({"w": jnp.ones(3), "b": jnp.ones(2, jnp.complex64)},
                               w.opt_state, w.params)),
    Case("gradients", "scaler.unscale_(optimizer, {'w': jnp.ones(2, jnp.complex64)})", TypeError,
         "leaf ['w']: complex arrays are not supported, got dtype complex64",
         lambda w: w.scaler.unscale_(w.optimizer, {"w": jnp.ones(2, jnp.complex64)})),
    Case("gradients", "scaler.step(optimizer, model, {})", AssertionError,
         "No inf checks were recorded for this optimizer. (PyTorch's message)",
         lambda w: w.scaler.step(w.optimizer, nnx.Dict(), {})),
    Case("gradients", "unscale_and_check({'w': g, 'n': jnp.int32(7)}, scale)", None,
         "integer (and bool, float0) leaves pass through unchanged and unchecked",
         lambda w: jaxscale.unscale_and_check({"w": jnp.ones(2), "n": jnp.int32(7)}, 2.0),
         _int_leaf_untouched),
    Case("gradients", "unscale_and_check({'w': g, 'skip': None}, scale)", None,
         "None leaves stay None",
         lambda w: jaxscale.unscale_and_check({"w": jnp.ones(2), "skip": None}, 2.0),
         _none_leaf_kept),
    Case("gradients", "unscale_and_check({}, scale)", None,
         "an empty tree is all finite",
         lambda w: jaxscale.unscale_and_check({}, 2.0), _empty_is_finite),
    Case("gradients", "tx.update({}, tx.init({}), {})", None,
         "empty gradients and parameters make an ordinary (empty) step",
         lambda w: w.tx.update({}, w.tx.init({}), {}), _both_empty_steps),
    # -- load_state_dict -------------------------------------------------------------------------
    Case("load_state_dict", "scaler.load_state_dict({})", RuntimeError,
         "The source state dict is empty, possibly because it was saved from a disabled "
         "instance of GradScaler. (PyTorch's message)",
         lambda w: w.scaler.load_state_dict({})),
    Case("load_state_dict", "load_state_dict(sd without '_growth_tracker')", KeyError,
         "GradScaler state_dict is missing ['_growth_tracker']",
         lambda w: w.scaler.load_state_dict(_dict_without("_growth_tracker"))),
    Case("load_state_dict", "load_state_dict({**sd, 'momentum': 0.9})", ValueError,
         "GradScaler state_dict has unknown keys ['momentum']",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "momentum": 0.9})),
    Case("load_state_dict", "load_state_dict({**sd, 'scale': 'big'})", TypeError,
         "scale must be a real number, got str 'big'",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "scale": "big"})),
    Case("load_state_dict", "load_state_dict({**sd, 'growth_interval': 2.5})", TypeError,
         "growth_interval must be an integer, got float 2.5",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "growth_interval": 2.5})),
    Case("load_state_dict", "load_state_dict({**sd, 'scale': float('nan')})", ValueError,
         "scale must be finite, got nan",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "scale": math.nan})),
    Case("load_state_dict", "load_state_dict({**sd, 'scale': float('inf')})", ValueError,
         "scale must be finite, got inf",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "scale": math.inf})),
    Case("load_state_dict", "load_state_dict({**sd, 'scale': -2.0})", ValueError,
         "scale must be positive and finite in float32",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "scale": -2.0})),
    Case("load_state_dict", "load_state_dict({**sd, '_growth_tracker': -1})", ValueError,
         "_growth_tracker must be in [0, 2**31), got -1",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "_growth_tracker": -1})),
    Case("load_state_dict", "load_state_dict({**sd, 'backoff_factor': 2.0})", ValueError,
         "backoff_factor must be in the open interval (0, 1), got 2.0",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "backoff_factor": 2.0})),
    Case("load_state_dict", "load_state_dict({**sd, 'scale': torch.ones(2)})", TypeError,
         "state_dict['scale'] must be a number, got a tensor of 2 elements",
         lambda w: w.scaler.load_state_dict({**_good_dict(), "scale": _torch_ones(2)})),
    Case("load_state_dict", "load_state_dict([('scale', 2.0)])", TypeError,
         "state_dict must be a dict, got list",
         lambda w: w.scaler.load_state_dict([("scale", 2.0)])),
    # -- the transform's helpers -----------------------------------------------------------------
    Case("helpers", "jaxscale.get_scale(optax.adam(1e-3).init(params))", ValueError,
         "expected one grad_scaler state in the tuple given, found none; pass the state of an "
         "optimizer built with jaxscale.grad_scaler(...)",
         lambda w: jaxscale.get_scale(optax.adam(1e-3).init(w.params))),
    Case("helpers", "jaxscale.skipped_steps(scaler)", ValueError,
         "expected one grad_scaler state in the GradScaler given, found none; a "
         "jaxscale.GradScaler answers this with its own methods: scaler.get_scale(), "
         "scaler.found_inf(), scaler.skipped_steps(), scaler.metrics()",
         lambda w: jaxscale.skipped_steps(w.scaler)),
    # -- update(new_scale) -----------------------------------------------------------------------
    Case("update", "scaler.update(1024)", AssertionError,
         "new_scale should be a float or a 1-element float array. Got int 1024.",
         lambda w: w.scaler.update(1024)),
    Case("update", "scaler.update(jnp.ones(2))", AssertionError,
         "new_scale should be a float or a 1-element float array. Got an array of shape (2,).",
         lambda w: w.scaler.update(jnp.ones(2))),
    Case("update", "scaler.update(jnp.array([4], jnp.int32))", AssertionError,
         "new_scale should be a float or a 1-element float array. Got dtype int32.",
         lambda w: w.scaler.update(jnp.array([4], jnp.int32))),
    Case("update", "scaler.update(float('nan'))", ValueError,
         "new_scale must be positive and finite in float32, got nan",
         lambda w: w.scaler.update(math.nan)),
    Case("update", "scaler.update(jnp.float32(0.0))", ValueError,
         "new_scale must be positive and finite in float32, got 0.0",
         lambda w: w.scaler.update(jnp.float32(0.0))),
    Case("update", "scaler.update(-1.0)", ValueError,
         "new_scale must be positive and finite in float32, got -1.0",
         lambda w: w.scaler.update(-1.0)),
    Case("update", "scaler.update(array on another device)", None,
         "moved to the device of the scale (PyTorch asserts the devices match)",
         lambda w: w.scaler.update(other_device_scale()), _moved_to_scale_device),
]
# fmt: on


def _torch_ones(count: int) -> Any:
    import torch  # only the cases that name torch need it (marked torch)

    return torch.ones(count)


def _without_bias(grads: Any) -> dict[str, Any]:
    return {"linear": {"kernel": grads["linear"]["kernel"]}}


def _good_dict() -> dict[str, Any]:
    return {
        "scale": 512.0,
        "growth_factor": 3.0,
        "backoff_factor": 0.25,
        "growth_interval": 7,
        "_growth_tracker": 2,
    }


def _dict_without(key: str) -> dict[str, Any]:
    return {k: v for k, v in _good_dict().items() if k != key}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.call, marks=[pytest.mark.torch] if "torch." in c.call else [])
        for c in CASES
    ],
)
def test_bad_input(case):
    world = World()
    before = world.snapshot()
    if case.error is None:
        assert case.accepted is not None
        case.accepted(world, case.run(world))
        return
    message = case.sees.removesuffix(" (PyTorch's message)").removesuffix(NOTED)
    with pytest.raises(case.error, match=re.escape(message)) as error:
        case.run(world)
    if case.sees.endswith(NOTED):
        assert error.value.__notes__ == [message]
    assert world.snapshot() == before


def test_a_good_state_dict_is_accepted_after_a_rejected_one():
    """All or nothing: a rejected dict changes nothing, and the scaler still takes a good one."""
    world = World()
    with pytest.raises(ValueError, match="_growth_tracker"):
        world.scaler.load_state_dict({**_good_dict(), "_growth_tracker": -1})
    world.scaler.load_state_dict(_good_dict())
    assert world.scaler.state_dict() == _good_dict()


def test_the_errors_guides_table_lists_every_case():
    guide = (paths.ROOT / "docs" / "errors.md").read_text()
    block = guide.split("<!-- bad-input-table -->")[1].strip().splitlines()
    table = block[: next(i for i, line in enumerate(block) if not line.startswith("|"))]
    rows = table[2:]  # below the header and its rule
    expected = [case.row for case in CASES]
    assert rows == expected, "docs/errors.md table out of date; expected:\n" + "\n".join(expected)
