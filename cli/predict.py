"""`ctseg predict`: label maps, statistics and previews for new scans."""

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ctseg import lock
from ctseg.cli import STARTED, library_output
from ctseg.cli.app import app
from ctseg.cli.flags import said
from ctseg.cli.options import (
    CompileCacheOption,
    DeviceChoice,
    DeviceOption,
    start_inference,
    warn,
)
from ctseg.cli.predict_options import (
    AllowNonCtOption,
    BackendChoice,
    BackendOption,
    CheckpointOption,
    ForceOption,
    InputsArgument,
    LocateOption,
    MarginOption,
    OutOption,
    OutputType,
    OutputTypeOption,
    RoiOption,
    RunDirArgument,
    RunsOption,
    TileOption,
    TtaOption,
    VerboseOption,
)
from ctseg.config import Config, InferenceOptions
from ctseg.errors import CtsegError
from ctseg.io import dicom_seg
from ctseg.run import rundir

if TYPE_CHECKING:  # the pipeline imports JAX: only after start_inference
    from ctseg.inference.inputs import ScanOutcome
    from ctseg.inference.predictor import Predictor

# The quality verdicts (`ctseg.inference.quality.scores.VERDICTS`) as the table shows them.
_VERDICT_STYLES = {"ok": "green", "review": "yellow", "unlike the training data": "red"}


def _verdict(stats: dict | None) -> str | None:
    """A scan's quality verdict from its stats (None: predicted before verdicts existed)."""
    quality = (stats or {}).get("quality")
    return quality.get("verdict") if isinstance(quality, dict) else None


def _verdict_cell(stats: dict | None) -> str:
    verdict = _verdict(stats)
    if verdict is None:
        return ""
    return f"[{_VERDICT_STYLES.get(verdict, 'yellow')}]{escape(verdict)}[/]"


def _stats_table(outcomes: list) -> Table:
    table = Table(title="Predictions")
    # In a narrow terminal, every letter of a name and a verdict shows, folded over lines:
    # cut short, the names of volume-1 and volume-12 both read "volume…".
    table.add_column("scan", overflow="fold")
    for heading in ("liver\nmL", "tumour\nmL", "tumours", "largest\nmm", "burden\n%"):
        table.add_column(heading, justify="right", no_wrap=True)  # numbers are never cut
    table.add_column("status")
    table.add_column("verdict", overflow="fold")
    for o in outcomes:
        if o.error is not None:  # its reason in full below the table, not folded in a column
            table.add_row(escape(o.name), "", "", "", "", "", "[red]failed[/]", "")
            continue
        s = o.stats
        # The fingerprint's checks show in the verdict (`unlike the training data`).
        status = "[yellow]warning[/]" if o.warnings else "[green]ok[/]"
        status = "[green]done earlier[/]" if o.done_earlier else status
        status = "[cyan]predicted again[/]" if o.again else status  # why: below the table
        table.add_row(
            escape(o.name),
            f"{s['liver_volume_ml']:.1f}",
            f"{s['tumour_volume_ml']:.1f}",
            str(s["tumour_count"]),
            f"{s['largest_tumour_diameter_mm']:.1f}",
            f"{s['tumour_burden_percent']:.2f}",
            status,
            _verdict_cell(s),
        )
    return table


def _quality_lines(outcomes: list) -> list[str]:
    """Below the table: why each flagged scan is flagged, and the batch's count, e.g.
    `quality: 3 of 40 to review`."""
    from ctseg.inference.quality.scores import OK, batch_line

    lines = []
    verdicts = []
    for o in outcomes:
        if o.error is not None:
            continue
        verdict = _verdict(o.stats)
        verdicts.append(verdict)
        if verdict is not None and verdict != OK:
            reason = (o.stats["quality"].get("reason") or "").strip()
            lines.append(f"[yellow]{escape(verdict)}:[/] {escape(o.name)}: {escape(reason)}")
    summary = batch_line(verdicts)
    if summary is not None:
        lines.append(f"quality: {summary}")
    return lines


