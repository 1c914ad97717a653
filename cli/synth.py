"""`ctseg synth`: write a synthetic LiTS-like data set."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ctseg import lock
from ctseg.cli.app import app
from ctseg.cli.options import warn
from ctseg.cli.progress import counting
from ctseg.config import check_seed
from ctseg.synth.cases import MAX_SLICES_PER_SIZE
from ctseg.synth.dataset import check_size, write_dataset


@app.command()
def synth(
    out_dir: Annotated[
        Path,
        typer.Argument(help="Folder to write volume-N / segmentation-N into.", metavar="OUT_DIR"),
    ],
    cases: Annotated[int, typer.Option(min=1, help="Number of cases to write.")] = 8,
    size: Annotated[
        int,
        typer.Option(
            min=16,
            help=(
                "In-plane pixels per side, over a 29–50 cm field of view at any size. A scan "
                f"has at most {MAX_SLICES_PER_SIZE:g}×SIZE slices: thin slices over a long "
                "scan are made thicker to stay within it (the anatomy is never cut)."
            ),
        ),
    ] = 96,
    seed: Annotated[int, typer.Option(help="Seed; the same seed writes identical files.")] = 0,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Write into a folder that holds other files (overwriting them)."
        ),
    ] = False,
    phases: Annotated[
        bool,
        typer.Option(
            "--phases",
            help="Draw each scan's contrast phase as archives hold them (15 % unenhanced, "
            "15 % arterial, 55 % portal venous, 15 % delayed: livers 50–135 HU). By "
            "default every scan is in one phase (liver 55–70 HU), as the demo's are.",
        ),
    ] = False,
) -> None:
    """Write synthetic CT scans with liver and tumour labels, named as LiTS names them.

    Phantoms at physical scale (a liver of about 1.3–2.1 L whatever the scan covers), each
    a liver-only (160–260 mm), abdominal (300–450 mm) or chest-abdomen-pelvis
    (600–900 mm) scan with 0.7–5 mm slices; OUT_DIR/synth.json lists what was
    drawn for each case. OUT_DIR must be new, empty or an earlier synth output,
    unless --force.
    """
    # Before the lock (which makes the folder): a bad seed or size leaves nothing behind.
    check_seed("seed", seed)
    check_size(size)
    # One writer per folder: two at once would write the same files over each other.
    with lock.hold(out_dir, warn), counting("synth") as report:
        write_dataset(out_dir, cases, size, seed, progress=report, force=force, phases=phases)
    Console(highlight=False).print(
        f"wrote {cases} synthetic cases to {out_dir}: volume-N.nii.gz and "
        f"segmentation-N.nii.gz for N = 0…{cases - 1}",
        soft_wrap=True,
    )
