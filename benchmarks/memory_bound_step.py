"""Memory-bound train steps: the gradient is computed in the same jit, and is cheap.

Adam on float32 parameters, donated. Two workloads:

* ``quadratic``: the loss ``0.5 * sum((p - d) ** 2)``, whose gradient ``p - d`` costs
  one subtraction. Without loss scaling XLA fuses it into Adam's pass and never
  materialises it; a scaler that decides before it updates must see every gradient
  first. Layouts ``N/L``: N float32 parameters in L leaves.
* ``mlp``: a wide MLP (4 layers of 2048 x 2048 with biases, 16.8M parameters) on a
  batch of 8, where the optimizer is a large share of the step.

Groups, each with its own baseline measured in the same process:

* Optax: ``optax.adam`` alone against every recipe of ``benchmarks/recipes.py``:
  ``jaxscale.grad_scaler(adam)``; ``jaxscale.GradScaler`` driving the same Optax
  triple; ``optax.apply_if_finite(adam)``; Flax's ``DynamicScale.value_and_grad`` with
  the ``jnp.where`` masking of Flax's examples; ``jmp.DynamicLossScale`` with
  ``jmp.select_tree``.
* NNX: ``nnx.Optimizer.update`` against the same step driven by ``jaxscale.GradScaler``.
* PyTorch (on its device): ``loss.backward()`` + ``torch.optim.Adam.step()`` against
  the same with ``torch.amp.GradScaler``.

For every jitted Optax variant the compiled program's ``copy`` instructions and
temporary memory are printed too: a scaler that materialises its gradients shows
them there.

    python -m benchmarks.memory_bound_step --workloads quadratic:10M/50 quadratic:10M/500 \\
        quadratic:100M/50 mlp
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale
from benchmarks import recipes
from benchmarks.harness import JaxStepper, Result, Stepper, measure, table
from benchmarks.optimizer_step import tree

LEARNING_RATE = recipes.LEARNING_RATE
MLP_WIDTH, MLP_DEPTH, MLP_BATCH = 2048, 4, 8

Params = dict[str, jax.Array]
Loss = Callable[[Params, Any], jax.Array]


# -- workloads ------------------------------------------------------------------------------------


def quadratic_loss(params: Params, data: Params) -> jax.Array:
    pairs = zip(params.values(), data.values(), strict=True)
    return sum((0.5 * jnp.sum((p - d) ** 2) for p, d in pairs), start=jnp.float32(0.0))


def mlp_loss(params: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    for i in range(MLP_DEPTH):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < MLP_DEPTH - 1:
            x = jax.nn.relu(x)
    return 0.5 * jnp.mean((x - y) ** 2)


def quadratic(n_params: int, n_leaves: int) -> tuple[Loss, Params, Any]:
    return quadratic_loss, tree(n_params, n_leaves, seed=0), tree(n_params, n_leaves, seed=1)


def mlp() -> tuple[Loss, Params, Any]:
    key = jax.random.key(0)
    params: Params = {}
    for i in range(MLP_DEPTH):
        k = jax.random.fold_in(key, i)
        params[f"w{i}"] = jax.random.normal(k, (MLP_WIDTH, MLP_WIDTH)) / np.sqrt(MLP_WIDTH)
        params[f"b{i}"] = jnp.zeros((MLP_WIDTH,))
    kx, ky = jax.random.split(jax.random.fold_in(key, 99))
    batch = (
        jax.random.normal(kx, (MLP_BATCH, MLP_WIDTH)),
        jax.random.normal(ky, (MLP_BATCH, MLP_WIDTH)),
    )
    return mlp_loss, params, batch


def workload(spec: str) -> tuple[Loss, Params, Any]:
    """``quadratic:10M/50`` or ``mlp``."""
    if spec == "mlp":
        return mlp()
    kind, _, layout = spec.partition(":")
    if kind != "quadratic" or "/" not in layout:
        raise ValueError(
            f"unknown workload {spec!r}: use quadratic:N/L (e.g. quadratic:10M/50) or mlp"
        )
    count, leaves = layout.split("/")
    return quadratic(int(float(count.rstrip("M")) * 1_000_000), int(leaves))


# -- Optax-level recipes (benchmarks/recipes.py) ---------------------------------------------------


def optax_group(n_leaves: int) -> dict[str, Callable[[Loss, Params, Any], Stepper]]:
    """Each recipe as a factory of a Stepper from ``(loss, params, batch)``."""

    def factory(name: str) -> Callable[[Loss, Params, Any], Stepper]:
        return lambda loss, params, batch: recipes.RECIPES[name](loss).stepper(params, (batch,))

    return {
        name: factory(name)
        for name in recipes.RECIPES
        if n_leaves <= recipes.MAX_LEAVES_FOR_SLOW or name not in recipes.SLOW_TO_COMPILE
    }


# -- NNX ------------------------------------------------------------------------------------------


class NnxStepper(Stepper):
    def __init__(self, loss: Loss, params: Params, batch: Any, with_scaler: bool):
        self.model = recipes.ParamLeaves(params)
        self.optimizer = nnx.Optimizer(self.model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
        self.batch = batch
        self.scaler = jaxscale.GradScaler() if with_scaler else None
        # Donating model, optimizer (and scaler) lets XLA update every buffer in place.
        donated = (0, 1, 2) if with_scaler else (0, 1)
        self.fn = nnx.jit(recipes.nnx_step(loss, with_scaler), donate_argnums=donated)

    def step(self) -> None:
        objects = (self.model, self.optimizer)
        if self.scaler is not None:
            objects += (self.scaler,)
        self.fn(*objects, self.batch)

    def block(self) -> None:
        jax.block_until_ready(nnx.state(self.model))


NNX_GROUP = {
    "nnx.Optimizer (baseline)": lambda loss, p, b: NnxStepper(loss, p, b, False),
    "jaxscale.GradScaler + nnx.Optimizer": lambda loss, p, b: NnxStepper(loss, p, b, True),
}


# -- PyTorch --------------------------------------------------------------------------------------


class TorchStepper(Stepper):
    """The same workload in PyTorch: ``backward()`` then Adam, with or without ``GradScaler``."""

    def __init__(self, workload_name: str, params: Params, batch: Any, device: str, scaler: bool):
        import torch

        self.torch, self.device = torch, device

        def tensor(x: Any) -> Any:
            return torch.from_numpy(np.array(x)).to(device)

        self.params = {k: torch.nn.Parameter(tensor(v)) for k, v in params.items()}
        self.optimizer = torch.optim.Adam(list(self.params.values()), lr=LEARNING_RATE)
        self.scaler = torch.amp.GradScaler(device) if scaler else None
        if workload_name == "mlp":
            x, y = (tensor(a) for a in batch)

            def loss() -> Any:
                h = x
                for i in range(MLP_DEPTH):
                    h = h @ self.params[f"w{i}"] + self.params[f"b{i}"]
                    if i < MLP_DEPTH - 1:
                        h = torch.relu(h)
                return 0.5 * torch.mean((h - y) ** 2)

        else:
            data = {k: tensor(v) for k, v in batch.items()}

            def loss() -> Any:
                terms = (0.5 * torch.sum((p - data[k]) ** 2) for k, p in self.params.items())
                return sum(terms)

        self.loss = loss

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        value = self.loss()
        if self.scaler is None:
            value.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(value).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def block(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def torch_group(workload_name: str, device: str) -> dict[str, Callable[..., Stepper]]:
    return {
        "torch.optim.Adam (baseline)": lambda loss, p, b: TorchStepper(
            workload_name, p, b, device, False
        ),
        "torch.amp.GradScaler + Adam": lambda loss, p, b: TorchStepper(
            workload_name, p, b, device, True
        ),
    }


# -- compiled-program statistics ------------------------------------------------------------------


def compiled_stats(stepper: Stepper) -> str:
    """Copies and temporary memory of a jitted step, from XLA's optimized program."""
    if not isinstance(stepper, JaxStepper) or not hasattr(stepper.fn, "lower"):
        return "-"
    try:
        compiled = stepper.fn.lower(*stepper.state, *stepper.extra).compile()
    except TypeError:  # jmp's loss scale cannot be rebuilt from lowering's argument records
        return "-"
    copies = len(re.findall(r"= \S+ copy\(", compiled.as_text()))
    memory = compiled.memory_analysis()
    temp = f"{memory.temp_size_in_bytes / 1e6:.1f} MB" if memory is not None else "?"
    return f"{copies} copies, {temp} temporaries"


