"""The one skeleton of the evaluations that predict with trained runs (a run, an
ensemble, a cross-validation), and the checks of what they are asked.

`evaluate` holds the evaluation folder's lock throughout, claims the folder, predicts
and scores every case (`score_parts`, through `ctseg.evaluation.scoring.score_cases`),
and only then replaces the folder's earlier evaluation, recording what it evaluated
(evaluated.json, `ctseg.run.evaluations`), and writes the report (summary.json,
metrics.csv). An `Evaluation` supplies only what differs: which models predict which
cases (its `Part`s, each loaded when its turn comes), its record, and its report's head.
`check_request` is the one check of the options every form shares, in the caller's words
(`names`: the library's parameters, or the CLI's flags), and of the runs' own records
(their thresholds and fingerprints), before anything starts.

The prediction pipeline starts JAX: `ctseg.inference.predictor` is imported only by
what an `Evaluation` loads, so that the CLI can choose the devices first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from ctseg import atomic, labels, lock
from ctseg.data.manifest import PREPARE_AGAIN
from ctseg.data.store import CaseEntry, Store
from ctseg.errors import CtsegError, OptionError
from ctseg.evaluation.reports import CaseRecord, FailedCase, HowPredicted, Json, Report
from ctseg.evaluation.scoring import evaluate_arrays, score_cases, write_reports
from ctseg.inference.pipeline import Ready, pipelined
from ctseg.inference.quality.thresholds import read_thresholds
from ctseg.inference.scan.region import check_margin
from ctseg.io import scans
from ctseg.io.orientation import voxels_difference
from ctseg.io.scans import Scan
from ctseg.progress import Progress
from ctseg.run import evaluations, fingerprint, rundir

if TYPE_CHECKING:
    from ctseg.inference.predictor import Prediction, Predictor

R = TypeVar("R", bound=Report, covariant=True)


def check_request(
    run_dirs: Sequence[Path],
    out_dir: Path | None = None,
    locate: Path | None = None,
    margin_mm: float | None = None,
    cross_validation: bool = False,
) -> None:
    """OptionError, one line, before anything is claimed, loaded or started, unless the
    request can be evaluated: a margin only with a locator, finite and not negative; a
    locator that is a run; an ensemble's or a cross-validation's `out_dir` given (they
    belong to no one run); runs whose records can be read (`check_records`). Options are
    named as the API spells them (the command line says its flags)."""
    check_margin(margin_mm, locate is not None)
    if locate is not None:
        try:
            rundir.load_config(Path(locate))
        except CtsegError as exc:
            raise OptionError(f"`locate`: {exc}") from None
    if out_dir is None and cross_validation:
        raise OptionError(
            "`cross_validation` writes its predictions and reports into `out_dir`: give one"
        )
    if out_dir is None and len(run_dirs) > 1:
        raise OptionError(
            "an ensemble of several runs writes its predictions and reports into `out_dir`: "
            "give one"
        )
    check_records(run_dirs, cross_validation)


def check_records(run_dirs: Sequence[Path], cross_validation: bool = False) -> None:
    """CtsegError (one line naming the file and the key) where a record the evaluation will
    read of its runs cannot be read (`ctseg.reading`): the quality thresholds and the
    fingerprint of each model's first run — every fold run's, in a cross-validation."""
    leaders = list(run_dirs) if cross_validation else list(run_dirs[:1])
    for run_dir in leaders:
        read_thresholds(Path(run_dir), ensemble=len(run_dirs) > 1 and not cross_validation)
        fingerprint.load(Path(run_dir))


@dataclass(frozen=True)
class Part:
    """Cases that one model (a run's, or an ensemble's mean) predicts: `load` makes its
    predictor when its turn comes (one model at a time on the devices); `store` as that
    model saw it (a fold run's: its fold view)."""

    load: Callable[[], Predictor]
    store: Store
    cases: Sequence[CaseEntry]


@dataclass(frozen=True)
class Scored:
    """A part's cases scored: their records and failures, each member's checkpoint step,
    and how its model predicted."""

    part: Part
    records: list[CaseRecord]
    errors: list[FailedCase]
    steps: tuple[int, ...]
    engine: HowPredicted


class Evaluation(Protocol[R]):
    """What differs between evaluations: which models predict which cases, what the
    folder records, and the report's head."""

    @property
    def parts(self) -> Sequence[Part]: ...

    def record(self, scored: Sequence[Scored] | None) -> Json:
        """evaluated.json: before scoring (`scored` None; it may load the model), then
        of the checkpoints the scored parts used."""
        ...

    def report(self, scored: Sequence[Scored]) -> R: ...


def evaluate(
    evaluation: Evaluation[R],
    out_dir: Path,
    force: bool = False,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> R:
    """Run `evaluation` into `out_dir`, under its lock (`ctseg.lock`; `warn` hears of a
    dead holder's): claim the folder, record what it evaluates (another evaluation's
    folder is replaced only with `force`, `evaluations.claim`), score every part's cases,
    say which checkpoints were used where one could not be read, write the report. The
    predictions are written out of sight until every case is scored; only then is the
    folder's earlier evaluation replaced (`evaluations.commit`): one that fails or is
    stopped half-way leaves it whole."""
    with lock.hold(out_dir, warn):
        atomic.claim_folder(out_dir, evaluations.OWN_FILES, force=None)
        staged = evaluations.claim(out_dir, evaluation.record(None), force)
        try:
            scored = score_parts(evaluation.parts, staged, progress)
            report = evaluation.report(scored)
        except BaseException:  # stopped or failed: the earlier evaluation stays as it was
            evaluations.discard(staged)
            raise
        # The checkpoints used (where one could not be read, another was), recorded as the
        # earlier evaluation is replaced: only now, with every result ready.
        evaluations.commit(out_dir, evaluation.record(scored), staged)
        write_reports(report, out_dir / evaluations.SUMMARY, out_dir / "metrics.csv")
        return report


def score_parts(
    parts: Sequence[Part], predictions: Path, progress: Progress | None = None
) -> list[Scored]:
    """Each part's model loaded in turn, its cases predicted (into the folder
    `predictions`) and scored; `progress` counts the cases of every part."""
    total, done, scored = sum(len(part.cases) for part in parts), 0, []
    for part in parts:
        predictor = part.load()

        def counted(i: int, _: int, name: str, done: int = done) -> None:
            if progress is not None:
                progress(done + i, total, name)

        records, errors = score_run(predictor, part.store, part.cases, predictions, counted)
        steps = tuple(member.model.step for member in predictor.members)
        scored.append(Scored(part, records, errors, steps, how_predicted(predictor)))
        done += len(part.cases)
        del predictor  # one model at a time on the devices
    return scored


def how_predicted(predictor: Predictor) -> HowPredicted:
    """How a model predicted: tiles, backend, TTA and devices."""
    return HowPredicted(predictor.plan, predictor.backend.name, predictor.tta, predictor.summary)


def score_run(
    predictor: Predictor,
    store: Store,
    cases: Sequence[CaseEntry],
    predictions: Path,
    progress: Progress | None,
) -> tuple[list[CaseRecord], list[FailedCase]]:
    """Predict and score `cases` with one model through the scan pipeline
    (`ctseg.inference.pipeline`): a case's scan and reference read and brought to the grid
    while the case before it predicts, scored while the case after it predicts; a case's
    `CtsegError` fails that case alone (`score_cases`)."""
    # The cases' extents, from the store's manifest: where the backend holds scans in
    # canvases, nothing compiles after the first case's programs.
    predictor.expect(
        scans.canonical_geometry(case.original_shape, case.original_affine) for case in cases
    )
    results = pipelined(cases, _CaseStages(predictor, store, predictions))

    def score(case: CaseEntry) -> CaseRecord:
        result = next(results)
        if isinstance(result, CtsegError):
            raise result
        return result

    return score_cases(cases, lambda case: case.id, score, progress)


@dataclass
class _CaseStages:
    """An evaluation's stages of the scan pipeline: a case's scan and reference read, the
    network, the prediction written and scored; a case's `CtsegError` is its result."""

    predictor: Predictor
    store: Store
    predictions: Path
    # Each case's reference labels, or the error that failed it, from its read to its result.
    carried: dict[str, Scan | CtsegError] = field(default_factory=dict)

    def read(self, case: CaseEntry) -> Ready | None:
        try:
            scan, self.carried[case.id] = read_case(case)
            return Ready(scan, self.predictor.to_grid(scan, {}))
        except CtsegError as exc:
            self.carried[case.id] = exc
            return None

    def infer(self, case: CaseEntry, ready: Ready) -> Any:
        try:
            return self.predictor.infer(ready.on_grids, {})
        except CtsegError as exc:
            self.carried[case.id] = exc
            return None

    def finish(
        self, case: CaseEntry, ready: Ready | None, probabilities: Any
    ) -> CaseRecord | CtsegError:
        reference = self.carried.pop(case.id)
        if isinstance(reference, CtsegError):
            return reference
        assert ready is not None
        try:
            prediction = self.predictor.to_scan(ready.scan, probabilities, ready.on_grids, {})
            return evaluate_case(
                self.predictor,
                self.store,
                case,
                self.predictions,
                ready.scan,
                reference,
                prediction,
            )
        except CtsegError as exc:
            return exc


def read_case(case: CaseEntry) -> tuple[Scan, Scan]:
    """A case's original scan and reference labels, each checked against what the store was
    prepared from (a source is outside the store: used only while it is that scan)."""
    scan = scans.read_scan(case.image_source)
    if scans.geometry_difference(
        scan.original_shape, scan.original_affine, case.original_shape, case.original_affine
    ):
        raise CtsegError(
            f"{case.image_source} is not the scan case {case.id} was prepared from (its geometry "
            f"differs from the store manifest's); {PREPARE_AGAIN}"
        )
    reference = scans.read_scan(case.label_source)
    # Compared in canonical order, where the case is scored: a reference stored mirrored or
    # transposed against its scan (its affine to match) holds the scan's voxels.
    if voxels_difference(scan, reference):
        raise CtsegError(f"{case.label_source} does not have its scan's geometry")
    return scan, reference


def evaluate_case(
    predictor: Predictor,
    store: Store,
    case: CaseEntry,
    predictions: Path,
    scan: Scan,
    reference: Scan,
    prediction: Prediction,
) -> CaseRecord:
    """One case's prediction of its original scan, scored there against `reference` and on
    the grid, with the prediction's quality (as `ctseg predict` records it) beside its
    metrics; the prediction written into the folder `predictions`."""
    predicted = predictions / f"{case.id}{evaluations.PREDICTED}"
    scans.write_labels(scan, prediction.labels, predicted)
    # Canonical order is a flip/permutation of the file's, and scan.spacing is canonical: the
    # metrics equal those computed in the file's own voxel order.
    record = evaluate_arrays(case.id, prediction.labels, reference.array, scan.spacing)
    # On the grid (the run's and the store's: the same scan, the same resampling), against
    # the store's labels. An ensemble has no one grid, nor has a prediction on a region's
    # window of it.
    on_grid = prediction.grid_labels
    grid_dice = (
        {"liver": None, "tumour": None}
        if on_grid is None
        else labels.grid_dice(on_grid, np.asarray(store.label(case.id)))
    )
    return replace(
        record,
        located=prediction.located,  # a locator's region, or why the whole scan
        # What the training data says of it (the run's fingerprint and thresholds).
        quality=predictor.judge(prediction, scan).to_json(),
        grid_dice=grid_dice,
    )
