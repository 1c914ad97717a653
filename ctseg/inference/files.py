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

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctseg import atomic
from ctseg.errors import CtsegError
from ctseg.inference import postprocess
from ctseg.inference.inputs import ScanOutcome, output_paths
from ctseg.inference.jax_backend import is_out_of_memory
from ctseg.inference.member import OnGrid
from ctseg.inference.predictor import PHASES, Predictor, StageProgress, timed
from ctseg.inference.scan_checks import volume_warnings
from ctseg.io import dicom_seg, pictures
from ctseg.io.readers import one_line
from ctseg.io.scans import (
    Scan,
    read_scan,
    scan_name,
    write_labels,
    write_volume,
)

FileProgress = Callable[[str, str, int, int], None]  # (scan name, stage, done, total)
OUTPUT_TYPES = ("nifti", "dicom-seg")


@dataclass
class Prepared:
    """A scan read and brought to each member's grid, ready for the network."""

    scan: Scan
    on_grids: list[OnGrid]

    def free_units(self) -> None:
        """Drop the boxes (inferred by now), keeping where each grid lies in its box."""
        self.on_grids = [dataclasses.replace(g, unit=None) for g in self.on_grids]


def predict_files(
    predictor: Predictor,
    sources: Sequence[Path],
    out_dir: Path,
    force: bool = False,
    progress: FileProgress | None = None,
    output_type: str = "nifti",
    allow_non_ct: bool = False,
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
    DICOM inputs only, `ctseg.io.dicom_seg`). `allow_non_ct`: segment DICOM series of
    another modality than CT too (refused otherwise, `ctseg.io.dicom`).
    """
    if output_type not in OUTPUT_TYPES:
        raise CtsegError(f"unknown output type {output_type!r}; choose {' or '.join(OUTPUT_TYPES)}")
    out_dir = Path(out_dir)
    model = _model_of(predictor)
    read = functools.partial(_read, predictor)
    with (
        ThreadPoolExecutor(1, thread_name_prefix="ctseg-read") as reader,
        ThreadPoolExecutor(1, thread_name_prefix="ctseg-write") as writer,
    ):
        reads = [
            reader.submit(read, Path(s), out_dir, force, model, output_type, allow_non_ct)
            for s in sources[:1]
        ]
        written: Future | None = None
        for index in range(len(sources)):
            outcome, prepared = reads[index].result()
            if index + 1 < len(sources):
                source = Path(sources[index + 1])
                reads.append(
                    reader.submit(read, source, out_dir, force, model, output_type, allow_non_ct)
                )
            reads[index] = None  # done with: `prepared` holds what is left of it
            probabilities = None
            if prepared is not None:
                probabilities = _guarded(
                    outcome,
                    _INFERENCE,
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


# What `_guarded` was doing when a scan failed, said in its error; only the network's
# inference is tiled, so only there does a smaller --tile help against running out of memory.
_READING, _INFERENCE, _WRITING = "reading", "inference", "post-processing and writing"


def _guarded(outcome: ScanOutcome, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None with the scan's one-line error on `outcome`: whatever `fn`
    raises (a library's bug on a strange file too) fails this scan, never the batch."""
    try:
        return fn(*args)
    except CtsegError as exc:
        outcome.error = str(exc)
    except Exception as exc:
        out_of_memory = isinstance(exc, MemoryError) or is_out_of_memory(exc)
        if out_of_memory and doing == _INFERENCE:
            outcome.error = f"{doing} ran out of memory; try a smaller --tile"
        elif out_of_memory:
            outcome.error = f"{doing} ran out of memory ({type(exc).__name__})"
        else:
            cause = one_line(exc) if str(exc).strip() else "no message"
            outcome.error = f"{doing} failed on {outcome.source}: {type(exc).__name__}: {cause}"
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
    allow_non_ct: bool,
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
            scan = read_scan(source, allow_non_ct)
        return Prepared(scan, predictor.to_grid(scan, outcome.seconds))

    return outcome, _guarded(outcome, _READING, read)


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
            _WRITING,
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
            # The region predicted at full resolution (`--locate`, `--roi`): its source,
            # margin, scan voxels [lo, hi), or why the whole scan was predicted.
            "located": prediction.located,
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
