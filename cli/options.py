"""Options shared by several commands, and the helpers that turn them into library calls."""

from pathlib import Path
from typing import Annotated

import typer

from ctseg import config as cfg

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


def load_config(path: Path | None, overrides: list[str] | None) -> cfg.Config:
    return cfg.load(path, overrides or ())


def start_jax(
    config: cfg.Config,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    devices: int | None = None,
) -> None:
    """Join a multi-host job if asked, and make sure the mesh has enough devices.

    `devices`: the devices the command needs over all processes (default: the
    config's mesh). Must run before anything touches JAX devices: simulated CPU
    devices can only be configured before the backend starts.
    """
    from ctseg import partition  # imports JAX; keep `ctseg --help` fast

    partition.initialize_distributed(coordinator, num_processes, process_id)
    # Each process contributes its share of the mesh's devices.
    processes = num_processes or 1
    partition.configure_cpu_devices(-(-(devices or config.num_devices) // processes))
