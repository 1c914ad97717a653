"""Options shared by several commands, and the helpers that turn them into library calls."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ctseg import config as cfg
from ctseg.cli import interrupts
from ctseg.cli.library_output import held
from ctseg.parallel.compile_cache import compile_cache_dir, use_compile_cache
from ctseg.parallel.devices import DEVICE_CHOICES, ChosenDevices

if TYPE_CHECKING:
    from ctseg.inference.network.backends import Backend

_stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """A `warning:` line on standard error, as every command prints them."""
    _stderr.print(f"[yellow]warning:[/] {escape(message)}")


ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="TOML experiment config (see configs/); defaults if omitted."
    ),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override one config value, e.g. --set data.resolution=32 (repeatable).",
        metavar="SECTION.KEY=VALUE",
    ),
]
CoordinatorOption = Annotated[
    str | None,
    typer.Option(help="Multi-host: address host:port of process 0 (jax.distributed)."),
]
NumProcessesOption = Annotated[
    int | None, typer.Option(help="Multi-host: total number of processes.")
]
ProcessIdOption = Annotated[
    int | None, typer.Option(help="Multi-host: index of this process, 0 … num-processes-1.")
]


# `ctseg.parallel.devices.DEVICE_CHOICES`, as a choice for the command line.
DeviceChoice = StrEnum("DeviceChoice", {choice: choice for choice in DEVICE_CHOICES})


DeviceOption = Annotated[
    DeviceChoice,
    typer.Option(
        "--device",
        help="Where to run: auto (the GPUs or TPUs here, else the CPU), cpu, gpu or tpu.",
    ),
]
CompileCacheOption = Annotated[
    str | None,
    typer.Option(
        "--compile-cache",
        help="Folder of the persistent XLA compilation cache, or 'off'. Default: "
        "$CTSEG_COMPILE_CACHE (empty: unset), else ~/.cache/ctseg/xla. A second run with "
        "the same shapes compiles nothing. A folder that cannot be written is reported "
        "and the run compiles without it.",
        metavar="DIR|off",
    ),
]


def config_from_options(path: Path | None, overrides: list[str] | None) -> cfg.Config:
    """The config a command's `--config` and `--set` options make (defaults where neither)."""
    return cfg.load(path, overrides or ())


# A signal while JAX starts ends the command at once: raised as KeyboardInterrupt it could be
# swallowed by a gc callback of JAX's, or crash its native start (`ctseg.cli.interrupts`).
@interrupts.starting()
def start_jax(
    config: cfg.Config,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cpu_devices: int | None = None,
    device: str = "auto",
    compile_cache: str | None = None,
    verbose: bool = False,
) -> ChosenDevices:
    """Start JAX for `device`, join a multi-host job if asked, and simulate CPU devices;
    the devices `device` chooses, which the command hands down (it chooses once, here).

    `cpu_devices`: the CPU devices to simulate over all processes (default: the
    config's mesh), used only where the CPU is what runs. `compile_cache`: the
    `--compile-cache` option. Must run before anything touches JAX devices: simulated
    CPU devices can only be configured before the backend starts. Raises the one-line
    error of a `device` that is not here.
    Prints, as the command's first lines, why `--device auto` runs on the CPU where an
    accelerator failed to start, and why the compilation cache is not used. What XLA
    and its plugins print on starting is held back (`library_output.held`; shown if
    `verbose`).
    """
    from ctseg.parallel import devices as dev
    from ctseg.parallel import held_output, jax_start

    # The first import of JAX (the commands' modules leave it here: `ctseg --help` stays
    # fast) loads its plugins, which print on their own: "Could not find cuda drivers".
    with held(show=verbose):
        from ctseg.parallel import partition

    held_output.commands_hold_output()  # held below, and shown with --verbose
    jax_start.restrict_backends(device)
    cache_problem = use_compile_cache(compile_cache_dir(compile_cache))
    partition.initialize_distributed(coordinator, num_processes, process_id)
    # Each process contributes its share of the mesh's devices.
    processes = num_processes or 1
    partition.configure_cpu_devices(-(-(cpu_devices or config.num_devices) // processes))
    with held(show=verbose):
        found = jax_start.visible(local=False)
    # Here, so that every command (bench too) refuses a --device it cannot have, in one
    # line with the reason, before it starts any work.
    chosen = ChosenDevices.of(device, found)
    fallback = dev.fallback_warning(device, found)
    for line in (fallback, cache_problem):
        if line is not None:
            warn(line)
    return chosen


def start_inference(
    config: cfg.Config,
    options: cfg.InferenceOptions,
    compile_cache: str | None = None,
    verbose: bool = False,
) -> Backend:
    """`start_jax` for a command that predicts (one CPU device: inference never simulates a
    mesh), and the backend its options ask for built on the devices chosen: what runs where,
    decided once, handed down to the predictor."""
    chosen = start_jax(
        config, cpu_devices=1, device=options.device, compile_cache=compile_cache, verbose=verbose
    )
    from ctseg.inference.network.choice import backend_for  # imports JAX: after its start

    return backend_for(options.backend, chosen)
