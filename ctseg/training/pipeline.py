"""Training input: sharded global batches read slab by slab from the prepared store.

A step's global batch ``[B, R, R, R, 1]`` is built with
`jax.make_array_from_callback`: each device's block is read from the
memory-mapped store on demand, so a device never reads more than its slab and
a host never more than its devices' slabs.

Augmentation is drawn from (seed, step, sample) alone (`ctseg.training.draws`), so the
global batch is the same whatever the mesh layout and after a resume. Flips, in-plane
quarter turns and the intensity scale and shift alone are applied per block by index
arithmetic as the block is read; with nnU-Net's transforms on (`[augment]`), the
devices make the batch (`ctseg.training.augment.Augmenter`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ctseg.config import Config
from ctseg.data.grids import hu_to_unit
from ctseg.data.store import CaseEntry, Store
from ctseg.model.step import LABEL_SPEC
from ctseg.parallel.partition import make_global_array
from ctseg.training.augment import Augmenter
from ctseg.training.draws import Augmentation, draw_augmentation, draw_sample


def draw_box_offset(
    config: Config, case: CaseEntry, box: int, step: int, sample: int, stream: int = 2
) -> tuple[int, ...]:
    """Where the sample's R³ box lies on its case's grid (box voxel b = grid voxel b + offset).

    On the cube the box is the grid. On the spacing grid, a share `train.liver_boxes` of
    the boxes lie around the liver (the case's own box, shifted by up to a quarter box),
    the others anywhere on the scan: where the grid is longer than the box, inside it;
    where it is shorter, covering it with the padding on either side. A function of
    (seed, step, sample) alone, as the augmentation is, so a batch is the same on every
    layout and after a resume.
    """
    grid = case.grid_shape
    if all(g == box for g in grid):
        return tuple(case.box_offset)
    rng = np.random.default_rng([config.train.seed, step, sample, stream])
    low = [min(0, g - box) for g in grid]
    high = [max(0, g - box) for g in grid]
    if rng.random() < config.train.liver_boxes:
        shift = rng.integers(-(box // 4), box // 4 + 1, size=3)
        wanted = [o + int(d) for o, d in zip(case.box_offset, shift, strict=True)]
    else:
        wanted = [int(rng.integers(lo, hi + 1)) for lo, hi in zip(low, high, strict=True)]
    return tuple(min(max(w, lo), hi) for w, lo, hi in zip(wanted, low, high, strict=True))


def cases_for_step(case_ids: Sequence[str], seed: int, step: int, batch_size: int) -> list[str]:
    """The step's cases: epochs are seeded permutations, so any step can be recomputed."""
    n = len(case_ids)
    picks = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, n)
        order = np.random.default_rng([seed, epoch, 0]).permutation(n)
        picks.append(case_ids[order[offset]])
    return picks