@app.command()
def predict(
    run_dir: RunDirArgument,
    inputs: InputsArgument,
    out: OutOption,
    runs: RunsOption = None,
    output_type: OutputTypeOption = OutputType.nifti,
    checkpoint: CheckpointOption = "best",
    tile: TileOption = None,
    device: DeviceOption = DeviceChoice.auto,
    backend: BackendOption = None,
    tta: TtaOption = None,
    compile_cache: CompileCacheOption = None,
    verbose: VerboseOption = False,
    allow_non_ct: AllowNonCtOption = False,
    locate: LocateOption = None,
    roi: RoiOption = None,
    margin: MarginOption = None,
    force: ForceOption = False,
) -> None:
    """Segment liver and tumours: <name>_seg.nii.gz, _stats.json and _preview.png per scan.

    Runs on the GPUs or TPUs that are here, whatever layout trained the
    model (else on the CPU, with ONNX Runtime when installed); the first
    line says what runs where. The segmentation has exactly the input's
    geometry, so it overlays on the scan in ITK-SNAP or 3D Slicer. Exits 1
    when any scan failed; the others are written. Run again after an
    interruption: scans already done for the same request (model,
    checkpoint, TTA, backend, region) are skipped, the rest are predicted; a
    scan whose content changed since (another file of the same name) is
    predicted again. ctseg replaces only files it wrote, as it wrote them
    (listed with their content in --out's .ctseg-outputs.json), others only
    with --force.
    """
    console = Console(highlight=False)  # here, not at import: the terminal's width of now
    run_dirs = rundir.member_runs([run_dir, *(runs or [])])
    configs = [rundir.load_config(path) for path in run_dirs]
    # JAX-free: every option checked before anything starts.
    options = _checked_options(
        configs[0], checkpoint, tile, backend, device, tta, margin, locate, roi
    )
    devices_began = time.perf_counter()
    backend = start_inference(configs[0], options, compile_cache, verbose)
    devices_seconds = time.perf_counter() - devices_began
    # After JAX started: importing the pipeline imports it.
    from ctseg.inference.inputs import check_output_folder
    from ctseg.inference.predictor import DEFAULT_MARGIN_MM, Predictor

    # Where a process's seconds went before the first scan (with --verbose; "devices":
    # JAX's import and start): on a GPU a warm one-scan prediction's wall was 3× its
    # scan's phases, unexplained by them.
    started = {
        "imports": time.perf_counter() - STARTED - devices_seconds,
        "devices": devices_seconds,
    }

    # One writer per --out: two predictions at once would mix their outputs. A file in
    # its place is one error line, not a failure per scan.
    check_output_folder(out)
    with lock.hold(out, warn):
        # Libraries' own lines (ITK, GDCM, XLA) would land among and after ctseg's.
        with library_output.held(show=verbose):
            scans, outcomes, skipped = _scans(inputs, out, output_type, roi, force)
            predictor = Predictor.from_run(run_dirs, backend, options, configs)
            if locate is not None or roi is not None:
                margin = DEFAULT_MARGIN_MM if margin is None else margin
                predictor.predict_region(locate, roi, margin, options)
            _print_start(console, predictor, scans, outcomes, skipped, started, verbose)
            outcomes += _predicted(
                console, predictor, scans, out, force, output_type, allow_non_ct, verbose
            )
        _print_results(console, outcomes)
        if any(o.error is not None for o in outcomes):
            raise typer.Exit(1)


def _checked_options(
    config: Config,
    checkpoint: str,
    tile: int | None,
    backend: BackendChoice | None,
    device: DeviceChoice,
    tta: bool | None,
    margin: float | None,
    locate: Path | None,
    roi: Path | None,
) -> InferenceOptions:
    """The request's `InferenceOptions`, every option checked (one line for a mistake)."""
    from ctseg.inference.inputs import inference_options
    from ctseg.inference.scan.region import check_margin

    asked_backend = backend and backend.value
    options = inference_options(config, checkpoint, tile, asked_backend, device.value, tta)
    check_margin(margin, locate is not None or roi is not None)
    if locate is not None and roi is not None:
        raise CtsegError("give --locate COARSE_RUN or --roi MASK, not both")
    if roi is not None and not roi.exists():
        raise CtsegError(f"--roi {roi}: no such mask file or folder")
    if roi is not None and not roi.is_dir():  # a pipe would hang the scan's reader
        from ctseg.inference.inputs import check_mask

        check_mask(roi)
    return options


