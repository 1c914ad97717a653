"""Predicting scan files into an output folder: what `ctseg predict` writes.

Named after each input::

    OUT_DIR/<name>_seg.nii.gz     labels 0/1/2 in exactly the input's geometry
    OUT_DIR/<name>_probs.nii.gz   class probabilities (only with predict.save_probabilities)
    OUT_DIR/<name>_stats.json     volumes, tumour count and size, burden; the model; timings;
                                  the prediction's quality and verdict (`quality`)
    OUT_DIR/<name>_preview.png    three slices through the liver with the labels overlaid

A scan's outputs appear together, `_stats.json` last (`atomic.atomic_group`): a scan
without its stats file is unfinished and is predicted again.

Ownership: the folder's record (`outputs_record.OwnOutputs`, `.ctseg-outputs.json`) lists
every file ctseg predict wrote there with its content (size and sha256), listed before it
appears under its name; a file of an output's name that it does not list, or whose content
is no longer what it lists (a label map corrected by hand), is someone else's and is
replaced only with `force`. An input of the call (a scan, a region mask) never, even with `force`
(`inputs.expand_inputs`, `inputs.keep_inputs`).

Sameness: each stats file records what was asked (`ctseg.inference.requests`): the model (runs,
checkpoint steps, TTA, an ensemble's members), the scan by its content, the backend's
exactness class and the region (the mask's path and content hash, or the locator run and
step, and the margin). Outputs of another request are never taken for this one's: the scan
fails naming the difference, and `force` replaces them. Outputs of this request over a scan
whose content changed since (another scan of the same name, one replaced in place) are
predicted again, the outcome saying why (`ScanOutcome.again`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctseg import atomic, memory
from ctseg.errors import CtsegError, OptionError
from ctseg.inference import requests
from ctseg.inference.inputs import ScanOutcome, output_name, output_paths
from ctseg.inference.outputs_record import OwnOutputs
from ctseg.inference.pipeline import Ready, pipelined
from ctseg.inference.predictor import (
    PHASES,
    Prediction,
    Predictor,
    timed,
)
from ctseg.inference.quality import scores
from ctseg.inference.quality.scan_checks import volume_warnings
from ctseg.inference.scan import postprocess
from ctseg.io import dicom_seg, pictures
from ctseg.io.readers import one_line
from ctseg.io.scans import (
    Scan,
    nifti_geometry,
    read_scan,
    write_labels,
    write_volume,
)
from ctseg.progress import FileProgress, StageProgress
from ctseg.reading import sha256_of

OUTPUT_TYPES = ("nifti", "dicom-seg")


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

    The scans go through the one scan pipeline (`ctseg.inference.pipeline`): the next is
    read and brought to the grid, and the last one post-processed and written, beside the
    network's pass over the current one. A problem with a scan is its outcome's error,
    never an exception.

    A scan's outputs appear together, its stats file last: a scan whose stats
    file is missing is unfinished and predicted again. Without `force`, a scan
    whose outputs are all there, for the same request (`requests.request_of`: its runs,
    checkpoint steps, TTA, the scan's content, backend class, region), is `done_earlier`
    and left alone; over a scan whose content changed, predicted again (`again` says
    why); outputs of another request fail the scan, naming the difference, rather than be
    taken for this one's, and so does a file of an output's name that ctseg did not
    write or whose content changed since (`OwnOutputs`), and a stats file that is not as
    ctseg wrote it. The caller holds `out_dir`'s lock; CtsegError, before any scan, if
    the folder's record cannot be read (without `force`).

    `output_type`: the label map as NIfTI (`<name>_seg.nii.gz`), or as a DICOM
    Segmentation object referencing its source series (`<name>_seg.dcm`, `dicom-seg`:
    DICOM inputs only, `ctseg.io.dicom_seg`). `allow_non_ct`: segment DICOM series of
    another modality than CT too (refused otherwise, `ctseg.io.dicom`).
    """
    if output_type not in OUTPUT_TYPES:
        raise OptionError(
            f"unknown `output_type` {output_type!r}; choose {' or '.join(OUTPUT_TYPES)}"
        )
    own = OwnOutputs(out_dir)
    own.check(force)
    # The batch's extents from the NIfTI headers, before its first scan: where the backend
    # holds scans in canvases, nothing compiles after the first scan's programs.
    predictor.expect(g for g in map(nifti_geometry, sources) if g is not None)
    stages = _FileStages(predictor, own, Path(out_dir), force, progress, output_type, allow_non_ct)
    yield from pipelined(list(enumerate(map(Path, sources))), stages)


