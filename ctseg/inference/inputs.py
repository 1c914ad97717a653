"""`ctseg predict`'s inputs and where their outputs go: files, folders and DICOM series
folders expanded into scans (each failure and each file skipped named), the output names
of a scan, and the folders predictions must not be written into; each scan's region mask
(`scan_masks`: never the scan itself, never one of two candidates picked without a word;
`read_roi`: on the scan's voxels, labels not HU);
and what a command or the API asks of a run's model, checked before anything runs
(`inference_options`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctseg import config as cfg
from ctseg.config import InferenceOptions, TileRequest
from ctseg.data.manifest import MANIFEST
from ctseg.errors import CtsegError, OptionError
from ctseg.inference.network.backends import BACKENDS
from ctseg.inference.outputs_record import (  # noqa: F401  (OUTPUTS_RECORD: callers find it here)
    OUTPUTS_RECORD,
    OwnOutputs,
)
from ctseg.io.scans import Scan, Skipped, find_scans, geometry_difference, read_scan, scan_name
from ctseg.parallel.devices import DEVICE_CHOICES
from ctseg.reading import check_regular
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
    # What was asked of its prediction beyond the model (`ctseg.inference.files`): the
    # backend's exactness class and the region; recorded in its stats file.
    request: dict[str, Any] | None = None
    # Why its earlier outputs, of this request, were predicted again: the scan they were
    # predicted from changed since (`requests.earlier_prediction`).
    again: str | None = None


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
    raise OptionError(f"`out_dir` {out_dir} is {what}; give a folder for the predictions")


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
            failed.append(ScanOutcome(Path(item), output_name(Path(item)), error=error))
            continue
        scans.extend(s for s in found.scans if not is_earlier_output(s))
        skipped.extend(found.skipped)
    # Outputs are named after the scan, so two scans of one name (a/volume-0.nii and
    # b/volume-0.nii) would write the same files: the first keeps the name.
    first_of: dict[str, Path] = {}
    unique = []
    input_paths = {scan.resolve() for scan in scans}
    for scan in dict.fromkeys(scans):
        name = output_name(scan)
        if not name:
            reason = f"its outputs would have an empty name (the file is named {scan.name!r}, "
            reason += "a scan suffix alone); rename it"
            failed.append(ScanOutcome(scan, scan.name, error=reason))  # its row: the file
        elif name in first_of:
            # Both paths: the table shows the two scans under the one name.
            reason = f"{scan} would write over the outputs of {first_of[name]} (both named "
            reason += f"{name!r}); predict it into another --out"
            failed.append(ScanOutcome(scan, name, error=reason))
        elif clash := _inputs_overwritten(name, out_dir, input_paths):
            reason = f"its output {clash} would overwrite an input of this call; use another --out"
            failed.append(ScanOutcome(scan, name, error=reason))
        else:
            first_of[name] = scan
            unique.append(scan)
    return unique, failed, skipped


def is_earlier_output(path: Path) -> bool:
    """A label or probability map that `predict_files` wrote: its folder's record lists it,
    or its stats file lies beside it (as in folders an earlier ctseg wrote)."""
    match = re.fullmatch(r"(.+)_(seg|probs)\.nii\.gz", path.name)
    if match is None:
        return False
    stats = path.parent / f"{match[1]}_stats.json"
    return stats.is_file() or OwnOutputs(path.parent).listed(path)


def keep_inputs(
    scans: Sequence[Path], out_dir: Path, protected: Sequence[Path], what: str
) -> tuple[list[Path], list[ScanOutcome]]:
    """`scans` whose outputs in `out_dir` overwrite none of the `protected` files (inputs
    read besides the scans, e.g. region masks, `what` in words), and a failed outcome for
    each of the others: an input is never replaced, not even with --force."""
    inputs = {Path(path).resolve() for path in protected}
    kept, failed = [], []
    for scan in scans:
        name = output_name(scan)
        if clash := _inputs_overwritten(name, out_dir, inputs):
            reason = f"its output {clash} would overwrite {what}, an input of this call"
            failed.append(ScanOutcome(scan, name, error=f"{reason}; use another --out"))
        else:
            kept.append(scan)
    return kept, failed


def _inputs_overwritten(name: str, out_dir: Path | None, inputs: set[Path]) -> Path | None:
    """The first output of scan `name` in `out_dir` that is one of the (resolved) `inputs`."""
    if out_dir is None:
        return None
    outputs = output_paths(Path(out_dir), name, with_probabilities=True).values()
    return next((path for path in outputs if path.resolve() in inputs), None)


def output_name(scan: Path) -> str:
    """The name of a scan's outputs: its file name without the scan suffix, or a DICOM
    series folder's name, also where its path names none (`.` inside the series, `..`);
    empty for a file named as a suffix alone (`.nii.gz`), which has none."""
    return scan_name(Path(os.path.abspath(scan)))


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


# ---------------------------------------------------------------- what is asked of a model


def inference_options(
    config: cfg.Config,
    checkpoint: str | int = "best",
    tile: TileRequest | int | None = None,
    backend: str | None = None,
    device: str = "auto",
    tta: bool | None = None,
) -> InferenceOptions:
    """`InferenceOptions` of a request on a run of `config`, each value checked before any
    model loads, one line for each mistake: the CLI's and the API's one check.

    `checkpoint`: best, latest or a step number (an int too); `tile`: a `TileRequest`,
    or its int read once as the config's predict.tile is (`TileRequest.from_int`): the
    options carry the request. Each mistake names the option as the API spells it
    (`OptionError`; the command line says its flag).
    """
    if isinstance(checkpoint, bool) or not isinstance(checkpoint, str | int):
        raise OptionError(f"`checkpoint` must be best, latest or a step number, got {checkpoint!r}")
    checkpoint = str(checkpoint)
    if tile is not None:  # read once, with predict.tile's one check
        try:
            tile = TileRequest.of(tile, "predict.tile")
        except CtsegError as exc:
            raise OptionError(f"`tile` {tile!r}: {exc}") from None
    if backend is not None and backend not in BACKENDS:
        raise OptionError(f"`backend` must be {' or '.join(BACKENDS)} (or None), got {backend!r}")
    if device not in DEVICE_CHOICES:
        raise OptionError(f"`device` must be one of {', '.join(DEVICE_CHOICES)}, got {device!r}")
    if tta is not None and not isinstance(tta, bool):
        raise OptionError(f"`tta` must be True, False or None, got {tta!r}")
    return InferenceOptions(checkpoint, tile, backend, device, tta)


# ---------------------------------------------------------------- region masks


def roi_mask(roi: Path, source: Path) -> Path:
    """The region mask of the scan read from `source`: `roi` itself, or in a folder `roi`
    the mask named as the scan (`inputs.mask_candidates`: its file name, `<name>.nii.gz`,
    or `<name>_seg.nii.gz`, as `ctseg predict` and TotalSegmentator-style tools name
    per-scan outputs)."""
    if not roi.is_dir():
        return roi
    name = output_name(source)
    if candidates := mask_candidates(roi, source):
        return candidates[0]
    raise OptionError(
        f"`roi` {roi}: no mask for the scan {source.name} (looked for {name}.nii.gz, "
        f"{name}.nii and {name}_seg.nii.gz)"
    )


# A mask holds labels: a file with values below 0 or above this is a scan, not a mask.
_MASK_LABELS_UP_TO = 255


def read_roi(path: Path, scan: Scan) -> np.ndarray:
    """A region mask of `scan`'s voxels (any label > 0 is the region), canonical. Its
    voxels may be stored in another order (mirrored, transposed, with the affine to
    match): in canonical order they are the scan's."""
    mask = read_scan(path)
    difference = geometry_difference(mask.array.shape, mask.affine, scan.array.shape, scan.affine)
    if difference:
        raise CtsegError(
            f"the region mask {path} is not on the scan's voxels in RAS order: {difference}"
        )
    low, high = float(np.min(mask.array)), float(np.max(mask.array))
    if low < 0 or high > _MASK_LABELS_UP_TO:
        raise CtsegError(
            f"the region mask {path} holds values from {low:g} to {high:g}: a scan, not a "
            f"mask of labels (0 outside, 1–{_MASK_LABELS_UP_TO} inside)"
        )
    return (mask.array > 0).astype(np.uint8)


