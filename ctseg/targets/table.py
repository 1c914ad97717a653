"""The table users read before renting hardware: every shipped config on the main targets,
as `ctseg plan --target` compiles it (docs/reference/targets.md).

`make targets-table` compiles each cell once and keeps its result as JSON beside the
page (docs/reference/targets/<config>__<target>.json, with the date, jax version and
ctseg commit it was made with); the page's table is rendered from those files alone, and
a test holds the page to them, as the configuration reference is held to the code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ctseg.memory import human_bytes

CONFIGS = ("demo", "lits128", "lits256_16way", "lits512_16way")
# (target, GPUs): what users rent, one of each kind and a 16-device slice.
TARGETS = (("h100", 1), ("h100", 16), ("a100-40", 16), ("l4", 1), ("tpu-v5e:4x4", None))
START, END = "<!-- targets-table:start -->", "<!-- targets-table:end -->"


def cell_name(config: str, target: str, devices: int | None) -> str:
    """The JSON file name of one cell: lits256_16way__h100x16.json, demo__tpu-v5e-4x4.json."""
    where = target.replace(":", "-") + (f"x{devices}" if devices else "")
    return f"{config}__{where}.json"


def heading(target: str, devices: int | None) -> str:
    names = {"h100": "H100 80 GB", "a100-40": "A100 40 GB", "l4": "L4 24 GB"}
    if target.startswith("tpu-"):
        generation, topology = target.removeprefix("tpu-").split(":")
        return f"TPU {generation} {topology}"
    return f"{devices} × {names.get(target, target)}"


def _cell(result: dict[str, Any] | None) -> str:
    if result is None:
        return "not compiled yet"
    train, predict = result["train"], result["predict"]
    if train.get("train_bytes") is None:
        training = "train: does not fit"
    else:
        split = "×".join(map(str, train["spatial"]))
        verdict = "fits" if train["fits"] else "**does not fit**"
        training = f"train {split}: {human_bytes(train['train_bytes'])}, {verdict}"
    if train.get("augment_bytes") is not None:
        training += (
            f"<br>augment: {human_bytes(train['augment_bytes'])}, compiled in "
            f"{train['augment_compile_seconds']:.0f} s (the step: "
            f"{train['train_compile_seconds']:.0f} s)"
        )
    if predict.get("plan") is None:
        inference = "predict: does not fit"
    else:
        verdict = "" if predict["fits"] else ", **does not fit**"
        inference = f"predict: {predict['plan']}, {human_bytes(predict['bytes'])}{verdict}"
    return f"{training}<br>{inference}"


def render(folder: Path) -> str:
    """The markdown table of the cells kept in `folder`."""
    columns = [heading(target, devices) for target, devices in TARGETS]
    rows = ["| config | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for config in CONFIGS:
        cells = []
        for target, devices in TARGETS:
            path = folder / cell_name(config, target, devices)
            cells.append(_cell(json.loads(path.read_text()) if path.is_file() else None))
        rows.append(f"| `{config}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)
