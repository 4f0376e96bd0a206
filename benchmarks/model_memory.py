"""Peak memory of a model's whole training step with each optimizer state format.

The main example's character transformer (``examples/char_lm.py``), made wide and deep
enough to matter (width 1024, 12 layers: 152M parameters), trained under
``jaxscale.autocast`` in bfloat16 on a batch of 8 x 512: forward, backward and AdamW,
the parameters and state donated. The step is compiled on abstract shapes (nothing of
the model's size is allocated) for this machine or, with ``--gpu-target h100``, for an
H100 on a machine without one (``benchmarks/gpu_target.py``), and read with
``memory_analysis()``: bytes per parameter at rest (parameters and state), of
temporaries (activations, gradients and whatever the optimizer adds) and at the peak.

    python -m benchmarks.model_memory --gpu-target h100
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxscale
from benchmarks import gpu_target

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import char_lm

FORMATS = ["bfloat16", "float8_e4m3fn", "int8", "int4"]


def abstract(tree: Any) -> Any:
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), tree)


def step_memory(tx: Any, width: int, layers: int, batch: int, seq_len: int, target: Any) -> dict:
    """Bytes per parameter of the donated training step with optimizer ``tx``."""
    model = nnx.eval_shape(
        lambda: char_lm.CharTransformer(
            vocab=96, seq_len=seq_len, width=width, layers=layers, heads=8, rngs=nnx.Rngs(0)
        )
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = abstract(params), abstract(rest)
    loss = jaxscale.autocast(char_lm.loss_fn, dtype=jnp.bfloat16)
    state = jax.eval_shape(tx.init, params)

    def step(params: Any, state: Any, rest: Any, x: Any, y: Any) -> tuple[Any, Any]:
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest), x, y))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    arguments = (params, state, rest, tokens, tokens)
    if target is not None:
        arguments = gpu_target.placed_like(arguments, target)
    analysis = jax.jit(step, donate_argnums=(0, 1)).lower(*arguments).compile().memory_analysis()
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    at_rest = analysis.argument_size_in_bytes / count
    temporaries = analysis.temp_size_in_bytes / count
    return {"count": count, "at rest": at_rest, "temporaries": temporaries}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-target", choices=list(gpu_target.TARGETS))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args(argv)
    target = gpu_target.device(args.gpu_target) if args.gpu_target else None
    shape = (args.width, args.layers, args.batch, args.seq_len)
    variants = {"optax.adamw": optax.adamw(1e-3)}
    for fmt in FORMATS:
        options = {} if fmt == "bfloat16" else {"partial_blocks": True}
        tx = jaxscale.low_precision_state(optax.adamw(1e-3), fmt, **options)
        variants[f"low_precision_state(adamw, {fmt})"] = tx
    results = {}
    for name, tx in variants.items():
        row = results[name] = step_memory(tx, *shape, target)
        if name == "optax.adamw":
            print(f"{row['count'] / 1e6:.1f}M parameters, bytes per parameter:\n")
            print("| optimizer | at rest | temporaries | peak | of AdamW's peak |")
            print("|---|---|---|---|---|")
        peak = row["at rest"] + row["temporaries"]
        baseline = results["optax.adamw"]["at rest"] + results["optax.adamw"]["temporaries"]
        print(
            f"| {name} | {row['at rest']:.2f} | {row['temporaries']:.2f} | {peak:.2f} "
            f"| {peak / baseline:.2f} |",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
