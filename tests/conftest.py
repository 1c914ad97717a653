"""Test setup: 16 simulated CPU devices, configured before JAX initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 16)
