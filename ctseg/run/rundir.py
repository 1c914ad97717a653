"""The run directory: what `ctseg train` writes, and what `predict` and `evaluate` read.

Layout (the contract between `ctseg train` and the commands after it)::

    RUN_DIR/config.toml      the fully resolved config; a resumed run must match it (mesh aside)
    RUN_DIR/checkpoints/     orbax checkpoints (`ctseg.run.checkpoints`): the latest K plus the best
    RUN_DIR/metrics.jsonl    one JSON object per logged step; validation entries carry Dice
    RUN_DIR/curves.png       loss and validation Dice over steps, redrawn at each validation
    RUN_DIR/layouts.jsonl    one line per start: {"from_step", "mesh", "devices"}
    RUN_DIR/fingerprint.json the training data's fingerprint (spacings, extents, livers' volumes,
                             extents and HU; `ctseg.run.fingerprint`), written when a run starts
                             (or resumes without one) and kept after; absent in runs trained
                             before fingerprints, whose scans `predict` checks as before
    RUN_DIR/fold.json        a cross-validation fold run's fold (train.fold ≥ 0 only):
                             {"fold", "folds", "fold_seed", "store", "val_cases",
                             "train_cases"}, the store's fold as the run first trained on it
    RUN_DIR/eval/            `ctseg evaluate RUN_DIR`'s default output folder: evaluated.json
                             (what it evaluated), summary.json, metrics.csv, predictions/

This module reads and writes the plain files; it imports no JAX, so a command can
read a run's config before it chooses (and starts) the devices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ctseg import atomic, compat
from ctseg import config as cfg
from ctseg.data.store import Store
from ctseg.errors import CtsegError, OptionError
from ctseg.reading import Record, parse_json, read_text

CONFIG = "config.toml"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
CURVES = "curves.png"
LAYOUTS = "layouts.jsonl"
FINGERPRINT = "fingerprint.json"
FOLD = "fold.json"
# What makes a folder a run directory's: `ctseg train` claims no folder of others' files.
OWN_FILES = (CONFIG, CHECKPOINTS)


def load_config(run_dir: Path) -> cfg.Config:
    """The run's config.toml; CtsegError if `run_dir` is no run directory."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise CtsegError(f"{run_dir} is not a ctseg run directory (no {CONFIG})")
    return cfg.load(path)


def write_or_check_config(run_dir: Path, config: cfg.Config, write: bool = True) -> None:
    """Write RUN_DIR/config.toml, or check that an existing run used the same config.

    The mesh is not part of a run's identity: every layout trains the same model
    (invariant 1), so a run may resume on another machine with another layout.
    """
    path = Path(run_dir) / CONFIG
    if path.exists():
        changed = config_changes(cfg.load(path), config)
        if changed:
            raise OptionError(
                f"{run_dir} holds a run with a different config ({', '.join(changed)}); "
                "use a new `run_dir`, or the same config to resume"
            )
        return
    if write:
        atomic.write_text(path, cfg.to_toml(config))


def config_changes(
    first: cfg.Config, second: cfg.Config, ignored: Sequence[str] = ("mesh",)
) -> list[str]:
    """The keys ("section.key", in the config's order) whose values differ between two
    configs; those `ignored` (whole sections, as "mesh", or keys, as "train.fold") aside.

    The mesh is ignored unless told otherwise: it is no part of a run's identity (every
    layout trains the same model, invariant 1)."""
    theirs = cfg.to_dict(first)
    return [
        f"{section}.{key}"
        for section, values in cfg.to_dict(second).items()
        if section not in ignored
        for key, value in values.items()
        if f"{section}.{key}" not in ignored and theirs[section][key] != value
    ]


def fold_record(store: Store, fold: int) -> dict[str, Any]:
    """What RUN_DIR/fold.json says of a run of fold `fold` of `store` (or of a fold view
    of it: the view keeps every case's fold)."""
    view = store.for_fold(fold)
    return {
        "fold": fold,
        "folds": store.folds,
        "fold_seed": store.fold_seed,
        "store": str(Path(store.path).resolve()),
        "val_cases": [case.id for case in view.split("val")],
        "train_cases": [case.id for case in view.split("train")],
    }


