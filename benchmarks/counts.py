"""Counts that must be zero: host traffic per step, and recompilations while the scale changes.

Runs 1,000 jitted train steps of a small model through ``jaxscale.grad_scaler``
and through ``jaxscale.GradScaler``, with an overflow injected every 7th step so
the scale backs off and grows throughout, and counts:

* compilations after the first (JAX's compile log);
* host transfers during the steps (``jax.transfer_guard("disallow")``: on a GPU
  this catches both directions; on the CPU, where device memory is host memory,
  only host-to-device);
* callback primitives in the step's jaxpr.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxscale

STEPS = 1000


class CompileCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Compiling" in record.getMessage() or "Finished XLA compilation" in record.getMessage():
            self.count += "Compiling" in record.getMessage()


def callbacks_in(fn, *args) -> int:
    text = str(jax.make_jaxpr(fn)(*args))
    return sum(text.count(name) for name in ["callback", "infeed", "outfeed"])


def transform_run() -> dict[str, int]:
    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    tx = jaxscale.grad_scaler(optax.adam(1e-3), growth_interval=3)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, poison):
        grads = jax.grad(
            lambda p: jaxscale.scale(jnp.sum(jnp.tanh(p["w"]) + p["b"][None, :]), opt_state)
        )(params)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    flags = jax.device_put(jnp.arange(STEPS) % 7 == 6)
    return run(step, (params, opt_state), flags, lambda state: jaxscale.get_scale(state[1]))


def facade_run() -> dict[str, int]:
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(growth_interval=3)
    graphdef, state = nnx.split((model, optimizer, scaler))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, poison):
        model, optimizer, scaler = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: scaler.scale(jnp.sum(jnp.tanh(m(jnp.ones((8, 64)))))))(model)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
        scaler.step(optimizer, model, grads)
        scaler.update()
        return (nnx.state((model, optimizer, scaler)),)

    flags = jax.device_put(jnp.arange(STEPS) % 7 == 6)
    return run(step, (state,), flags, lambda s: nnx.merge(graphdef, s[0])[2].get_scale())


def run(step, state, flags, read_scale) -> dict[str, int]:
    callbacks = callbacks_in(step, *state, flags[0])
    counter = CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    previous = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        state = step(*state, flags[0])  # the one compilation
        first = counter.count
        scales = set()
        per_step_flags = [flags[i] for i in range(STEPS)]
        jax.block_until_ready(per_step_flags)
        with jax.transfer_guard("disallow"):
            for i in range(1, STEPS):
                state = step(*state, per_step_flags[i])
                if i % 50 == 0:
                    with jax.transfer_guard("allow"):
                        scales.add(float(read_scale(state)))
        jax.block_until_ready(state)
    finally:
        jax.config.update("jax_log_compiles", previous)
        logger.removeHandler(counter)
    return {
        "steps": STEPS,
        "distinct scales seen": len(scales),
        "compilations": first,
        "recompilations": counter.count - first,
        "host transfers (transfer guard)": 0,  # any transfer would have raised
        "callbacks in the jaxpr": callbacks,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    out = {
        "jaxscale.grad_scaler(adam)": transform_run(),
        "jaxscale.GradScaler + nnx.Optimizer": facade_run(),
    }
    keys = list(next(iter(out.values())))
    print("| | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, row in out.items():
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")
    return out


if __name__ == "__main__":
    main()
