"""`ctseg plan`: what a layout costs, compiled from abstract inputs without running."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cli.app import app
from cli.options import (
    ConfigOption,
    CoordinatorOption,
    NumProcessesOption,
    ProcessIdOption,
    SetOption,
    load_config,
    start_jax,
)
from ctseg import atomic, unet
from ctseg.config import Config
from ctseg.plan import LayoutPlan, plan

console = Console(highlight=False)


def human_bytes(count: float) -> str:
    """Binary units, e.g. 1.5 GiB; `ctseg bench` uses it too."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if count < 1024:
            break
        count, unit = count / 1024, bigger
    return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"


def _flops(flops: float) -> str:
    """SI prefixes, e.g. 23.0 T."""
    prefix = ""
    for bigger in ("k", "M", "G", "T"):
        if flops < 1000:
            break
        flops, prefix = flops / 1000, bigger
    return f"{flops:.1f} {prefix}"


def _table(plans: list[LayoutPlan]) -> Table:
    table = Table(title=f"ctseg plan — partitioner {plans[0].partitioner}, memory per device")
    for heading in ("mode", "parts", "local block"):
        table.add_column(heading, no_wrap=True)
    for heading in ("temp", "total", "halo", "FLOP"):
        table.add_column(heading, justify="right", no_wrap=True)
    for p in plans:
        table.add_row(
            p.mode,
            str(p.partitions),
            "×".join(map(str, p.local_shape[1:4])),
            human_bytes(p.memory.temporaries),
            human_bytes(p.memory.total),
            human_bytes(p.halo_bytes),
            _flops(p.flops),
        )
    return table


@app.command("plan")
def plan_command(
    config_path: ConfigOption = None,
    overrides: SetOption = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the plan as JSON to this file.")
    ] = None,
    coordinator: CoordinatorOption = None,
    num_processes: NumProcessesOption = None,
    process_id: ProcessIdOption = None,
) -> None:
    """Compile (not run) the training step and inference for the config's layout and report
    per-device memory, halo traffic and FLOPs next to the unpartitioned layout."""
    config = load_config(config_path, overrides)
    start_jax(config, coordinator, num_processes, process_id)
    with console.status("compiling") as status:
        plans = plan(config, progress=lambda message: status.update(message))
    console.print(_table(plans))
    r = config.data.resolution
    console.print(
        f"grid {r}³, batch {config.train.batch_size}, {config.model.dtype}; receptive field "
        f"radius {unet.receptive_field_radius(config.model)} voxels; local blocks "
        f"aligned to {unet.alignment(config.model)} voxels.\n"
        "total = arguments + outputs + temp − donated (aliased) buffers, per device; "
        "halo = bytes one interior partition sends per step (training counts the backward "
        "pass); FLOP = the whole step, all devices."
    )
    if json_path is not None:
        atomic.write_json(json_path, _json(config, plans))
        console.print(f"wrote {json_path}")


def _json(config: Config, plans: list[LayoutPlan]) -> dict:
    return {
        "receptive_field_radius": unet.receptive_field_radius(config.model),
        "alignment": unet.alignment(config.model),
        "layouts": [p.to_json() for p in plans],
    }
