"""Evaluations that predict with trained runs: a run (or an ensemble of runs) on a
store's split, case by case (`ctseg.evaluation.skeleton`, which
`ctseg.evaluation.cross_validation` shares).

`evaluate_run` (``ctseg evaluate RUN_DIR… --data PREP``) predicts every labelled case
of a store's split from its original scan, with one run's model or the mean of
several runs' (an ensemble), and scores it against the original label file (LiTS
style, in the original geometry), plus, for one run, the grid-level Dice that
training reports. With a locator run (``--locate COARSE_RUN``) every case is predicted
as ``ctseg predict --locate`` predicts it (`Predictor.predict_region`): at full
resolution on the located liver's box plus a margin, or the whole scan where the locator
finds no liver or a cut one; each case's record says which. A run of a cross-validation
fold (``ctseg train --fold``) sees the store as it trained on it: its "val" split is its
fold.
Cases go through `ctseg.evaluation.scoring.score_cases`, and the reports are written
as `ctseg evaluate --pred/--ref` writes them (`ctseg.evaluation.reports.RunReport`).
The evaluation folder's record, and how its earlier evaluation is replaced, are
`ctseg.run.evaluations`'s.

The prediction pipeline starts JAX: it is imported when an evaluation runs, so that
the CLI can choose the devices first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ctseg.config import Config, InferenceOptions
from ctseg.data.manifest import SPLITS
from ctseg.data.store import CaseEntry, Store
from ctseg.errors import CtsegError, OptionError
from ctseg.evaluation.reports import Checkpoint, Json, Locator, RunHead, RunReport, Summary
from ctseg.evaluation.skeleton import Part, Scored, check_request, evaluate
from ctseg.progress import Progress
from ctseg.run import evaluations, rundir

if TYPE_CHECKING:
    from ctseg.inference.network.backends import Backend
    from ctseg.inference.predictor import Predictor


def _labelled_cases(store: Store, split: str) -> list[CaseEntry]:
    """The split's labelled cases; CtsegError when there are none."""
    try:
        cases = store.split(split)
    except ValueError as exc:
        raise CtsegError(str(exc)) from None
    cases = [case for case in cases if case.labelled]
    if not cases:
        raise CtsegError(f"the store at {store.path} has no labelled cases in the {split!r} split")
    return cases


def evaluate_run(
    run_dirs: Path | Sequence[Path],
    data_dir: Path,
    split: str = "val",
    out_dir: Path | None = None,
    options: InferenceOptions | None = None,
    configs: Config | Sequence[Config] | None = None,
    locate: Path | None = None,
    margin_mm: float | None = None,
    progress: Progress | None = None,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
    backend: Backend | None = None,
) -> RunReport:
    """Predict a store's split with a run (or an ensemble of runs) and score it; writes
    summary.json and metrics.csv.

    `options`: checkpoint, tiles and TTA (`ctseg.inference.predictor.Predictor`), and the
    backend and device asked for; `configs`: the runs' config.toml if already read;
    `backend`: where the network runs, as the command chose it when it started JAX (default:
    started as the API starts it, `choice.start_backend`, from `options`). `locate`: a
    coarse run that finds the liver first, with `margin_mm` around it (default
    `predictor.DEFAULT_MARGIN_MM`, as `ctseg predict`): `Predictor.predict_region`. Each
    case's record then holds the predictor's `located` (its region, or why the whole scan
    was predicted instead), the report's "run" the locator and margin, and the summary
    how many cases used a region.
    `out_dir` (default RUN_DIR/eval; an ensemble's must be given) holds one evaluation:
    evaluated.json records its runs, checkpoints, store and split (not the locator: as
    TTA or the backend, it is how the run predicted, and the report records it). Another
    one is replaced only with `force`, and only once every case of this one is scored
    (a failure or a stop half-way leaves it whole), so that predictions are never mixed
    and never lost to a failed run. The folder's lock is held throughout
    (`ctseg.lock`; `warn` hears of a dead holder's).

    Metrics compare the post-processed prediction, mapped back to the case's
    original scan, with its original label file (the LiTS way); each case of a lone
    run also gets the Dice of the raw prediction on the grid against the store's label
    (`grid_dice`, what training validates with; an ensemble's members have grids of
    their own, so it has none). Returns the report (`RunReport`; `to_json`: summary.json).
    """
    run_dirs = [Path(run_dirs)] if isinstance(run_dirs, str | Path) else list(map(Path, run_dirs))
    check_request(run_dirs, out_dir, locate, margin_mm)  # before anything is claimed
    data_dir = Path(data_dir)
    if len(run_dirs) > 1:
        store, fold = Store.open(data_dir), None
        _check_unseen(store, run_dirs, split)
    else:
        store, fold = _as_the_run_saw_it(Store.open(data_dir), run_dirs[0], split)
    evaluation = _RunEvaluation(
        run_dirs,
        data_dir,
        split,
        store,
        fold,
        _labelled_cases(store, split),
        options,
        configs,
        None if locate is None else Path(locate),
        margin_mm,
        backend,
    )
    out_dir = evaluations.evaluation_dir(run_dirs[0], out_dir)
    return evaluate(evaluation, out_dir, force, progress, warn)


