"""Which labelled cases of a store validate: its train/val split and its
cross-validation folds, drawn deterministically by seed (no I/O but the earlier
manifest's folds).

Folds (`assign_folds`) are drawn over the labelled cases, at preprocess time
(`data.folds`) or later over an existing store (`write_folds`,
``ctseg folds``). Once a store has folds they are kept: a re-run of preprocess
draws them again with their recorded count and seed (the same folds for the same
cases), and assigning others needs ``force``, since fold runs may have trained on
them (`fold_plan`, `with_folds`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctseg import lock
from ctseg.config import Config
from ctseg.data.manifest import MANIFEST, manifest_file, read_manifest, write_manifest
from ctseg.data.store import CaseEntry, Store
from ctseg.data_prep.raw import RawLayout
from ctseg.errors import CtsegError, OptionError


def assign_splits(case_ids: list[str], val_fraction: float, seed: int) -> dict[str, str]:
    """Deterministic train/val split: at least one val case once there are two or more."""
    count = len(case_ids)
    n_val = round(count * val_fraction)
    if val_fraction > 0 and count >= 2:
        n_val = min(max(n_val, 1), count - 1)
    order = np.random.default_rng(seed).permutation(count)
    val = {case_ids[i] for i in order[:n_val]}
    return {cid: "val" if cid in val else "train" for cid in case_ids}


def assign_folds(case_ids: list[str], folds: int, seed: int) -> dict[str, int]:
    """Deterministic cross-validation folds: case id -> fold 0 … `folds` − 1.

    The ids, sorted (so that the order they are listed in does not matter), are
    permuted by `seed` and cut into `folds` runs whose sizes differ by at most one.
    The same ids, count and seed always give the same folds.
    """
    ids = sorted(case_ids)
    # A stream of its own: the folds do not follow the train/val split drawn from the seed.
    order = np.random.default_rng([seed, _FOLD_STREAM]).permutation(len(ids))
    return {ids[i]: fold for fold, chunk in enumerate(np.array_split(order, folds)) for i in chunk}


_FOLD_STREAM = 1


def of_layout(layout: RawLayout, config: Config) -> dict[str, str]:
    """Case id -> split: "test" in a predict-only store, else a train/val split.

    The split is drawn over all training cases found, failed ones included, so that
    a case keeps its split when a failed neighbour is fixed and the store brought up to date.
    """
    case_ids = [c.case_id for c in layout.cases]
    if layout.predict_only:
        return dict.fromkeys(case_ids, "test")
    return assign_splits(case_ids, config.data.val_fraction, config.data.split_seed)


@dataclass(frozen=True)
class FoldHistory:
    """The folds a store's manifest recorded before this run of preprocess."""

    count: int
    seed: int | None
    of_case: dict[str, int | None]  # labelled case id -> fold


def earlier_folds(out_dir: Path) -> FoldHistory | None:
    """The folds of the store at `out_dir`, None if it has none (or no readable manifest)."""
    try:
        manifest = read_manifest(out_dir)
        if manifest is None or not manifest.get("folds"):
            return None
        of_case = {
            c["id"]: c.get("fold") for c in manifest["cases"] if c.get("label_source") is not None
        }
        return FoldHistory(int(manifest["folds"]), manifest.get("fold_seed"), of_case)
    except (CtsegError, KeyError, TypeError, ValueError, AttributeError):
        return None  # a damaged manifest (rebuilt with `force`) keeps nothing


def fold_plan(
    layout: RawLayout, out_dir: Path, config: Config, earlier: FoldHistory | None, force: bool
) -> tuple[int, int]:
    """(folds, seed) this run assigns, checked before any case is prepared.

    data.folds = 0 keeps the store's own folds; another count or seed than the store's
    is refused unless `force` (fold runs may have trained on them).
    """
    asked, seed = config.data.folds, config.data.split_seed
    if asked == 0:
        keep = earlier is not None and not layout.predict_only
        return (earlier.count, earlier.seed or 0) if keep else (0, 0)
    if layout.predict_only:
        raise CtsegError(
            f"data.folds = {asked}, but the raw folder holds no labels: a predict-only store "
            "has no cases to cross-validate"
        )
    if asked > len(layout.cases):
        raise CtsegError(
            f"data.folds = {asked} needs at least {asked} labelled cases; the raw folder holds "
            f"{len(layout.cases)}"
        )
    if earlier is not None and (earlier.count, earlier.seed) != (asked, seed) and not force:
        raise CtsegError(
            f"{out_dir} has {earlier.count} folds (seed {earlier.seed}), which fold runs may "
            f"have trained on; data.folds = {asked} with data.split_seed = {seed} would assign "
            f"others: assign those with ctseg folds ({asked} folds, seed {seed}, forced), or "
            "leave data.folds = 0 to keep them"
        )
    return asked, seed


