"""Twin models: a torch ``Sequential(Linear, Linear)`` and a Flax NNX model with the same weights.

PyTorch's grad-scaling tests (``_create_scaling_case``) train two 8x8 linear layers
with MSE loss on four random batches. These helpers build that case for both
frameworks from one seed, so a scenario can run in each and be compared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

from support import third_party


class TwoLinear(nnx.Module):
    def __init__(self, weights: list[tuple[np.ndarray, np.ndarray]]):
        # torch.nn.Linear stores weight as (out, in) and computes x @ W.T + b
        self.layers = nnx.List(
            [nnx.Linear(w.shape[1], w.shape[0], rngs=nnx.Rngs(0)) for w, _ in weights]
        )
        for layer, (w, b) in zip(self.layers, weights, strict=True):
            layer.kernel[...] = jnp.asarray(w.T)
            layer.bias[...] = jnp.asarray(b)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


def torch_model(seed: int, width: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))


def weights_of(model: torch.nn.Sequential) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy()) for m in model]


def twin(model: torch.nn.Sequential) -> TwoLinear:
    return TwoLinear(weights_of(model))


def data(seed: int, batches: int = 4, width: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn((8, width), generator=generator).numpy(),
            torch.randn((8, width), generator=generator).numpy(),
        )
        for _ in range(batches)
    ]


def mse(model: TwoLinear, x: np.ndarray, y: np.ndarray) -> jax.Array:
    return jnp.mean((model(jnp.asarray(x)) - jnp.asarray(y)) ** 2)


def nnx_params(model: TwoLinear) -> list[np.ndarray]:
    """Parameters in torch's order and layout: [W0, b0, W1, b1] with W as (out, in)."""
    out = []
    for layer in model.layers:
        out += [np.asarray(layer.kernel[...]).T, np.asarray(layer.bias[...])]
    return out


def torch_params(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def optimizers(kind: str, lr: float) -> tuple[optax.GradientTransformation, type, dict]:
    """(optax optimizer, torch optimizer class, torch kwargs) that compute the same update."""
    if kind == "sgd":
        return third_party.optimizer(optax.sgd(lr)), torch.optim.SGD, {"lr": lr}
    if kind == "adam":
        return third_party.optimizer(optax.adam(lr)), torch.optim.Adam, {"lr": lr}
    raise ValueError(kind)


def clip_like_torch(grads, max_norm: float):
    """``torch.nn.utils.clip_grad_norm_``: scale by max_norm / (norm + 1e-6), clamped at 1."""
    leaves = jax.tree.leaves(grads)
    total = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in leaves))
    coef = jnp.minimum(jnp.float32(max_norm) / (total + jnp.float32(1e-6)), jnp.float32(1.0))
    return jax.tree.map(lambda g: g * coef, grads)


def poison_layer(grads, layer: int = 1, value: float = np.inf):
    """``model[layer].weight.grad.fill_(value)`` on an NNX grads State."""
    kernel = grads["layers"][layer]["kernel"]
    kernel[...] = jnp.full_like(kernel[...], value)
    return grads
