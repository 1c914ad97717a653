"""`ctseg predict`'s inputs and where their outputs go: files, folders and DICOM series
folders expanded into scans (each failure and each file skipped named), the output names
of a scan, and the folders predictions must not be written into.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctseg.data.manifest import MANIFEST
from ctseg.errors import CtsegError
from ctseg.io.scans import Skipped, find_scans, scan_name
from ctseg.run import evaluations, rundir


@dataclass
class ScanOutcome:
    """What `predict_files` did with one input."""

    source: Path
    name: str
    stats: dict[str, Any] | None = None
    outputs: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None  # the one-line reason the scan failed
    # This scan's own seconds per phase (`PHASES`); the call's one-off costs (loading,
    # compiling ahead) are the predictor's, added to them in the stats file.
    seconds: dict[str, float] = field(default_factory=dict)
    done_earlier: bool = False  # its outputs, by this model, were all there: left as they were
    checks: list[str] = field(default_factory=list)  # far outside the training data


def check_output_folder(out_dir: Path) -> None:
    """CtsegError if `out_dir` is another command's folder: a run directory, a prepared
    store or an evaluation's folder. Predictions written there would be mixed with what
    that command reads back (and `ctseg preprocess` would take the store for foreign)."""
    out_dir = Path(out_dir)
    if rundir.is_run_dir(out_dir):
        what = "a run directory of `ctseg train`"
    elif (out_dir / MANIFEST).exists():
        what = "a prepared store of `ctseg preprocess`"
    elif (out_dir / evaluations.EVALUATED).exists():
        what = "the folder of a `ctseg evaluate RUN_DIR`"
    else:
        return
    raise CtsegError(f"--out {out_dir} is {what}; give a folder for the predictions")


def expand_inputs(
    inputs: Sequence[Path], out_dir: Path | None = None
) -> tuple[list[Path], list[ScanOutcome], list[Skipped]]:
    """Scans named by files, folders and DICOM series folders; inputs that fail, as
    outcomes; and what was found in folders but is no scan, each named (`find_scans`).

    Earlier outputs of `ctseg predict` are not scans and are left out; a scan whose
    outputs in `out_dir` would overwrite an input of this call fails, even with --force.
    """
    scans: list[Path] = []
    failed: list[ScanOutcome] = []
    skipped: list[Skipped] = []
    for item in inputs:
        try:
            found = find_scans([Path(item)])
        except Exception as exc:  # an unreadable folder too: this input's row, not the call's
            error = str(exc) if isinstance(exc, CtsegError) else f"cannot list {item}: {exc}"
            failed.append(ScanOutcome(Path(item), scan_name(Path(item)), error=error))
            continue
        scans.extend(s for s in found.scans if not is_earlier_output(s))
        skipped.extend(found.skipped)
    # Outputs are named after the scan, so two scans of one name (a/volume-0.nii and
    # b/volume-0.nii) would write the same files: the first keeps the name.
    first_of: dict[str, Path] = {}
    unique = []
    input_paths = {scan.resolve() for scan in scans}
    for scan in dict.fromkeys(scans):
        name = scan_name(scan)
        if name in first_of:
            reason = f"its outputs would overwrite those of {first_of[name]} (both are {name!r}); "
            failed.append(ScanOutcome(scan, name, error=reason + "predict it into another --out"))
        elif clash := _inputs_overwritten(name, out_dir, input_paths):
            reason = f"its output {clash} would overwrite an input of this call; use another --out"
            failed.append(ScanOutcome(scan, name, error=reason))
        else:
            first_of[name] = scan
            unique.append(scan)
    return unique, failed, skipped


def is_earlier_output(path: Path) -> bool:
    """A label or probability map that `predict_files` wrote: its stats file lies beside it."""
    match = re.fullmatch(r"(.+)_(seg|probs)\.nii\.gz", path.name)
    return match is not None and (path.parent / f"{match[1]}_stats.json").is_file()


def _inputs_overwritten(name: str, out_dir: Path | None, inputs: set[Path]) -> Path | None:
    """The first output of scan `name` in `out_dir` that is one of the (resolved) `inputs`."""
    if out_dir is None:
        return None
    outputs = output_paths(Path(out_dir), name, with_probabilities=True).values()
    return next((path for path in outputs if path.resolve() in inputs), None)


def output_paths(
    out_dir: Path, name: str, with_probabilities: bool, output_type: str = "nifti"
) -> dict[str, Path]:
    seg = f"{name}_seg.dcm" if output_type == "dicom-seg" else f"{name}_seg.nii.gz"
    paths = {
        "seg": out_dir / seg,
        "stats": out_dir / f"{name}_stats.json",
        "preview": out_dir / f"{name}_preview.png",
    }
    if with_probabilities:
        paths["probs"] = out_dir / f"{name}_probs.nii.gz"
    return paths
