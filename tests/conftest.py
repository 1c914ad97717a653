"""Test setup: 16 simulated CPU devices, configured before JAX initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Commands run in tests keep no compilation cache unless a test gives one (--compile-cache).
os.environ.setdefault("CTSEG_COMPILE_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 16)
