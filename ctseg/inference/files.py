"""Predicting scan files into an output folder: what `ctseg predict` writes.

Named after each input::

    OUT_DIR/<name>_seg.nii.gz     labels 0/1/2 in exactly the input's geometry
    OUT_DIR/<name>_probs.nii.gz   class probabilities (only with predict.save_probabilities)
    OUT_DIR/<name>_stats.json     volumes, tumour count and size, burden; the model; timings
    OUT_DIR/<name>_preview.png    three slices through the liver with the labels overlaid

A scan's outputs appear together, `_stats.json` last (`atomic.atomic_group`): a scan
without its stats file is unfinished and is predicted again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctseg import atomic
from ctseg.data.manifest import MANIFEST
from ctseg.errors import CtsegError
from ctseg.inference import postprocess
from ctseg.inference.jax_backend import is_out_of_memory
from ctseg.inference.member import OnGrid
from ctseg.inference.predictor import PHASES, Predictor, Seconds, StageProgress, timed
from ctseg.inference.scan_checks import volume_warnings
from ctseg.io import dicom_seg, pictures
from ctseg.io.scans import Scan, find_scans, read_scan, scan_name, write_labels, write_volume
from ctseg.run import evaluations, rundir

FileProgress = Callable[[str, str, int, int], None]  # (scan name, stage, done, total)
OUTPUT_TYPES = ("nifti", "dicom-seg")


@dataclass
class Prepared:
    """A scan read and brought to each member's grid, ready for the network."""

    scan: Scan
    on_grids: list[OnGrid]

    def free_units(self) -> None:
        """Drop the boxes (inferred by now), keeping where each grid lies in its box."""
        self.on_grids = [OnGrid(None, g.grid) for g in self.on_grids]


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
    seconds: Seconds = field(default_factory=dict)
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
) -> tuple[list[Path], list[ScanOutcome]]:
    """Scans named by files, folders and DICOM series folders; inputs that fail, as outcomes.

    Earlier outputs of `ctseg predict` are not scans and are left out; a scan whose
    outputs in `out_dir` would overwrite an input of this call fails, even with --force.
    """
    scans: list[Path] = []
    failed: list[ScanOutcome] = []
    for item in inputs:
        try:
            scans.extend(s for s in find_scans([Path(item)]) if not is_earlier_output(s))
        except CtsegError as exc:
            failed.append(ScanOutcome(Path(item), scan_name(Path(item)), error=str(exc)))
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
    return unique, failed


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


def predict_files(
    predictor: Predictor,
    sources: Sequence[Path],
    out_dir: Path,
    force: bool = False,
    progress: FileProgress | None = None,
    output_type: str = "nifti",
) -> Iterator[ScanOutcome]:
    """Predict scans one after another and write their outputs; yields each scan's outcome.

    Reading and resampling the next scan, and post-processing and writing the
    last one, run in threads beside the inference of the current one (the
    network, NumPy, SciPy and the image libraries release the GIL). A problem
    with a scan is its outcome's error, never an exception.

    A scan's outputs appear together, its stats file last: a scan whose stats
    file is missing is unfinished and predicted again. Without `force`, a scan
    whose outputs are all there, by the same model (its runs, checkpoint steps,
    TTA), is `done_earlier` and left alone; outputs of another model fail the
    scan rather than be mixed with this one's. The caller holds `out_dir`'s lock.

    `output_type`: the label map as NIfTI (`<name>_seg.nii.gz`), or as a DICOM
    Segmentation object referencing its source series (`<name>_seg.dcm`, `dicom-seg`:
    DICOM inputs only, `ctseg.io.dicom_seg`).
    """
    if output_type not in OUTPUT_TYPES:
        raise CtsegError(f"unknown output type {output_type!r}; choose {' or '.join(OUTPUT_TYPES)}")
    out_dir = Path(out_dir)
    model = _model_of(predictor)
    with (
        ThreadPoolExecutor(1, thread_name_prefix="ctseg-read") as reader,
        ThreadPoolExecutor(1, thread_name_prefix="ctseg-write") as writer,
    ):
        reads = [
            reader.submit(_read, predictor, Path(s), out_dir, force, model, output_type)
            for s in sources[:1]
        ]
        written: Future | None = None
        for index in range(len(sources)):
            outcome, prepared = reads[index].result()
            if index + 1 < len(sources):
                source = Path(sources[index + 1])
                reads.append(
                    reader.submit(_read, predictor, source, out_dir, force, model, output_type)
                )
            reads[index] = None  # done with: `prepared` holds what is left of it
            probabilities = None
            if prepared is not None:
                probabilities = _guarded(
                    outcome,
                    predictor.infer,
                    prepared.on_grids,
                    outcome.seconds,
                    _stage_progress(progress, outcome.name),
                    outcome.warnings,
                )
                prepared.free_units()  # the boxes are freed once inferred
            if written is not None:
                yield written.result()
            written = writer.submit(
                _write, predictor, outcome, prepared, probabilities, out_dir, model, output_type
            )
        if written is not None:
            yield written.result()


def _stage_progress(progress: FileProgress | None, name: str) -> StageProgress | None:
    if progress is None:
        return None
    return lambda stage, done, total: progress(name, stage, done, total)


