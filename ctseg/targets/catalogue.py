"""The accelerators `ctseg plan --target` compiles for without having them: what users rent.

A GPU target is a description of one GPU in the form XLA takes (a `GpuTargetConfigProto`
in text form: `ctseg/targets/specs/<name>.txtpb`, written from the vendor's published
specifications; a user passes their own as `target_file`) and a count of them
(`devices`). A TPU target is a generation and a slice topology, `tpu-v5e:4x4`: libtpu
knows the chips. Memory per device is each device's HBM or GDDR, as its vendor states it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ctseg.errors import CtsegError, OptionError

SPECS = Path(__file__).with_name("specs")
GIB = 2**30
EXTRA = "pip install 'ctseg[targets]'"

# TPU generations: libtpu's name for the topology, the chip's HBM, the accelerator type
# libtpu is told it runs on (it asks the machine otherwise, and warns), and TensorCores
# per chip that JAX shows as devices (v4 and v5p chips are megacores: one device each).
_TPUS = {
    "v4": ("v4", 32 * GIB, "v4", 3),
    "v5e": ("v5e", 16 * GIB, "v5litepod", 2),
    "v5p": ("v5p", 95 * GIB, "v5p", 3),
    "v6e": ("v6e", 32 * GIB, "v6e", 2),
}
# Standard slices by the number of sides of a generation's topology, smallest first.
_SLICES = {
    2: ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    3: ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
}
# Each GPU spec's memory, read once from its file, is the number users compare with.
_MEMORY = re.compile(r"device_memory_size:\s*(\d+)")
_GPUS_PER_HOST = 8
# A GPU's memory, from the smallest any GPU has to beyond any made (an H100: 80 GiB).
# Below, XLA compiles for a budget far under what a program needs, which it does not
# finish (a 16³ model for 64 KiB, a 64³ one for 1 MiB: minutes, no answer) or dies of
# (SIGFPE for 1000 bytes); at 0 it never answers.
GPU_MEMORY = (GIB, 16 * 1024 * GIB)
# Fields of a GPU description that XLA divides by: each must be a positive number.
_POSITIVE_FIELDS = (
    "core_count",
    "threads_per_warp",
    "clock_rate_ghz",
    "memory_bandwidth",
    "fpus_per_core",
    "threads_per_block_limit",
    "threads_per_core_limit",
)
# The most devices a plan is made for (GPUs: 128 hosts of 8): the inference planner tries
# its splits over every device, which takes seconds for 1024 of them, and for 4096 more
# minutes than anyone waits (a million: no answer at all).
MOST_DEVICES = 1024
# A TPU generation's largest slice, in chips (its pod; v5p's by Google's figures).
_POD_CHIPS = {"v4": 4096, "v5e": 256, "v5p": 8960, "v6e": 256}


@dataclass(frozen=True)
class Target:
    """Compile-only devices of one kind: `count` of them, `memory` bytes each."""

    name: str  # as the user named it, e.g. h100, tpu-v5e:4x4
    platform: str  # "cuda" or "tpu"
    device: str  # in words: NVIDIA H100 80GB HBM3, TPU v5e
    memory: int  # per GPU, or per TPU chip
    count: int  # GPUs, or TPU chips
    topology: str  # the topology XLA takes: "1x2x8" (slices × hosts × GPUs), "v5e:4x4" (TPU)
    gpu_spec: str | None = None  # the GpuTargetConfigProto text
    accelerator_type: str | None = None  # TPU_ACCELERATOR_TYPE for libtpu

    def describe(self) -> str:
        each = f"{self.memory / GIB:.0f} GiB"
        return f"{self.count} × {self.device} ({each} each)"

    def with_count(self, count: int) -> Target | None:
        """The same kind of device, `count` of them (a standard slice for TPUs); None where
        no such slice exists."""
        if self.platform == "cuda":
            if count > _GPUS_PER_HOST and count % _GPUS_PER_HOST:
                return None
            return _gpu(self.name, self.gpu_spec or "", count)
        generation = self.device.removeprefix("TPU ")
        for topology in _SLICES[_TPUS[generation][3]]:
            chips = 1
            for side in topology.split("x"):
                chips *= int(side)
            if chips == count:
                return _tpu(f"tpu-{generation}:{topology}")
        return None


def names() -> list[str]:
    """The targets that `resolve` knows, for `ctseg plan --target list` and messages."""
    gpus = sorted(path.stem for path in SPECS.glob("*.txtpb"))
    return gpus + [f"tpu-{generation}:TOPOLOGY" for generation in _TPUS]


def resolve(target: str, devices: int | None = None, target_file: Path | None = None) -> Target:
    """The `target` (`h100`, `tpu-v5e:4x4`, …) with `devices` GPUs (default 1; a TPU's
    count comes from its topology), or the GPU that `target_file` describes; OptionError
    (CtsegError) in one line for a name, topology or file that is not one."""
    if devices is not None and not 1 <= devices <= MOST_DEVICES:
        raise OptionError(
            f"`devices` must be from 1 to {MOST_DEVICES} GPUs ({MOST_DEVICES // _GPUS_PER_HOST} "
            f"hosts of {_GPUS_PER_HOST}), got {devices}"
        )
    if target_file is not None:
        if target:
            raise OptionError(
                f"`target` {target} and `target_file` {target_file} both name the target: give "
                "`target_file` alone for your own GPU description, or `target` alone"
            )
        return _gpu(target_file.stem, _read_spec(target_file), devices or 1)
    if target.startswith("tpu-"):
        if devices is not None:
            raise OptionError(
                f"`devices` does not apply to {target}: a TPU slice's chips come from its "
                "topology (e.g. tpu-v5e:4x4 is 16 chips)"
            )
        return _tpu(target)
    spec = SPECS / f"{target}.txtpb"
    if not spec.is_file():
        raise OptionError(f"no target {target!r}; known: {', '.join(names())} (or `target_file`)")
    return _gpu(target, spec.read_text(), devices or 1)


def _read_spec(path: Path) -> str:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CtsegError(f"cannot read the target file {path}: {exc}") from None
    if "gpu_device_info" not in text or not _MEMORY.search(text):
        raise CtsegError(
            f"{path} is not a GPU target description: a GpuTargetConfigProto in text form "
            "with gpu_device_info { … device_memory_size: BYTES … } (see ctseg/targets/specs/)"
        )
    memory = int(_MEMORY.search(text).group(1))
    low, high = GPU_MEMORY
    if not low <= memory <= high:
        raise CtsegError(
            f"{path}: device_memory_size: {memory} is no GPU's memory; give its bytes, from "
            f"{low} (1 GiB) to {high} (16 TiB): an H100's is 85899345920"
        )
    for name in _POSITIVE_FIELDS:
        for value in re.findall(rf"\b{name}:\s*([-+0-9.eE]+)", text):
            try:
                positive = float(value) > 0
            except ValueError:
                positive = False
            if not positive:
                raise CtsegError(
                    f"{path}: {name}: {value} must be a positive number (XLA divides by it)"
                )
    return text


def _gpu(name: str, spec: str, count: int) -> Target:
    memory = int(_MEMORY.search(spec).group(1))
    device = re.search(r'device_description_str:\s*"([^"]*)"', spec)
    hosts = max(1, -(-count // _GPUS_PER_HOST))
    if count > _GPUS_PER_HOST and count % _GPUS_PER_HOST:
        raise OptionError(
            f"`devices` {count}: more than {_GPUS_PER_HOST} GPUs come in hosts of "
            f"{_GPUS_PER_HOST}; give a multiple of {_GPUS_PER_HOST}"
        )
    per_host = min(count, _GPUS_PER_HOST)
    return Target(
        name=name,
        platform="cuda",
        device=device.group(1) if device else name,
        memory=memory,
        count=count,
        topology=f"1x{hosts}x{per_host}",
        gpu_spec=spec,
    )


def _tpu(name: str) -> Target:
    match = re.fullmatch(r"tpu-(v\w+):(\d+(?:x\d+)+)", name)
    if not match or match.group(1) not in _TPUS:
        raise OptionError(
            f"`target` {name} is no TPU slice; give tpu-GENERATION:TOPOLOGY with a generation "
            f"of {', '.join(_TPUS)} and a topology like 2x2 (v5e, v6e) or 2x2x1 (v4, v5p)"
        )
    generation, topology = match.group(1), match.group(2)
    libtpu_name, memory, accelerator, dims = _TPUS[generation]
    sides = [int(side) for side in topology.split("x")]
    example = "x".join(["2"] * dims)
    if len(sides) != dims:
        raise OptionError(
            f"`target` {name}: a {generation} topology has {dims} sides, e.g. "
            f"tpu-{generation}:{example}"
        )
    if min(sides) < 1:
        raise OptionError(
            f"`target` {name}: every side of a topology must be at least 1 chip, e.g. "
            f"tpu-{generation}:{example}"
        )
    chips = 1
    for side in sides:
        chips *= side
    if chips > _POD_CHIPS[generation]:
        raise OptionError(
            f"`target` {name} is {chips} chips, more than a {generation} pod's "
            f"{_POD_CHIPS[generation]}: no such slice exists"
        )
    if chips > MOST_DEVICES:
        raise OptionError(
            f"`target` {name} is {chips} chips; ctseg plans for at most {MOST_DEVICES} devices "
            "(beyond, planning takes more minutes than anyone waits): plan for a smaller slice"
        )
    # libtpu names a slice by its TensorCores (v4, v5p: 2 per chip) or chips (v5e, v6e).
    cores = chips * (2 if dims == 3 else 1)
    return Target(
        name=name,
        platform="tpu",
        device=f"TPU {generation}",
        memory=memory,
        count=chips,
        topology=f"{libtpu_name}:{topology}",
        accelerator_type=f"{accelerator}-{cores}",
    )