@dataclass
class _FileStages:
    """`ctseg predict`'s stages of the scan pipeline: each scan's outcome beside what it
    carries through them (a scan done earlier or failed carries nothing to the network)."""

    predictor: Predictor
    own: OwnOutputs
    out_dir: Path
    force: bool
    progress: FileProgress | None
    output_type: str
    allow_non_ct: bool
    model: dict[str, Any] = field(init=False)
    outcomes: dict[int, ScanOutcome] = field(default_factory=dict, init=False)  # by index

    def __post_init__(self) -> None:
        self.model = requests.model_of(self.predictor)

    def read(self, item: tuple[int, Path]) -> Ready | None:
        index, source = item
        outcome = self.outcomes[index] = ScanOutcome(source, output_name(source))
        return _guarded(outcome, _READING, self._read, outcome)

    def infer(self, item: tuple[int, Path], ready: Ready) -> Any:
        outcome = self.outcomes[item[0]]
        progress = _stage_progress(self.progress, outcome.name)
        return _guarded(
            outcome,
            _INFERENCE,
            self.predictor.infer,
            ready.on_grids,
            outcome.seconds,
            progress,
            outcome.warnings,
        )

    def finish(
        self, item: tuple[int, Path], ready: Ready | None, probabilities: Any
    ) -> ScanOutcome:
        outcome = self.outcomes.pop(item[0])
        if ready is not None and probabilities is not None:
            _guarded(outcome, _WRITING, self._write, outcome, ready, probabilities)
        return outcome

    def _read(self, outcome: ScanOutcome) -> Ready | None:
        predictor, source, force = self.predictor, outcome.source, self.force
        with_probabilities = predictor.config.predict.save_probabilities
        paths = output_paths(self.out_dir, outcome.name, with_probabilities, self.output_type)
        outcome.request = requests.request_of(predictor, source)  # hashes the scan
        earlier = None
        # Without its stats file a scan is unfinished (see `_write`): predicted again.
        # One of ours edited by hand names its key (before its content, changed, is not ours).
        if paths["stats"].exists() and self.own.listed(paths["stats"]) and not force:
            earlier = requests.earlier_prediction(paths["stats"], self.model, outcome.request)
            outcome.again = earlier.again
        if not force and (refusal := self.own.refusal(list(paths.values()))):
            raise CtsegError(refusal)
        if earlier is not None and earlier.summary is not None:
            if all(path.exists() for path in paths.values()):
                outcome.done_earlier = True
                outcome.stats, outcome.outputs = earlier.summary, list(paths.values())
                return None
        with timed(outcome.seconds, "read"):
            scan = read_scan(source, self.allow_non_ct)
        return Ready(scan, predictor.to_grid(scan, outcome.seconds))

    def _write(self, outcome: ScanOutcome, ready: Ready, probabilities: Any) -> None:
        predictor, scan, seconds = self.predictor, ready.scan, outcome.seconds
        with_probabilities = predictor.config.predict.save_probabilities
        prediction = predictor.to_scan(
            scan, probabilities, ready.on_grids, seconds, with_probabilities
        )
        del probabilities
        with timed(seconds, "postprocess"):
            stats = postprocess.scan_stats(prediction.labels, scan.affine)
            judged = predictor.judge(prediction, scan)
        prediction.grid_probabilities = None  # freed before writing
        outcome.warnings += prediction.warnings + volume_warnings(stats)
        outcome.checks += prediction.checks
        paths = output_paths(self.out_dir, outcome.name, with_probabilities, self.output_type)
        # Every output under a temporary name, then renamed with the stats file last: a kill
        # half-way leaves no stats file, so the next run predicts the scan again.
        order = [key for key in paths if key != "stats"] + ["stats"]
        with atomic.atomic_group([paths[key] for key in order]) as temporaries:
            tmp = dict(zip(order, temporaries, strict=True))
            with timed(seconds, "write"):
                _write_images(predictor, outcome, scan, prediction, tmp, self.output_type, judged)
            record = _stats_record(predictor, outcome, scan, prediction, stats, self.model, judged)
            tmp["stats"].write_text(json.dumps(record, indent=2) + "\n")
            # Listed, with the content each will have, before it appears under its name.
            self.own.claim({paths[key]: sha256_of(tmp[key]) for key in order}, outcome.source)
        self.own.confirm([paths[key] for key in order])
        outcome.stats = {**stats, "quality": record["quality"]}  # as a done-earlier scan's
        outcome.outputs = list(paths.values())