def _guarded(outcome: ScanOutcome, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None with the scan's one-line error on `outcome`."""
    try:
        return fn(*args)
    except CtsegError as exc:
        outcome.error = str(exc)
    except MemoryError:
        outcome.error = "out of memory; try a smaller --tile"
    except Exception as exc:  # an accelerator's out-of-memory fails the scan, not the batch
        if not is_out_of_memory(exc):
            raise
        outcome.error = "the accelerator ran out of memory; try a smaller --tile"
    return None


def _model_of(predictor: Predictor) -> dict[str, Any]:
    """What makes two predictions of a scan the same, as its stats file records it: the
    (first) run and checkpoint step, TTA, and an ensemble's members (None for one run)."""
    members = [
        {
            "run_dir": None if m.run_dir is None else str(Path(m.run_dir).resolve()),
            "run_step": m.model.step,
        }
        for m in predictor.members
    ]
    return {**members[0], "tta": predictor.tta, "ensemble": members if len(members) > 1 else None}


def _earlier_prediction(stats_path: Path, model: dict[str, Any]) -> dict[str, Any]:
    """The stats of an earlier prediction of a scan by this `model`; CtsegError for another's."""
    try:
        earlier = json.loads(stats_path.read_text())
    except (OSError, ValueError):
        earlier = None
    if not isinstance(earlier, dict):
        what = "cannot be read as the stats of an earlier prediction"
    elif any(earlier.get(key) != model[key] for key in model):
        what = (
            f"is of another prediction (run {earlier.get('run_dir') or '?'}, step "
            f"{earlier.get('run_step')}{', TTA' if earlier.get('tta') else ''})"
        )
    else:
        return earlier
    raise CtsegError(
        f"{stats_path.name} in {stats_path.parent} {what}; use --force to replace it, "
        "or another --out"
    )


def _read(
    predictor: Predictor,
    source: Path,
    out_dir: Path,
    force: bool,
    model: dict[str, Any],
    output_type: str,
) -> tuple[ScanOutcome, Prepared | None]:
    outcome = ScanOutcome(source, scan_name(source))

    def read() -> Prepared | None:
        with_probabilities = predictor.config.predict.save_probabilities
        paths = output_paths(out_dir, outcome.name, with_probabilities, output_type)
        # Without its stats file a scan is unfinished (see `_write_outputs`): predicted again.
        if paths["stats"].exists() and not force:
            earlier = _earlier_prediction(paths["stats"], model)
            if all(path.exists() for path in paths.values()):
                outcome.done_earlier = True
                outcome.stats, outcome.outputs = earlier, list(paths.values())
                return None
        with timed(outcome.seconds, "read"):
            scan = read_scan(source)
        return Prepared(scan, predictor.to_grid(scan, outcome.seconds))

    return outcome, _guarded(outcome, read)


def _write(
    predictor: Predictor,
    outcome: ScanOutcome,
    prepared: Prepared | None,
    probabilities: np.ndarray | None,
    out_dir: Path,
    model: dict[str, Any],
    output_type: str,
) -> ScanOutcome:
    if prepared is not None and probabilities is not None:
        _guarded(
            outcome,
            _write_outputs,
            predictor,
            outcome,
            prepared,
            probabilities,
            out_dir,
            model,
            output_type,
        )
    return outcome


def _write_outputs(
    predictor: Predictor,
    outcome: ScanOutcome,
    prepared: Prepared,
    probabilities: np.ndarray,
    out_dir: Path,
    model: dict[str, Any],
    output_type: str,
) -> None:
    scan, seconds = prepared.scan, outcome.seconds
    with_probabilities = predictor.config.predict.save_probabilities
    prediction = predictor.to_scan(
        scan, probabilities, prepared.on_grids, seconds, with_probabilities
    )
    del probabilities
    with timed(seconds, "postprocess"):
        stats = postprocess.scan_stats(prediction.labels, scan.affine)
    outcome.warnings += prediction.warnings + volume_warnings(stats)
    outcome.checks += prediction.checks
    paths = output_paths(out_dir, outcome.name, with_probabilities, output_type)
    # Every output under a temporary name, then renamed with the stats file last: a kill
    # half-way leaves no stats file, so the next run predicts the scan again.
    order = [key for key in paths if key != "stats"] + ["stats"]
    with atomic.atomic_group([paths[key] for key in order]) as temporaries:
        tmp = dict(zip(order, temporaries, strict=True))
        with timed(seconds, "write"):
            if output_type == "dicom-seg":
                dicom_seg.write_dicom_seg(scan, prediction.labels, tmp["seg"])
            else:
                write_labels(scan, prediction.labels, tmp["seg"])
            if prediction.probabilities is not None:
                write_volume(scan, prediction.probabilities, tmp["probs"], np.float32)
            pictures.plot_preview(
                scan.array,
                prediction.labels,
                scan.spacing,
                tmp["preview"],
                title=outcome.name,
                window=predictor.config.data.hu_window,
            )
        # The call's one-off costs (loading, compiling ahead) beside this scan's own phases.
        with_one_off_costs = {
            phase: round(predictor.seconds.get(phase, 0.0) + seconds.get(phase, 0.0), 3)
            for phase in PHASES
        }
        record = {
            "scan": str(outcome.source),
            **model,
            "device": predictor.summary,
            "plan": predictor.plan,
            "shape": list(scan.original_shape),
            "spacing_mm": list(scan.spacing),
            **stats,
            "warnings": outcome.warnings,
            "checks": outcome.checks,  # where it lies far outside the training data
            "seconds": with_one_off_costs,
            # An ensemble's members' network seconds, in the order of "ensemble".
            "member_seconds": [
                round(seconds.get(f"infer.{i}", 0.0), 3) for i in range(len(predictor.members))
            ]
            if len(predictor.members) > 1
            else None,
            # Programs this call compiled so far, and how many came from the persistent cache.
            "compiled": {
                "programs": predictor.clock.programs,
                "from_cache": predictor.clock.cache_hits,
            },
        }
        tmp["stats"].write_text(json.dumps(record, indent=2) + "\n")
    outcome.stats = stats
    outcome.outputs = list(paths.values())
