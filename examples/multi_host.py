"""Multi-host training with loss scaling: JAX's multi-controller runtime, several processes.

Every process runs this same program on its own devices; ``jax.distributed``
joins them into one global set of devices, and the jitted step is one SPMD
program over all of them. The skip decision is computed inside that program
from the *global* gradients, so when any device of any process holds an inf or
NaN, every process skips the step and backs off alike, and the scale, the
growth tracker and the parameters stay equal everywhere.

On one machine, N processes of several CPU devices each (CPU collectives by gloo;
the same code path as N hosts):

    python examples/multi_host.py --processes 2
    python examples/multi_host.py --processes 4 --interface transform
    python examples/multi_host.py --processes 2 --interface facade transform  # one after the other

On N real hosts, run on every host i = 0 .. N-1, with host 0's address as the
coordinator (any free port):

    python examples/multi_host.py --coordinator 10.0.0.1:8476 --num-processes N --process-id i

Each process writes what it saw as JSON with ``--out``: for each interface trained,
per step the scale, the skip and the growth tracker, and at the end a digest of the
parameters. ``--poison-step`` puts an inf into one device's batch on
``--poison-process``; ``--save-at``/``--restore`` write and resume an Orbax checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

INTERFACES = ("facade", "transform", "trainstate", "shard_map")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, help="launch this many local processes")
    parser.add_argument("--coordinator", help="host:port of process 0 (multi-host)")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--local-devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument(
        "--interface", nargs="+", choices=INTERFACES, default=["facade"],
        help="train with each of these, one after the other, in the same processes",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--poison-step", type=int, default=5)
    parser.add_argument("--poison-process", type=int, default=-1, help="default: the last")
    parser.add_argument("--save-at", type=int, help="write an Orbax checkpoint after this step")
    parser.add_argument("--restore", type=pathlib.Path, help="resume from this checkpoint")
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=pathlib.Path("ckpt"))
    parser.add_argument("--die-at-step", type=int, help="--die-process exits at this step")
    parser.add_argument("--die-process", type=int, default=-1, help="default: the last")
    parser.add_argument("--heartbeat-timeout", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path, help="write this process's record here")
    args = parser.parse_args(argv)
    if len(args.interface) > 1 and (args.save_at is not None or args.restore is not None):
        parser.error("--save-at and --restore take one --interface")
    return args


# -- launcher: N local processes ---------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option`` and its value, written as two words or as ``option=value``."""
    kept, skip_value = [], False
    for word in argv:
        if skip_value:
            skip_value = False
        elif word == option:
            skip_value = True
        elif not word.startswith(option + "="):
            kept.append(word)
    return kept


def launch(args: argparse.Namespace, argv: list[str], timeout: float = 300.0) -> list[dict]:
    """Run ``args.processes`` copies of this script as one job; return each one's record."""
    port = free_port()
    outdir = pathlib.Path(os.environ.get("MULTI_HOST_OUT", ".")).resolve()
    forwarded = without_option(argv, "--processes")
    procs, outs = [], []
    for i in range(args.processes):
        out = outdir / f"process{i}.json"
        outs.append(out)
        command = [sys.executable, __file__, *forwarded, "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", str(args.processes), "--process-id", str(i),
                   "--out", str(out)]  # fmt: skip
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    deadline = time.monotonic() + timeout
    records = []
    for i, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            # reaped, so that no process outlives the job; the stuck one's last words kept
            last_words = [other.communicate()[1] for other in procs][i]
            raise RuntimeError(
                f"process {i} did not finish within {timeout:.0f} s; the end of its stderr:\n"
                + last_words.decode(errors="replace")[-2000:]
            ) from None
        record = json.loads(out.read_text()) if out.exists() and proc.returncode == 0 else {}
        record.update(returncode=proc.returncode, stderr=stderr.decode(errors="replace"))
        records.append(record)
        sys.stdout.write(stdout.decode(errors="replace"))
    return records


# -- one process of the job ----------------------------------------------------------------


def worker(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    from multi_host_training import Trainer

    runs = {
        name: train(Trainer(name, poison_process=args.poison_process), args)
        for name in args.interface
    }
    record = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "runs": runs,
    }
    if jax.process_index() == 0:
        for name, run in runs.items():
            steps = run["steps"]
            print(
                f"{jax.process_count()} processes, {jax.device_count()} devices, "
                f"{name}: scale {steps[-1]['scale']:g} after {args.steps} steps, "
                f"{sum(s['found_inf'] for s in steps)} skipped, params {run['params'][:12]}",
                flush=True,
            )
    return record


def train(trainer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One interface's run: what each step saw, and the parameters it ended with."""
    import jax

    start = 0
    if args.restore is not None:
        start = trainer.restore(args.restore)
    steps = []
    for step in range(start, args.steps):
        if (
            args.die_at_step == step
            and jax.process_index() == args.die_process % jax.process_count()
        ):
            print(f"process {jax.process_index()}: exiting at step {step}", flush=True)
            os._exit(1)
        steps.append(trainer.step(step, poisoned=step == args.poison_step))
        if args.save_at == step:
            trainer.save(args.checkpoint_dir, step + 1)
    return {"steps": steps, "params": trainer.digest(), "parameters": trainer.parameters()}


def main(argv: list[str] | None = None) -> list[dict] | dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.processes:
        records = launch(args, argv)
        same = len({json.dumps(r.get("runs"), sort_keys=True) for r in records}) == 1
        print(f"every process saw the same scales, skips and parameters: {same}")
        return records
    record = worker(args)
    if args.out is not None:
        args.out.write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    main()
