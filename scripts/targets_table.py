"""`make targets-table`: compile every shipped config for the main targets (`ctseg plan
--target`, compile-only) and render docs/reference/targets.md's table from the results.

Each cell's result is kept as JSON in docs/reference/targets/; a cell already there is
not compiled again unless --refresh names it (or `all`). XLA compiles for TPUs slowly
(minutes per program at 256³ and above on a 2-core machine): run it where there is time.

    python scripts/targets_table.py [--refresh all|CONFIG] [--only CONFIG]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.targets.catalogue import resolve
from ctseg.targets.process import plan_on_target
from ctseg.targets.table import CONFIGS, END, START, TARGETS, cell_name, render

REPO = Path(__file__).resolve().parent.parent
FOLDER = REPO / "docs" / "reference" / "targets"
PAGE = REPO / "docs" / "reference" / "targets.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refresh", default="", help="recompile: all, or a config's name")
    parser.add_argument("--only", default="", help="only this config")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    FOLDER.mkdir(parents=True, exist_ok=True)
    for name in CONFIGS:
        if args.only and name != args.only:
            continue
        config = cfg.load(REPO / "configs" / f"{name}.toml")
        for target_name, devices in TARGETS:
            path = FOLDER / cell_name(name, target_name, devices)
            if path.exists() and args.refresh not in ("all", name):
                continue
            target = resolve(target_name, devices)
            began = time.perf_counter()
            try:
                result = plan_on_target(config, target, search=False)
            except CtsegError as exc:
                print(f"{path.name}: {exc}", file=sys.stderr)
                continue
            result["made"] = {
                "date": datetime.date.today().isoformat(),
                "commit": commit,
                "seconds": round(time.perf_counter() - began, 1),
            }
            path.write_text(json.dumps(result, indent=1) + "\n")
            print(f"{path.name}: {result['made']['seconds']} s", flush=True)
            _write_page()
    _write_page()


def _write_page() -> None:
    text = PAGE.read_text()
    table = render(FOLDER)
    text = re.sub(
        re.escape(START) + ".*?" + re.escape(END), f"{START}\n{table}\n{END}", text, flags=re.S
    )
    PAGE.write_text(text)


if __name__ == "__main__":
    main()
