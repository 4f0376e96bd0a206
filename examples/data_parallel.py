"""Train the character-level transformer data-parallel over every visible device.

The batch is split over a one-axis device mesh ("data"); the model, the optimizer
state and the scaler are replicated. Under ``jax.jit`` with sharded inputs XLA
inserts the gradient all-reduce itself, and the scaler's inf/NaN check runs on
the global gradients, so every device makes the same skip decision and holds the
same scale: nothing in the training step is device-specific. On a CPU-only
machine the script simulates 8 devices (``--xla_force_host_platform_device_count``).

    python examples/data_parallel.py --steps 200
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Only affects the CPU backend; set before JAX starts, as XLA reads it once.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import argparse
import dataclasses
import pathlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxscale

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import char_lm
from tqdm import tqdm


@nnx.jit(donate_argnums=(0, 1, 2))
def train_step(model, optimizer, scaler, x, y):
    def scaled_loss(model):
        loss = jaxscale.autocast(char_lm.loss_fn)(model, x, y)  # the global mean, float16 matmuls
        return scaler.scale(loss), loss

    grads, loss = nnx.grad(scaled_loss, has_aux=True)(model)
    scaler.step(optimizer, model, grads)
    scaler.update()
    return loss, scaler.metrics()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, all devices")
    args = parser.parse_args(argv)

    devices = jax.devices()
    if args.batch_size % len(devices):
        parser.error(f"--batch-size {args.batch_size} must divide over {len(devices)} devices")
    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))

    dataset = char_lm.Dataset.load()
    config = dataclasses.replace(char_lm.Config(), steps=args.steps, batch_size=args.batch_size)
    model, optimizer, scaler = char_lm.build(config, dataset)
    # Replicate the model, the optimizer state and the scaler's state on every device.
    objects = (model, optimizer, scaler)
    nnx.update(objects, jax.device_put(nnx.state(objects), replicated))

    print(f"{len(devices)} devices ({devices[0].platform}), global batch {args.batch_size}")
    batches = dataset.batches("train", args.batch_size, config.seq_len, seed=0)
    loss = float("nan")
    with tqdm(total=args.steps, unit="step") as progress:
        for step in range(1, args.steps + 1):
            x, y = (jax.device_put(a, batch_sharding) for a in next(batches))
            loss_array, metrics = train_step(model, optimizer, scaler, x, y)
            progress.update()
            if step % 10 == 0 or step == args.steps:  # reading values back waits for the step
                loss = float(loss_array)
                progress.set_postfix_str(
                    f"loss {loss:.3f}, scale {float(metrics['scale']):.0f}, "
                    f"skipped {int(metrics['skipped_steps'])}"
                )

    # The scale and growth tracker: one replicated value, equal on every device.
    scaler_arrays = jax.tree.leaves(nnx.state(scaler))
    replicated_everywhere = all(
        len({np.asarray(shard.data).item() for shard in array.addressable_shards}) == 1
        for array in scaler_arrays
    )
    skipped = scaler.skipped_steps()
    summary = {"loss": loss, "scale": scaler.get_scale(), "skipped": float(skipped)}
    print(
        f"final loss {loss:.4f}, scale {summary['scale']:.0f} "
        f"(equal on all {len(devices)} devices: {replicated_everywhere}), "
        f"{skipped} skipped steps"
    )
    return summary


if __name__ == "__main__":
    main()
