"""`ctseg preprocess`: raw LiTS / MSD / plain-scan (or DICOM series) folder -> prepared store."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ctseg.cli.app import app
from ctseg.cli.options import ConfigOption, SetOption, config_from_options, warn
from ctseg.cli.progress import counting
from ctseg.data.manifest import MANIFEST, SPLITS
from ctseg.data_prep.build import PrepareResult, write_store
from ctseg.data_prep.raw import find_cases
from ctseg.data_prep.workers import usable_workers

_STATUS_STYLE = {"prepared": "green", "resumed": "cyan", "failed": "red"}


@app.command()
def preprocess(
    raw_dir: Annotated[
        Path,
        typer.Argument(
            help="Folder with LiTS volume-N/segmentation-N, MSD imagesTr/labelsTr, "
            "or scans without labels (NIfTI/NRRD/MHA files, DICOM series folders of one "
            "complete series each: a predict-only store).",
            metavar="RAW_DIR",
        ),
    ],
    out_dir: Annotated[
        Path, typer.Argument(help="Folder of the prepared store to write.", metavar="OUT_DIR")
    ],
    config_path: ConfigOption = None,
    overrides: SetOption = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            help="Cases prepared at once, each in its own process (at most one per CPU).",
        ),
    ] = 1,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Redo every case, overwrite a store of another resolution, and let "
            "data.folds replace the store's own folds.",
        ),
    ] = False,
) -> None:
    """Resample every scan to the R³ grid and write the prepared store.

    Exits 1 when some case failed (the others are in the store), 2 when nothing could start.
    A scan larger than 1/8 of the available memory is refused from its header; set
    CTSEG_MAX_SCAN_BYTES to allow more.
    """
    config = config_from_options(config_path, overrides)
    console = Console(highlight=False)
    usable = usable_workers(workers)
    if usable < workers:
        console.print(f"--workers {workers}: {usable} CPU(s) here, so {usable} worker(s)")
    layout = find_cases(raw_dir)
    with counting("preprocess") as report:
        result = write_store(
            layout, out_dir, config, progress=report, force=force, workers=workers, warn=warn
        )
    console.print(_case_table(result))
    console.print(_summary_line(result, out_dir), soft_wrap=True)
    if result.failures:
        raise typer.Exit(code=1)


def _case_table(result: PrepareResult) -> Table:
    table = Table(title="preprocess")
    table.add_column("case", overflow="fold")  # every letter, however narrow the terminal
    table.add_column("split")
    folds = {}
    if result.store is not None and result.store.folds:
        table.add_column("fold", justify="right")
        folds = {case.id: case.fold for case in result.store.cases}
    table.add_column("status", overflow="fold")  # a failure's reason in full, however narrow
    for outcome in result.outcomes:
        style = _STATUS_STYLE[outcome.status]
        status = f"failed: {outcome.reason}" if outcome.reason else outcome.status
        row = [outcome.case_id, outcome.split]
        if folds:
            fold = folds.get(outcome.case_id)  # none: a failed or label-free case
            row.append("" if fold is None else str(fold))
        table.add_row(*row, Text(status, style=style))
    return table


def _summary_line(result: PrepareResult, out_dir: Path) -> str:
    failed = len(result.failures)
    if result.store is None:
        return (
            f"[red]all {failed} case(s) failed[/]; no store was written to {escape(str(out_dir))}"
        )
    store = result.store
    counts = " / ".join(f"{len(store.split(s))} {s}" for s in SPLITS if store.split(s))
    if store.folds:
        counts += f"; {store.folds} folds, seed {store.fold_seed}"
    line = (
        f"prepared store: {len(store.cases)} case(s) ({counts}), {store.grid_spec.describe()}; "
        f"manifest {escape(str(store.path / MANIFEST))}"
    )
    longer = [c for c in store.cases if any(g > store.resolution for g in c.grid_shape)]
    if store.grid == "spacing" and longer:
        line += (
            f"\n{len(longer)} scan(s) extend beyond the {store.resolution}³ box at this "
            "spacing: kept whole; training draws its boxes on them, validation scores the "
            "box around the liver (box_offset in the manifest)"
        )
    if failed:
        line += f"\n[red]{failed} case(s) failed[/]; fix them and re-run to add them to the store"
    return line
