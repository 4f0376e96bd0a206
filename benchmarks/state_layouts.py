"""Bytes of Adam's state per parameter for real models' layouts, in each format.

torchao (after bitsandbytes) quantizes a tensor only when it has at least 4,096
elements and its size is a multiple of the block: a model's other tensors keep
float32 state, so the bytes a model saves are not the table's. For the parameter
shapes of GPT-2 small, ViT-B/16, ResNet-50 and a Llama-style 1B model, this prints
the bytes per parameter of ``low_precision_state(optax.adamw(...), fmt)``'s state
under torchao's rule and with ``partial_blocks=True`` (every tensor of at least
4,096 elements quantized). Computed with ``jax.eval_shape``: nothing is allocated.

With ``--peak`` it prints instead what a model meets: the peak of the donated step
(``update`` + ``apply_updates``, the gradients passed to it), parameters, gradients,
state and XLA's temporaries, per parameter and as a fraction of float32 Adam's, each
format with ``partial_blocks=True``; compiled on abstract shapes for this machine, or
with ``--gpu-target h100`` for an H100 on a machine without one (XLA's deviceless
compile, ``benchmarks/gpu_target.py``; needs JAX's CUDA plugin).

    python -m benchmarks.state_layouts
    python -m benchmarks.state_layouts --peak --gpu-target h100
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxscale
from benchmarks import gpu_target


def gpt2_small() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"wte": (50257, 768), "wpe": (1024, 768)}
    for i in range(12):
        shapes |= {
            f"h{i}.ln_1.scale": (768,), f"h{i}.ln_1.bias": (768,),
            f"h{i}.attn.c_attn.kernel": (768, 2304), f"h{i}.attn.c_attn.bias": (2304,),
            f"h{i}.attn.c_proj.kernel": (768, 768), f"h{i}.attn.c_proj.bias": (768,),
            f"h{i}.ln_2.scale": (768,), f"h{i}.ln_2.bias": (768,),
            f"h{i}.mlp.c_fc.kernel": (768, 3072), f"h{i}.mlp.c_fc.bias": (3072,),
            f"h{i}.mlp.c_proj.kernel": (3072, 768), f"h{i}.mlp.c_proj.bias": (768,),
        }  # fmt: skip
    return shapes | {"ln_f.scale": (768,), "ln_f.bias": (768,)}


def vit_b16() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "patch.kernel": (16, 16, 3, 768), "patch.bias": (768,),
        "cls": (1, 1, 768), "position": (1, 197, 768),
    }  # fmt: skip
    for i in range(12):
        shapes |= {
            f"b{i}.ln1.scale": (768,), f"b{i}.ln1.bias": (768,),
            f"b{i}.qkv.kernel": (768, 2304), f"b{i}.qkv.bias": (2304,),
            f"b{i}.proj.kernel": (768, 768), f"b{i}.proj.bias": (768,),
            f"b{i}.ln2.scale": (768,), f"b{i}.ln2.bias": (768,),
            f"b{i}.fc1.kernel": (768, 3072), f"b{i}.fc1.bias": (3072,),
            f"b{i}.fc2.kernel": (3072, 768), f"b{i}.fc2.bias": (768,),
        }  # fmt: skip
    return shapes | {"ln.scale": (768,), "ln.bias": (768,), "head.kernel": (768, 1000),
                     "head.bias": (1000,)}  # fmt: skip


def resnet50() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"conv1": (7, 7, 3, 64), "bn1.scale": (64,),
                                          "bn1.bias": (64,)}  # fmt: skip
    channels = 64
    for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)]):
        for block in range(blocks):
            name = f"layer{stage + 1}.{block}"
            shapes |= {
                f"{name}.conv1": (1, 1, channels, width),
                f"{name}.conv2": (3, 3, width, width),
                f"{name}.conv3": (1, 1, width, 4 * width),
            }
            for norm, size in (("bn1", width), ("bn2", width), ("bn3", 4 * width)):
                shapes |= {f"{name}.{norm}.scale": (size,), f"{name}.{norm}.bias": (size,)}
            if block == 0:
                shapes |= {
                    f"{name}.downsample": (1, 1, channels, 4 * width),
                    f"{name}.downsample_bn.scale": (4 * width,),
                    f"{name}.downsample_bn.bias": (4 * width,),
                }
            channels = 4 * width
    return shapes | {"fc.kernel": (2048, 1000), "fc.bias": (1000,)}


def llama_1b() -> dict[str, tuple[int, ...]]:
    """A Llama 3.2 1B-style configuration: vocabulary 128,256, width 2,048, 16 layers,
    8 key-value heads of 64, MLP 8,192, tied embeddings."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (128256, 2048)}
    for i in range(16):
        shapes |= {
            f"l{i}.attn_norm": (2048,), f"l{i}.q": (2048, 2048), f"l{i}.k": (2048, 512),
            f"l{i}.v": (2048, 512), f"l{i}.o": (2048, 2048), f"l{i}.mlp_norm": (2048,),
            f"l{i}.gate": (2048, 8192), f"l{i}.up": (2048, 8192), f"l{i}.down": (8192, 2048),
        }  # fmt: skip
    return shapes | {"norm": (2048,)}


