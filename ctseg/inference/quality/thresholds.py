"""The review thresholds of the per-scan quality (`ctseg.inference.quality.scores`), and their file.

Each concern's threshold is where its raw measure sends a scan to review. The defaults
were calibrated by `make experiment-quality` (docs/experiments/quality.md); a run may hold
its own, `RUN_DIR/quality.json` (`ctseg evaluate --calibrate` writes it), versioned and
checked on reading: a malformed file is one line of error, never a silent default.

A lone run and an ensemble have thresholds of their own: an ensemble's mean is less sure
than its members where they disagree, so its expected Dice lies lower for predictions as
good (a lone run's thresholds sent 18 of an ensemble's 28 good cases to review). An
ensemble is judged by `DEFAULT_ENSEMBLE_THRESHOLDS`, or by those its first run holds for
the ensembles it leads (`RUN_DIR/quality-ensemble.json`, `ctseg evaluate RUN --run …
--calibrate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ctseg import atomic, compat
from ctseg.errors import CtsegError
from ctseg.reading import Record, read_json

THRESHOLDS_FILE = "quality.json"  # a run's own thresholds: RUN_DIR/quality.json
ENSEMBLE_THRESHOLDS_FILE = "quality-ensemble.json"  # those of the ensembles it leads
THRESHOLDS_FORMAT = "ctseg-quality-thresholds"
THRESHOLDS_VERSION = 2
DEFAULT_CALIBRATION = (
    "ctseg's default: the demo's model on 176 phantoms of 11 sets, 2026-11-26 "
    "(docs/experiments/quality.md)"
)
DEFAULT_ENSEMBLE_CALIBRATION = (
    "ctseg's default for ensembles: 3 demo models on 176 phantoms of 11 sets, 2026-11-26 "
    "(docs/experiments/quality.md)"
)


@dataclass(frozen=True)
class Thresholds:
    """Where each concern reaches `REVIEW_AT` (the scan is reviewed): the values of its raw
    measure. The defaults were calibrated by `make experiment-quality`
    (docs/experiments/quality.md); a run may hold its own (`THRESHOLDS_FILE`, written by
    `ctseg evaluate --calibrate`), which `Reference.of_run` loads."""

    # The defaults: chosen by `make experiment-quality` on 2026-11-26 (docs/experiments/
    # quality.md), the demo's model on 176 phantoms of 11 sets.
    # 1 − the expected Dice of the predicted liver (measured on the scan's voxels).
    liver_uncertainty: float = 0.07735
    # 1 − the expected Dice of the predicted tumours.
    tumour_uncertainty: float = 0.22465
    # |median HU inside the predicted liver − the training livers' median|, in the training
    # liver voxels' standard deviations (the phantoms': about 30 HU).
    intensity_sd: float = 0.3794
    # How many times smaller or larger than any training liver (the fingerprint's range)
    # the liver's share of the body over its slices is (its volume, against a fingerprint
    # made before shares). Chosen again the same day with the share: the experiment keeps
    # the hand-chosen 1.5, where no good case is flagged.
    liver_volume_factor: float = 1.5
    # The share of the liver outside its largest connected piece.
    fragments: float = 0.1
    # 1 − the Dice of an ensemble's members' livers with each other's (a lone run has no
    # disagreement; the ensembles' calibrated value, as `DEFAULT_ENSEMBLE_THRESHOLDS`).
    liver_disagreement: float = 0.13690000000000002
    # 1 − the same of their tumours.
    tumour_disagreement: float = 0.8288000000000001
    # What they were chosen on (shown with every verdict).
    calibrated_on: str = DEFAULT_CALIBRATION
    n_cases: int | None = 176  # how many labelled cases they were chosen on

    # The concern each threshold belongs to (`Concern.name` → field).
    CONCERNS: ClassVar[dict[str, str]] = {
        "liver_uncertainty": "liver_uncertainty",
        "tumour_uncertainty": "tumour_uncertainty",
        "intensity": "intensity_sd",
        "liver_volume": "liver_volume_factor",
        "fragments": "fragments",
        "liver_disagreement": "liver_disagreement",
        "tumour_disagreement": "tumour_disagreement",
    }

    def of(self, concern: str) -> float | None:
        """The review threshold of the concern named `concern` (None: it has none)."""
        field_name = self.CONCERNS.get(concern)
        return None if field_name is None else float(getattr(self, field_name))

    def replace(self, **values: Any) -> Thresholds:
        """A copy with some values replaced (by concern or field name)."""
        renamed = {self.CONCERNS.get(name, name): value for name, value in values.items()}
        return dataclasses.replace(self, **renamed)

    def to_json(self) -> dict[str, Any]:
        """As RUN_DIR/quality.json holds them."""
        return {
            "format": THRESHOLDS_FORMAT,
            "version": THRESHOLDS_VERSION,
            "calibrated_on": self.calibrated_on,
            "n_cases": self.n_cases,
            "thresholds": {name: self.of(name) for name in self.CONCERNS},
        }

    @classmethod
    def from_json(cls, raw: Any, source: str | Path = "the thresholds") -> Thresholds:
        """From `to_json`'s form; CtsegError (one line naming `source` and the key) for
        anything else: another format or version, a missing or unknown concern, a threshold
        that is not a positive finite number (the volume's: above 1)."""

        def refuse(why: str) -> CtsegError:
            return CtsegError(f"{source} is not a ctseg quality thresholds file: {why}")

        if not isinstance(raw, dict) or raw.get("format") != THRESHOLDS_FORMAT:
            raise refuse(f"its format is not {THRESHOLDS_FORMAT!r}")
        raw = compat.quality_thresholds(raw, cls._defaults())
        # Each key's type and range through one schema: its errors name the file and the key.
        record = Record(raw, source, "the quality thresholds")
        if raw.get("version") != THRESHOLDS_VERSION:
            raise refuse(
                f"version {_shown(raw.get('version'))}, this ctseg reads version "
                f"{THRESHOLDS_VERSION}"
            )
        values = record.record("thresholds")
        if set(values.value) != set(cls.CONCERNS):
            raise refuse(f"its thresholds must name exactly {', '.join(cls.CONCERNS)}")
        chosen = {}
        for name, field_name in cls.CONCERNS.items():
            value = values.number(name)
            low = 1.0 if name == "liver_volume" else 0.0
            if value <= low:
                raise refuse(f"{name} is {value:g}, not a number above {low:g}")
            chosen[field_name] = value
        return cls(
            **chosen,
            calibrated_on=record.text("calibrated_on"),
            n_cases=record.integer("n_cases", optional=True, low=0),
        )

    @classmethod
    def _defaults(cls) -> dict[str, float | None]:
        return {name: cls().of(name) for name in cls.CONCERNS}

    @classmethod
    def read(cls, path: Path) -> Thresholds:
        """A thresholds file; CtsegError (one line naming the file and the key) where it is
        not a regular file, cannot be read or is malformed (`ctseg.reading`)."""
        return cls.from_json(read_json(path, "the quality thresholds"), path)

    def write(self, path: Path) -> None:
        """Written atomically (`ctseg.atomic.write_json`)."""
        atomic.write_json(path, self.to_json())


# The first version's thresholds, chosen by hand: where calibration starts
# (`ctseg.evaluation.calibration.choose_thresholds`).
HAND_CHOSEN = Thresholds(
    liver_uncertainty=0.10,
    tumour_uncertainty=0.50,
    intensity_sd=1.0,
    liver_volume_factor=1.5,
    fragments=0.10,
    liver_disagreement=0.05,
    tumour_disagreement=0.3,
    calibrated_on="chosen by hand",
    n_cases=None,
)
DEFAULT_THRESHOLDS = Thresholds()
# Chosen by `make experiment-quality` with ENSEMBLE= (docs/experiments/quality.md): the
# demo's model and two more of its config (seeds 1 and 2) on the same 176 phantoms.
# As chosen, unrounded: rounded to four places, two cases recorded at 0.8288 and 0.1369
# would sit on their thresholds and go to review.
DEFAULT_ENSEMBLE_THRESHOLDS = Thresholds(
    liver_uncertainty=0.1,
    tumour_uncertainty=0.39795,
    intensity_sd=0.2639,
    liver_volume_factor=1.18365,  # chosen again with the liver's share of the body
    fragments=0.1,
    liver_disagreement=0.13690000000000002,
    tumour_disagreement=0.8288000000000001,
    calibrated_on=DEFAULT_ENSEMBLE_CALIBRATION,
    n_cases=176,
)


def _shown(value: Any) -> str:
    """A value of a record in a message: short, whatever it is (a 5,000-digit version)."""
    text = repr(value) if isinstance(value, int | float | str | None) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "…"


def thresholds_path(run_dir: Path, ensemble: bool = False) -> Path:
    """Where a run keeps its own thresholds: for itself, or for the ensembles it leads."""
    return Path(run_dir) / (ENSEMBLE_THRESHOLDS_FILE if ensemble else THRESHOLDS_FILE)


def read_thresholds(run_dir: Path, ensemble: bool = False) -> Thresholds:
    """The run's own thresholds (for itself, or for the ensembles it leads), else the
    defaults; CtsegError (one line) for a file that cannot be read or is malformed."""
    try:
        return Thresholds.read(thresholds_path(run_dir, ensemble))
    except FileNotFoundError:
        return DEFAULT_ENSEMBLE_THRESHOLDS if ensemble else DEFAULT_THRESHOLDS
