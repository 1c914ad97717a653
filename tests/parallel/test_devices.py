"""The device policy over fake device lists: what runs where, and the line that says so."""

import os
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import jax
import pytest

from ctseg import config as cfg
from ctseg.errors import CtsegError, OptionError
from ctseg.inference.network.choice import backend_name
from ctseg.memory import host_memory
from ctseg.parallel import devices as dev
from ctseg.parallel import jax_start, xla_options
from ctseg.parallel.compile_cache import COMPILE_CACHE_ENV, compile_cache_dir
from ctseg.parallel.devices import ChosenDevices
from ctseg.parallel.layouts import fit_layout, fit_training
from ctseg.parallel.xla_options import CUBLAS_GEMMS, OPTIONS, add_options
from ctseg.training import programs

GIB = 2**30


@dataclass
class FakeDevice:
    platform: str
    device_kind: str
    free: int | None = None  # bytes; None: no memory statistics (a CPU)

    def memory_stats(self):
        if self.free is None:
            return None
        return {"bytes_limit": self.free + GIB, "bytes_in_use": GIB}


CPU = [FakeDevice("cpu", "cpu") for _ in range(16)]  # simulated, as in the tests
H100 = "NVIDIA H100 80GB HBM3"


def gpus(count: int, free: int = 70 * GIB) -> list[FakeDevice]:
    return [FakeDevice("gpu", H100, free) for _ in range(count)]


def test_auto_takes_the_accelerators_else_the_cpu():
    assert dev.choose("auto", {"cpu": CPU}) == CPU
    one = gpus(1)
    assert dev.choose("auto", {"gpu": one, "cpu": CPU}) == one
    eight = gpus(8)
    assert dev.choose("auto", {"gpu": eight, "cpu": CPU}) == eight
    tpus = [FakeDevice("tpu", "TPU v5 lite") for _ in range(4)]
    assert dev.choose("auto", {"tpu": tpus, "cpu": CPU}) == tpus
    # Asked for the CPU on a GPU machine: the CPU, never the other way round.
    assert dev.choose("cpu", {"gpu": one, "cpu": CPU}) == CPU


def test_an_accelerator_that_is_not_there_is_one_line():
    with pytest.raises(CtsegError, match=r"`device` gpu: JAX sees no GPU here \(platforms: cpu\)"):
        dev.choose("gpu", {"cpu": CPU})
    with pytest.raises(CtsegError, match="no TPU"):
        dev.choose("tpu", {"gpu": gpus(1), "cpu": CPU})


def test_inference_backend():
    def chosen(request: str, devices: list) -> ChosenDevices:
        return ChosenDevices(request, tuple(devices), {})

    # A CPU-only machine: ONNX Runtime when installed, else XLA.
    assert backend_name(None, chosen("auto", CPU), have_onnx=True) == "onnx"
    assert backend_name(None, chosen("cpu", CPU), have_onnx=False) == "jax"
    # Accelerators run JAX; `backend` stays the override on the CPU.
    assert backend_name(None, chosen("auto", gpus(1)), have_onnx=True) == "jax"
    assert backend_name("jax", chosen("cpu", CPU), have_onnx=True) == "jax"
    assert backend_name("onnx", chosen("auto", gpus(1)), have_onnx=True) == "onnx"
    with pytest.raises(OptionError, match="`backend` onnx runs on the CPU, not on `device` gpu"):
        backend_name("onnx", chosen("gpu", gpus(1)), have_onnx=True)


def test_what_runs_where_is_said_in_words():
    assert dev.describe(gpus(1)) == f"1 × {H100}"
    assert dev.describe(gpus(8)) == f"8 × {H100}"
    cores = os.cpu_count()
    assert dev.describe(CPU[:1]) == f"CPU ({cores} cores)"
    assert dev.describe(CPU, simulated=True) == f"16 simulated CPU devices ({cores} cores)"


def test_free_memory_is_the_least_free_accelerator_or_the_host():
    mixed = [FakeDevice("gpu", H100, 70 * GIB), FakeDevice("gpu", H100, 30 * GIB)]
    assert dev.free_memory(mixed) == 30 * GIB
    assert dev.free_memory(CPU) == host_memory() > 0


