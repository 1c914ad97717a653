"""`ctseg folds`: assign cross-validation folds to an existing prepared store."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ctseg.cli.app import app
from ctseg.cli.options import warn
from ctseg.config import check_seed
from ctseg.data.manifest import MANIFEST
from ctseg.data.store import Store
from ctseg.data_prep.splits import write_folds


@app.command()
def folds(
    prep_dir: Annotated[
        Path,
        typer.Argument(help="Prepared store written by `ctseg preprocess`.", metavar="PREP_DIR"),
    ],
    k: Annotated[
        int,
        typer.Option(
            "--k", help="Number of folds (at least 2; 0 removes the store's folds).", metavar="K"
        ),
    ],
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the folds (as data.split_seed in preprocess).")
    ] = 0,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Re-assign a store that already has other folds (runs trained on them can "
            "then no longer be resumed or evaluated together).",
        ),
    ] = False,
) -> None:
    """Split the store's labelled cases into K cross-validation folds (sizes differ by at most 1).

    Deterministic by seed; only manifest.json is rewritten (atomically, under the store's
    lock), never the arrays. Train one run per fold with `ctseg train --fold I` and
    evaluate them together with `ctseg evaluate RUN_DIR... --cross-validation`.
    """
    check_seed("seed", seed)
    result = write_folds(prep_dir, k, seed, force=force, warn=warn)
    console = Console(highlight=False)
    store = result.store
    if store.folds:
        console.print(_fold_table(store))
    where = escape(str(store.path / MANIFEST))
    if not result.changed:
        what = f"{store.folds} folds (seed {store.fold_seed})" if store.folds else "no folds"
        console.print(f"the store already has {what}; {where} left as it was")
    elif store.folds:
        labelled = sum(1 for case in store.cases if case.labelled)
        console.print(
            f"{store.folds} folds (seed {store.fold_seed}) of {labelled} labelled case(s) written "
            f"to {where} (the arrays are untouched)"
        )
    else:
        console.print(f"the store's {result.earlier} folds removed from {where}")


def _fold_table(store: Store) -> Table:
    table = Table(title="folds")
    table.add_column("fold", justify="right")
    table.add_column("cases", justify="right")
    table.add_column("case ids", overflow="fold")
    for fold in range(store.folds):
        ids = [case.id for case in store.fold_cases(fold)]
        table.add_row(str(fold), str(len(ids)), escape(", ".join(ids)))
    return table
