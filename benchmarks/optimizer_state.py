"""Low-precision parameters and optimizer state: bytes per parameter at rest and at the
compiled step's peak, and step time.

For one parameter layout (10M parameters in 50 leaves by default), each variant
runs ``update`` + ``apply_updates`` under ``jax.jit`` with parameters and state
donated, on fixed gradients, interleaved with the baseline ``optax.adamw`` on
float32 parameters:

* on bfloat16 parameters: ``master_weights(adamw)``, ``stochastic_rounding(adamw)``,
  ``kahan_summation(adamw)``, and ``adamw`` alone (round to nearest, which stalls);
* on float32 parameters: ``low_precision_state(adamw, dtype)`` for bfloat16,
  float8_e4m3fn, 8 and 4 bits (torchao's ``AdamWFp8``, ``AdamW8bit`` and
  ``AdamW4bit`` formats), and the compositions ``master_weights(low_precision_state)``
  and ``grad_scaler(low_precision_state)``;
* ``optax.MultiSteps`` and ``optax.apply_if_finite`` outside and inside the 8-bit state
  (memory only).

Memory is read from the step compiled on abstract shapes (``jax.ShapeDtypeStruct``;
nothing is allocated), as bytes per parameter: at rest (the step's arguments:
parameters, gradients and state), the temporaries XLA needs on top, and the peak
(their sum, with any output not written into a donated argument); then the same for a
training step that computes its gradients (from a matmul per leaf), whose gradients
are temporaries and may be overwritten. ``--torch cpu``
also times torchao's optimizers against PyTorch's fused ``AdamW`` on the same layout
(torchao compiles its step with ``torch.compile``, as it ships).

On a CPU the step time is measured twice: with the C library's allocator as it is,
and with freed memory kept for reuse (``benchmarks/allocation.py``): XLA allocates a
step's temporaries each time it runs, and glibc maps fresh pages for each one above
32 MiB, so the first table charges a variant for its temporaries' page faults and
the second for its arithmetic and memory traffic alone.

With ``--gpu-target h100`` the memory tables are read from the steps compiled for an
H100 on a machine without one (XLA's deviceless compile, ``benchmarks/gpu_target.py``;
needs JAX's CUDA plugin), and nothing is timed.

    python -m benchmarks.optimizer_state --layout 10M/50 --repeats 7
    python -m benchmarks.optimizer_state --layout 32M/4 --gpu-target h100  # no GPU needed
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxscale
from benchmarks import gpu_target
from benchmarks.allocation import reuse_freed_memory
from benchmarks.harness import JaxStepper, Result, Stepper, measure, table

LEARNING_RATE = 1e-3
BF16, F32 = jnp.bfloat16, jnp.float32


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LEARNING_RATE)


def state(dtype: Any) -> Callable[[], optax.GradientTransformation]:
    return lambda: jaxscale.low_precision_state(adamw(), dtype)


VARIANTS: dict[str, tuple[Any, Callable[[], optax.GradientTransformation]]] = {
    "adamw, float32 parameters (baseline)": (F32, adamw),
    "adamw, bfloat16 parameters (round to nearest)": (BF16, adamw),
    "master_weights(adamw), bfloat16 parameters": (BF16, lambda: jaxscale.master_weights(adamw())),
    "stochastic_rounding(adamw), bfloat16 parameters": (
        BF16, lambda: jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0))
    ),
    "kahan_summation(adamw), bfloat16 parameters": (
        BF16, lambda: jaxscale.kahan_summation(adamw())
    ),
    "low_precision_state(adamw, bfloat16)": (F32, state("bfloat16")),
    "low_precision_state(adamw, float8_e4m3fn)": (F32, state("float8_e4m3fn")),
    "low_precision_state(adamw, int8)": (F32, state("int8")),
    "low_precision_state(adamw, int4)": (F32, state("int4")),
    "master_weights(low_precision_state(adamw, int8)), bfloat16 parameters": (
        BF16, lambda: jaxscale.master_weights(jaxscale.low_precision_state(adamw(), "int8"))
    ),
    "grad_scaler(low_precision_state(adamw, int8))": (
        F32, lambda: jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), "int8"))
    ),
}  # fmt: skip
BASELINE = "adamw, float32 parameters (baseline)"


def accumulating(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    return optax.MultiSteps(tx, every_k_schedule=4).gradient_transformation()


def if_finite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    return optax.apply_if_finite(tx, 3)


# optax.MultiSteps and optax.apply_if_finite apply their inner update inside a lax.cond,
# which the state's slice loop reads as both branches and a selection
CONDITIONAL: dict[str, Callable[[], optax.GradientTransformation]] = {
    "MultiSteps(adamw), float32 state": lambda: accumulating(adamw()),
    "MultiSteps(low_precision_state(adamw, int8))": lambda: accumulating(state("int8")()),
    "low_precision_state(MultiSteps(adamw), int8)": lambda: jaxscale.low_precision_state(
        accumulating(adamw()), "int8"
    ),
    "apply_if_finite(adamw), float32 state": lambda: if_finite(adamw()),
    "apply_if_finite(low_precision_state(adamw, int8))": lambda: if_finite(state("int8")()),
    "low_precision_state(apply_if_finite(adamw), int8)": lambda: jaxscale.low_precision_state(
        if_finite(adamw()), "int8"
    ),
}
ALLOCATORS = {
    "default": "the C library's allocator as it is",
    "reuse": "freed memory kept for reuse (benchmarks/allocation.py)",
}


def leaf_size(n_params: int, n_leaves: int) -> int:
    # leaves of a multiple of 256 elements, so that the block formats quantize every one
    return n_params // n_leaves // 256 * 256


def parameters(n_params: int, n_leaves: int, dtype: Any) -> dict[str, jax.Array]:
    size = leaf_size(n_params, n_leaves)
    key = jax.random.key(0)
    return {
        f"p{i:03d}": (1e-2 * jax.random.normal(jax.random.fold_in(key, i), (size,))).astype(dtype)
        for i in range(n_leaves)
    }


def abstract_parameters(n_params: int, n_leaves: int, dtype: Any) -> dict[str, Any]:
    size = leaf_size(n_params, n_leaves)
    return {f"p{i:03d}": jax.ShapeDtypeStruct((size,), dtype) for i in range(n_leaves)}


def placed(tree: Any, target: Any) -> Any:
    """``tree``'s abstract arrays, on ``target`` (a device of ``gpu_target``) if any."""
    return tree if target is None else gpu_target.placed_like(tree, target)