MODELS = {
    "GPT-2 small": gpt2_small,
    "ViT-B/16": vit_b16,
    "ResNet-50": resnet50,
    "Llama-style 1B": llama_1b,
}
FORMATS = ["bfloat16", "float8_e4m3fn", "int8", "int4"]


def state_bytes_per_parameter(shapes: dict[str, tuple[int, ...]], tx: Any) -> float:
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
    state = jax.eval_shape(tx.init, params)
    count = sum(math.prod(shape) for shape in shapes.values())
    stored = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
    return stored / count


def peak_bytes_per_parameter(
    shapes: dict[str, tuple[int, ...]], tx: Any, target: Any = None
) -> tuple[float, float]:
    """The donated step's peak (arguments, temporaries and any output not written into a
    donated argument) and its temporaries alone, bytes per parameter, the gradients
    passed; compiled for this machine or for ``target`` (a device of ``gpu_target``)."""
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
    state = jax.eval_shape(tx.init, params)

    def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    arguments = (params, state, params)
    if target is not None:
        arguments = gpu_target.placed_like(arguments, target)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*arguments).compile()
    analysis = compiled.memory_analysis()
    count = sum(math.prod(shape) for shape in shapes.values())
    unaliased = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    peak = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes + unaliased
    return peak / count, analysis.temp_size_in_bytes / count


def layouts(baseline: str) -> Iterator[tuple[str, dict[str, tuple[int, ...]], int]]:
    """Each model's name, parameter shapes and parameter count, after a table header
    whose third column is ``baseline``."""
    print(f"| model | parameters | {baseline} | " + " | ".join(FORMATS) + " |")
    print("|---|---|---|" + "---|" * len(FORMATS))
    for model, make in MODELS.items():
        shapes = make()
        yield model, shapes, sum(math.prod(shape) for shape in shapes.values())


def print_peaks(target: Any) -> dict[str, dict[str, tuple[float, float]]]:
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for model, shapes, count in layouts("float32 Adam"):
        baseline = peak_bytes_per_parameter(shapes, optax.adamw(1e-3), target)
        row = {"float32": baseline}
        for fmt in FORMATS:
            options = {} if fmt == "bfloat16" else {"partial_blocks": True}
            tx = jaxscale.low_precision_state(optax.adamw(1e-3), fmt, **options)
            row[fmt] = peak_bytes_per_parameter(shapes, tx, target)
        results[model] = row
        cells = [f"{peak:.2f} ({peak / baseline[0]:.2f}x)" for peak, _ in list(row.values())[1:]]
        print(
            f"| {model} | {count / 1e6:.1f}M | {baseline[0]:.2f} | " + " | ".join(cells) + " |",
            flush=True,
        )
    largest = max(temporaries for row in results.values() for _, temporaries in row.values())
    print(f"\n(peak bytes per parameter; temporaries at most {largest:.2f} bytes per parameter)")
    return results


def main(argv: list[str] | None = None) -> dict[str, dict[str, tuple[float, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak", action="store_true", help="the donated step's peak")
    parser.add_argument(
        "--gpu-target",
        choices=list(gpu_target.TARGETS),
        help="with --peak: compile for this GPU, on a machine without one (needs JAX's "
        "CUDA plugin)",
    )
    args = parser.parse_args(argv)
    if args.gpu_target and not args.peak:
        parser.error("--gpu-target measures the peak: give --peak too")
    if args.peak:
        target = gpu_target.device(args.gpu_target) if args.gpu_target else None
        return print_peaks(target)
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for model, shapes, count in layouts("float32"):
        float32 = state_bytes_per_parameter(shapes, optax.adamw(1e-3))
        row = {}
        for fmt in FORMATS:
            torchao_rule = state_bytes_per_parameter(
                shapes, jaxscale.low_precision_state(optax.adamw(1e-3), fmt)
            )
            every = (
                torchao_rule
                if fmt == "bfloat16"
                else state_bytes_per_parameter(
                    shapes,
                    jaxscale.low_precision_state(optax.adamw(1e-3), fmt, partial_blocks=True),
                )
            )
            row[fmt] = (torchao_rule, every)
        results[model] = row
        cells = [
            f"{a:.3f}" if fmt == "bfloat16" else f"{a:.3f} / {b:.3f}" for fmt, (a, b) in row.items()
        ]
        print(f"| {model} | {count / 1e6:.1f}M | {float32:.3f} | " + " | ".join(cells) + " |")
    print("\n(block formats: torchao's rule / partial_blocks=True)")
    return results


if __name__ == "__main__":
    main()
