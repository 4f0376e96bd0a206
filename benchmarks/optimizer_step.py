"""Optimizer-step overhead: Adam with each loss scaler, against Adam alone.

For every parameter layout (10M or 100M float32 parameters in 50 or 500 leaves)
each variant runs ``update`` + ``apply_updates`` under ``jax.jit`` with the
parameters and optimizer state donated, on the same finite gradients. Groups
and their baselines:

* Optax: ``optax.adam`` alone, against jaxscale's ``grad_scaler``, jaxscale's
  ``GradScaler`` driving the same Optax triple, ``optax.apply_if_finite``, Flax's
  ``DynamicScale`` (its ``value_and_grad`` post-processing followed by the
  ``jnp.where`` masking of Flax's ImageNet example) and ``jmp`` (``unscale``,
  ``all_finite``, ``adjust``, ``select_tree``);
* NNX: ``nnx.Optimizer.update`` under ``nnx.jit`` with model and optimizer
  donated, against the same step driven by ``jaxscale.GradScaler``;
* PyTorch: ``torch.optim.Adam.step()``, against ``GradScaler.step`` + ``update``
  (scale 1, so repeated in-place unscaling leaves the gradients as they are).
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import dynamic_scale as flax_dynamic_scale

import jaxscale
from benchmarks.harness import JaxStepper, Result, Stepper, measure

LEARNING_RATE = 1e-3


def tree(n_params: int, n_leaves: int, seed: int) -> dict[str, jax.Array]:
    size = n_params // n_leaves
    key = jax.random.key(seed)
    return {
        f"p{i:03d}": 1e-2 * jax.random.normal(jax.random.fold_in(key, i), (size,))
        for i in range(n_leaves)
    }


def fresh(params: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return jax.tree.map(jnp.copy, params)


# -- JAX variants: each returns a factory of a Stepper ---------------------------------------------


def wrapped_adam(wrap):
    def make(params, grads):
        tx = wrap(optax.adam(LEARNING_RATE))

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        p = fresh(params)
        return JaxStepper(step, (p, tx.init(p)), (grads,))

    return make


plain_adam = wrapped_adam(lambda tx: tx)


def facade_optax_triple(params, grads):
    tx = optax.adam(LEARNING_RATE)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, scaler, grads):
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    p = fresh(params)
    scaler = jaxscale.GradScaler()
    scaler.scale(jnp.float32(0.0))  # PyTorch's rule: scale() before the first step
    return JaxStepper(step, (p, tx.init(p), scaler), (grads,))


def flax_dynamic_scale_recipe(params, grads):
    """Flax's DynamicScale: the post-processing of its value_and_grad, then the ImageNet masking."""
    tx = optax.adam(LEARNING_RATE)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, ds, grads):
        grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / ds.scale, grads)
        finite = jnp.array(True)
        for g in jax.tree_util.tree_leaves(grads):
            finite &= jnp.all(jax.lax.is_finite(g))
        grow = ds.fin_steps == ds.growth_interval
        fin_scale = jnp.where(
            grow & finite,
            jnp.minimum(ds.scale * ds.growth_factor, jnp.finfo(jnp.float32).max),
            ds.scale,
        )
        new_scale = jnp.where(finite, fin_scale, ds.scale * ds.backoff_factor)
        ds = ds.replace(fin_steps=jnp.where(grow | ~finite, 0, ds.fin_steps + 1), scale=new_scale)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_opt_state = jax.tree.map(functools.partial(jnp.where, finite), new_opt_state, opt_state)
        new_params = jax.tree.map(functools.partial(jnp.where, finite), new_params, params)
        return new_params, new_opt_state, ds

    p = fresh(params)
    return JaxStepper(step, (p, tx.init(p), flax_dynamic_scale.DynamicScale()), (grads,))


def jmp_masked_step(tx, params, opt_state, loss_scale, grads):
    """jmp's recipe after the backward pass: unscale, check, adjust, update, select_tree."""
    import jmp

    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new_params, new_opt_state = jmp.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state)
    )
    return new_params, new_opt_state, loss_scale


def jmp_recipe(params, grads):
    import jmp

    tx = optax.adam(LEARNING_RATE)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, loss_scale, grads):
        return jmp_masked_step(tx, params, opt_state, loss_scale, grads)

    p = fresh(params)
    return JaxStepper(step, (p, tx.init(p), jmp.DynamicLossScale(jnp.float32(2.0**15))), (grads,))


class NnxStepper(Stepper):
    def __init__(self, model, optimizer, scaler, grads):
        self.model, self.optimizer, self.scaler, self.grads = model, optimizer, scaler, grads
        # Donating the model, optimizer (and scaler) lets XLA update every buffer in place.
        if scaler is None:
            self.fn = nnx.jit(self._plain, donate_argnums=(0, 1))
        else:
            self.fn = nnx.jit(self._with_scaler, donate_argnums=(0, 1, 2))

    @staticmethod
    def _plain(model, optimizer, grads):
        optimizer.update(model, grads)

    @staticmethod
    def _with_scaler(model, optimizer, scaler, grads):
        scaler.step(optimizer, model, grads)
        scaler.update()

    def step(self) -> None:
        if self.scaler is None:
            self.fn(self.model, self.optimizer, self.grads)
        else:
            self.fn(self.model, self.optimizer, self.scaler, self.grads)

    def block(self) -> None:
        jax.block_until_ready(nnx.state(self.model))


