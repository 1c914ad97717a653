"""Test setup: 16 simulated CPU devices, configured before JAX initialises its backend."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Commands run in tests choose no compilation cache of their own unless a test gives one
# (--compile-cache); the test process keeps one of its own (below).
os.environ.setdefault("CTSEG_COMPILE_CACHE", "off")

from ctseg.parallel.xla_options import add_options  # noqa: E402

# Programs compiled here for GPU targets are compiled as a command compiles them, whichever
# test (a command run in this process) happens to start JAX first.
add_options(os.environ)

from ctseg.cli.library_output import held  # noqa: E402

with held(show=False):  # the lines of compile-only plugins (the targets extra) on import
    import jax

jax.config.update("jax_num_cpu_devices", 16)

# One persistent compilation cache per test process: many tests build the same tiny
# programs again (a model's steps, a training run's) and would otherwise compile each anew
# (on 2 cores the suite ran 10 min 19 s with it, 11 min 52 s without).
_CACHE = tempfile.mkdtemp(prefix="ctseg-tests-xla-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_configure(config):
    # A program compiled for a GPU or TPU that is not there finds its earlier entry but
    # cannot load it without that device: JAX compiles it again, and warns.
    config.addinivalue_line(
        "filterwarnings", "ignore:Error reading persistent compilation cache entry"
    )


import pytest  # noqa: E402
from helpers import write_trained_run  # noqa: E402


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(run_dir, store_dir, raw_dir) of a 2-step run of a tiny model on a 16³ grid, built
    once per test process and shared: tests copy it before changing anything in it."""
    return write_trained_run(tmp_path_factory.mktemp("run"))