@pytest.mark.parametrize(
    ("resolution", "depth", "devices", "spatial"),
    [
        (32, 2, 1, [1, 1, 1]),
        (32, 2, 4, [2, 2, 1]),
        (32, 2, 8, [2, 2, 2]),
        (32, 2, 16, [4, 4, 1]),
        (32, 2, 3, [2, 1, 1]),  # 3 partitions cannot split a 32 grid: fewer devices
        # alignment 8: 16 / 4 = 4 slices are not a multiple of 8, so [2, 2, 2] at most
        (16, 4, 16, [2, 2, 2]),
        (32, 4, 16, [4, 4, 1]),
    ],
)
def test_a_trained_layout_is_refitted_to_the_devices(resolution, depth, devices, spatial):
    trained = cfg.load(
        None,
        [
            f"data.resolution={resolution}",
            f"model.depth={depth}",
            "mesh.spatial=[1,1,1]" if resolution == 16 else "mesh.spatial=[4,4,1]",
        ],
    )
    fitted = fit_layout(trained, devices)
    assert list(fitted.mesh.spatial) == spatial and fitted.mesh.data == 1
    assert fitted.model == trained.model  # the layout changes, never the model


def test_compile_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache_dir(None) == tmp_path / "ctseg" / "xla"
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "elsewhere"))
    assert compile_cache_dir(None) == tmp_path / "elsewhere"
    assert compile_cache_dir("off") is None
    assert compile_cache_dir(str(tmp_path / "given")) == tmp_path / "given"


SIXTEEN_WAY = cfg.load(None, ["data.resolution=32", "model.depth=2", "mesh.spatial=[4,4,1]"])


@pytest.mark.parametrize(
    ("devices", "spatial", "line"),
    [
        (
            CPU,
            [4, 4, 1],
            "16 simulated CPU devices ({cores} cores) here: training [4, 4, 1] (16 partitions)",
        ),
        (
            gpus(1),
            [1, 1, 1],
            f"config asks [4, 4, 1] (16 devices); 1 × {H100} here: training unpartitioned",
        ),
        (
            gpus(4),
            [2, 2, 1],
            f"config asks [4, 4, 1] (16 devices); 4 × {H100} here: "
            "training [2, 2, 1] (4 partitions)",
        ),
        (
            gpus(8),
            [2, 2, 2],
            f"config asks [4, 4, 1] (16 devices); 8 × {H100} here: "
            "training [2, 2, 2] (8 partitions)",
        ),
        (gpus(16), [4, 4, 1], f"16 × {H100} here: training [4, 4, 1] (16 partitions)"),
    ],
)
def test_training_fits_the_mesh_to_the_devices_here(devices, spatial, line):
    layout = fit_training(SIXTEEN_WAY, devices)
    assert list(layout.config.mesh.spatial) == spatial
    assert layout.devices == devices[: layout.config.num_devices]
    assert layout.line == line.format(cores=os.cpu_count())
    assert layout.config.model == SIXTEEN_WAY.model and layout.config.train == SIXTEEN_WAY.train


def replicated(batch: int, data: int) -> cfg.Config:
    """16³ at depth 4 (at most 8 partitions, [2, 2, 2]) asking for `data` replicas."""
    overrides = ["data.resolution=16", "model.depth=4", "mesh.spatial=[2,2,2]"]
    return cfg.load(None, [*overrides, f"train.batch_size={batch}", f"mesh.data={data}"])


@pytest.mark.parametrize(
    ("batch", "data", "gpu_count", "spatial", "replicas"),
    [
        (2, 2, 12, [2, 2, 2], 1),  # 8 devices either way: a tie keeps the spatial split
        (3, 3, 12, [2, 2, 1], 3),  # 4 × 3 uses all 12, [2, 2, 2] only 8
        (4, 4, 16, [2, 2, 2], 2),  # 8 × 2 = 16 (as does 4 × 4: the tie keeps the larger split)
    ],
)
def test_data_replicas_take_the_devices_the_grid_cannot(batch, data, gpu_count, spatial, replicas):
    layout = fit_training(replicated(batch, data), gpus(gpu_count))
    assert (list(layout.config.mesh.spatial), layout.config.mesh.data) == (spatial, replicas)
    if replicas > 1:
        partitions = 8 if spatial == [2, 2, 2] else 4
        assert layout.line.endswith(
            f"training {spatial} ({partitions} partitions) × {replicas} data replicas"
        )