class Flat(nnx.Module):
    def __init__(self, params):
        self.leaves = nnx.Dict({k: nnx.Param(jnp.copy(v)) for k, v in params.items()})


def nnx_variant(with_scaler: bool):
    def make(params, grads):
        model = Flat(params)
        optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
        grad_state = nnx.state(Flat(grads), nnx.Param)
        scaler = None
        if with_scaler:
            scaler = jaxscale.GradScaler()
            scaler.scale(jnp.float32(0.0))
        return NnxStepper(model, optimizer, scaler, grad_state)

    return make


# -- PyTorch ---------------------------------------------------------------------------------------


class TorchStepper(Stepper):
    def __init__(self, params, grads, device, with_scaler):
        import torch

        self.torch = torch
        self.params = [
            torch.nn.Parameter(torch.from_numpy(np.asarray(p)).to(device)) for p in params.values()
        ]
        for p, g in zip(self.params, grads.values(), strict=True):
            p.grad = torch.from_numpy(np.asarray(g)).to(device)
        self.optimizer = torch.optim.Adam(self.params, lr=LEARNING_RATE)
        self.device = device
        self.scaler = (
            torch.amp.GradScaler(device, init_scale=1.0, growth_interval=10**9)
            if with_scaler
            else None
        )
        if self.scaler is not None:
            self.scaler.scale(torch.zeros((), device=device))

    def step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def block(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def torch_variants(device: str):
    return {
        "torch.optim.Adam (baseline)": lambda p, g: TorchStepper(p, g, device, False),
        "torch.amp.GradScaler + Adam": lambda p, g: TorchStepper(p, g, device, True),
    }


# -- groups ----------------------------------------------------------------------------------------

OPTAX_GROUP = {
    "optax.adam (baseline)": plain_adam,
    "jaxscale.grad_scaler(adam)": wrapped_adam(jaxscale.grad_scaler),
    "jaxscale.GradScaler, optax triple": facade_optax_triple,
    "optax.apply_if_finite(adam)": wrapped_adam(lambda tx: optax.apply_if_finite(tx, 10)),
    "flax DynamicScale + jnp.where masking": flax_dynamic_scale_recipe,
    "jmp.DynamicLossScale + select_tree": jmp_recipe,
}
SLOW_TO_COMPILE = ["flax DynamicScale + jnp.where masking", "jmp.DynamicLossScale + select_tree"]
MAX_LEAVES_FOR_RECIPES = int(os.environ.get("JAXSCALE_BENCH_RECIPE_MAX_LEAVES", "100"))
NNX_GROUP = {
    "nnx.Optimizer (baseline)": nnx_variant(False),
    "jaxscale.GradScaler + nnx.Optimizer": nnx_variant(True),
}


def run_layout(
    n_params: int, n_leaves: int, repeats: int, torch_device: str | None
) -> dict[str, list[Result]]:
    params = tree(n_params, n_leaves, seed=0)
    grads = tree(n_params, n_leaves, seed=1)
    groups: dict[str, list[Result]] = {}

    def bind(factories: dict[str, Any]) -> dict[str, Any]:
        return {name: functools.partial(make, params, grads) for name, make in factories.items()}

    optax_group = dict(OPTAX_GROUP)
    if n_leaves > MAX_LEAVES_FOR_RECIPES:
        # Their per-leaf reduction chains take minutes and many GB to compile at 500 leaves
        # on a 2-core machine (flax: 135 s and 4.5 GB at 10M/500; jmp: longer).
        for name in SLOW_TO_COMPILE:
            optax_group.pop(name)
    groups["optax"] = measure(bind(optax_group), "optax.adam (baseline)", repeats=repeats)
    groups["nnx"] = measure(bind(NNX_GROUP), "nnx.Optimizer (baseline)", repeats=repeats)
    if torch_device is not None:
        groups["torch"] = measure(
            bind(torch_variants(torch_device)), "torch.optim.Adam (baseline)", repeats=repeats
        )
    return groups


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[Result]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layouts", nargs="+", default=["10M/50", "10M/500", "100M/50", "100M/500"]
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--torch", choices=["cpu", "cuda", "none"], default="cpu")
    args = parser.parse_args(argv)
    from benchmarks.harness import table

    out = {}
    for layout in args.layouts:
        count, leaves = layout.split("/")
        n_params = int(float(count.rstrip("M")) * 1_000_000)
        groups = run_layout(
            n_params, int(leaves), args.repeats, None if args.torch == "none" else args.torch
        )
        out[layout] = groups
        for name, results in groups.items():
            print(f"\n### {layout} parameters/leaves, {name}\n\n{table(results)}", flush=True)
    return out


if __name__ == "__main__":
    main()
