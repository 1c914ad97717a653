"""What a prediction asks of level-wise tiles: automatic, the whole volume, or a core size.

The config file (`predict.tile`) and the command line (`ctseg predict --tile`) spell it as
one int (−1 automatic, 0 whole volume, N an even core size); `TileRequest.from_int` reads
that int once, with the one check, and everything below takes the typed request.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

from ctseg.errors import CtsegError

AUTO, WHOLE, SIZE = "auto", "whole", "size"


@dataclass(frozen=True)
class TileRequest:
    """Level-wise tiles as asked: chosen from the free memory (`auto`), none (`whole`), or
    cores of `core` voxels a side at every U-Net level (`size`)."""

    kind: Literal["auto", "whole", "size"]
    core: int = 0  # the core's side in voxels (even), for `size`

    @classmethod
    def auto(cls) -> TileRequest:
        return cls(AUTO)

    @classmethod
    def whole(cls) -> TileRequest:
        return cls(WHOLE)

    @classmethod
    def size(cls, core: int, name: str = "tile") -> TileRequest:
        """Cores of `core` voxels (even: level-wise tiles are pooled in pairs of voxels)."""
        request = cls.from_int(core, name)
        if request.kind != SIZE:
            raise CtsegError(f"{name} must be a positive even core size, got {core}")
        return request

    @classmethod
    def from_int(cls, tile: int, name: str = "tile") -> TileRequest:
        """The request a config's or a command's int spells (−1 automatic, 0 whole volume,
        else an even core size); `CtsegError` naming the option (`name`) for any other."""
        if isinstance(tile, bool):
            raise CtsegError(_not_an_int(name, tile))
        try:
            tile = operator.index(tile)  # an int, NumPy's too; not 2.0 or "2"
        except TypeError:
            raise CtsegError(_not_an_int(name, tile)) from None
        if tile == -1:
            return cls.auto()
        if tile == 0:
            return cls.whole()
        if tile < -1:
            raise CtsegError(f"{name} must be -1 (auto), 0 (whole volume) or a size, got {tile}")
        if tile % 2:
            raise CtsegError(
                f"{name} = {tile} must be even: level-wise tiles are pooled in pairs of voxels"
            )
        return cls(SIZE, tile)

    @classmethod
    def of(cls, tile: TileRequest | int, name: str = "tile") -> TileRequest:
        """`tile` as a request: itself, or read from its int (`from_int`)."""
        return tile if isinstance(tile, TileRequest) else cls.from_int(tile, name)

    def __post_init__(self) -> None:
        if self.kind not in (AUTO, WHOLE, SIZE):
            raise ValueError(f"unknown tile request {self.kind!r}")
        if (self.kind == SIZE) != (self.core > 0) or self.core % 2:
            raise ValueError(f"a {self.kind} tile request with core {self.core}")

    @property
    def is_auto(self) -> bool:
        return self.kind == AUTO

    def to_int(self) -> int:
        """The int the config and the command line spell it as."""
        return {AUTO: -1, WHOLE: 0}.get(self.kind, self.core)

    def __str__(self) -> str:
        return {AUTO: "automatic", WHOLE: "whole volume"}.get(self.kind, f"cores of {self.core}³")


def _not_an_int(name: str, tile: object) -> str:
    return (
        f"{name} must be an integer: -1 (automatic), 0 (whole volume) or an even core size, "
        f"got {tile!r}"
    )