def step_of(tx: Any) -> Callable[..., tuple[Any, Any]]:
    def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def stepper(dtype: Any, make_tx: Callable[[], Any], n_params: int, n_leaves: int) -> JaxStepper:
    tx = make_tx()
    params = parameters(n_params, n_leaves, dtype)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    step = jax.jit(step_of(tx), donate_argnums=(0, 1))
    return JaxStepper(step, (params, tx.init(params)), (grads,))


def memory(
    dtype: Any, make_tx: Callable[[], Any], n_params: int, n_leaves: int, target: Any = None
) -> dict:
    """Bytes per parameter of the donated step compiled on abstract shapes (for this
    machine's default device, or ``target``): at rest (arguments), the temporaries, the
    peak, and the optimizer's state alone."""
    tx = make_tx()
    params = abstract_parameters(n_params, n_leaves, dtype)
    state = jax.eval_shape(tx.init, params)
    arguments = placed((params, state, params), target)
    compiled = jax.jit(step_of(tx), donate_argnums=(0, 1)).lower(*arguments).compile()
    analysis = compiled.memory_analysis()
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    unaliased = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    state_bytes = sum(
        math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)
    )
    return {
        "at rest": analysis.argument_size_in_bytes / count,
        "temporaries": analysis.temp_size_in_bytes / count,
        "peak": (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes + unaliased) / count,
        "state": state_bytes / count,
    }


def training_step_memory(
    dtype: Any, make_tx: Callable[[], Any], n_params: int, n_leaves: int, target: Any = None
) -> dict:
    """Bytes per parameter of a donated training step that computes its gradients (each
    leaf's from a matmul, as a layer's are, so XLA writes them out): at rest (parameters
    and state), the temporaries (the gradients among them; on a CPU, a bfloat16 matmul's
    float32 operand and output too, which XLA's CPU backend computes it through), and
    the peak."""
    tx = make_tx()
    params = abstract_parameters(n_params, n_leaves, dtype)
    state = jax.eval_shape(tx.init, params)

    def step(params: Any, state: Any, mixing: Any) -> tuple[Any, Any]:
        grads = jax.tree.map(
            lambda p: (p.reshape(-1, 256) @ mixing.astype(p.dtype)).reshape(p.shape), params
        )
        return step_of(tx)(params, state, grads)

    mixing = jax.ShapeDtypeStruct((256, 256), F32)  # (its bytes are left out below)
    arguments = placed((params, state, mixing), target)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*arguments).compile()
    analysis = compiled.memory_analysis()
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    at_rest = (analysis.argument_size_in_bytes - 256 * 256 * 4) / count
    temporaries = analysis.temp_size_in_bytes / count
    return {"at rest": at_rest, "temporaries": temporaries, "peak": at_rest + temporaries}


class TorchStepper(Stepper):
    """A torch optimizer stepping parameters of the layout with fixed gradients."""

    def __init__(self, make: Callable[[list], Any], n_params: int, n_leaves: int, dtype: Any):
        import torch

        self.torch = torch
        size = leaf_size(n_params, n_leaves)
        generator = torch.Generator().manual_seed(0)
        self.params = [
            torch.nn.Parameter((torch.randn(size, generator=generator) * 1e-2).to(dtype))
            for _ in range(n_leaves)
        ]
        for p in self.params:
            p.grad = torch.full_like(p, 1e-3)
        self.optimizer = make(self.params)

    def step(self) -> None:
        self.optimizer.step()

    def block(self) -> None:
        pass


