"""Test setup: 16 simulated CPU devices, configured before JAX initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Commands run in tests keep no compilation cache unless a test gives one (--compile-cache).
os.environ.setdefault("CTSEG_COMPILE_CACHE", "off")

from ctseg.parallel.xla_options import add_options  # noqa: E402

# Programs compiled here for GPU targets are compiled as a command compiles them, whichever
# test (a command run in this process) happens to start JAX first.
add_options(os.environ)

from ctseg.cli.library_output import held  # noqa: E402

with held(show=False):  # the lines of compile-only plugins (the targets extra) on import
    import jax

jax.config.update("jax_num_cpu_devices", 16)


import pytest  # noqa: E402
from helpers import write_trained_run  # noqa: E402


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(run_dir, store_dir, raw_dir) of a 2-step run of a tiny model on a 16³ grid, built
    once per test process and shared: tests copy it before changing anything in it."""
    return write_trained_run(tmp_path_factory.mktemp("run"))
