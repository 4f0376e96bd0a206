"""The jaxscale side of the side-by-side tests with PyTorch: a two-layer model's
weights by PyTorch's names, its scaled gradients, and three ways of holding its
optimizer (an Optax triple, a Linen ``TrainState``, a Flax NNX ``nnx.Optimizer``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.training import train_state

from support import torch_twins as tw

WIDTH = 6
KEYS = ["0.weight", "0.bias", "1.weight", "1.bias"]


def forward(params, x):
    hidden = x @ params["0.weight"].T + params["0.bias"][None, :]
    return hidden @ params["1.weight"].T + params["1.bias"][None, :]


@jax.jit
def scaled_grads(params, scale, x, y, micro_batches):
    """Gradients of ``scaler.scale(mse / micro_batches)``: the product scale_outputs forms."""

    def loss(p):
        return (jnp.mean((forward(p, x) - y) ** 2) / micro_batches) * scale

    return jax.grad(loss)(params)


# -- the jaxscale side: three ways of holding an optimizer -----------------------


class OptaxDriver:
    def __init__(self, weights, kind, lr):
        self.tx, _, _ = tw.optimizers(kind, lr)
        self.params = weights
        self.opt_state = self.tx.init(self.params)

    def key(self):
        return self.tx

    def step(self, scaler, grads):
        self.params, self.opt_state = scaler.step(self.tx, grads, self.opt_state, self.params)

    def from_dict(self, grads):
        return grads

    def to_list(self, tree):
        return [np.asarray(tree[k]) for k in KEYS]


class TrainStateDriver(OptaxDriver):
    def __init__(self, weights, kind, lr):
        tx, _, _ = tw.optimizers(kind, lr)
        self.state = train_state.TrainState.create(apply_fn=None, params=weights, tx=tx)

    @property
    def params(self):
        return self.state.params

    def key(self):
        return self.state

    def step(self, scaler, grads):
        self.state = scaler.step(self.state, grads=grads)


class NnxDriver(OptaxDriver):
    def __init__(self, weights, kind, lr):
        tx, _, _ = tw.optimizers(kind, lr)
        self.model = tw.TwoLinear(
            [
                (np.asarray(weights[f"{i}.weight"]), np.asarray(weights[f"{i}.bias"]))
                for i in range(2)
            ]
        )
        self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)

    @property
    def params(self):
        return dict(zip(KEYS, [jnp.asarray(p) for p in tw.nnx_params(self.model)], strict=True))

    def key(self):
        return self.optimizer

    def from_dict(self, grads):
        # tree.map builds new Variables: writing into nnx.state(model) would write into the model
        state = jax.tree.map(lambda leaf: leaf, nnx.state(self.model, nnx.Param))
        for i, layer in enumerate(state["layers"].values()):
            layer["kernel"][...] = grads[f"{i}.weight"].T
            layer["bias"][...] = grads[f"{i}.bias"]
        return state

    def to_list(self, tree):
        return [
            np.asarray(v)
            for i in range(2)
            for v in (tree["layers"][i]["kernel"][...].T, tree["layers"][i]["bias"][...])
        ]

    def step(self, scaler, grads):
        scaler.step(self.optimizer, self.model, grads)


DRIVERS = {"optax": OptaxDriver, "trainstate": TrainStateDriver, "nnx": NnxDriver}
