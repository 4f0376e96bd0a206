"""Test configuration: strict dtype promotion and eight simulated CPU devices.

Strict promotion turns every silent float16 -> float32 promotion (the bug class a
loss scaler invites) into an error. The device count must be set before JAX
creates its backends, hence before anything imports jax.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
