"""What an evaluation returns and writes (summary.json): its report, as types.

Every evaluation's report is a `Report`: its cases (each a `CaseRecord`, as
metrics.csv's rows and summary.json's "cases" hold it), their `Summary`, the cases that
failed (each a `FailedCase`) and, for ``--pred/--ref``, the files left unpaired. A run's
or an ensemble's evaluation adds its `RunHead` (`RunReport`), a cross-validation its
`CrossValidationHead` and one `FoldEntry` per fold run (`CrossValidationReport`).
`to_json` gives summary.json's content, key for key, in its order.

Plain Python: no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ctseg.evaluation import calibration as quality_power
from ctseg.evaluation import metrics

Json = dict[str, Any]
GRID_DICE_KEYS = ("liver", "tumour")


@dataclass(frozen=True)
class CaseRecord:
    """One case's record: its metrics (`metrics.case_metrics`: the "liver", "tumour",
    "detection" and "burden" tables), and where known the prediction's quality (as
    `ctseg predict` judged it), with a locator where it was predicted (`located`), and a
    run's evaluation's Dice on the training grid (`grid_dice`: liver, tumour)."""

    case: str
    metrics: Json
    quality: Json | None = None
    located: Json | None = None
    grid_dice: Json | None = None

    def to_json(self) -> Json:
        """The case as summary.json's "cases" hold it, key for key, in its order."""
        record: Json = {"case": self.case, **self.metrics}
        for key in ("located", "quality", "grid_dice"):
            if (value := getattr(self, key)) is not None:
                record[key] = value
        return record


@dataclass(frozen=True)
class FailedCase:
    """A case that could not be scored, and why, in one line."""

    case: str
    message: str

    def to_json(self) -> Json:
        return {"case": self.case, "message": self.message}


@dataclass(frozen=True)
class LocatedCounts:
    """With a locator: how many cases were predicted on its region, how many whole."""

    region: int
    whole_scan: int

    def to_json(self) -> Json:
        return {"region": self.region, "whole_scan": self.whole_scan}


@dataclass(frozen=True)
class Summary:
    """The cases' summary: `metrics.summarize` (`liver`, `tumour`: metric name → mean),
    with a run's evaluation the mean grid Dice (`grid_dice`: liver, tumour) and, with a
    locator, `located`; the prediction quality's power (`quality`) where cases carry one."""

    n_cases: int
    liver: Json
    tumour: Json
    grid_dice: Json | None = None  # None: a --pred/--ref report, which has none
    located: LocatedCounts | None = None
    quality: Json | None = None

    @classmethod
    def of(cls, records: Sequence[CaseRecord], grid_dice: bool = True) -> Summary:
        """The summary of case records (`grid_dice`: a run's, whose records carry one)."""
        written = [record.to_json() for record in records]
        summary = metrics.summarize(written)
        grid = None
        if grid_dice:
            grid = {
                key: metrics.mean_defined([(r.grid_dice or {}).get(key) for r in records])
                for key in GRID_DICE_KEYS
            }
        located = [r.located for r in records if r.located is not None]
        counts = None
        if located:
            regions = sum(entry["region"] is not None for entry in located)
            counts = LocatedCounts(regions, len(located) - regions)
        power = quality_power.summarize(written)
        return cls(summary["n_cases"], summary["liver"], summary["tumour"], grid, counts, power)

    def to_json(self) -> Json:
        summary: Json = {"n_cases": self.n_cases, "liver": self.liver, "tumour": self.tumour}
        if self.grid_dice is not None:
            summary["grid_dice"] = self.grid_dice
        if self.located is not None:
            summary["located"] = self.located.to_json()
        if self.quality is not None:
            summary["quality"] = self.quality
        return summary


@dataclass(frozen=True)
class Unpaired:
    """``--pred/--ref``: the file names left without a partner in each folder."""

    pred: list[str] = field(default_factory=list)
    ref: list[str] = field(default_factory=list)

    def to_json(self) -> Json:
        return {"pred": self.pred, "ref": self.ref}