def test_exact_mesh_is_an_error_where_the_devices_are_missing():
    assert fit_training(SIXTEEN_WAY, gpus(16), exact=True).config == SIXTEEN_WAY
    with pytest.raises(
        CtsegError,
        match=r"config asks \[4, 4, 1\] \(16 devices\) but only 1 "
        r"are here \(1 × NVIDIA H100 80GB HBM3\) and `exact`",
    ):
        fit_training(SIXTEEN_WAY, gpus(1), exact=True)


@dataclass
class FakeCompiled:
    """What `aot.memory_of` reads of a compiled step."""

    temp: int

    def memory_analysis(self):
        return SimpleNamespace(
            argument_size_in_bytes=GIB,
            output_size_in_bytes=GIB,
            temp_size_in_bytes=self.temp,
            alias_size_in_bytes=GIB,
        )


def test_a_step_too_large_for_the_gpu_is_one_line_with_the_ways_out():
    programs.check_memory(FakeCompiled(10 * GIB), SIXTEEN_WAY, gpus(1, free=70 * GIB))
    with pytest.raises(
        CtsegError,
        match=r"needs 101\.0 GiB per device but 1 × NVIDIA H100 80GB "
        r"HBM3 has 70\.0 GiB free; use more devices, a lower data.resolution",
    ):
        programs.check_memory(FakeCompiled(100 * GIB), SIXTEEN_WAY, gpus(1, free=70 * GIB))
    programs.check_memory(FakeCompiled(100 * GIB), SIXTEEN_WAY, CPU)  # the OS has the last word


# --------------------------------------------------------------------------- backends that fail

CUDA_FAILED = (
    "Unable to initialize backend 'cuda': INTERNAL: no supported devices found for platform "
    "CUDA (you may need to uninstall the failing plugin package, or set JAX_PLATFORMS=cpu to "
    "skip this backend.)"
)
NO_GPU = (
    "Unknown backend: 'gpu' requested, but no platforms that are instances of gpu are "
    "present. Platforms present are: cpu"
)
NO_LIBTPU = (
    "Backend 'tpu' failed to initialize: INTERNAL: Failed to open libtpu.so: libtpu.so: "
    "cannot open shared object file: No such file or directory. Available backends are ['cpu']"
)
ROCM_UNKNOWN = (
    "Unable to initialize backend 'rocm': Backend 'rocm' is not in the list of known "
    "backends: ['cpu', 'tpu']. (set JAX_PLATFORMS='' to automatically choose an available "
    "backend)"
)


def fake_jax(monkeypatch, answer):
    """`jax.local_devices` / `jax.devices` as JAX answers them; `answer(backend, call)` gives
    the devices or raises. A fresh process: no start failure noted yet."""
    import jax

    calls = []

    def listing(backend=None):
        calls.append(backend)
        return answer(backend, len(calls))

    monkeypatch.setattr(jax, "local_devices", listing)
    monkeypatch.setattr(jax, "devices", listing)
    monkeypatch.setattr(jax_start, "_faults", {})


def cuda_plugin_fails(backend, call):
    """A CUDA plugin that fails to start: JAX raises it from the first call only, then
    serves the backends that started before it (the CPU)."""
    if call == 1:
        raise RuntimeError(CUDA_FAILED)
    return cpu_only(lambda other: NO_GPU if other == "gpu" else NO_LIBTPU)(backend, call)


def cpu_only(refusal):
    """JAX where only the CPU starts; any other backend is answered with `refusal(backend)`."""

    def answer(backend, call):
        if backend == "cpu":
            return CPU
        raise RuntimeError(refusal(backend))

    return answer


def test_auto_says_why_the_gpu_did_not_start(monkeypatch):
    fake_jax(monkeypatch, cuda_plugin_fails)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    found = jax_start.visible(local=False)
    assert dev.choose("auto", found) == CPU
    assert dev.fallback_warning("auto", found) == (
        "CUDA backend failed to start: INTERNAL: no supported devices found for platform "
        "CUDA; running on the CPU"
    )
    assert dev.fallback_warning("cpu", found) is None  # asked for: nothing to explain
    # JAX said it once; a later look in the same process still knows.
    assert jax_start.visible().faults == {"cuda": found.faults["cuda"]}


