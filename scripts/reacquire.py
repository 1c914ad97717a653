"""Write held-out scans as acquired differently, one folder per change (the robustness set).

    python scripts/reacquire.py HELDOUT_DIR OUT_DIR [--changes rotated noise …]

HELDOUT_DIR holds volume-N / segmentation-N pairs; OUT_DIR/<change>/ gets each pair as
that acquisition would have shown it (`ctseg.synth.reacquire`). The scans of other kinds
(`OTHER_SCANS`: mr, chest) are written only when --changes names them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ctseg.synth.reacquire import CHANGES, OTHER_SCANS, write_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heldout", type=Path, help="folder of volume-N / segmentation-N pairs")
    parser.add_argument("out", type=Path, help="a folder per change is written here")
    parser.add_argument("--changes", nargs="*", choices=[*CHANGES, *OTHER_SCANS], default=None)
    args = parser.parse_args()
    for folder in write_sets(args.heldout, args.out, args.changes):
        print(f"{folder}: {({**CHANGES, **OTHER_SCANS})[folder.name]}")


if __name__ == "__main__":
    main()
