"""What a scan's prediction was asked, and whether an earlier one answers the same request.

`ctseg predict` records with each scan's outputs the model (`model_of`: run, checkpoint
step, TTA, an ensemble's members) and the request beyond it (`request_of`: the scan by its
content, the backend's exactness class, and the region predicted at full resolution: a mask
with its content's hash, or a locator, and the margin). A re-run keeps an earlier output
only for the same model and request (`earlier_prediction`); for another model or region
it names the difference; for the same one over a scan whose content changed (another
patient's scan of the same file name, a scan replaced in place) it predicts again, saying
why. An earlier stats file is read key by key (`read_stats`): one edited by hand is one
line naming the file and the key.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ctseg import compat
from ctseg.errors import CtsegError, OptionError
from ctseg.inference.inputs import roi_mask
from ctseg.inference.predictor import Predictor
from ctseg.inference.quality.scores import VERDICTS
from ctseg.reading import Record, sha256_of

T = TypeVar("T")


def model_of(predictor: Predictor) -> dict[str, Any]:
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


def _exactness(predictor: Predictor) -> str:
    """The backend's exactness class of the members' models (`Backend.exactness`)."""
    configs = [member.model.config for member in predictor.members]
    return predictor.backend.exactness(configs)


def scan_identity(source: Path) -> dict[str, Any]:
    """The scan read from `source` by its content: {"sha256", "bytes"} of the file, or of a
    DICOM series folder its files (not hidden, directly in it: those the series is read
    from) by name and content in the order of their names.

    Hashed before the scan is read, on the reader's thread: a scan done earlier is never
    read, and the read that follows finds the file in the page cache. A scan replaced
    between its digest and its read is predicted again by the next run: the digests differ."""
    source = Path(source)
    try:
        return _identity(source)
    except FileNotFoundError:
        raise CtsegError(f"scan not found: {source}") from None  # as `read_scan` says it
    except OSError as exc:
        raise CtsegError(f"cannot read the scan {source}: {exc.strerror or exc}") from None


def _identity(source: Path) -> dict[str, Any]:
    if not source.is_dir():
        size, sha256 = sha256_of(source, "scan")
        return {"sha256": sha256, "bytes": size}
    digest, total = hashlib.sha256(), 0
    files = sorted(p for p in source.iterdir() if not p.name.startswith(".") and p.is_file())
    for path in files:
        size, sha256 = sha256_of(path, "DICOM file")
        name = os.fsencode(path.name)
        digest.update(len(name).to_bytes(8, "little") + name + bytes.fromhex(sha256))
        total += size
    return {"sha256": digest.hexdigest(), "bytes": total}


def request_of(predictor: Predictor, source: Path) -> dict[str, Any]:
    """What a scan's prediction was asked beyond the model (`model_of`): the scan by its
    content (`scan_identity`), the backend's exactness class and the region predicted at
    full resolution (None: the whole scan)."""
    region = None
    if predictor.roi is not None:
        mask = roi_mask(predictor.roi, source)
        region = {"mask": str(mask.resolve()), "sha256": sha256_of(mask, "--roi mask")[1]}
    elif predictor.locator is not None:
        locator = predictor.locator.members[0]
        run_dir = None if locator.run_dir is None else str(Path(locator.run_dir).resolve())
        region = {"locator": run_dir, "locator_step": locator.model.step}
    if region is not None:
        region["margin_mm"] = predictor.margin_mm
    return {"backend": _exactness(predictor), "region": region, "scan": scan_identity(source)}


# ---------------------------------------------------------------- an earlier stats file


@dataclass(frozen=True)
class EarlierStats:
    """A `<name>_stats.json`, read and checked: what it was asked (`model`, as `model_of`;
    `request`, as `request_of`, None where an earlier ctseg recorded none) and what the
    table shows of it (`summary`: volumes, tumours, burden, quality verdict and reason)."""

    model: dict[str, Any]
    request: dict[str, Any] | None
    summary: dict[str, Any]


def _nullable(record: Record, key: str, read: Callable[[str], T]) -> T | None:
    """`read(key)` of a key that must be there, but may be null."""
    return None if key in record and record.value[key] is None else read(key)


def _member(record: Record) -> dict[str, Any]:
    return {
        "run_dir": _nullable(record, "run_dir", record.text),
        "run_step": record.integer("run_step", low=0),
    }


def _region(record: Record) -> dict[str, Any]:
    if "mask" in record:
        region = {"mask": record.text("mask"), "sha256": record.sha256("sha256")}
    else:
        locator = _nullable(record, "locator", record.text)
        region = {"locator": locator, "locator_step": record.integer("locator_step", low=0)}
    return {**region, "margin_mm": record.number("margin_mm", low=0)}


def _request(stats: Record) -> dict[str, Any] | None:
    raw = stats.record("request", optional=True)
    if raw is None:
        return None  # written before requests were recorded
    request = Record(compat.prediction_request(raw.value), stats.path, stats.what, "request")
    scan = _nullable(request, "scan", request.record)
    return {
        "backend": request.text("backend"),
        "region": _nullable(request, "region", lambda key: _region(request.record(key))),
        "scan": None
        if scan is None
        else {"sha256": scan.sha256("sha256"), "bytes": scan.integer("bytes", low=0)},
    }


def _summary(stats: Record) -> dict[str, Any]:
    numbers = ("liver_volume_ml", "tumour_volume_ml", "largest_tumour_diameter_mm")
    summary: dict[str, Any] = {key: stats.number(key, low=0) for key in numbers}
    summary["tumour_burden_percent"] = stats.number("tumour_burden_percent", low=0, high=100)
    summary["tumour_count"] = stats.integer("tumour_count", low=0)
    quality = stats.record("quality", optional=True)  # none before verdicts
    if quality is not None:
        verdict = quality.text("verdict")
        if verdict not in VERDICTS:
            raise CtsegError(
                f"{stats.what} {stats.path}: key 'quality.verdict' must be one of "
                f"{', '.join(VERDICTS)}, not {verdict[:40]!r}"
            )
        reason = _nullable(quality, "reason", quality.text)
        summary["quality"] = {"verdict": verdict, "reason": reason}
    return summary


def read_stats(path: Path) -> EarlierStats:
    """The stats file `path` of an earlier prediction, each key ctseg reads checked;
    CtsegError, one line naming the file and the key, for one that is not as ctseg wrote it
    (FileNotFoundError where there is none)."""
    stats = Record.read(path, "stats file")
    ensemble = _nullable(stats, "ensemble", lambda key: list(stats.records(key)))
    model = {
        **_member(stats),
        "tta": stats.flag("tta"),
        "ensemble": None if ensemble is None else [_member(member) for member in ensemble],
    }
    return EarlierStats(model, _request(stats), _summary(stats))


def _region_words(region: dict[str, Any] | None) -> str:
    if region is None:
        return "the whole scan"
    if "mask" in region:
        where = f"the mask {region['mask']} (sha256 {region['sha256'][:12]}…)"
    else:
        where = f"the locator {region['locator']} (step {region['locator_step']})"
    return f"the region of {where}, margin {region['margin_mm']} mm"


def _differences(earlier: dict[str, Any] | None, request: dict[str, Any]) -> list[str]:
    """How an earlier stats file's request differs from `request`, in words (the scan
    aside: see `earlier_prediction`)."""
    if earlier is None:
        return ["its request is not recorded (an earlier version of ctseg wrote it)"]
    differences = []
    if earlier["backend"] != request["backend"]:
        differences.append(f"backend {earlier['backend']}, not {request['backend']}")
    then, now = earlier["region"], request["region"]
    if then == now:
        return differences
    source = ("mask", "locator", "locator_step")
    if then is not None and now is not None and all(then.get(k) == now.get(k) for k in source):
        if then.get("sha256") != now.get("sha256"):
            differences.append(
                f"the mask {now['mask']} changed since (sha256 "
                f"{then['sha256'][:12]}… then, {now['sha256'][:12]}… now)"
            )
        if then["margin_mm"] != now["margin_mm"]:
            differences.append(f"margin {then['margin_mm']} mm, not {now['margin_mm']} mm")
    else:
        differences.append(f"{_region_words(then)}, not {_region_words(now)}")
    return differences


def _scan_change(then: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """Why the scan is not the one predicted (None: it is)."""
    if then is None:
        return "its scan's content is not recorded (an earlier version of ctseg predicted it)"
    if then["sha256"] == now["sha256"]:
        return None
    return (
        f"the scan changed since its prediction (sha256 {then['sha256'][:12]}…, "
        f"{then['bytes']:,} bytes then; {now['sha256'][:12]}…, {now['bytes']:,} bytes now)"
    )


@dataclass(frozen=True)
class Earlier:
    """What an earlier prediction's stats file says of this request: its `summary` where it
    answers it (done earlier), else why the scan is predicted again (`again`)."""

    summary: dict[str, Any] | None
    again: str | None = None


def earlier_prediction(stats_path: Path, model: dict[str, Any], request: dict[str, Any]) -> Earlier:
    """Whether the earlier prediction whose stats file is `stats_path` answers this `model`
    and `request`: its summary; or why the scan is predicted again (the same request over
    a scan whose content changed). CtsegError, naming the difference, for another model or
    request, and for a stats file that is not as ctseg wrote it: not ctseg's to keep or to
    replace without `force`."""
    try:
        earlier = read_stats(stats_path)
    except (CtsegError, OSError) as exc:
        reason = str(exc) if isinstance(exc, CtsegError) else f"{stats_path}: {exc}"
        raise OptionError(
            f"{reason}: it cannot be read as the stats of an earlier prediction; use `force` "
            "to predict the scan again, or another `out_dir`"
        ) from exc
    then = earlier.model
    if any(then[key] != model[key] for key in model):
        what = (
            f"is of another prediction (run {then['run_dir'] or '?'}, step "
            f"{then['run_step']}{', TTA' if then['tta'] else ''})"
        )
    elif differences := _differences(earlier.request, request):
        what = f"is of another request ({'; '.join(differences)})"
    elif again := _scan_change(earlier.request["scan"], request["scan"]):
        return Earlier(None, again)
    else:
        return Earlier(earlier.summary)
    raise OptionError(
        f"{stats_path.name} in {stats_path.parent} {what}; use `force` to replace it, "
        "or another `out_dir`"
    )