def read_fold(run_dir: Path) -> dict[str, Any] | None:
    """RUN_DIR/fold.json, None for a run of a store's own split; CtsegError (one line naming
    the file and the key) if damaged."""
    path = Path(run_dir) / FOLD
    try:
        record = Record.read(path, "the fold record")
    except FileNotFoundError:
        return None
    record.integer("folds", low=0)
    record.integer("fold", low=0)
    record.texts("val_cases")
    record.texts("train_cases")
    return record.value


def fold_difference(record: dict[str, Any], store: Store) -> str | None:
    """How the fold a run recorded differs from that fold of `store` now; None if it does not.

    Compared by case ids (the store may have moved): fold runs of folds re-assigned
    since they trained neither resume nor make a cross-validation together.
    """
    fold = record["fold"]
    if store.folds != record["folds"] or not 0 <= fold < store.folds:
        now = f"{store.folds} folds" if store.folds else "no folds"
        return (
            f"trained on fold {fold} of {record['folds']} folds, but the store at {store.path} "
            f"has {now} now"
        )
    now = fold_record(store, fold)
    if sorted(now["val_cases"]) != sorted(record["val_cases"]) or sorted(
        now["train_cases"]
    ) != sorted(record["train_cases"]):
        return (
            f"trained on fold {fold} as it was then ({_cases(record['val_cases'])}), but fold "
            f"{fold} of the store at {store.path} is now {_cases(now['val_cases'])}: its folds "
            "were re-assigned since"
        )
    return None


def _cases(ids: list[str]) -> str:
    shown = ", ".join(ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
    return f"{len(ids)} case(s): {shown}"


def write_or_check_fold(run_dir: Path, store: Store, fold: int, write: bool = True) -> None:
    """Write RUN_DIR/fold.json, or check that a resumed run's fold is still the store's."""
    earlier = read_fold(run_dir)
    if earlier is None:
        if write:
            atomic.write_json(Path(run_dir) / FOLD, fold_record(store, fold))
        return
    difference = fold_difference(earlier, store)
    if earlier["fold"] != fold:
        difference = f"trained on fold {earlier['fold']}, not {fold}"
    if difference is not None:
        raise OptionError(
            f"{run_dir} {difference}; use a new `run_dir`, or assign the folds it trained on again"
        )


def is_run_dir(folder: Path) -> bool:
    """Whether `folder` is a run directory (a `ctseg train` wrote its config there)."""
    return all((Path(folder) / name).exists() for name in OWN_FILES)


def runs_in(path: Path) -> list[Path]:
    """The run directories `path` names: itself, or (a folder of runs, e.g. one per
    cross-validation fold) every run directory directly inside it, sorted."""
    path = Path(path)
    if (path / CONFIG).is_file():  # a run (whose checkpoints the loading checks)
        return [path]
    runs = sorted(p for p in path.iterdir() if is_run_dir(p)) if path.is_dir() else []
    if not runs:
        raise CtsegError(
            f"{path} is not a ctseg run directory (no {CONFIG}), nor a folder of run directories"
        )
    return runs


def member_runs(paths: Sequence[Path]) -> list[Path]:
    """The run directories several paths name (`runs_in` each), each once: a run named
    twice would silently weigh twice in an ensemble's mean."""
    runs = [run for path in paths for run in runs_in(path)]
    seen: dict[Path, Path] = {}
    for run in runs:
        same = seen.setdefault(run.resolve(), run)
        if same is not run:
            also = f" (also as {same})" if str(same) != str(run) else ""
            raise CtsegError(f"{run} is named twice{also}: name each run once")
    return runs


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir).absolute() / CHECKPOINTS