def test_gpu_that_failed_to_start_is_one_line_with_the_reason(monkeypatch):
    fake_jax(monkeypatch, cuda_plugin_fails)
    found = jax_start.visible()
    with pytest.raises(CtsegError) as error:
        dev.choose("gpu", found)
    assert str(error.value) == (
        "`device` gpu: CUDA backend failed to start: INTERNAL: no supported devices found "
        "for platform CUDA"
    )


def test_a_backend_not_installed_is_quiet(monkeypatch):
    # A CPU-only JAX (or JAX_PLATFORMS=cpu): no CUDA backend, no libtpu.
    fake_jax(monkeypatch, cpu_only(lambda backend: NO_GPU if backend == "gpu" else NO_LIBTPU))
    found = jax_start.visible()
    assert found == {"cpu": CPU} and found.faults == {}
    assert dev.fallback_warning("auto", found) is None
    with pytest.raises(CtsegError, match=r"^`device` gpu: JAX sees no GPU here \(platforms: cpu\)"):
        dev.choose("gpu", found)


def test_jax_platforms_that_starts_nothing_names_the_variable(monkeypatch):
    # JAX_PLATFORMS=gpu on a machine without one: JAX refuses every backend, the CPU too.
    def refuses(backend, call):
        raise RuntimeError(ROCM_UNKNOWN)

    fake_jax(monkeypatch, refuses)
    monkeypatch.setenv("JAX_PLATFORMS", "gpu")
    found = jax_start.visible()
    assert found.faults == {}  # ROCm is not installed: no fault, the variable is the cause
    with pytest.raises(CtsegError) as error:
        dev.choose("auto", found)
    message = str(error.value)
    assert message.startswith("JAX_PLATFORMS=gpu is set, and JAX started none of the platforms")
    assert "unset JAX_PLATFORMS" in message and "`device`" in message