def make_batch(
    store: Store,
    case_ids: Sequence[str],
    augmentations: Sequence[Augmentation],
    mesh: Mesh,
    hu_window: tuple[float, float],
    offsets: Sequence[Sequence[int] | None] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sharded (image [B,R,R,R,1] float32 in [-1,1], label [B,R,R,R] int32) for these cases:
    the R³ boxes at `offsets` on their grids (None: each case's own box)."""
    r = store.resolution
    batch = len(case_ids)
    offsets = list(offsets or [None] * batch)
    # Opened once here, not in the callbacks, which run once per device block.
    images = [store.box(c, "image", o) for c, o in zip(case_ids, offsets, strict=True)]
    labels = [store.box(c, "label", o) for c, o in zip(case_ids, offsets, strict=True)]

    def read_image(index: tuple[slice, ...]) -> np.ndarray:
        rows = []
        for b in range(*index[0].indices(batch)):
            aug = augmentations[b]
            unit = hu_to_unit(aug.read(images[b], index[1:4]), hu_window)
            rows.append(unit * aug.scale + aug.shift)
        return np.stack(rows)[..., None]

    def read_label(index: tuple[slice, ...]) -> np.ndarray:
        rows = [
            augmentations[b].read(labels[b], index[1:4]) for b in range(*index[0].indices(batch))
        ]
        return np.stack(rows)

    image = make_global_array(mesh, (batch, r, r, r, 1), np.float32, read_image)
    label = make_global_array(mesh, (batch, r, r, r), np.int32, read_label, LABEL_SPEC)
    return image, label


def augmenter_for(store: Store, config: Config, mesh: Mesh) -> Augmenter:
    """The run's augmenter, its blocks bounded by the store's largest training grid."""
    grids = [case.grid_shape for case in store.split("train")]
    return Augmenter(config, mesh, store.resolution, tuple(np.max(grids, axis=0)))


def training_batch(
    store: Store, config: Config, mesh: Mesh, step: int, augmenter: Augmenter | None = None
) -> tuple[jax.Array, jax.Array]:
    """The step's augmented batch; `augmenter` (made once per run, for `[augment]`) makes
    it on the devices."""
    ids = [c.id for c in store.split("train")]
    picks = cases_for_step(ids, config.train.seed, step, config.train.batch_size)
    augs = [draw_augmentation(config, step, i) for i in range(len(picks))]
    offsets = [
        draw_box_offset(config, store.case(c), store.resolution, step, i)
        for i, c in enumerate(picks)
    ]
    if config.augment.on_device:
        augmenter = augmenter or augmenter_for(store, config, mesh)
        draws = [draw_sample(config, step, i, aug) for i, aug in enumerate(augs)]
        return augmenter(step, augmenter.inputs(store, picks, offsets, augs, draws))
    return make_batch(store, picks, augs, mesh, config.data.hu_window, offsets)


class Prefetcher:
    """Builds the next batches in a background thread so devices do not wait on disk.

    `wait_seconds` accumulates the time the training loop spent blocked on it.
    """

    def __init__(
        self,
        store: Store,
        config: Config,
        mesh: Mesh,
        start: int,
        stop: int,
        depth: int = 2,
        augmenter: Augmenter | None = None,
    ):
        """`augmenter`: the run's, made ahead (`augmenter_for`); made here when not."""
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._count = max(stop - start, 0)
        self.wait_seconds = 0.0
        if augmenter is None and config.augment.on_device:
            augmenter = augmenter_for(store, config, mesh)

        def work() -> None:
            for step in range(start, stop):
                if self._stop.is_set():
                    return
                try:
                    item = (step, training_batch(store, config, mesh, step, augmenter))
                except Exception as exc:  # surfaced in the loop's thread
                    item = (step, exc)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue

        self._thread = threading.Thread(target=work, name="ctseg-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[tuple[int, tuple[jax.Array, jax.Array]]]:
        for _ in range(self._count):
            began = time.perf_counter()
            step, item = self._queue.get()
            self.wait_seconds += time.perf_counter() - began
            if isinstance(item, Exception):
                raise item
            yield step, item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def validation_batches(
    store: Store, config: Config, mesh: Mesh
) -> Iterator[tuple[list[str], jax.Array, np.ndarray]]:
    """Validation cases in batches of mesh.data (the last padded by repetition)."""
    cases = [c.id for c in store.split("val")]
    size = config.mesh.data
    identity = Augmentation()
    for start in range(0, len(cases), size):
        ids = cases[start : start + size]
        padded = ids + [ids[-1]] * (size - len(ids))
        image, _ = make_batch(store, padded, [identity] * size, mesh, config.data.hu_window)
        labels = np.stack([np.asarray(store.box(i, "label")) for i in ids])
        yield ids, image, labels


def statistics_batches(store: Store, config: Config, mesh: Mesh) -> Iterator[jax.Array]:
    """Unaugmented training images whose batch-norm statistics are pooled for inference.

    `train.bn_population_volumes` volumes (at least one batch) of a seeded
    permutation of the training split, in batches of `train.batch_size`: always
    the same volumes (and, on the spacing grid, boxes drawn as training draws them,
    from a stream of their own), so the statistics depend on the parameters alone.
    """
    ids = [c.id for c in store.split("train")]
    size = config.train.batch_size
    count = -(-min(config.train.bn_population_volumes, len(ids)) // size) * size
    order = np.random.default_rng([config.train.seed, 0, 1]).permutation(len(ids))
    picks = [ids[order[i % len(ids)]] for i in range(count)]
    offsets = [
        draw_box_offset(config, store.case(c), store.resolution, 0, i, stream=3)
        for i, c in enumerate(picks)
    ]
    identity = Augmentation()
    for start in range(0, count, size):
        batch = slice(start, start + size)
        image, _ = make_batch(
            store, picks[batch], [identity] * size, mesh, config.data.hu_window, offsets[batch]
        )
        yield image
