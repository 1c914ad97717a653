"""Layouts: how a grid is split over devices, and the layout a training run gets on the
devices it has (invariant 8: a config's mesh is a request).

`auto_spatial` splits a partition count over x, y, z; `fit_layout` and `fit_split` find
the largest split a grid allows (every U-Net level's blocks even and thicker than the
halo); `fit_training` fits a config's mesh, with data replicas, to the devices present.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ctseg.config import Config, split_problem, with_mesh
from ctseg.errors import CtsegError, OptionError
from ctseg.parallel.devices import Device, describe, is_accelerator


def auto_spatial(partitions: int) -> tuple[int, int, int]:
    """Split `partitions` over x, y, z: 1→[1,1,1], 2→[2,1,1], 4→[2,2,1], 8→[2,2,2], 16→[4,4,1].

    The largest per-axis split is made as small as possible, which keeps the
    local blocks thick and the halo a small share of them; among those, the
    fewest partitions go to z (x and y first, as Google's 4×4 TPU layout
    splits the in-plane axes), and x gets at least as many as y.
    """
    if partitions < 1:
        raise CtsegError(f"a partition count must be positive, got {partitions}")
    splits = [
        (x, y, partitions // (x * y))
        for x in range(1, partitions + 1)
        for y in range(1, x + 1)
        if partitions % (x * y) == 0
    ]
    return min(splits, key=lambda s: (max(s), s[2], -s[0]))


def fit_layout(config: Config, devices: int, data: int = 1) -> Config:
    """`config` on as many of `devices` as its grid allows, with `data` replicas.

    The `auto_spatial` split of the most partitions, at most `devices // data`, that
    passes the config's own mesh check (invariant 3: every level's blocks even,
    thicker than the halo).
    """
    for count in range(devices // data, 1, -1):
        try:
            return with_mesh(config, auto_spatial(count), data=data)
        except CtsegError:
            continue
    return with_mesh(config, (1, 1, 1), data=data)


def fit_split(config: Config, shape: Sequence[int], devices: int) -> tuple[int, int, int]:
    """The `auto_spatial` split of a grid of `shape` over the most of `devices` whose blocks
    every U-Net level can work on (`config.split_problem`); [1, 1, 1] when none can."""
    for count in range(devices, 1, -1):
        spatial = auto_spatial(count)
        if split_problem(config, spatial, shape) is None:
            return spatial
    return (1, 1, 1)


@dataclass(frozen=True)
class TrainingLayout:
    """Where a training run runs: the config with the mesh it gets, its devices, and why."""

    config: Config
    devices: list[Any]
    line: str  # the command's first line


def _mesh_words(config: Config) -> str:
    spatial, data = list(config.mesh.spatial), config.mesh.data
    if config.num_devices == 1:
        return "unpartitioned"
    split = f"{spatial} ({config.num_partitions} partitions)"
    return split if data == 1 else f"{split} × {data} data replicas"


def fit_training(config: Config, devices: Sequence[Device], exact: bool = False) -> TrainingLayout:
    """The layout to train `config` on `devices` (invariant 8: the mesh is a request).

    Enough devices: the config's own mesh, on the first of them. Fewer: the grid
    split over as many as it allows, with data replicas where the batch divides
    among them and the grid alone cannot use every device (`fit_layout`;
    partitioned training equals unpartitioned training, so the model is the
    same), unless `exact`, which makes it an error. Memory is checked when the
    step is compiled (`ctseg.training.loop`).
    """
    need = config.num_devices
    simulated = not is_accelerator(devices)
    here = f"{describe(devices, simulated)} here"
    asked = f"config asks {list(config.mesh.spatial)}"
    asked += f" × data {config.mesh.data}" if config.mesh.data > 1 else ""
    asked += f" ({need} device{'s' if need > 1 else ''})"
    if len(devices) >= need:
        return TrainingLayout(
            config, list(devices[:need]), f"{here}: training {_mesh_words(config)}"
        )
    if exact:
        raise OptionError(
            f"{asked} but only {len(devices)} are here ({describe(devices, simulated)}) and "
            "`exact` keeps the config's mesh; leave `exact` out to fit the layout "
            "to this machine, or use `device` cpu to simulate the devices"
        )
    # The most devices the grid and the batch allow: data replicas where the grid alone
    # cannot use them all (the batch must divide among them); spatial splits first.
    replicas = [d for d in range(1, len(devices) + 1) if config.train.batch_size % d == 0]
    fitted = max(
        (fit_layout(config, len(devices), data) for data in replicas),
        key=lambda layout: layout.num_devices,
    )
    return TrainingLayout(
        fitted,
        list(devices[: fitted.num_devices]),
        f"{asked}; {here}: training {_mesh_words(fitted)}",
    )
