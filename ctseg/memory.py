"""The host's memory, and byte counts as people read them (one formatter for every command)."""

from __future__ import annotations

import os
from pathlib import Path


def host_memory() -> int:
    """Bytes of the host's RAM available to new allocations."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def human_bytes(count: float) -> str:
    """Binary units, the largest that keeps the number ≥ 1: `512 B`, `3.4 MiB`, `48.0 GiB`."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if count < 1024:
            break
        count, unit = count / 1024, bigger
    return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"
