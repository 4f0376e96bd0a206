"""8-bit Adam state sharded with its parameters (FSDP), on one process or several.

Each parameter is sharded along its first axis over every device of the job, and the
optimizer's state with it: the codes of ``low_precision_state(adamw, "int8")`` have
the parameter's shape and the scales its leading axes, so both take the parameter's
sharding. The step computes each device's shard on that device (no collective) and
writes the new state in place. Run it on one process of four devices, or as two
processes of two devices each (JAX's multi-controller runtime with gloo CPU
collectives, the same code path as two hosts): each device holds a quarter of the
state, the compiled step holds no collective, and both print the same digest of the
parameters and state after the steps. With ``--axes explicit`` the mesh's axes are
explicit (sharding in types, ``jax.make_mesh``'s default) and set with
``jax.set_mesh``: the same digest again.

    python examples/fsdp_low_precision.py --local-devices 4
    python examples/fsdp_low_precision.py --processes 2
    python examples/fsdp_low_precision.py --processes 2 --axes explicit
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import socket
import subprocess
import sys
from typing import Any

SHAPES = {"embed": (512, 256), "dense": (1024, 512), "head": (256, 1000), "bias": (4096,)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, help="launch this many local processes")
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--local-devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--format", default="int8", help="the state's dtype, e.g. int8 or int4")
    parser.add_argument(
        "--axes", choices=("automatic", "explicit"), default="automatic", help="the mesh's axes"
    )
    parser.add_argument("--out", type=pathlib.Path, help="write this process's record here")
    return parser.parse_args(argv)


def launch(args: argparse.Namespace, timeout: float = 240.0) -> list[dict]:
    """``args.processes`` copies of this script as one job; each one's record."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    outdir = pathlib.Path(os.environ.get("FSDP_OUT", ".")).resolve()
    procs, outs = [], []
    for i in range(args.processes):
        outs.append(outdir / f"fsdp{i}.json")
        command = [sys.executable, __file__, "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", str(args.processes), "--process-id", str(i),
                   "--local-devices", str(args.local_devices), "--steps", str(args.steps),
                   "--format", args.format, "--axes", args.axes,
                   "--out", str(outs[-1])]  # fmt: skip
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    records = []
    for proc, out in zip(procs, outs, strict=True):
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:  # killed and reaped: no process outlives the job
                other.kill()
                other.communicate()
            raise
        record = json.loads(out.read_text()) if proc.returncode == 0 else {}
        records.append({**record, "returncode": proc.returncode, "stderr": stderr.decode()[-3000:]})
    return records


def train(args: argparse.Namespace) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )
    import numpy as np

    if args.axes == "explicit":
        mesh = jax.make_mesh(
            (jax.device_count(),), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,)
        )
        with jax.set_mesh(mesh):
            return _train(args, mesh)
    return _train(args, jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",)))


def _train(args: argparse.Namespace, mesh: Any) -> dict:
    """The steps on ``mesh``: this process's record."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxscale

    def along_first_axis(leaf: jax.Array) -> NamedSharding:
        return NamedSharding(mesh, P("fsdp") if np.ndim(leaf) else P())

    tx = jaxscale.low_precision_state(optax.adamw(1e-3), args.format)
    key = jax.random.key(0)
    params = {
        name: jax.random.normal(jax.random.fold_in(key, i), shape) * 0.05
        for i, (name, shape) in enumerate(SHAPES.items())
    }
    abstract = jax.eval_shape(tx.init, params)
    params_sharding = jax.tree.map(along_first_axis, params)
    state_sharding = jax.tree.map(along_first_axis, abstract)
    params = jax.jit(lambda p: p, out_shardings=params_sharding)(params)
    state = jax.jit(tx.init, out_shardings=state_sharding)(params)

    def step(params: dict, state: object, grads: dict) -> tuple:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    # Gradients that each device computes from its own shard (a model's would come from
    # its backward pass): the steps are then the same arithmetic on any mesh, bit for bit.
    gradients = jax.jit(
        lambda params, t: jax.tree.map(lambda p: jnp.sin(p * (t + 1.0)) * 1e-2, params),
        out_shardings=params_sharding,
    )
    step = jax.jit(step, donate_argnums=(0, 1), out_shardings=(params_sharding, state_sharding))
    text = step.lower(params, state, params).compile().as_text()
    collectives = sum(
        text.count(f" {op}(")
        for op in ("all-gather", "all-to-all", "all-reduce", "collective-permute")
    )
    for index in range(args.steps):
        params, state = step(params, state, gradients(params, float(index)))
    gathered = multihost_utils.process_allgather((params, state), tiled=True)
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(gathered):
        digest.update(np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).tobytes())
    local = sum(
        shard.data.nbytes for leaf in jax.tree.leaves(state) for shard in leaf.addressable_shards
    )
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(gathered[1]))
    return {
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "digest": digest.hexdigest(),
        "collectives": collectives,
        "state_bytes_here": int(local),
        "state_bytes": int(total),
    }


def main(argv: list[str] | None = None) -> list[dict] | dict:
    args = parse(argv)
    if args.processes:
        records = launch(args)
        for record in records:
            print(json.dumps({k: v for k, v in record.items() if k != "stderr"}))
        return records
    record = train(args)
    if args.out is not None:
        args.out.write_text(json.dumps(record))
    else:
        print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