def with_folds(
    out_dir: Path,
    entries: list[CaseEntry],
    folds: int,
    seed: int,
    earlier: FoldHistory | None,
    warn: Callable[[str], None] | None,
) -> tuple[list[CaseEntry], int]:
    """`entries` with their folds (over the labelled ones), and the count of folds.

    Fewer labelled cases than folds (some failed) leaves the store without folds until
    they are fixed; labelled cases that changed since the folds were drawn draw them
    again. Either is said through `warn`.
    """
    labelled = [e.id for e in entries if e.labelled]
    if folds and len(labelled) < folds:
        if warn is not None:
            warn(
                f"only {len(labelled)} labelled case(s) were prepared, fewer than {folds} "
                "folds: the store has no folds until the failed cases are fixed"
            )
        folds = 0
    of_case = assign_folds(labelled, folds, seed) if folds else {}
    if earlier is not None and folds and of_case != earlier.of_case and warn is not None:
        if (earlier.count, earlier.seed) == (folds, seed):
            what = (
                f"the labelled cases of {out_dir} changed since its {folds} folds were drawn, "
                "so they were drawn again"
            )
        else:  # `force`
            what = (
                f"the {earlier.count} folds (seed {earlier.seed}) of {out_dir} were replaced by "
                f"{folds} folds (seed {seed})"
            )
        warn(
            f"{what}: fold runs trained on the earlier folds can no longer be resumed or "
            "evaluated together"
        )
    return [dataclasses.replace(e, fold=of_case.get(e.id)) for e in entries], folds


@dataclass(frozen=True)
class FoldsResult:
    """What `write_folds` did: the store as it is now, and whether its manifest changed."""

    store: Store
    changed: bool
    earlier: int  # the folds the store had before


def write_folds(
    store_dir: str | Path,
    folds: int,
    seed: int = 0,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
) -> FoldsResult:
    """Assign `folds` cross-validation folds (0: none) to an existing store (`ctseg folds`).

    Rewrites manifest.json alone, atomically, under the store's lock; the arrays and
    case.json files are not touched. Folds equal to the store's are left as they are;
    other folds over a store that has some need `force`, because runs trained on the
    old ones could no longer be resumed or evaluated together (their fold.json
    records the cases they validated on, and both refuse the mismatch).
    """
    store_dir = Path(store_dir)
    if folds < 0 or folds == 1:
        raise OptionError(f"`folds` must be 0 (no folds) or at least 2, got {folds}")
    if seed < 0:
        raise OptionError(f"`seed` must not be negative, got {seed}")
    if manifest_file(store_dir) is None:
        raise CtsegError(
            f"no prepared store at {store_dir} ({MANIFEST} missing); run `ctseg preprocess` first"
        )
    with lock.hold(store_dir, warn):
        current = Store.open(store_dir)
        labelled = [case.id for case in current.cases if case.labelled]
        if folds > len(labelled):
            raise OptionError(
                f"`folds` {folds} needs at least {folds} labelled cases; the store at {store_dir} "
                f"has {len(labelled)}"
            )
        of_case = assign_folds(labelled, folds, seed) if folds else {}
        now = {case.id: case.fold for case in current.cases if case.labelled}
        same_assignment = now == {i: of_case.get(i) for i in labelled}
        if same_assignment and (current.folds, current.fold_seed) == (
            folds,
            seed if folds else None,
        ):
            return FoldsResult(current, changed=False, earlier=current.folds)
        if current.folds and not force:
            raise OptionError(
                f"{store_dir} already has {current.folds} folds (seed {current.fold_seed}); "
                "runs trained on them could no longer be resumed or evaluated together: "
                "give `force` to re-assign them"
            )
        entries = [dataclasses.replace(case, fold=of_case.get(case.id)) for case in current.cases]
        cases = [entry.to_json() for entry in entries]
        write_manifest(store_dir, current.grid_spec, cases, folds, seed if folds else None)
        return FoldsResult(Store.open(store_dir), changed=True, earlier=current.folds)
