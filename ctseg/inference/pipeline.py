"""One scan pipeline for every caller: read ahead → to the grid → the network → back to
the scan → post-processing and quality → the caller's outputs.

`ctseg predict`'s files (`ctseg.inference.files`), the API's `Segmenter.map` and the
evaluation of a run (`ctseg.evaluation.skeleton`) each name their three stages
(`Stages`), and `pipelined` runs them:

- `read`, on a reader thread: the scan read and brought to each member's grid
  (`Predictor.to_grid`), the next scan while the network runs on this one;
- `infer`, on the calling thread: the network (`Predictor.infer`), one scan at a time;
- `finish`, on a finisher thread: back to the scan's voxels, post-processed and judged
  (`Predictor.to_scan`, `Predictor.judge`), then written or scored, while the network runs
  on the next scan.

The network, NumPy, SciPy and the image libraries release the GIL, so the three overlap.
Results come in the items' order. A stage that raises ends the pipeline there, after the
results of the items before it: stages that want a failed row rather than an exception
(the commands' files and cases) catch their own.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # this module imports no JAX: evaluation imports it before JAX starts
    from ctseg.inference.member import OnGrid
    from ctseg.io.scans import Scan

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class Ready:
    """A scan read and brought to each member's grid, ready for the network."""

    scan: Scan
    on_grids: list[OnGrid]

    def free_units(self) -> None:
        """Drop the boxes (inferred by now), keeping where each grid lies in its box."""
        self.on_grids = [dataclasses.replace(g, unit=None) for g in self.on_grids]


class Stages(Protocol, Generic[Item, Result]):
    """What a caller does with each item at each stage of the pipeline."""

    def read(self, item: Item) -> Ready | None:
        """The item's scan read and brought to the grids; None: nothing for the network
        (a scan done earlier, or one that failed and says so in its result)."""

    def infer(self, item: Item, ready: Ready) -> Any:
        """The network's class probabilities of the item's scan, brought to the grids."""

    def finish(self, item: Item, ready: Ready | None, probabilities: Any) -> Result:
        """The item's result: its scan's labels back on its voxels, judged, written or scored
        (`probabilities` None where `read` gave nothing, or `infer` failed)."""


def pipelined(items: Sequence[Item], stages: Stages[Item, Result]) -> Iterator[Result]:
    """Each item's result, in order, the next item read and the last one finished beside
    the network's pass over the current one."""
    with (
        ThreadPoolExecutor(1, thread_name_prefix="ctseg-read") as reader,
        ThreadPoolExecutor(1, thread_name_prefix="ctseg-finish") as finisher,
    ):
        reading = deque(reader.submit(stages.read, item) for item in items[:1])
        finishing: Future[Result] | None = None
        for index, item in enumerate(items):
            try:
                ready = reading.popleft().result()
                if index + 1 < len(items):
                    reading.append(reader.submit(stages.read, items[index + 1]))
                probabilities = None if ready is None else stages.infer(item, ready)
            except BaseException:
                if finishing is not None:  # the results before a failure first
                    yield finishing.result()
                raise
            if ready is not None:
                ready.free_units()  # inferred: the boxes are freed before the next read
            if finishing is not None:
                yield finishing.result()
            finishing = finisher.submit(stages.finish, item, ready, probabilities)
        if finishing is not None:
            yield finishing.result()
