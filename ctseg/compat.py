"""Files that earlier versions of ctseg wrote, read as today's: the one place for such reads.

Each function takes a file's parsed content as it was written and returns it in
today's form, so that the module owning the format (`ctseg.config`,
`ctseg.data.store`, `ctseg.run.rundir`, `ctseg.run.fingerprint`, `ctseg.evaluation`)
reads one format only. A file that earlier versions did not write at all is read here
too, as None, where today's readers would refuse its absence.
CHANGELOG.md names each change of format; removing an upgrade here is such a change.
"""

from __future__ import annotations

from typing import Any

# Report columns are "<section>_<metric>"; reports of early runs spelled one section so.
OLD_REPORT_SECTIONS = ("tumor",)


def config(raw: dict[str, Any]) -> dict[str, Any]:
    """A config as TOML gives it. `train.frozen_norm_share` had two earlier spellings:
    `train.held_norm_share`, the same share (renamed: "held" also named captured output and
    the run folder's lock), and before it `train.held_norm_steps`, a number of steps
    (a share needs no second setting to shorten a run), rounded to 4 places, so that a run
    that froze 200 of 600 steps resumes under a config saying 0.3333, and still freezes 200.
    The newest spelling present wins."""
    train = raw.get("train")
    if not isinstance(train, dict) or not {"held_norm_share", "held_norm_steps"} & train.keys():
        return raw
    train = dict(train)
    if "held_norm_share" in train:
        train.setdefault("frozen_norm_share", train.pop("held_norm_share"))
    if "held_norm_steps" in train:
        train.setdefault("frozen_norm_share", _share_of_steps(train.pop("held_norm_steps"), train))
    return {**raw, "train": train}


def _share_of_steps(count: Any, train: dict[str, Any]) -> Any:
    """`train.held_norm_steps` as a share of the run's steps (default 2000)."""
    steps = train.get("steps", 2000)
    if isinstance(count, int) and isinstance(steps, int) and steps > 0:
        return round(count / steps, 4)
    return count  # not numbers: the share's own check names the key


def store_manifest(raw: dict[str, Any]) -> dict[str, Any]:
    """A store's manifest.json. Stores written before the spacing grid name no grid (the
    cube), and their cases no grid shape or box offset (R³, at 0); stores written
    before cross-validation folds have none (0)."""
    upgraded = {"grid": "cube", "folds": 0, **raw}
    resolution = raw.get("resolution")
    if isinstance(raw.get("cases"), list):
        upgraded["cases"] = [case_entry(case, resolution) for case in raw["cases"]]
    return upgraded


def case_entry(raw: Any, resolution: Any) -> Any:
    """One case of a manifest (or its case JSON), as `store_manifest` says."""
    if not isinstance(raw, dict) or not isinstance(resolution, int):
        return raw  # the store's own checks name what is wrong
    return {"grid_shape": [resolution] * 3, "box_offset": [0, 0, 0], **raw}


def metrics_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """One line of a run's metrics.jsonl: early runs logged `val_dice_tumor`."""
    if "val_dice_tumor" in entry:
        entry = {**entry}
        entry["val_dice_tumour"] = entry.pop("val_dice_tumor")
    return entry


def fingerprint(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run's fingerprint.json as `ctseg.run.rundir.read_fingerprint` parsed it, None where
    the file is absent. Runs trained before fingerprints were recorded have none: None,
    which `ctseg.run.fingerprint.load` answers with None (nothing to hold scans against, so
    `predict` checks them as it did then); a run that resumes training gets one."""
    return raw


def evaluation_of_summary(summary: dict[str, Any]) -> tuple[str, int, str, str]:
    """What an evaluation folder holds, from its summary.json, for folders written before
    evaluations recorded it (evaluated.json): (run_dir, checkpoint_step, data, split).
    KeyError or TypeError when the summary does not say."""
    run = summary["run"]
    return run["run_dir"], run["checkpoint_step"], run["data"], run["split"]


def quality_thresholds(raw: dict[str, Any], defaults: dict[str, float]) -> dict[str, Any]:
    """A run's quality thresholds (RUN_DIR/quality.json). Version 1 had no thresholds for an
    ensemble's disagreement: those take today's `defaults` (by concern)."""
    if raw.get("version") != 1 or not isinstance(raw.get("thresholds"), dict):
        return raw
    added = {name: defaults[name] for name in ("liver_disagreement", "tumour_disagreement")}
    return {**raw, "version": 2, "thresholds": {**added, **raw["thresholds"]}}


def prediction_request(raw: dict[str, Any]) -> dict[str, Any]:
    """The request of a `<name>_stats.json` (`ctseg.inference.requests`). Those written
    before scans were known by their content record no "scan": None, the scan unknown (it
    is predicted again rather than taken for the one it was predicted from)."""
    return {"scan": None, **raw}


def outputs_entry(raw: dict[str, Any]) -> dict[str, Any]:
    """One file of a prediction folder's `.ctseg-outputs.json`. Entries written before
    outputs were known by their content have no digest ("bytes", "sha256": None): the file
    is ctseg's by its name alone, as it was then."""
    return {"bytes": None, "sha256": None, **raw}
