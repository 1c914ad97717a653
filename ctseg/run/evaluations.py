"""An evaluation's folder (RUN_DIR/eval, or `out_dir`): what it holds, claimed and replaced.

One folder holds one evaluation. ``evaluated.json`` records which: a run (or an
ensemble) with its checkpoint, the store and the split, or a cross-validation's fold
runs. A second evaluation of something else replaces a finished one (with its
summary.json) only with `force`, an unfinished one of ctseg's without it. Nothing
of the earlier one goes before the new one is ready: its predictions are written out of
sight (`STAGED`), and `commit` replaces the earlier evaluation by them, so that a folder
never holds a finished evaluation of mixed predictions, nor loses one to a failed run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ctseg import atomic, compat
from ctseg.errors import CtsegError, OptionError
from ctseg.reading import Record, read_json

EVALUATION = "eval"  # RUN_DIR/eval: `ctseg evaluate RUN_DIR`'s folder unless told otherwise
EVALUATED = "evaluated.json"  # the record of what the folder holds
SUMMARY = "summary.json"  # the report, written last: the evaluation is finished
PREDICTIONS = "predictions"
PREDICTED = "_seg.nii.gz"  # how each case's prediction in PREDICTIONS is named
# Where an evaluation's predictions are written until it is finished (ctseg's temporary:
# a killed evaluation's is no one's files, and the next one removes it).
STAGED = f"{atomic.TEMP_PREFIX}predictions"


def evaluation_dir(run_dir: Path, out: Path | None = None) -> Path:
    """Where `ctseg evaluate RUN_DIR` writes: `out`, else RUN_DIR/eval."""
    return Path(run_dir) / EVALUATION if out is None else Path(out)


# What makes a folder an evaluation's (`atomic.claim_folder`).
OWN_FILES = (SUMMARY, PREDICTIONS, EVALUATED)


def evaluation_record(
    run_dirs: Sequence[Path],
    steps: Sequence[int],
    data_dir: Path,
    split: str,
    locate: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What an evaluation's folder holds (evaluated.json): its run(s) and store, and the
    locator (`locate`: its run_dir, checkpoint_step and margin_mm) if the cases were
    predicted on the liver's region only."""
    evaluation = {
        "run_dir": str(Path(run_dirs[0]).resolve()),
        "checkpoint_step": steps[0],
        "data": str(Path(data_dir).resolve()),
        "split": split,
    }
    if locate is not None:
        evaluation["locate"] = {**locate, "run_dir": str(Path(locate["run_dir"]).resolve())}
    if len(run_dirs) > 1:
        evaluation["ensemble"] = [
            {"run_dir": str(Path(r).resolve()), "checkpoint_step": s}
            for r, s in zip(run_dirs, steps, strict=True)
        ]
    return evaluation


def cross_validation_record(
    folds: Sequence[tuple[int, Path, int]], data_dir: Path
) -> dict[str, Any]:
    """What a cross-validation's folder holds: (fold, run, checkpoint step) of each fold run,
    and the store."""
    return {
        "cross_validation": [
            {"fold": fold, "run_dir": str(Path(run_dir).resolve()), "checkpoint_step": step}
            for fold, run_dir, step in folds
        ],
        "data": str(Path(data_dir).resolve()),
    }


def claim(out_dir: Path, evaluation: dict[str, Any], force: bool) -> Path:
    """Check that `out_dir` may become the folder of `evaluation` (another's is refused
    unless `force`) and make the folder its predictions are written into meanwhile, out
    of sight (`STAGED`). Nothing of an earlier evaluation is touched: `commit` replaces it
    once this one's results are ready."""
    record, summary = out_dir / EVALUATED, out_dir / SUMMARY
    earlier = _earlier(out_dir)
    has_files = any((out_dir / name).exists() for name in OWN_FILES)
    # An evaluation ctseg began and never finished (its record, no summary: it crashed or
    # was stopped while being replaced) holds nothing another would lose: it does not
    # block the next command.
    unfinished = earlier is not None and record.exists() and not summary.exists()
    if earlier != evaluation and has_files and not unfinished and not force:
        raise OptionError(
            f"{out_dir} holds {_described(earlier)}; give another `out_dir`, or `force` to "
            "replace it"
        )
    staged = out_dir / STAGED
    discard(staged)  # a killed evaluation's: never part of a finished one
    staged.mkdir()
    return staged


def _earlier(out_dir: Path) -> dict[str, Any] | None:
    """The record of the evaluation `out_dir` holds (evaluated.json, or for an earlier
    ctseg's, its summary.json); None where there is none or it cannot be read (a FIFO, a
    record edited by hand: `ctseg.reading`)."""
    try:
        return Record.read(out_dir / EVALUATED, "the evaluation record").value
    except FileNotFoundError:
        pass
    except CtsegError:
        return None
    try:
        written = compat.evaluation_of_summary(read_json(out_dir / SUMMARY, "the summary"))
        return evaluation_record(*written)
    except (FileNotFoundError, CtsegError, KeyError, TypeError, ValueError, AttributeError):
        return None


def commit(out_dir: Path, evaluation: dict[str, Any], staged: Path) -> None:
    """Replace the folder's earlier evaluation by this one, whose predictions are ready in
    `staged`: its summary goes first (the folder is then an unfinished evaluation, never
    a finished one of mixed predictions), then its record and predictions are replaced;
    the caller writes the new reports, summary.json last. Files in predictions/ that no
    evaluation wrote are left alone."""
    for name in (SUMMARY, "metrics.csv"):
        (out_dir / name).unlink(missing_ok=True)
    atomic.write_json(out_dir / EVALUATED, evaluation)
    predictions = out_dir / PREDICTIONS
    predictions.mkdir(exist_ok=True)
    new = {path.name for path in staged.iterdir()}
    for path in predictions.iterdir():
        earlier = path.name.endswith(PREDICTED) or path.name.startswith(atomic.TEMP_PREFIX)
        if earlier and path.name not in new:
            path.unlink()
    for name in sorted(new):
        os.replace(staged / name, predictions / name)
    discard(staged)


def discard(staged: Path) -> None:
    """Remove the predictions of an evaluation that did not finish (`claim`'s folder)."""
    if staged.is_symlink() or staged.is_file():
        staged.unlink()
    elif staged.is_dir():
        shutil.rmtree(staged)


def _described(evaluation: dict[str, Any] | None) -> str:
    """An evaluation's record (evaluated.json) in words."""
    try:
        if evaluation is not None and "cross_validation" in evaluation:
            runs = evaluation["cross_validation"]
            return (
                f"the cross-validation of {len(runs)} fold runs ({runs[0]['run_dir']}, …) on "
                f"{evaluation['data']}"
            )
        if evaluation is not None:
            locate = evaluation.get("locate")
            located = "" if locate is None else f", located by {locate['run_dir']}"
            return (
                f"the evaluation of {evaluation['run_dir']} (checkpoint "
                f"{evaluation['checkpoint_step']}, {evaluation['data']} split "
                f"{evaluation['split']!r}{located})"
            )
    except (KeyError, IndexError, TypeError):
        pass
    return "an evaluation that cannot be read"