def _scans(
    inputs: list[Path], out: Path, output_type: OutputType, roi: Path | None, force: bool
) -> tuple[list[Path], list["ScanOutcome"], list]:
    """(scans to predict, failed outcomes, skipped files) of the inputs: every file found is
    a scan, a failed row or named; DICOM SEG needs DICOM inputs; each scan's --roi mask is
    found before any is predicted, and never written over; --out's record is readable (or
    `force` starts a new one)."""
    from ctseg.inference.inputs import expand_inputs, keep_inputs, scan_masks
    from ctseg.inference.outputs_record import OwnOutputs

    own = OwnOutputs(out)
    own.check(force)  # a record edited by hand: one line before the model loads
    scans, outcomes, skipped = expand_inputs(inputs, out)
    for line, _ in skipped:
        warn(line)
    if output_type == OutputType.dicom_seg:
        for scan in scans:
            dicom_seg.check_dicom_source(scan)
    if roi is not None:
        masks = scan_masks(roi, scans, own.listed)
        scans, overwriting = keep_inputs(scans, out, list(masks.values()), "a --roi mask")
        outcomes += overwriting
    return scans, outcomes, skipped


def _print_start(
    console: Console,
    predictor: "Predictor",
    scans: list[Path],
    outcomes: list["ScanOutcome"],
    skipped: list,
    started: dict[str, float],
    verbose: bool,
) -> None:
    """What runs where, the checkpoints, the scans (and with --verbose the plan, and the
    seconds `started` took before the model loaded)."""
    runs = len(predictor.members)
    steps = ", ".join(str(m.model.step) for m in predictor.members)
    unusable = f", {len(outcomes)} input(s) failed" if outcomes else ""
    unusable += f", {sum(s.count for s in skipped)} file(s) skipped" if skipped else ""
    console.print(
        f"{escape(predictor.summary)}; checkpoint step{'s' * (runs > 1)} {steps}; "
        f"{len(scans)} scan(s){unusable}"
    )
    if verbose:
        console.print(f"plan: {escape(predictor.plan_line)}")
        seconds = {**started, **predictor.seconds}
        one_off = ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items())
        console.print(f"once for all scans: {one_off}")


def _predicted(
    console: Console,
    predictor: "Predictor",
    scans: list[Path],
    out: Path,
    force: bool,
    output_type: OutputType,
    allow_non_ct: bool,
    verbose: bool,
) -> list["ScanOutcome"]:
    """Every scan predicted under a progress bar, its warnings printed as it is written."""
    from ctseg.inference.files import predict_files

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    outcomes = []
    with Progress(*columns, console=console, transient=True) as bar:
        scan_task = bar.add_task("scans", total=len(scans))
        tile_task = bar.add_task("", total=None)

        def report(name: str, stage: str, done: int, total: int) -> None:
            # Reading the next scan and writing the last run beside inference: show the latter.
            if stage == "infer":
                description = f"{escape(name)}: tiles"
                bar.update(tile_task, description=description, completed=done, total=total)

        for outcome in predict_files(
            predictor, scans, out, force, report, output_type.value, allow_non_ct
        ):
            outcomes.append(outcome)
            name = escape(outcome.name)
            for warning in outcome.warnings + outcome.checks:
                console.print(f"[yellow]warning:[/] {name}: {escape(warning)}")
            if outcome.error is None and verbose:
                seconds = outcome.seconds.items()
                console.print(f"{name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in seconds))
            bar.advance(scan_task)
    return outcomes


def _print_results(console: Console, outcomes: list["ScanOutcome"]) -> None:
    """The table, the quality's lines, and each failure in full."""
    console.print(_stats_table(outcomes))
    for line in _quality_lines(outcomes):
        console.print(line, soft_wrap=True)
    for outcome in outcomes:  # in full, one paragraph each, however narrow the terminal
        if outcome.again is not None and outcome.error is None:
            text = f"[cyan]predicted again:[/] {escape(outcome.name)}: {escape(outcome.again)}"
            console.print(text, soft_wrap=True)
        if outcome.error is not None:
            text = f"[bold red]failed:[/] {escape(outcome.name)}: {escape(said(outcome.error))}"
            console.print(text, soft_wrap=True)
