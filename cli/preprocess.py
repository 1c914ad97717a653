"""`ctseg preprocess`: raw LiTS / MSD folder -> prepared store."""

import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.app import app
from cli.options import ConfigOption, SetOption, load_config
from ctseg.store import MANIFEST, Store, prepare


@app.command()
def preprocess(
    raw_dir: Annotated[
        Path,
        typer.Argument(help="Folder with LiTS volume-N/segmentation-N or MSD imagesTr/labelsTr."),
    ],
    out_dir: Annotated[Path, typer.Argument(help="Folder of the prepared store to write.")],
    config: ConfigOption = None,
    set_: SetOption = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Redo every case and overwrite a store of another resolution."
        ),
    ] = False,
) -> None:
    """Resample every labelled scan to the R³ grid and write the prepared store."""
    cfg = load_config(config, set_)
    console = Console(highlight=False)
    with (
        warnings.catch_warnings(record=True) as caught,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
        ) as bar,
    ):
        warnings.simplefilter("always")
        task = bar.add_task("preprocess", total=None)

        def advance(done: int, total: int, case_id: str) -> None:
            bar.update(task, completed=done, total=total, description=f"preprocess {case_id}")

        store = prepare(raw_dir, out_dir, cfg, progress=advance, force=force)
    for warning in caught:
        console.print(f"[yellow]warning:[/] {warning.message}")
    console.print(_summary(store))


def _summary(store: Store) -> Table:
    table = Table(title="prepared store", show_header=False)
    table.add_row("cases", str(len(store.cases)))
    table.add_row("train / val", f"{len(store.split('train'))} / {len(store.split('val'))}")
    table.add_row("resolution", f"{store.resolution}³")
    table.add_row("manifest", str(store.path / MANIFEST))
    return table
