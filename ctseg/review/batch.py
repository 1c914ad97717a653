"""The batch a review shows: a `ctseg predict` folder's scans, or an evaluation's cases.

Read tolerantly, through small readers of ctseg's own records (`ctseg.reading.Record`):
a scan whose stats cannot be read is still a row, with the problem said, so that one bad
file never hides the rest of the batch. Nothing here writes to those records.

- A prediction folder: its record (`.ctseg-outputs.json`, `OwnOutputs`) lists every file
  `ctseg predict` wrote with the scan it was predicted from; a scan is there once its
  `<name>_stats.json` is (written last). Its verdict, reasons and numbers come from that
  stats file.
- An evaluation folder (`evaluated.json`, `summary.json`, `predictions/`): each case's
  quality and Dice from summary.json, its scan and reference from the store's manifest.

The files a case may have served (`Case.files`) are the only files the review server
sends: each a path the folder's records name, never one a request names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctseg.errors import CtsegError
from ctseg.reading import Record

OUTPUTS_RECORD = ".ctseg-outputs.json"  # `ctseg.inference.inputs.OUTPUTS_RECORD`
EVALUATED, SUMMARY, PREDICTIONS = "evaluated.json", "summary.json", "predictions"
STATS_SUFFIX = "_stats.json"

# The quality's verdicts (`ctseg.inference.quality.scores.VERDICTS`), worst first: the order of
# the page. A scan without one (an earlier ctseg's, or unreadable) comes before the ok ones.
REVIEW, UNLIKE, OK = "review", "unlike the training data", "ok"
VERDICT_ORDER = (REVIEW, UNLIKE, None, OK)

# A prediction's numbers, from its stats file (an evaluation's cases have none: None).
NUMBERS = (
    "liver_volume_ml",
    "tumour_volume_ml",
    "tumour_count",
    "largest_tumour_diameter_mm",
    "tumour_burden_percent",
)

# What a case's files are served as (`Case.files`' keys).
SEG, PREVIEW, SCAN, REFERENCE = "seg", "preview", "scan", "reference"


@dataclass(frozen=True)
class Case:
    """One row of the page: a scan's prediction, its verdict and numbers, and its files."""

    name: str
    verdict: str | None = None
    score: float | None = None
    reasons: tuple[str, ...] = ()
    numbers: dict[str, float | None] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    tumours: tuple[dict[str, Any], ...] = ()  # largest first: volume_ml, centre_mm, diameter_mm
    dice: dict[str, float | None] = field(default_factory=dict)  # an evaluation's
    files: dict[str, Path] = field(default_factory=dict)
    problems: tuple[str, ...] = ()

    def sort_key(self) -> tuple[int, float, str]:
        """Verdict (review first), then the highest score first, then the name."""
        rank = VERDICT_ORDER.index(self.verdict if self.verdict in VERDICT_ORDER else None)
        return rank, -(self.score if self.score is not None else 1.0), self.name

    def to_json(self) -> dict[str, Any]:
        """What the page shows; the files as the kinds it may ask for, never as paths."""
        return {
            "name": self.name,
            "verdict": self.verdict,
            "score": self.score,
            "reasons": list(self.reasons),
            **{key: self.numbers.get(key) for key in NUMBERS},
            "warnings": list(self.warnings),
            "tumours": list(self.tumours),
            "dice": self.dice or None,
            "files": sorted(self.files),  # the server names them (`files.served_name`)
            "problems": list(self.problems),
        }


@dataclass(frozen=True)
class Batch:
    """A folder's cases, in the order of the page."""

    folder: Path
    kind: str  # "predict" or "evaluate"
    cases: tuple[Case, ...]

    def case(self, name: str) -> Case | None:
        return next((c for c in self.cases if c.name == name), None)


def read_batch(folder: Path) -> Batch:
    """The cases of a prediction or evaluation folder; CtsegError if it is neither."""
    folder = Path(folder).absolute()
    if not folder.is_dir():
        raise CtsegError(f"{folder} is not a folder of `ctseg predict` or `ctseg evaluate`")
    if (folder / OUTPUTS_RECORD).exists():
        kind, cases = "predict", _predicted_cases(folder)
    elif (folder / EVALUATED).exists() and (folder / SUMMARY).exists():
        kind, cases = "evaluate", _evaluated_cases(folder)
    else:
        raise CtsegError(
            f"{folder} holds no predictions: neither `ctseg predict`'s record {OUTPUTS_RECORD} "
            f"nor an evaluation's {SUMMARY}"
        )
    if not cases:
        raise CtsegError(f"{folder} holds no finished predictions to review")
    return Batch(folder, kind, tuple(sorted(cases, key=Case.sort_key)))


# --- a `ctseg predict` folder ---------------------------------------------------------------


def _predicted_cases(folder: Path) -> list[Case]:
    outputs = Record.read(folder / OUTPUTS_RECORD, "predict's record").record("outputs")
    listed: dict[str, Path | None] = {}  # file name -> the scan it was predicted from
    for name, entry in outputs.value.items():
        scan = entry.get("scan") if isinstance(entry, dict) else None
        listed[name] = Path(scan) if isinstance(scan, str) and Path(scan).is_absolute() else None
    names = [n[: -len(STATS_SUFFIX)] for n in listed if n.endswith(STATS_SUFFIX)]
    # Without its stats file (written last) a scan is unfinished: not yet a prediction.
    return [
        _predicted_case(folder, name, listed)
        for name in sorted(names)
        if (folder / f"{name}{STATS_SUFFIX}").exists()
    ]


