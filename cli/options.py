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
