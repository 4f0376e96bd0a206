"""An NVIDIA H100 to compile for, on a machine without one (XLA's deviceless compile).

XLA's GPU compiler needs no GPU to compile: given a description of the device it
runs every pass and emits the kernels, so compile time, the fusions it makes and the
kernels it launches can be studied on any machine. Needs JAX's CUDA plugin
(``pip install "jax[cuda13]"``); no GPU and no driver, but without a driver the
plugin's version checks fail and it does not load unless they are skipped:
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``. Figures from it are compile times, memory
and program structure, never run times.

    python -m benchmarks.compile_time --gpu-target h100 --leaves 100 500
"""

from __future__ import annotations

from typing import Any

import jax

# The device description XLA reads for an H100 SXM (80 GB, compute capability 9.0),
# with the CUDA and cuDNN versions the plugin was built against.
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version: {
  major: 12
  minor: 8
  patch: 0
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 7
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""

TARGETS = {"h100": H100}


def device(target: str) -> Any:
    """A device of ``target`` (a key of :data:`TARGETS`) to lower and compile for."""
    from jax.experimental.topologies import get_topology_desc

    try:
        topology = get_topology_desc("gpu", "cuda", target_config=TARGETS[target], topology="1x1x1")
    except Exception as error:  # the plugin's errors differ between JAX releases
        raise RuntimeError(
            f"no deviceless compile for {target!r}: it needs JAX's CUDA plugin "
            f'(pip install "jax[cuda13]"; on a machine without a driver, run with '
            f"JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1), and the plugin said: {error}"
        ) from error
    return topology.devices[0]


def placed_like(tree: Any, target_device: Any) -> Any:
    """Shape-and-dtype placeholders of ``tree``'s arrays, on ``target_device``."""
    # JAX 0.12.1 deprecates the class's name for this function; earlier ones lack it
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    sharding = make(target_device) if make else jax.sharding.SingleDeviceSharding(target_device)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            jax.numpy.shape(x), jax.numpy.result_type(x), sharding=sharding
        ),
        tree,
    )