def _predicted_case(folder: Path, name: str, listed: dict[str, Path | None]) -> Case:
    files = {
        kind: folder / file
        for kind, file in ((SEG, f"{name}_seg.nii.gz"), (PREVIEW, f"{name}_preview.png"))
        if file in listed
    }
    scan = listed.get(f"{name}{STATS_SUFFIX}")
    if scan is not None:
        files[SCAN] = scan
    problems = []
    if f"{name}_seg.dcm" in listed:
        problems.append("its labels are a DICOM SEG object, which the viewer does not draw yet")
    try:
        stats = Record.read(folder / f"{name}{STATS_SUFFIX}", "stats file")
        return Case(name, **_stats_fields(stats), files=files, problems=tuple(problems))
    except (CtsegError, OSError) as exc:
        return Case(name, files=files, problems=(*problems, str(exc)))


def _stats_fields(stats: Record) -> dict[str, Any]:
    """Verdict, reasons, numbers and warnings of a `<name>_stats.json`."""
    numbers = {key: stats.number(key, optional=True) for key in NUMBERS if key != "tumour_count"}
    count = stats.integer("tumour_count", optional=True, low=0)
    numbers["tumour_count"] = None if count is None else float(count)
    warnings = tuple(stats.texts("warnings", optional=True) or ())
    return {**_quality_fields(stats.record("quality", optional=True)), "numbers": numbers,
            "warnings": warnings, "tumours": _tumours(stats)}  # fmt: skip


SHOWN_TUMOURS = 20  # predict measures the 20 largest; a noisy prediction lists thousands


def _tumours(stats: Record) -> tuple[dict[str, Any], ...]:
    """The largest tumours, where they are (their box's centre in the scan's world mm, as
    NIfTI's affine places it) and how large: the viewer goes to each."""
    tumours = []
    for tumour in stats.records("tumours", optional=True):
        if len(tumours) == SHOWN_TUMOURS:
            break
        centre = tumour.items("box_centre_mm")
        numbers = all(isinstance(c, int | float) and math.isfinite(c) for c in centre)
        if len(centre) != 3 or not numbers:
            continue  # no place to go to
        tumours.append({
            "volume_ml": tumour.number("volume_ml", optional=True),
            "diameter_mm": tumour.number("diameter_mm", optional=True),
            "centre_mm": [float(c) for c in centre],
        })  # fmt: skip
    return tuple(tumours)


def _quality_fields(quality: Record | None) -> dict[str, Any]:
    """The verdict, its score and its reasons: the verdict's, then each concern's that
    reached review (a concern of 0.5 or more), largest first."""
    if quality is None:
        return {}
    reason = quality.text("reason", optional=True)
    concerns = []
    for name, value in (quality.record("concerns", optional=True) or Record({}, "")).value.items():
        concern = Record(value, quality.path, quality.what, f"quality.concerns.{name}")
        level = concern.number("concern", optional=True)
        text = concern.text("reason", optional=True)
        if level is not None and level >= 0.5 and text:
            concerns.append((level, text))
    reasons = [reason] if reason else []
    reasons += [text for _, text in sorted(concerns, reverse=True) if text not in reasons]
    reasons += [c for c in quality.texts("checks", optional=True) or () if c not in reasons]
    return {
        "verdict": quality.text("verdict", optional=True),
        "score": quality.number("score", optional=True),
        "reasons": tuple(reasons),
    }


# --- a `ctseg evaluate` folder ------------------------------------------------------------


def _evaluated_cases(folder: Path) -> list[Case]:
    summary = Record.read(folder / SUMMARY, "evaluation summary")
    sources = _store_sources(folder)
    cases = []
    for entry in summary.records("cases"):
        name = entry.text("case")
        files = {k: p for k, p in sources.get(name, {}).items()}
        seg = folder / PREDICTIONS / f"{name}_seg.nii.gz"
        if seg.exists():
            files[SEG] = seg
        dice = {
            structure: (entry.record(structure, optional=True) or Record({}, "")).number(
                "dice", optional=True
            )
            for structure in ("liver", "tumour")
        }
        cases.append(
            Case(
                name,
                **_quality_fields(entry.record("quality", optional=True)),
                dice=dice,
                files=files,
            )  # fmt: skip
        )
    return cases


def _store_sources(folder: Path) -> dict[str, dict[str, Path]]:
    """Each case's original scan and reference, from the evaluated store's manifest; none
    where the store is gone or unreadable (the labels are still shown)."""
    try:
        store = Record.read(folder / EVALUATED, "evaluation record").text("data")
        manifest = Record.read(Path(store) / "manifest.json", "store manifest")
        sources = {}
        for case in manifest.records("cases"):
            paths = {
                kind: Path(case.text(key))
                for kind, key in ((SCAN, "image_source"), (REFERENCE, "label_source"))
                if case.text(key, optional=True)
            }
            sources[case.text("id")] = {k: p for k, p in paths.items() if p.is_absolute()}
        return sources
    except (CtsegError, OSError):
        return {}
