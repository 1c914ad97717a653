"""What every backend's programs for boxes of one shape are (`Plan`): the interface the
engine runs, whether the whole volume, level-wise tiles or fixed windows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ctseg.inference.network.tiling import Span, Stage
    from ctseg.progress import TileProgress


class Plan(Protocol):
    """A backend's programs for boxes of one shape: the whole volume, or level-wise stages."""

    stages: list[Stage]  # [] the whole volume
    needed: int  # bytes per device the programs need (0: not measured)
    spatial: tuple[int, int, int]  # the whole volume's split over the devices
    spills: bool  # levels waiting for their up stage are kept on the host

    def place(self, image: Any) -> Any:
        """A unit-scaled image [x, y, z] as the programs take it: [1, x, y, z, 1] float32."""

    def logits(self, image: Any, progress: TileProgress | None, need: Span | None = None) -> Any:
        """Logits [x, y, z, 3] float32 of a `place`d image (exact on `need` if given)."""

    def memory_words(self, memory: int) -> str:
        """What the plan needs of `memory`, in words following its description."""
