"""The same model trained with torch.amp.GradScaler and with jaxscale.GradScaler.

Both libraries start from the same weights, see the same batches and get the
same bursts of overflowing gradients; the script prints both loss-scale
trajectories and checks that they are identical. Growth 1.5 and backoff 0.3 make
the scale's rounding matter: float32 arithmetic would drift away from PyTorch.
PyTorch runs on the CPU (``pip install torch==2.13.0``).

    python examples/pytorch_side_by_side.py --steps 40
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import jaxscale

HYPER = {"init_scale": 1024.0, "growth_factor": 1.5, "backoff_factor": 0.3, "growth_interval": 3}


def overflowing(step: int) -> bool:
    """Steps whose gradients overflow: a few bursts, as a too-large scale would cause."""
    return step % 11 in (5, 6) or step % 17 == 0


def main(argv: list[str] | None = None) -> tuple[list[float], list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32))
        for _ in range(args.steps)
    ]

    # PyTorch
    torch.manual_seed(0)
    torch_model = torch.nn.Linear(8, 1)
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.05)
    torch_scaler = torch.amp.GradScaler("cpu", **HYPER)
    torch_scales = []
    for step, (x, y) in enumerate(batches):
        torch_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(torch_model(torch.from_numpy(x)), torch.from_numpy(y))
        torch_scaler.scale(loss).backward()
        if overflowing(step):
            torch_model.weight.grad.fill_(float("inf"))
        torch_scaler.step(torch_opt)
        torch_scaler.update()
        torch_scales.append(torch_scaler.get_scale())

    # jaxscale, from the same initial weights
    torch.manual_seed(0)
    initial = torch.nn.Linear(8, 1)
    model = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.asarray(initial.weight.detach().numpy().T)
    model.bias[...] = jnp.asarray(initial.bias.detach().numpy())
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(**HYPER)

    @nnx.jit
    def train_step(model, optimizer, scaler, x, y, overflow):
        grads = nnx.grad(lambda m: scaler.scale(jnp.mean((m(x) - y) ** 2)))(model)
        grads = jax.tree.map(lambda g: jnp.where(overflow, jnp.inf, g), grads)
        scaler.step(optimizer, model, grads)
        scaler.update()

    jax_scales = []
    for step, (x, y) in enumerate(batches):
        train_step(model, optimizer, scaler, jnp.asarray(x), jnp.asarray(y), overflowing(step))
        jax_scales.append(scaler.get_scale())

    print(f"{'step':>4}  {'torch.amp.GradScaler':>22}  {'jaxscale.GradScaler':>22}  overflow")
    for step, (t, j) in enumerate(zip(torch_scales, jax_scales, strict=True)):
        print(f"{step:4d}  {t:22.17g}  {j:22.17g}  {'yes' if overflowing(step) else ''}")
    weights_close = np.allclose(
        torch_model.weight.detach().numpy().T, np.asarray(model.kernel[...]), rtol=1e-5
    )
    print(
        f"\nscale trajectories identical: {torch_scales == jax_scales}; "
        f"weights agree: {weights_close}"
    )
    return torch_scales, jax_scales


if __name__ == "__main__":
    main()
