"""Optimizer-step overhead: Adam with each loss scaler, against Adam alone.

For every parameter layout (10M or 100M float32 parameters in 50 or 500 leaves)
each variant runs ``update`` + ``apply_updates`` under ``jax.jit`` with the
parameters and optimizer state donated, on the same finite gradients, read from
memory (the loss is ``recipes.given_gradients``, whose gradient is the given array
times the loss scale). Groups and their baselines:

* Optax: ``optax.adam`` alone against every recipe of ``benchmarks/recipes.py``:
  jaxscale's ``grad_scaler`` and ``GradScaler`` driving an Optax triple,
  ``optax.apply_if_finite``, Flax's ``DynamicScale`` and jmp's ``DynamicLossScale``;
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

import jaxscale
from benchmarks import recipes
from benchmarks.harness import Result, Stepper, measure

LEARNING_RATE = recipes.LEARNING_RATE


def tree(n_params: int, n_leaves: int, seed: int) -> dict[str, jax.Array]:
    size = n_params // n_leaves
    key = jax.random.key(seed)
    return {
        f"p{i:03d}": 1e-2 * jax.random.normal(jax.random.fold_in(key, i), (size,))
        for i in range(n_leaves)
    }


# -- Optax-level recipes (benchmarks/recipes.py) on the given gradients ---------------------------


def optax_group(n_leaves: int) -> dict[str, Any]:
    """Each recipe as a factory of a Stepper from ``(params, grads)``."""
    names = [
        name
        for name in recipes.RECIPES
        if n_leaves <= MAX_LEAVES_FOR_SLOW or name not in recipes.SLOW_TO_COMPILE
    ]

    def factory(name: str) -> Any:
        def make(params: Any, grads: Any) -> Stepper:
            return recipes.RECIPES[name](recipes.given_gradients).stepper(params, (grads,))

        return make

    return {name: factory(name) for name in names}


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


def nnx_variant(with_scaler: bool):
    def make(params, grads):
        model = recipes.ParamLeaves(params)
        optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
        grad_state = nnx.state(recipes.ParamLeaves(grads), nnx.Param)
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

MAX_LEAVES_FOR_SLOW = int(
    os.environ.get("JAXSCALE_BENCH_RECIPE_MAX_LEAVES", recipes.MAX_LEAVES_FOR_SLOW)
)
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

    groups["optax"] = measure(bind(optax_group(n_leaves)), recipes.BASELINE, repeats=repeats)
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