class MetricsLog:
    """RUN_DIR/metrics.jsonl; on resume, entries after the restored step are dropped.

    Only the writing process (process 0 of a multi-host job) touches the file;
    the others keep the entries in memory.
    """

    def __init__(self, run_dir: Path, resume_step: int, write: bool = True):
        self.path = Path(run_dir) / METRICS
        self.write = write
        kept = [e for e in self.read(run_dir) if e["step"] <= resume_step]
        if write:
            atomic.write_text(self.path, "".join(json.dumps(e) + "\n" for e in kept))
        self.entries = kept

    @staticmethod
    def read(run_dir: Path) -> list[dict[str, Any]]:
        """The entries of RUN_DIR/metrics.jsonl, early runs' keys spelled as today's; each
        a JSON object with its step (CtsegError, one line naming the file, line and key)."""
        entries = []
        for entry in _json_lines(Path(run_dir) / METRICS, "the metrics"):
            entry.integer("step", low=0)
            entry = Record(compat.metrics_entry(entry.value), entry.path, entry.what)
            for key in ("loss", "val_dice_liver", "val_dice_tumour"):
                value = entry.value.get(key)
                # A diverged step's loss is logged as it was: NaN or infinite.
                if not (isinstance(value, float) and not math.isfinite(value)):
                    entry.number(key, optional=True)
            entries.append(entry.value)
        return entries

    def append(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        if not self.write:
            return
        # A full disk is the user's to fix: one line, not a traceback. A line cut short
        # here is no harm: `read` stops at it, and a resume drops it with the later steps.
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as exc:
            raise CtsegError(f"could not write {self.path}: {exc.strerror or exc}") from exc

    def validations(self) -> dict[int, dict[str, float]]:
        """Step → {step, liver, tumour} of every validation entry."""
        return {
            e["step"]: {
                "step": e["step"],
                "liver": e["val_dice_liver"],
                "tumour": e["val_dice_tumour"],
            }
            for e in self.entries
            if "val_dice_liver" in e
        }


def record_layout(run_dir: Path, step: int, config: cfg.Config, where: str) -> None:
    """Append to RUN_DIR/layouts.jsonl which layout and devices train from `step` on."""
    entry = {"from_step": step, "mesh": cfg.to_dict(config)["mesh"], "devices": where}
    path = Path(run_dir) / LAYOUTS
    try:
        previous = read_text(path, "the layouts", limit=None)
    except FileNotFoundError:
        previous = ""
    atomic.write_text(path, previous + json.dumps(entry) + "\n")


def last_layout(run_dir: Path) -> dict[str, Any] | None:
    """The latest entry of RUN_DIR/layouts.jsonl (the layout the run last trained on)."""
    entries = _json_lines(Path(run_dir) / LAYOUTS, "the layouts")
    return entries[-1].value if entries else None


def _json_lines(path: Path, what: str) -> list[Record]:
    """The JSON objects of a log of JSON lines (none if it is absent), up to a line cut
    short (a kill while appending: what follows it is lost anyway, and a resume drops it).
    CtsegError, one line naming the file and the line, for a file that is not a regular
    file or a line that is JSON but no object, or past Python's limits."""
    try:
        text = read_text(path, what, limit=None)
    except FileNotFoundError:
        return []
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            break
        except (ValueError, RecursionError):
            value = parse_json(line, path, f"line {number} of {what}")  # its one-line error
        entries.append(Record(value, path, f"line {number} of {what}"))
    return entries


def write_fingerprint(run_dir: Path, fingerprint: dict[str, Any]) -> None:
    """Write RUN_DIR/fingerprint.json (`ctseg.run.fingerprint.compute`'s JSON)."""
    atomic.write_json(Path(run_dir) / FINGERPRINT, fingerprint)


def read_fingerprint(run_dir: Path) -> dict[str, Any] | None:
    """RUN_DIR/fingerprint.json; None where it is absent (a run trained before fingerprints
    were recorded: `ctseg.compat.fingerprint`).

    CtsegError (one line) if the file is there but is no regular file or no JSON object
    (`ctseg.run.fingerprint.load` checks its fields)."""
    path = Path(run_dir) / FINGERPRINT
    try:
        return Record.read(path, "the fingerprint").value
    except FileNotFoundError:
        return None
    except CtsegError as exc:
        raise CtsegError(
            f"{exc}; delete it to predict without comparing scans with the training data"
        ) from None