@dataclass(frozen=True)
class Report:
    """An evaluation's cases, their summary, the failed cases and the unpaired files
    (empty but for ``--pred/--ref``)."""

    cases: list[CaseRecord]
    summary: Summary
    errors: list[FailedCase]
    unpaired: Unpaired = field(default_factory=Unpaired)

    def head(self) -> Json:
        """What the report says before its cases (nothing; a run's: "run", …)."""
        return {}

    def to_json(self) -> Json:
        """summary.json's content."""
        return {
            **self.head(),
            "cases": [case.to_json() for case in self.cases],
            "summary": self.summary.to_json(),
            "errors": [error.to_json() for error in self.errors],
            "unpaired": self.unpaired.to_json(),
        }


@dataclass(frozen=True)
class HowPredicted:
    """How a model predicted: tiles, backend, TTA and devices (in words)."""

    tiling: str
    backend: str
    tta: bool
    device: str

    def to_json(self) -> Json:
        return {
            "tiling": self.tiling,
            "backend": self.backend,
            "tta": self.tta,
            "device": self.device,
        }


@dataclass(frozen=True)
class Checkpoint:
    """A run and the checkpoint step its model was loaded from (an ensemble's member)."""

    run_dir: str
    checkpoint_step: int

    def to_json(self) -> Json:
        return {"run_dir": self.run_dir, "checkpoint_step": self.checkpoint_step}


@dataclass(frozen=True)
class Locator:
    """``--locate``: the coarse run, its checkpoint step and the margin around its liver."""

    run_dir: str
    checkpoint_step: int
    margin_mm: float

    def to_json(self) -> Json:
        return {
            "run_dir": self.run_dir,
            "checkpoint_step": self.checkpoint_step,
            "margin_mm": self.margin_mm,
        }


@dataclass(frozen=True)
class RunHead:
    """What a run's (or an ensemble's) evaluation predicted with, and on what: the first
    run and its checkpoint step, the store, split and fold (None: the store's own split),
    the engine, the locator if any, and an ensemble's members."""

    run_dir: str
    checkpoint_step: int
    data: str
    split: str
    fold: int | None
    engine: HowPredicted
    locate: Locator | None = None
    ensemble: tuple[Checkpoint, ...] | None = None

    def to_json(self) -> Json:
        run: Json = {
            "run_dir": self.run_dir,
            "checkpoint_step": self.checkpoint_step,
            "data": self.data,
            "split": self.split,
            "fold": self.fold,
            **self.engine.to_json(),
        }
        if self.locate is not None:
            run["locate"] = self.locate.to_json()
        if self.ensemble is not None:
            run["ensemble"] = [member.to_json() for member in self.ensemble]
        return run


@dataclass(frozen=True, kw_only=True)
class RunReport(Report):
    """`ctseg evaluate RUN_DIR…`'s report: "run" (`RunHead`), then the cases."""

    run: RunHead

    def head(self) -> Json:
        return {"run": self.run.to_json()}


@dataclass(frozen=True)
class CrossValidationHead:
    """A cross-validation's store (its folds and their seed) and how its runs predicted
    (the first fold run's engine)."""

    data: str
    folds: int
    fold_seed: int
    engine: HowPredicted

    def to_json(self) -> Json:
        return {
            "data": self.data,
            "folds": self.folds,
            "fold_seed": self.fold_seed,
            **self.engine.to_json(),
        }


@dataclass(frozen=True)
class FoldEntry:
    """One fold run of a cross-validation: its checkpoint step, its fold's cases and their
    summary."""

    run_dir: str
    fold: int
    checkpoint_step: int
    cases: list[str]
    summary: Summary

    def to_json(self) -> Json:
        return {
            "run_dir": self.run_dir,
            "fold": self.fold,
            "checkpoint_step": self.checkpoint_step,
            "cases": self.cases,
            "summary": self.summary.to_json(),
        }


@dataclass(frozen=True, kw_only=True)
class CrossValidationReport(Report):
    """``ctseg evaluate --cross-validation``'s report: "cross_validation", "runs" (one
    `FoldEntry` per fold), then the cases of every fold."""

    cross_validation: CrossValidationHead
    runs: tuple[FoldEntry, ...]

    def head(self) -> Json:
        return {
            "cross_validation": self.cross_validation.to_json(),
            "runs": [entry.to_json() for entry in self.runs],
        }