def mask_candidates(roi: Path, source: Path) -> list[Path]:
    """The files of mask folder `roi` named as the scan read from `source`, in the order
    `roi_mask` takes them: its file name, `<name>.nii.gz`,
    `<name>.nii`, `<name>_seg.nii.gz`. Whatever stands there but a folder: a pipe too,
    which `scan_masks` refuses rather than look past."""
    name = output_name(source)
    file = Path(os.path.abspath(source)).name
    names = (file, f"{name}.nii.gz", f"{name}.nii", f"{name}_seg.nii.gz")
    paths = [roi / n for n in dict.fromkeys(names) if n]
    return [path for path in paths if os.path.lexists(path) and not path.is_dir()]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def scan_masks(
    roi: Path, scans: Sequence[Path], ours: Callable[[Path], bool] = lambda path: False
) -> dict[Path, Path]:
    """Each scan's region mask (`--roi`: one mask for one scan, or a folder of masks named
    as the scans), found before any scan runs; CtsegError, one line, when a scan has none,
    when its mask is the scan itself (the input folder given as the mask folder: its
    "region" would be every voxel above 0 HU), or when the folder holds two candidates for
    one scan (`mask_candidates`; `ours`: files this call wrote earlier, no candidates).
    """
    roi = Path(roi)
    if not roi.exists():
        raise OptionError(f"`roi` {roi}: no such mask file or folder")
    if not roi.is_dir() and len(scans) != 1:
        raise OptionError(
            f"`roi` {roi} is the mask of one scan; give that one scan, or a folder of masks "
            "named as the scans"
        )
    masks = {}
    for scan in scans:
        candidates = mask_candidates(roi, scan) if roi.is_dir() else [roi]
        # The scan itself first: a folder's first candidate is the scan's own file name.
        if any(_same_file(path, scan) for path in candidates):
            where = f"--roi {roi}: the mask of {scan.name}" if roi.is_dir() else f"--roi {roi}"
            raise CtsegError(
                f"{where} is the scan {scan} itself, not a mask of it; give a liver mask "
                "(or a folder of masks named as the scans, not the scans' folder)"
            )
        found = [path for path in candidates if not (roi.is_dir() and ours(path))]
        if not found:
            name = output_name(scan)
            own = [path.name for path in candidates if ours(path)]
            why = f"; {own[0]} is this --out's own earlier output" if own else ""
            raise OptionError(
                f"`roi` {roi}: no mask for the scan {scan.name} (looked for {name}.nii.gz, "
                f"{name}.nii and {name}_seg.nii.gz{why})"
            )
        if len(found) > 1:
            raise OptionError(
                f"`roi` {roi}: two masks for the scan {scan.name}, "
                f"{found[0].name} and {found[1].name}; keep one of them"
            )
        masks[scan] = check_mask(found[0])
    return masks


def check_mask(mask: Path) -> Path:
    """`mask` if it is (or links to) a regular file; CtsegError, one line, for a pipe (whose
    reading would wait for a writer for ever), a device or a broken link."""
    try:
        check_regular(mask, "--roi mask")
    except OSError as exc:
        raise OptionError(f"`roi` mask {mask} cannot be read: {exc.strerror or exc}") from None
    return mask
