"""The training side of ``multi_host.py``: one model, trained over every device of every process.

Imported only after ``jax.distributed.initialize``, so that ``jax.devices()`` is the
global list. The batch of each step is the same global array whatever the number
of processes: each process builds the rows that live on its own devices
(``jax.make_array_from_process_local_data``). Parameters, optimizer state and the
scaler's state are replicated on every device.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale

ROWS_PER_DEVICE = 4
SCALER = {"init_scale": 2.0**10, "growth_interval": 3}


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(8, 16, rngs=rngs)
        self.second = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.second(jnp.tanh(self.first(x)))


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


class Trainer:
    """One interface (the facade, the transform or a TrainState) on the global mesh."""

    def __init__(self, interface: str, poison_process: int = -1):
        self.interface = interface
        self.mesh = Mesh(np.array(jax.devices()), ("data",))
        self.replicated = NamedSharding(self.mesh, P())
        self.sharded = NamedSharding(self.mesh, P("data"))
        self.poison_process = poison_process % jax.process_count()
        model = Model(nnx.Rngs(0))
        self.graphdef, params = nnx.split(model)
        if interface == "facade":
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            self.objects = (model, optimizer, jaxscale.GradScaler(**SCALER))
            nnx.update(self.objects, self._replicate(nnx.state(self.objects)))
        elif interface == "transform":
            self.tx = jaxscale.grad_scaler(optax.adam(1e-2), **SCALER)
            self.state = self._replicate((params, self.tx.init(params)))
        elif interface == "shard_map":
            # Each device checks its own, unaveraged gradients; axis_name or-s the decision
            # over every device of every process before anything is applied.
            average = optax.GradientTransformation(
                lambda params: optax.EmptyState(),
                lambda updates, state, params=None: (jax.lax.pmean(updates, "data"), state),
            )
            self.tx = jaxscale.grad_scaler(
                optax.chain(average, optax.adam(1e-2)), axis_name="data", **SCALER
            )
            self.state = self._replicate((params, self.tx.init(params)))
        else:
            state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
            self.state = self._replicate((state, jaxscale.GradScaler(**SCALER)))
        self._step = self._compile()

    def _replicate(self, tree: Any) -> Any:
        return jax.device_put(tree, self.replicated)

    def _compile(self) -> Any:
        graphdef = self.graphdef
        if self.interface == "facade":

            @nnx.jit
            def facade_step(model, optimizer, scaler, x, y):
                grads = nnx.grad(lambda m: scaler.scale(mse(m, x, y)))(model)
                scaler.step(optimizer, model, grads)
                scaler.update()
                return scaler.metrics()

            return facade_step
        if self.interface == "transform":
            tx = self.tx

            @jax.jit
            def transform_step(state, x, y):
                params, opt_state = state
                loss = lambda p: jaxscale.scale(mse(nnx.merge(graphdef, p), x, y), opt_state)  # noqa: E731
                updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
                new_state = (optax.apply_updates(params, updates), opt_state)
                return new_state, jaxscale.metrics(opt_state)

            return transform_step
        if self.interface == "shard_map":
            tx = self.tx

            def per_device(state, x, y):
                params, opt_state = state
                loss = lambda p: jaxscale.scale(mse(nnx.merge(graphdef, p), x, y), opt_state)  # noqa: E731
                # the gradient of this device's own copy: its batch alone, not summed
                own = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
                updates, opt_state = tx.update(jax.grad(loss)(own), opt_state, params)
                new_state = (optax.apply_updates(params, updates), opt_state)
                return new_state, jaxscale.metrics(opt_state)

            return jax.jit(
                jax.shard_map(
                    per_device, mesh=self.mesh, in_specs=(P(), P("data"), P("data")),
                    out_specs=(P(), P()),
                )
            )  # fmt: skip

        @jax.jit
        def train_state_step(state, x, y):
            train, scaler = state
            loss = lambda p: scaler.scale(mse(nnx.merge(graphdef, p), x, y))  # noqa: E731
            train = scaler.step(train, grads=jax.grad(loss)(train.params))
            scaler.update()
            return (train, scaler), scaler.metrics()

        return train_state_step

    def batch(self, step: int, poisoned: bool) -> tuple[jax.Array, jax.Array]:
        """This step's global batch; the poisoned row lies on the poison process's first device."""
        rows = ROWS_PER_DEVICE * jax.device_count()
        rng = np.random.default_rng(step)
        x = rng.normal(size=(rows, 8)).astype(np.float32)
        y = rng.normal(size=(rows, 4)).astype(np.float32)
        if poisoned:
            x[self.poison_process * ROWS_PER_DEVICE * jax.local_device_count(), 0] = np.inf
        local = slice(
            jax.process_index() * ROWS_PER_DEVICE * jax.local_device_count(),
            (jax.process_index() + 1) * ROWS_PER_DEVICE * jax.local_device_count(),
        )
        return tuple(  # type: ignore[return-value]
            jax.make_array_from_process_local_data(self.sharded, a[local]) for a in (x, y)
        )

    def step(self, step: int, poisoned: bool = False) -> dict[str, Any]:
        x, y = self.batch(step, poisoned)
        if self.interface == "facade":
            metrics = self._step(*self.objects, x, y)
        else:
            self.state, metrics = self._step(self.state, x, y)
        local = {k: np.asarray(v.addressable_data(0)) for k, v in metrics.items()}
        return {
            "step": step,
            "scale": float(local["scale"]),
            "found_inf": bool(local["found_inf"]),
            "growth_tracker": int(local["growth_tracker"]),
        }

    def _tree(self) -> Any:
        return nnx.state(self.objects) if self.interface == "facade" else self.state

    def digest(self) -> str:
        """A digest of every replicated array of the training state, read on this process."""
        sha = hashlib.sha256()
        for leaf in jax.tree.leaves(self._tree()):
            sha.update(np.asarray(leaf.addressable_data(0)).tobytes())
        return sha.hexdigest()

    def parameters(self) -> list[float]:
        """The model's parameters, flattened, as read on this process."""
        if self.interface == "facade":
            params = nnx.state(self.objects[0], nnx.Param)
        elif self.interface == "trainstate":
            params = self.state[0].params
        else:
            params = self.state[0]
        leaves = [np.asarray(leaf.addressable_data(0)).ravel() for leaf in jax.tree.leaves(params)]
        return np.concatenate(leaves).tolist()

    def save(self, directory: pathlib.Path, next_step: int) -> None:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(directory.resolve() / str(next_step), self._tree(), force=True)

    def restore(self, path: pathlib.Path) -> int:
        """Load a checkpoint written by any number of processes; returns the step to resume at."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._tree())
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path.resolve(), abstract)
        if self.interface == "facade":
            nnx.update(self.objects, restored)
        else:
            self.state = jax.tree.unflatten(
                jax.tree.structure(self.state), jax.tree.leaves(restored)
            )
        return int(path.name)