def torch_variants(n_params: int, n_leaves: int) -> dict[str, Callable[[], Stepper]]:
    import torch

    with warnings.catch_warnings():  # torchao's import warns about its optional GPU kernels
        warnings.simplefilter("ignore")
        from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8, _AdamW

    def make(optimizer: Any, dtype: Any = torch.float32, **options: Any) -> Callable[[], Stepper]:
        return lambda: TorchStepper(
            lambda p: optimizer(p, lr=LEARNING_RATE, **options), n_params, n_leaves, dtype
        )

    return {
        "torch AdamW (fused), float32 (baseline)": make(torch.optim.AdamW, fused=True),
        "torchao _AdamW, bfloat16, stochastic rounding": make(
            _AdamW, torch.bfloat16, bf16_stochastic_round=True
        ),
        "torchao AdamWFp8": make(AdamWFp8),
        "torchao AdamW8bit": make(AdamW8bit),
        "torchao AdamW4bit": make(AdamW4bit),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="10M/50", help="parameters/leaves, e.g. 10M/50")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--torch", choices=["cpu", "none"], default="none")
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument(
        "--gpu-target",
        choices=list(gpu_target.TARGETS),
        help="the memory tables of the steps compiled for this GPU, on a machine without "
        "one (XLA's deviceless compile; needs JAX's CUDA plugin); nothing is timed",
    )
    parser.add_argument(
        "--allocator",
        choices=["both", "default", "reuse"],
        default="both",
        help="time the steps with the C library's allocator as it is, with freed memory "
        "kept for reuse (benchmarks/allocation.py), or both, one after the other",
    )
    args = parser.parse_args(argv)
    count, leaves = args.layout.split("/")
    n_params, n_leaves = int(float(count.rstrip("M")) * 1e6), int(leaves)
    target = gpu_target.device(args.gpu_target) if args.gpu_target else None
    compiled_for = f" for {args.gpu_target} (no device)" if target else ""

    print(
        f"Bytes per parameter, {args.layout} parameters/leaves, the donated step compiled"
        f"{compiled_for}:\n"
    )
    print("| variant | at rest | temporaries | peak | optimizer state alone |")
    print("|---|---|---|---|---|")
    footprint = {}
    for name, (dtype, make_tx) in VARIANTS.items():
        footprint[name] = memory(dtype, make_tx, n_params, n_leaves, target)
        row = footprint[name]
        print(
            f"| {name} | {row['at rest']:.2f} | {row['temporaries']:.2f} | {row['peak']:.2f} "
            f"| {row['state']:.3f} |",
            flush=True,
        )
    print(f"\nThe training step that computes its gradients, {args.layout}, bytes per parameter:\n")
    print("| variant | at rest | temporaries | beyond optax.adamw's | peak |")
    print("|---|---|---|---|---|")
    plain: dict[Any, float] = {}  # optax.adamw's temporaries, by parameter dtype
    for name, (dtype, make_tx) in VARIANTS.items():
        row = training_step_memory(dtype, make_tx, n_params, n_leaves, target)
        plain.setdefault(dtype, row["temporaries"])  # (the first variant of each dtype)
        beyond = row["beyond optax.adamw's"] = row["temporaries"] - plain[dtype]
        footprint[name]["training step"] = row
        print(
            f"| {name} | {row['at rest']:.2f} | {row['temporaries']:.2f} "
            f"| {beyond:.2f} | {row['peak']:.2f} |",
            flush=True,
        )
    print(
        "\nConditional updates (optax.MultiSteps, k=4; optax.apply_if_finite), the training "
        f"step, {args.layout}:\n"
    )
    print("| variant | at rest | temporaries | peak |")
    print("|---|---|---|---|")
    for name, make_tx in CONDITIONAL.items():
        row = training_step_memory(F32, make_tx, n_params, n_leaves, target)
        footprint[name] = {"training step": row}
        print(
            f"| {name} | {row['at rest']:.2f} | {row['temporaries']:.2f} | {row['peak']:.2f} |",
            flush=True,
        )
    if args.memory_only or target is not None:
        return {"memory": footprint}

    variants = {
        name: (lambda d=dtype, m=make_tx: stepper(d, m, n_params, n_leaves))
        for name, (dtype, make_tx) in VARIANTS.items()
    }
    out: dict[str, Any] = {"memory": footprint}
    modes = ["default", "reuse"] if args.allocator == "both" else [args.allocator]
    for mode in modes:
        if mode == "reuse" and not reuse_freed_memory():
            print("\n(freed memory cannot be kept for reuse here: not glibc)")
            continue
        results: list[Result] = measure(variants, BASELINE, repeats=args.repeats)
        allocator = ALLOCATORS[mode]
        print(f"\nStep time, {args.layout} parameters/leaves, {allocator}, ratio to {BASELINE}:\n")
        print(table(results), flush=True)
        out["step" if mode == "default" else "step, freed memory reused"] = results
    if args.torch != "none":
        theirs = measure(
            torch_variants(n_params, n_leaves),
            "torch AdamW (fused), float32 (baseline)",
            repeats=args.repeats,
        )
        allocator = ALLOCATORS[modes[-1]]
        print(f"\ntorchao on the same layout, {allocator}, ratio to torch's fused AdamW:\n")
        print(table(theirs), flush=True)
        out["torchao"] = theirs
    return out


if __name__ == "__main__":
    main()
