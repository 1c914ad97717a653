"""`ctseg synth`: write a synthetic LiTS-like data set."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cli.app import app
from cli.options import warn
from cli.progress import counting
from ctseg import lock
from data_prep.synth import write_dataset


@app.command()
def synth(
    out_dir: Annotated[
        Path, typer.Argument(help="Folder to write volume-N / segmentation-N into.")
    ],
    cases: Annotated[int, typer.Option(min=1, help="Number of cases to write.")] = 8,
    size: Annotated[
        int,
        typer.Option(
            min=16, help="In-plane voxels per side (the field of view is 32–42 cm at any size)."
        ),
    ] = 96,
    seed: Annotated[int, typer.Option(help="Seed; the same seed writes identical files.")] = 0,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Write into a folder that holds other files (overwriting them)."
        ),
    ] = False,
) -> None:
    """Write synthetic abdomen CT scans with liver and tumour labels, named as LiTS names them.

    OUT_DIR must be new, empty or an earlier synth output, unless --force.
    """
    # One writer per folder: two at once would write the same files over each other.
    with lock.hold(out_dir, warn), counting("synth") as report:
        write_dataset(out_dir, cases, size, seed, progress=report, force=force)
    Console(highlight=False).print(
        f"wrote {cases} synthetic cases to {out_dir}: volume-N.nii.gz and "
        f"segmentation-N.nii.gz for N = 0…{cases - 1}",
        soft_wrap=True,
    )