def _stage_progress(progress: FileProgress | None, name: str) -> StageProgress | None:
    if progress is None:
        return None
    return lambda stage, done, total: progress(name, stage, done, total)


# What `_guarded` was doing when a scan failed, said in its error; only the network's
# inference is tiled, so only there do smaller tiles help against running out of memory.
_READING, _INFERENCE, _WRITING = "reading", "inference", "post-processing and writing"


def _guarded(outcome: ScanOutcome, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None with the scan's one-line error on `outcome`: whatever `fn`
    raises (a library's bug on a strange file too) fails this scan, never the batch."""
    try:
        return fn(*args)
    except CtsegError as exc:
        outcome.error = str(exc)
    except Exception as exc:
        out_of_memory = memory.out_of_memory(exc)
        if out_of_memory and doing == _INFERENCE:
            outcome.error = f"{doing} ran out of memory; try a smaller tile size"
        elif out_of_memory:
            outcome.error = f"{doing} ran out of memory ({type(exc).__name__})"
        else:
            cause = one_line(exc) if str(exc).strip() else "no message"
            outcome.error = f"{doing} failed on {outcome.source}: {type(exc).__name__}: {cause}"
    return None


def _write_images(
    predictor: Predictor,
    outcome: ScanOutcome,
    scan: Scan,
    prediction: Prediction,
    tmp: dict[str, Path],
    output_type: str,
    judged: scores.Quality,
) -> None:
    """The label map (NIfTI or DICOM SEG), the probabilities where asked, the preview."""
    if output_type == "dicom-seg":
        dicom_seg.write_dicom_seg(scan, prediction.labels, tmp["seg"], verdict=judged.verdict)
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


def _stats_record(
    predictor: Predictor,
    outcome: ScanOutcome,
    scan: Scan,
    prediction: Prediction,
    stats: dict[str, Any],
    model: dict[str, Any],
    judged: scores.Quality,
) -> dict[str, Any]:
    """The scan's `_stats.json` (docs/reference/file-formats.md)."""
    seconds = outcome.seconds
    # The call's one-off costs (loading, compiling ahead) beside this scan's own phases.
    with_one_off_costs = {
        phase: round(predictor.seconds.get(phase, 0.0) + seconds.get(phase, 0.0), 3)
        for phase in PHASES
    }
    members = len(predictor.members)
    return {
        "scan": str(outcome.source),
        **model,
        # With the model: what makes another prediction of the scan the same one.
        "request": outcome.request,
        "device": predictor.summary,
        "plan": predictor.plan,
        "shape": list(scan.original_shape),
        "spacing_mm": list(scan.spacing),
        **stats,
        "warnings": outcome.warnings,
        "checks": outcome.checks,  # where it lies far outside the training data
        # Whether to trust it: ok, review or unlike the training data, the reason, the
        # scores and their components (`ctseg.inference.quality.scores`).
        "quality": judged.to_json(),
        # The region predicted at full resolution (`--locate`, `--roi`): its source,
        # margin, scan voxels [lo, hi), or why the whole scan was predicted.
        "located": prediction.located,
        "seconds": with_one_off_costs,
        # An ensemble's members' network seconds, in the order of "ensemble".
        "member_seconds": [round(seconds.get(f"infer.{i}", 0.0), 3) for i in range(members)]
        if members > 1
        else None,
        # Programs this call compiled so far, and how many came from the persistent cache.
        "compiled": {
            "programs": predictor.clock.programs,
            "from_cache": predictor.clock.cache_hits,
        },
    }
