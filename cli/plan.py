"""`ctseg plan`: what a layout costs, compiled from abstract inputs without running."""

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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
    config_from_options,
    start_jax,
)
from ctseg.config import Config
from ctseg.errors import CtsegError
from ctseg.memory import human_bytes
from ctseg.parallel.layouts import fit_training
from ctseg.progress import Status
from ctseg.targets.catalogue import names as target_names
from ctseg.targets.catalogue import resolve
from ctseg.targets.process import plan_on_target

if TYPE_CHECKING:  # the planner imports JAX: only once the command runs (`--help` fast)
    from ctseg.model.plan import LayoutPlan

console = Console(highlight=False)


def _flops(flops: float | None) -> str:
    """SI prefixes, e.g. 23.0 T; – where the compiler counted none."""
    if flops is None:
        return "–"
    prefix = ""
    for bigger in ("k", "M", "G", "T"):
        if flops < 1000:
            break
        flops, prefix = flops / 1000, bigger
    return f"{flops:.1f} {prefix}"


def _table(plans: list["LayoutPlan"]) -> Table:
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
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="Compile for hardware that is not here: a GPU (h100, a100-80, a100-40, l40s, "
            "l4, rtx4090) or a TPU slice (tpu-v5e:4x4, tpu-v5p:2x2x4, …); 'list' names them. "
            "Needs the targets extra.",
            metavar="NAME",
        ),
    ] = None,
    target_devices: Annotated[
        int | None,
        typer.Option(
            "--devices",
            help="With a GPU --target: how many GPUs (default 1; at most 1024, more than 8 in "
            "hosts of 8).",
        ),
    ] = None,
    target_file: Annotated[
        Path | None,
        typer.Option(
            "--target-file",
            help="Instead of --target: your own GPU description (a GpuTargetConfigProto in "
            "text form, as the files in ctseg/targets/specs/), with --devices of them.",
        ),
    ] = None,
    coordinator: CoordinatorOption = None,
    num_processes: NumProcessesOption = None,
    process_id: ProcessIdOption = None,
) -> None:
    """What a layout costs: memory per device, halo traffic and FLOPs, compiled (not run).

    The training step and inference compile for the config's layout and, beside it, the
    unpartitioned one.

    The layouts compile on the devices here when there are enough of them, else on
    simulated CPU devices (the first line says which); the last line says which layout
    `ctseg train` would choose here and, on accelerators, whether its step fits.

    With --target, they compile for GPUs or TPUs that are not here (compile-only devices):
    whether training fits them, the plan `ctseg predict` would choose there, and where
    training does not fit, the fewest partitions and the largest grid that do."""
    if target == "list":
        console.print("\n".join(target_names()))
        return
    config = config_from_options(config_path, overrides)
    if json_path is not None:  # before compiling, not after
        # Never over an input, --force or not: the config, the GPU description.
        inputs = [path for path in (config_path, target_file) if path is not None]
        atomic.claim_report(json_path, _is_plan_json, inputs, force)
    if target is not None or target_file is not None:
        _plan_target(config, target, target_devices, target_file, json_path)
        return
    if target_devices is not None:
        raise CtsegError("--devices counts the GPUs of a --target; give --target too")
    chosen = start_jax(config, coordinator, num_processes, process_id, device=device.value)
    from ctseg.model import unet  # after start_jax: imports start JAX
    from ctseg.model.plan import plan
    from ctseg.parallel import devices as dev

    # start_jax made as many simulated CPU devices as the config's mesh needs.
    planned_on, line = dev.plan_devices(chosen, config.num_devices)
    console.print(line)
    with console.status("compiling") as status:
        plans = plan(config, lambda message: status.update(message), planned_on)
        here = _this_machine(config, chosen.devices, lambda message: status.update(message))
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


