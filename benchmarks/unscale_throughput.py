"""Throughput of unscale_and_check against a plain copy of the same bytes.

A copy (read N bytes, write N bytes) is the memory-bandwidth limit for any
elementwise pass. ``unscale_and_check`` reads each gradient, writes the
unscaled gradient and reduces the inf/NaN check; the figure of merit is its
bandwidth (the same 2N bytes over its time) as a fraction of the copy's. The
check alone (``all_finite``: N bytes read) is reported too.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

import jaxscale
from benchmarks.harness import JaxStepper, measure


def leaves(total_bytes: int, n_leaves: int, dtype) -> list[jax.Array]:
    size = total_bytes // jnp.dtype(dtype).itemsize // n_leaves
    key = jax.random.key(0)
    return [jax.random.normal(jax.random.fold_in(key, i), (size,), dtype) for i in range(n_leaves)]


def copy_stepper(grads, scale):
    # negation: a full read and write that XLA cannot elide (x * 1 and x + 0 it may);
    # the gradients are donated, so it writes in place, as unscale_and_check does
    step = jax.jit(lambda g, s: (jax.tree.map(jnp.negative, g), s), donate_argnums=0)
    return JaxStepper(step, (jax.tree.map(jnp.copy, grads), scale))


def unscale_stepper(grads, scale):
    step = jax.jit(lambda g, s: (jaxscale.unscale_and_check(g, s)[0], s), donate_argnums=0)
    return JaxStepper(step, (jax.tree.map(jnp.copy, grads), scale))


def check_stepper(grads, scale):
    step = jax.jit(lambda s, g: (s + jaxscale.all_finite(g).astype(jnp.float32),))
    return JaxStepper(step, (scale,), (grads,))


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    rows = []
    for dtype in [jnp.float32, jnp.float16]:
        for n_leaves in [1, 64]:
            grads = leaves(args.megabytes * 2**20, n_leaves, dtype)
            nbytes = sum(g.nbytes for g in grads)
            scale = jnp.float32(2.0**16)
            variants = {
                "copy": functools.partial(copy_stepper, grads, scale),
                "unscale_and_check": functools.partial(unscale_stepper, grads, scale),
                "all_finite": functools.partial(check_stepper, grads, scale),
            }
            results = {r.name: r for r in measure(variants, "copy", repeats=args.repeats)}
            copy_bw = 2 * nbytes / results["copy"].seconds / 1e9
            unscale_bw = 2 * nbytes / results["unscale_and_check"].seconds / 1e9
            check_bw = nbytes / results["all_finite"].seconds / 1e9
            rows.append({
                "dtype": jnp.dtype(dtype).name, "leaves": n_leaves, "MB": nbytes / 2**20,
                "copy GB/s": copy_bw, "unscale_and_check GB/s": unscale_bw,
                "fraction of copy": unscale_bw / copy_bw, "all_finite GB/s (read only)": check_bw,
            })  # fmt: skip
    print(
        "| dtype | leaves | MB | copy GB/s | unscale_and_check GB/s | fraction of copy "
        "| all_finite GB/s (read) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['leaves']} | {r['MB']:.0f} | {r['copy GB/s']:.1f} | "
              f"{r['unscale_and_check GB/s']:.1f} | {r['fraction of copy']:.2f} | "
              f"{r['all_finite GB/s (read only)']:.1f} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
