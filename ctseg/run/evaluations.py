"""An evaluation's folder (RUN_DIR/eval, or `--out`): what it holds, claimed and cleared.

One folder holds one evaluation. ``evaluated.json`` records which: a run (or an
ensemble) with its checkpoint, the store and the split, or a cross-validation's fold
runs. A second evaluation of something else replaces a finished one (with its
summary.json) only with ``--force``, an unfinished one of ctseg's without it; any
evaluation first clears what an earlier one wrote, so that predictions are never mixed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ctseg import atomic, compat
from ctseg.errors import CtsegError

EVALUATION = "eval"  # RUN_DIR/eval: `ctseg evaluate RUN_DIR`'s folder unless told otherwise
EVALUATED = "evaluated.json"  # the record of what the folder holds
PREDICTIONS = "predictions"


def evaluation_dir(run_dir: Path, out: Path | None = None) -> Path:
    """Where `ctseg evaluate RUN_DIR` writes: `out`, else RUN_DIR/eval."""
    return Path(run_dir) / EVALUATION if out is None else Path(out)


# What makes a folder an evaluation's (`atomic.claim_folder`).
OWN_FILES = ("summary.json", PREDICTIONS, EVALUATED)


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


def claim(out_dir: Path, evaluation: dict[str, Any], force: bool) -> None:
    """Make `out_dir` the folder of `evaluation`: refuse another's unless `force`, then clear."""
    record, summary = out_dir / EVALUATED, out_dir / "summary.json"
    earlier = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if record.exists():
            earlier = json.loads(record.read_text())
            earlier = earlier if isinstance(earlier, dict) else None
        elif summary.exists():
            written = compat.evaluation_of_summary(json.loads(summary.read_text()))
            earlier = evaluation_record(*written)
    has_files = record.exists() or summary.exists() or (out_dir / PREDICTIONS).exists()
    # An evaluation ctseg began and never finished (its record, no summary: it crashed or
    # was stopped) holds nothing another would lose: it does not block the next command.
    unfinished = earlier is not None and record.exists() and not summary.exists()
    if earlier != evaluation and has_files and not unfinished and not force:
        raise CtsegError(
            f"{out_dir} holds {_described(earlier)}; give another --out, or --force to replace it"
        )
    # An evaluation is never resumed: what an earlier one wrote goes, so that the
    # predictions and reports here are all of this one, even if it stops half-way.
    predictions = out_dir / PREDICTIONS
    if predictions.is_dir():
        for path in predictions.iterdir():
            if path.name.endswith("_seg.nii.gz") or path.name.startswith(atomic.TEMP_PREFIX):
                path.unlink()
    for name in ("summary.json", "metrics.csv"):
        (out_dir / name).unlink(missing_ok=True)
    atomic.write_json(record, evaluation)


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