def run(spec: str, repeats: int, torch_device: str | None) -> dict[str, list[Result]]:
    loss, params, batch = workload(spec)
    n_leaves = len(params)

    def bind(group: dict[str, Callable[..., Stepper]]) -> dict[str, Callable[[], Stepper]]:
        return {name: functools.partial(make, loss, params, batch) for name, make in group.items()}

    stats: dict[str, str] = {}

    def with_stats(name: str, make: Callable[[], Stepper]) -> Callable[[], Stepper]:
        def build() -> Stepper:
            stepper = make()
            stats[name] = compiled_stats(stepper)
            return stepper

        return build

    groups = {
        "optax": measure(
            {name: with_stats(name, make) for name, make in bind(optax_group(n_leaves)).items()},
            recipes.BASELINE,
            repeats=repeats,
        ),
        "nnx": measure(bind(NNX_GROUP), "nnx.Optimizer (baseline)", repeats=repeats),
    }
    if torch_device is not None:
        name = "mlp" if spec == "mlp" else "quadratic"
        groups["torch"] = measure(
            bind(torch_group(name, torch_device)), "torch.optim.Adam (baseline)", repeats=repeats
        )
    print(f"\n### memory-bound step, {spec}: compiled programs\n")
    print("| variant | optimized program |\n|---|---|")
    for name, text in stats.items():
        print(f"| {name} | {text} |")
    return groups


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[Result]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["quadratic:10M/50", "quadratic:10M/500", "quadratic:100M/50", "mlp"],
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--torch", choices=["cpu", "cuda", "none"], default="cpu")
    args = parser.parse_args(argv)
    results = {}
    for spec in args.workloads:
        torch_device = None if args.torch == "none" else args.torch
        results[spec] = run(spec, args.repeats, torch_device)
        for group, rows in results[spec].items():
            print(f"\n### memory-bound step, {spec}, {group}\n\n{table(rows)}", flush=True)
    return results


if __name__ == "__main__":
    main()
