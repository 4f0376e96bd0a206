"""A jitted train step with grad_scaler(adam) never talks to the host.

Three independent checks, each with a positive control proving it can fail:
the jaxpr holds no callback primitive, the compiled HLO holds no host transfer,
callback or host memory space, and 50 steps run under
``jax.transfer_guard("disallow")`` (which on CPU can only police host-to-device
transfers: there, device memory is host memory).
"""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support import third_party

import jaxscale

PARAMS = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
X = jnp.ones((4, 16))
TX = jaxscale.grad_scaler(third_party.optimizer(optax.adam(1e-3)))

HOST_PRIMITIVE = re.compile(r"callback|infeed|outfeed|host")
HOST_HLO = re.compile(
    r"custom_call_target=\"[^\"]*callback[^\"]*\"|\b(outfeed|infeed|send|recv|send-done|recv-done)\(|pinned_host|S\(5\)"
)
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.-]+ = ")


def train_step(params, opt_state):
    def loss_fn(p):
        return jaxscale.scale(jnp.mean((X @ p["w"] + p["b"][None, :]) ** 2), opt_state)

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def leaky_step(params, opt_state):
    jax.debug.callback(lambda scale: None, jaxscale.get_scale(opt_state))
    return train_step(params, opt_state)


def primitives(jaxpr):
    """Every primitive name in a closed jaxpr, including nested ones (pjit, cond, scan)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= primitives(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= primitives(sub)
    return names


def host_primitives(step, *args):
    args = args or (PARAMS, TX.init(PARAMS))
    jaxpr = jax.make_jaxpr(step)(*args)
    return {name for name in primitives(jaxpr.jaxpr) if HOST_PRIMITIVE.search(name)}


def host_hlo(step, *args):
    args = args or (PARAMS, TX.init(PARAMS))
    hlo = jax.jit(step).lower(*args).compile().as_text()
    instructions = [
        re.sub(r", metadata=\{.*?\}", "", line)
        for line in hlo.splitlines()
        if INSTRUCTION.match(line)
    ]
    assert len(instructions) > 20
    return [match.group(0) for line in instructions for match in [HOST_HLO.search(line)] if match]


def test_jaxpr_has_no_callbacks():
    assert host_primitives(train_step) == set()
    assert host_primitives(leaky_step) == {"debug_callback"}


def test_compiled_hlo_has_no_host_transfer_or_callback():
    assert host_hlo(train_step) == []
    assert host_hlo(leaky_step) != []


def test_fifty_steps_run_with_host_transfers_disallowed():
    step = jax.jit(train_step)
    params, opt_state = jax.device_put((PARAMS, TX.init(PARAMS)))
    params, opt_state = step(params, opt_state)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        for _ in range(50):
            params, opt_state = step(params, opt_state)
        with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device transfer"):
            step({"w": PARAMS["w"], "b": np.zeros(8, np.float32)}, opt_state)
    assert float(jaxscale.get_scale(opt_state)) == 65536.0


def facade_step():
    """A pure NNX train step with GradScaler: scale, unscale_, step, update."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return self.linear(x)

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.adam(1e-3)), wrt=nnx.Param)
    scaler = jaxscale.GradScaler()
    graphdef, state = nnx.split((model, optimizer, scaler))

    def step(state):
        model, optimizer, scaler = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: scaler.scale(jnp.mean(m(X) ** 2)))(model)
        grads = scaler.unscale_(optimizer, grads)
        scaler.step(optimizer, model, grads)
        scaler.update()
        return nnx.state((model, optimizer, scaler))

    return step, state


def test_facade_step_has_no_callbacks_or_host_transfers():
    step, state = facade_step()
    assert host_primitives(step, state) == set()
    assert host_hlo(step, state) == []