def test_jax_platforms_that_leaves_the_gpu_out_says_so(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    fake_jax(monkeypatch, cpu_only(lambda backend: NO_GPU))
    with pytest.raises(CtsegError, match="JAX_PLATFORMS=cpu leaves it out: unset JAX_PLATFORMS"):
        dev.choose("gpu", jax_start.visible())


def test_the_command_prints_why_it_runs_on_the_cpu_first(monkeypatch, capsys):
    from ctseg.cli.options import start_jax

    fake_jax(monkeypatch, cuda_plugin_fails)
    chosen = start_jax(SIXTEEN_WAY, compile_cache="off")
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("warning: CUDA backend failed to start: INTERNAL: no supported")
    assert first.endswith("; running on the CPU")
    # The command's devices, chosen once and handed down.
    assert chosen.request == "auto" and {d.platform for d in chosen.devices} == {"cpu"}
    assert chosen.line == dev.describe(chosen.devices, simulated=True)


def test_jax_platforms_without_the_platform_is_one_line_from_the_command(tmp_path):
    # The real JAX on this CPU-only machine, as a user's shell would start it.
    env = {**os.environ, "JAX_PLATFORMS": "gpu", "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "ctseg.cli.main", "plan", "--set", "data.resolution=16"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: JAX_PLATFORMS=gpu is set"), done.stderr
    assert "Traceback" not in done.stderr and "--device cpu:" not in done.stderr


def test_plan_compiles_a_mesh_larger_than_the_gpus_on_simulated_cpu_devices():
    found = jax_start.Found({"gpu": gpus(1), "cpu": CPU})
    devices, line = dev.plan_devices(dev.ChosenDevices.of("auto", found), 16)
    assert devices == CPU
    assert line == (
        f"planning on 16 simulated CPU devices: the config's mesh needs 16, 1 × {H100} here has 1"
    )
    # Enough accelerators: the plan compiles on them.
    devices, line = dev.plan_devices(
        dev.ChosenDevices.of("auto", {"gpu": gpus(16), "cpu": CPU}), 16
    )
    assert [d.platform for d in devices] == ["gpu"] * 16
    assert line == f"planning on 16 × {H100}"
    assert dev.plan_devices(dev.ChosenDevices.of("cpu", found), 4)[0] == CPU[:4]
    with pytest.raises(CtsegError, match="no CPU devices to simulate them"):
        dev.plan_devices(dev.ChosenDevices.of("gpu", {"gpu": gpus(1)}), 16)  # JAX_PLATFORMS=cuda


def test_every_command_refuses_a_gpu_that_failed_before_it_starts_work(monkeypatch):
    from ctseg.cli.options import start_jax

    fake_jax(monkeypatch, cuda_plugin_fails)
    with pytest.raises(CtsegError, match="^`device` gpu: CUDA backend failed to start: INTERNAL"):
        start_jax(SIXTEEN_WAY, device="gpu", compile_cache="off")


def test_auto_starts_only_the_cpu_where_no_accelerator_is_attached(monkeypatch):
    """A compile-only plugin (the targets extra) must not fail to start on every command of
    a machine without accelerators: `--device auto` starts the CPU alone there."""
    monkeypatch.setattr(jax_start.sys, "platform", "linux")
    monkeypatch.setattr(jax_start.glob, "glob", lambda pattern: [])
    assert jax_start.no_accelerator()
    nvidia_only = lambda pattern: [pattern] if "nvidia" in pattern else []  # noqa: E731
    monkeypatch.setattr(jax_start.glob, "glob", nvidia_only)
    assert not jax_start.no_accelerator()
    monkeypatch.setattr(jax_start.sys, "platform", "darwin")  # no device files to read: no claim
    assert not jax_start.no_accelerator()


def test_xla_options_are_added_once_unless_the_user_chose():
    environ: dict[str, str] = {}
    add_options(environ)
    add_options(environ)  # once only
    assert environ["XLA_FLAGS"].split() == list(OPTIONS)
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/hlo"}
    add_options(environ)
    assert environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/hlo", *OPTIONS]
    # A layout or GEMM choice of the user's stands; a flag that merely begins alike does not
    # count as one.
    chosen = {"XLA_FLAGS": "--xla_gpu_force_conv_nchw --xla_gpu_enable_triton_gemm=true"}
    add_options(chosen)
    assert chosen == {"XLA_FLAGS": "--xla_gpu_force_conv_nchw --xla_gpu_enable_triton_gemm=true"}
    layout = {"XLA_FLAGS": "--xla_gpu_force_conv_nchw --xla_gpu_enable_triton_gemm_int4=true"}
    add_options(layout)
    assert layout["XLA_FLAGS"].split()[-1] == CUBLAS_GEMMS


class _Lowered:
    """A lowered program whose compile refuses options as an XLA without them would."""

    def __init__(self, error: str | None):
        self.error, self.options = error, []

    def compile(self, compiler_options=None):
        self.options.append(compiler_options)
        if compiler_options and self.error:
            raise jax.errors.JaxRuntimeError(self.error)
        return "compiled"


def test_untuned_programs_compile_with_the_option_or_without_where_xla_has_none():
    lowered = jax.jit(lambda x: 2 * x).lower(jax.numpy.ones(3))
    assert list(xla_options.compile_untuned(lowered)(jax.numpy.ones(3))) == [2, 2, 2]
    accepted = _Lowered(None)
    assert xla_options.compile_untuned(accepted) == "compiled"
    assert accepted.options == [xla_options.UNTUNED_FUSIONS]
    unknown = _Lowered("INVALID_ARGUMENT: No such compile option: 'xla_gpu_experimental_…'")
    assert xla_options.compile_untuned(unknown) == "compiled"
    assert unknown.options == [xla_options.UNTUNED_FUSIONS, None]
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        xla_options.compile_untuned(_Lowered("RESOURCE_EXHAUSTED: out of memory"))


@pytest.mark.parametrize("started", [False, True])
def test_xla_options_are_set_only_before_jax_starts(monkeypatch, started):
    # Afterwards XLA would not read them, but JAX's cache keys would: programs compiled
    # without an option would be filed under it.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(jax_start, "_backends_started", lambda: started)
    jax_start.restrict_backends("gpu")
    assert os.environ.get("XLA_FLAGS") == (None if started else " ".join(OPTIONS))