def _this_machine(config: Config, chosen: Sequence[Any], progress: Status) -> dict:
    """Which layout `ctseg train` would choose on the `chosen` devices and, on accelerators,
    whether it fits."""
    from ctseg.model.plan import plan_layout
    from ctseg.parallel import devices as dev

    layout = fit_training(config, chosen)
    here = {
        "devices": dev.describe(chosen, simulated=True),
        "spatial": list(layout.config.mesh.spatial),
        "data": layout.config.mesh.data,
        "line": layout.line,
        "fits": None,  # simulated CPU devices share the host's RAM: not judged
    }
    if dev.is_accelerator(chosen):
        train = plan_layout(layout.config, progress, layout.devices)[0]
        here["train_bytes"] = train.memory.total
        here["free_bytes"] = dev.free_memory(layout.devices)
        here["fits"] = here["train_bytes"] <= here["free_bytes"]
    return here


def _is_plan_json(path: Path) -> bool:
    """An earlier `ctseg plan --json` report: of this machine's layouts, or of a target."""
    layouts = ("receptive_field_radius", "alignment", "layouts")
    return atomic.is_json_with(path, layouts) or atomic.is_json_with(path, ("target",))


def _json(config: Config, plans: list["LayoutPlan"]) -> dict:
    from ctseg.model import unet

    return {
        "receptive_field_radius": unet.receptive_field_radius(config.model),
        "alignment": unet.alignment(config.model),
        "layouts": [p.to_json() for p in plans],
    }


def _plan_target(
    config: Config,
    name: str | None,
    devices: int | None,
    target_file: Path | None,
    json_path: Path | None,
) -> None:
    """`ctseg plan --target`: the config compiled for compile-only devices, in a child."""
    target = resolve(name or "", devices, target_file)
    console.print(f"planning for {target.describe()}: compile-only, nothing runs")
    with console.status(f"compiling for {target.name} (XLA for TPUs takes minutes)"):
        result = plan_on_target(config, target)
    for line in target_lines(result):
        console.print(escape(line))
    if json_path is not None:
        atomic.write_json(json_path, {"target": result})
        console.print(f"wrote {json_path}")


def _size(count: float | None) -> str:
    return "–" if count is None else human_bytes(count)


def target_lines(result: dict) -> list[str]:
    """What `ctseg plan --target` prints of a target's plan, line by line."""
    memory, share = result["memory_per_device"], result["share"]
    budget = f"of {_size(memory)}, plans take {share:.0%}"
    train = result["train"]
    where = f"{list(train['spatial'])} over {train['devices']} device(s)"
    if train["data"] > 1:
        where += f", {train['data']} data replicas"
    if train.get("train_bytes") is None:
        fit = f"does NOT fit: {train.get('compiler', 'out of memory')}"
    else:
        verdict = "fits" if train["fits"] else "does NOT fit"
        fit = f"{_size(train['train_bytes'])} per device {budget}: {verdict}"
    lines = [f"training {where}: {fit}"]
    if train.get("augment_bytes") is not None:
        block = "×".join(str(n) for n in train["augment_block"])
        lines.append(
            f"augmentation on the devices ([augment]; blocks of {block}): "
            f"{_size(train['augment_bytes'])} per device; compiled here in "
            f"{train['augment_compile_seconds']:.1f} s, the training step in "
            f"{train['train_compile_seconds']:.1f} s"
        )
    predict = result["predict"]
    box = "×".join(str(n) for n in predict["box"])
    if predict.get("plan") is None:
        lines.append(f"prediction of a {box} box: does NOT fit: {predict.get('compiler')}")
    else:
        verdict = "fits" if predict["fits"] else "does NOT fit"
        lines.append(
            f"prediction of a {box} box: {predict['plan']}, {_size(predict['bytes'])} per "
            f"device: {verdict}"
        )
    if "fewest_partitions" in result:
        fewest = result["fewest_partitions"]
        if fewest is None:
            lines.append("no split of this grid over up to 256 such devices fits training")
        else:
            lines.append(
                f"training fits with {fewest['devices']} devices ({fewest['target']}), split "
                f"{fewest['spatial']}: {_size(fewest['train_bytes'])} per device"
            )
        largest = result.get("largest_resolution")
        lines.append(
            f"the largest grid whose training fits {result['count']} such device(s): "
            + ("none" if largest is None else f"data.resolution = {largest}")
        )
    return lines
