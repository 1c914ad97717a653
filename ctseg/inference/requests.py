"""What a scan's prediction was asked, and whether an earlier one answers the same request.

`ctseg predict` records with each scan's outputs the model (`model_of`: run, checkpoint
step, TTA, an ensemble's members) and the request beyond it (`request_of`: the backend's
exactness class, and the region predicted at full resolution: a mask with its content's
hash, or a locator, and the margin). A re-run keeps an earlier output only for the same
model and request (`earlier_prediction`); for another it names the difference.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ctseg.errors import CtsegError
from ctseg.inference.inputs import roi_mask
from ctseg.inference.predictor import Predictor


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
    return predictor.inference_backend.exactness(configs)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def request_of(predictor: Predictor, source: Path) -> dict[str, Any]:
    """What a scan's prediction was asked beyond the model (`model_of`): the backend's
    exactness class and the region predicted at full resolution (None: the whole scan)."""
    region = None
    if predictor.roi is not None:
        mask = roi_mask(predictor.roi, source)
        region = {"mask": str(mask.resolve()), "sha256": _sha256(mask)}
    elif predictor.locator is not None:
        locator = predictor.locator.members[0]
        run_dir = None if locator.run_dir is None else str(Path(locator.run_dir).resolve())
        region = {"locator": run_dir, "locator_step": locator.model.step}
    if region is not None:
        region["margin_mm"] = predictor.margin_mm
    return {"backend": _exactness(predictor), "region": region}


def _region_words(region: Any) -> str:
    if not isinstance(region, dict):
        return "the whole scan"
    if "mask" in region:
        where = f"the mask {region['mask']} (sha256 {str(region.get('sha256'))[:12]}…)"
    else:
        where = f"the locator {region.get('locator')} (step {region.get('locator_step')})"
    return f"the region of {where}, margin {region.get('margin_mm')} mm"


def _differences(earlier: Any, request: dict[str, Any]) -> list[str]:
    """How an earlier stats file's request differs from `request`, in words."""
    if not isinstance(earlier, dict):
        return ["its request is not recorded (an earlier version of ctseg wrote it)"]
    differences = []
    if earlier.get("backend") != request["backend"]:
        differences.append(f"backend {earlier.get('backend')}, not {request['backend']}")
    then, now = earlier.get("region"), request["region"]
    if then == now:
        return differences
    source = ("mask", "locator", "locator_step")
    if (
        isinstance(then, dict)
        and isinstance(now, dict)
        and all(then.get(key) == now.get(key) for key in source)
    ):
        if then.get("sha256") != now.get("sha256"):
            differences.append(
                f"the mask {now.get('mask')} changed since (sha256 "
                f"{str(then.get('sha256'))[:12]}… then, {str(now.get('sha256'))[:12]}… now)"
            )
        if then.get("margin_mm") != now.get("margin_mm"):
            differences.append(f"margin {then.get('margin_mm')} mm, not {now.get('margin_mm')} mm")
    else:
        differences.append(f"{_region_words(then)}, not {_region_words(now)}")
    return differences


def earlier_prediction(
    stats_path: Path, model: dict[str, Any], request: dict[str, Any]
) -> dict[str, Any]:
    """The stats of an earlier prediction of a scan for this `model` and `request`;
    CtsegError, naming the difference, for another's."""
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
    elif differences := _differences(earlier.get("request"), request):
        what = f"is of another request ({'; '.join(differences)})"
    else:
        return earlier
    raise CtsegError(
        f"{stats_path.name} in {stats_path.parent} {what}; use --force to replace it, "
        "or another --out"
    )
