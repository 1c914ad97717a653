"""`ctseg plan`: what a layout costs, compiled from abstract inputs without running."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ctseg import atomic
from ctseg.cli.app import app
from ctseg.cli.options import (
    ConfigOption,
    CoordinatorOption,
    DeviceChoice,
    DeviceOption,
    NumProcessesOption,
    ProcessIdOption,
    SetOption,
    load_config,
    start_jax,
)
from ctseg.config import Config
from ctseg.memory import human_bytes
from ctseg.model import unet
from ctseg.model.plan import LayoutPlan, plan, plan_layout
from ctseg.parallel.layouts import fit_training

console = Console(highlight=False)


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
        Path | None,
        typer.Option(
            "--json",
            help="Also write the plan as JSON to this file (an existing file only when it is "
            "an earlier plan, or with --force).",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a --json file that is not a plan.")
    ] = False,
    device: DeviceOption = DeviceChoice.auto,
    coordinator: CoordinatorOption = None,
    num_processes: NumProcessesOption = None,
    process_id: ProcessIdOption = None,
) -> None:
    """Compile (not run) the training step and inference for the config's layout and report
    per-device memory, halo traffic and FLOPs next to the unpartitioned layout.

    The layouts compile on the devices here when there are enough of them, else on
    simulated CPU devices (the first line says which); the last line says which layout
    `ctseg train` would choose here and, on accelerators, whether its step fits."""
    config = load_config(config_path, overrides)
    if json_path is not None:  # before compiling, not after
        inputs = [] if config_path is None else [config_path]
        atomic.claim_report(json_path, _is_plan_json, inputs, force)
    start_jax(config, coordinator, num_processes, process_id, device=device.value)
    from ctseg.parallel import devices as dev  # after start_jax: imports start JAX

    visible = dev.visible(local=False)
    found = dev.choose(device.value, visible)
    # start_jax made as many simulated CPU devices as the config's mesh needs.
    planned_on, line = dev.plan_devices(device.value, visible, config.num_devices)
    console.print(line)
    with console.status("compiling") as status:
        plans = plan(config, lambda message: status.update(message), planned_on)
        here = _this_machine(config, found, lambda message: status.update(message))
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
    fits = here["fits"]
    verdict = "" if fits is None else f"; its step {'fits' if fits else 'does NOT fit'}: "
    if fits is not None:
        verdict += f"{human_bytes(here['train_bytes'])} of {human_bytes(here['free_bytes'])} free"
    console.print(f"this machine: {escape(here['line'])}{verdict}")
    if json_path is not None:
        atomic.write_json(json_path, {**_json(config, plans), "this_machine": here})
        console.print(f"wrote {json_path}")


def _this_machine(config: Config, found: list, progress) -> dict:
    """Which layout `ctseg train` would choose here and, on accelerators, whether it fits."""
    from ctseg.parallel import devices as dev

    layout = fit_training(config, found)
    here = {
        "devices": dev.describe(found, simulated=True),
        "spatial": list(layout.config.mesh.spatial),
        "data": layout.config.mesh.data,
        "line": layout.line,
        "fits": None,  # simulated CPU devices share the host's RAM: not judged
    }
    if dev.is_accelerator(found):
        train = plan_layout(layout.config, progress, layout.devices)[0]
        here["train_bytes"] = train.memory.total
        here["free_bytes"] = dev.free_memory(layout.devices)
        here["fits"] = here["train_bytes"] <= here["free_bytes"]
    return here


def _is_plan_json(path: Path) -> bool:
    return atomic.is_json_with(path, ("receptive_field_radius", "alignment", "layouts"))


def _json(config: Config, plans: list[LayoutPlan]) -> dict:
    return {
        "receptive_field_radius": unet.receptive_field_radius(config.model),
        "alignment": unet.alignment(config.model),
        "layouts": [p.to_json() for p in plans],
    }