@dataclass
class _RunEvaluation:
    """A run's or an ensemble's evaluation: one part, the split's cases, predicted by
    the runs' model (loaded, with its locator, when the folder is first recorded)."""

    run_dirs: list[Path]
    data_dir: Path
    split: str
    store: Store
    fold: int | None
    cases: list[CaseEntry]
    options: InferenceOptions | None
    configs: Config | Sequence[Config] | None
    locate: Path | None
    margin_mm: float | None
    backend: Backend | None
    predictor: Predictor | None = field(default=None, init=False)

    def loaded(self) -> Predictor:
        """The runs' model (and locator), loaded once."""
        # Imported here: the prediction pipeline starts JAX, which must not start before the
        # CLI has chosen the devices.
        from ctseg.inference.network.choice import start_backend
        from ctseg.inference.predictor import DEFAULT_MARGIN_MM, Predictor

        if self.predictor is None:
            backend = self.backend or start_backend(self.options or InferenceOptions())
            predictor = Predictor.from_run(self.run_dirs, backend, self.options, self.configs)
            if self.locate is not None:  # exactly as `ctseg predict --locate` (its checkpoint too)
                margin = DEFAULT_MARGIN_MM if self.margin_mm is None else float(self.margin_mm)
                predictor.predict_region(self.locate, None, margin, self.options)
            if len(self.run_dirs) == 1:  # the grid Dice compares with the store's boxes
                self.store.check_grid(predictor.config.data)
            self.predictor = predictor
        return self.predictor

    @property
    def parts(self) -> list[Part]:
        return [Part(self.loaded, self.store, self.cases)]

    def _locator(self) -> Locator | None:
        predictor = self.loaded()
        if predictor.locator is None:
            return None
        return Locator(str(self.locate), predictor.locator.model.step, predictor.margin_mm)

    def record(self, scored: Sequence[Scored] | None) -> Json:
        steps = [member.model.step for member in self.loaded().members]
        locator = self._locator()
        located = None if locator is None else locator.to_json()
        return evaluations.evaluation_record(
            self.run_dirs, steps, self.data_dir, self.split, located
        )

    def report(self, scored: Sequence[Scored]) -> RunReport:
        (part,) = scored
        ensemble = None
        if len(self.run_dirs) > 1:
            ensemble = tuple(
                Checkpoint(str(r), s) for r, s in zip(self.run_dirs, part.steps, strict=True)
            )
        head = RunHead(
            str(self.run_dirs[0]),
            part.steps[0],
            str(self.data_dir),
            self.split,
            self.fold,
            part.engine,
            self._locator(),
            ensemble,
        )
        return RunReport(part.records, Summary.of(part.records), part.errors, run=head)


def _check_unseen(store: Store, run_dirs: Sequence[Path], split: str) -> None:
    """CtsegError if a member of an ensemble trained on cases of the split it is to be
    scored on (a fold run of this store, say): its score would flatter it."""
    ids = {case.id for case in store.split(split) if case.labelled} if split in SPLITS else set()
    for run_dir in run_dirs:
        record = rundir.read_fold(run_dir)
        seen = ids & set(record["train_cases"]) if record is not None else set()
        if seen:
            raise OptionError(
                f"{run_dir} trained on {len(seen)} case(s) of the {split!r} split of "
                f"{store.path} (e.g. {sorted(seen)[0]}); score an ensemble of fold runs on "
                "scans none of them trained on, or with `cross_validation`"
            )


def _as_the_run_saw_it(store: Store, run_dir: Path, split: str) -> tuple[Store, int | None]:
    """`store` as the run split it, and the run's fold (None: the store's own split).

    A fold run (RUN_DIR/fold.json) evaluated on its train or val split of a store that
    holds cases it trained on sees the store's fold view, so that "val" is the fold it
    did not train on; that fold must still be the one it trained on. On another store
    (an external data set sharing none of its cases) the store's own split applies.
    """
    record = rundir.read_fold(run_dir)
    if record is None or split == "test":
        return store, None
    trained_on = set(record["train_cases"]) | set(record["val_cases"])
    if not trained_on & {case.id for case in store.cases if case.labelled}:
        return store, None
    difference = rundir.fold_difference(record, store)
    if difference is not None:
        raise CtsegError(
            f"{run_dir} {difference}; its {split!r} split cannot be told apart from the cases "
            "it trained on"
        )
    return store.for_fold(record["fold"]), record["fold"]
