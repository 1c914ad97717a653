"""`ctseg bench`: training-step time and memory per layout and partitioner on one grid."""

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
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
from ctseg.cli.progress import counting
from ctseg.errors import CtsegError
from ctseg.memory import human_bytes
from ctseg.parallel.layouts import auto_spatial

if TYPE_CHECKING:  # the benchmark imports JAX: only once the command runs (`--help` fast)
    from ctseg.model.bench import BenchResult, Peak

console = Console(highlight=False)


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise CtsegError(f"{option} expects comma-separated integers, got '{text}'") from None
    if not values:
        raise CtsegError(f"{option} names nothing to measure, got '{text}'")
    return values


def _splits(partitions: str | None, spatial: list[str] | None) -> list[tuple[int, int, int]]:
    """Explicit --spatial splits, or the automatic split of each --partitions count."""
    if spatial:
        if partitions is not None:
            raise CtsegError("give either --partitions or --spatial, not both")
        splits = [tuple(_int_list(s, "--spatial")) for s in spatial]
        if any(len(s) != 3 for s in splits):
            raise CtsegError("--spatial expects three counts x,y,z, e.g. --spatial 4,4,1")
        return splits
    return [auto_spatial(n) for n in _int_list(partitions or "1,2,4,8,16", "--partitions")]


def _table(results: list["BenchResult"], peak: "Peak | None") -> Table:
    from ctseg.model.bench import ratio_to_one_partition

    table = Table(
        title="Training step on one global grid (median after warm-up)",
        caption="memory: per device, from XLA's analysis of the compiled step",
        box=box.SIMPLE_HEAD,
        padding=(0, 0, 0, 1),
        pad_edge=False,  # eight columns in an 80-column terminal
    )
    for heading in ("partitioner", "split"):
        table.add_column(heading)
    headings = ["step s", "vs 1", "Mvoxel/s", "TFLOP/s"]
    headings += ["of peak"] if peak else []
    for heading in (*headings, "memory"):
        table.add_column(heading, justify="right")
    for r in results:
        ratio = ratio_to_one_partition(results, r)
        cells = [
            f"{r.step_seconds:.3f}",
            "–" if ratio is None else f"{ratio:.2f}×",
            f"{r.voxels_per_second / 1e6:.3g}",
            _or_dash(r.flops_per_second, lambda flops: f"{flops / 1e12:.3g}"),
        ]
        cells += [_or_dash(peak.utilisation(r), lambda share: f"{share:.1%}")] if peak else []
        table.add_row(
            r.partitioner,
            "×".join(map(str, r.spatial)),
            *cells,
            human_bytes(r.per_device_bytes),
        )
    return table


def _or_dash(value: float | None, shown: Callable[[float], str]) -> str:
    """A figure the compiler did not count (a GPU compiled for without one) is a dash."""
    return "–" if value is None else shown(value)


def _peak_line(peak: "Peak") -> str:
    return (
        f"peak: {peak.flops_per_second / 1e12:.3g} TFLOP/s, best {peak.size}² × {peak.size}² "
        f"{peak.dtype} matrix product on one {peak.platform} device"
    )


def _is_bench_json(path: Path) -> bool:
    return atomic.is_json_with(path, ("results",))


@app.command("bench")
def bench_command(
    config_path: ConfigOption = None,
    overrides: SetOption = None,
    partitions: Annotated[
        str | None,
        typer.Option(help="Comma-separated partition counts, split automatically (1,2,4,8,16)."),
    ] = None,
    spatial: Annotated[
        list[str] | None,
        typer.Option(help="An explicit x,y,z split instead of --partitions (repeatable)."),
    ] = None,
    partitioner: Annotated[
        str, typer.Option(help="Comma-separated partitioners to compare: halo, gspmd.")
    ] = "halo,gspmd",
    steps: Annotated[int, typer.Option(help="Timed steps per layout, after one warm-up.")] = 5,
    peak: Annotated[
        bool,
        typer.Option(
            "--peak",
            help="Also time a large matrix product in the compute dtype and give each "
            "step's FLOP/s as a share of that measured peak.",
        ),
    ] = False,
    json_path: Annotated[
        Path | None,
        typer.Option(
            "--json",
            help="Also write the results as JSON to this file (an existing file only when it "
            "is an earlier bench report, or with --force).",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a --json file that is not a bench report.")
    ] = False,
    device: DeviceOption = DeviceChoice.auto,
    coordinator: CoordinatorOption = None,
    num_processes: NumProcessesOption = None,
    process_id: ProcessIdOption = None,
) -> None:
    """Time the training step for each layout and partitioner on the config's grid.

    Prints step time, ratio to 1 partition, throughput (voxels/s and the FLOP/s
    XLA counts in the compiled step) and per-device memory.
    """
    config = config_from_options(config_path, overrides)
    if json_path is not None:  # before minutes of timing, not after
        inputs = [] if config_path is None else [config_path]
        atomic.claim_report(json_path, _is_bench_json, inputs, force)
    splits = _splits(partitions, spatial)
    partitioners = [p.strip() for p in partitioner.split(",") if p.strip()]
    if not partitioners:
        raise CtsegError(f"--partitioner names nothing to measure, got '{partitioner}'")
    needed = max(math.prod(split) for split in splits) * config.mesh.data  # with replicas
    chosen = start_jax(config, coordinator, num_processes, process_id, needed, device=device.value)
    from ctseg.model.bench import bench, measure_peak  # after start_jax: imports start JAX

    with counting("bench") as report:
        results = bench(config, splits, partitioners, steps, report, chosen.devices)
    measured_peak = measure_peak(config.model.dtype, devices=chosen.devices) if peak else None
    console.print(_table(results, measured_peak))
    if measured_peak is not None:
        console.print(_peak_line(measured_peak))
    if json_path is not None:
        report_json = {"results": [r.to_json() for r in results]}
        if measured_peak is not None:
            report_json["peak"] = measured_peak.to_json()
            for entry, r in zip(report_json["results"], results, strict=True):
                entry["share_of_peak"] = measured_peak.utilisation(r)
        atomic.write_json(json_path, report_json)
        console.print(f"wrote {json_path}")
