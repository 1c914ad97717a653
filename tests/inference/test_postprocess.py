"""Post-processing and per-scan statistics on phantoms with known answers."""

import time
import tracemalloc

import numpy as np
import pytest
from scipy import ndimage, spatial

from ctseg.inference.scan.postprocess import (
    MEASURED_TUMOURS,
    clean_labels,
    components,
    largest_component,
    max_diameter_mm,
    scan_stats,
)
from ctseg.io.pictures import plot_preview


def phantom() -> tuple[np.ndarray, np.ndarray]:
    """A 40×40×20 mm cube liver (32 mL) at 1×1×2 mm voxels with two tumours inside."""
    labels = np.zeros((60, 60, 30), np.uint8)
    labels[10:50, 10:50, 5:15] = 1  # 40 × 40 × 10 voxels of 2 µL each
    x, y, z = np.ogrid[:60, :60, :30]
    sphere = (x - 30) ** 2 + (y - 30) ** 2 + ((z - 10) * 2) ** 2 <= 8**2  # radius 8 mm
    labels[sphere] = 2
    labels[12:14, 12:14, 6:8] = 2  # a second, 2×2×2-voxel tumour
    return labels, np.diag([1.0, 1.0, 2.0, 1.0])


def test_stats_of_a_phantom():
    labels, affine = phantom()
    stats = scan_stats(labels, affine)
    assert stats["liver_volume_ml"] == pytest.approx(32.0)  # tumours count as liver
    tumour_voxels = np.count_nonzero(labels == 2)
    assert stats["tumour_volume_ml"] == pytest.approx(tumour_voxels * 0.002)
    assert stats["tumour_volume_ml"] == pytest.approx(4 / 3 * np.pi * 8**3 / 1000 + 0.016, rel=0.1)
    assert stats["tumour_count"] == 2
    assert stats["largest_tumour_diameter_mm"] == pytest.approx(16.0)  # centres 8 mm either side
    assert stats["tumour_burden_percent"] == pytest.approx(100 * tumour_voxels * 0.002 / 32.0)
    # Every tumour, largest first, with where it is (its bounding box's centre) in mm.
    sphere, small = stats["tumours"]
    assert sphere["volume_ml"] + small["volume_ml"] == pytest.approx(stats["tumour_volume_ml"])
    assert sphere["box_centre_mm"] == [30.0, 30.0, 20.0] and sphere["diameter_mm"] == 16.0
    assert small == {
        "volume_ml": pytest.approx(0.016),
        "box_centre_mm": [12.5, 12.5, 13.0],
        "diameter_mm": pytest.approx(np.sqrt(1 + 1 + 4)),
    }


def test_stats_of_an_empty_map():
    stats = scan_stats(np.zeros((5, 5, 5), np.uint8), np.eye(4))
    assert stats == {
        "liver_volume_ml": 0.0,
        "tumour_volume_ml": 0.0,
        "tumour_count": 0,
        "largest_tumour_diameter_mm": 0.0,
        "tumour_burden_percent": 0.0,
        "tumours": [],
    }


def test_a_noisy_prediction_with_20000_tumours_is_summed_up_quickly(tmp_path):
    """Every tumour is listed; diameters are measured for the largest only (a hull each)."""
    labels = np.ones((100, 100, 18), np.uint8)
    labels[::2, ::2, 1:17:2] = 2  # 50 × 50 × 8 isolated voxels: 20,000 26-connected tumours
    # One real tumour, which merges with the specks touching it: x and y in {40, …, 46}
    # (4 each), z in {7, 9, 11} (3): 48 specks, 9 of them inside the block.
    labels[40:46, 40:46, 8:11] = 2
    stats = scan_stats(labels, np.diag([0.8, 0.8, 2.5, 1.0]))
    assert stats["tumour_count"] == len(stats["tumours"]) == 20000 - 48 + 1
    assert stats["tumours"][0]["volume_ml"] == pytest.approx((6 * 6 * 3 + 48 - 9) * 0.0016)
    measured = [t for t in stats["tumours"] if "diameter_mm" in t]
    assert len(measured) == MEASURED_TUMOURS
    # From voxel (40, 40, 7) to (46, 46, 11).
    assert stats["largest_tumour_diameter_mm"] == pytest.approx(np.hypot(np.hypot(4.8, 4.8), 10))
    hu = np.zeros(labels.shape, np.int16)
    plot_preview(hu, labels, (0.8, 0.8, 2.5), tmp_path / "preview.png")
    assert (tmp_path / "preview.png").stat().st_size > 0


def test_oblique_voxels_are_measured_through_the_affine():
    c, s = np.cos(0.5), np.sin(0.5)
    rotated = np.array([[2 * c, -2 * s, 0, 0], [2 * s, 2 * c, 0, 0], [0, 0, 3, 0], [0, 0, 0, 1]])
    labels = np.zeros((10, 10, 10), np.uint8)
    labels[2:8, 2:8, 2:8] = 2
    stats = scan_stats(labels, rotated)
    assert stats["tumour_volume_ml"] == pytest.approx(216 * 12 / 1000)
    assert stats["largest_tumour_diameter_mm"] == pytest.approx(np.sqrt(2 * 10**2 + 15**2))


def test_diameter_of_degenerate_pieces():
    affine = np.eye(4)
    assert max_diameter_mm(np.array([[1.0, 2.0, 3.0]]), affine) == 0.0
    line = np.array([[0, 0, z] for z in range(6)], float)  # collinear: no hull
    assert max_diameter_mm(line, affine) == pytest.approx(5.0)


def test_a_flat_large_tumour_is_measured_in_seconds_and_little_memory():
    # One 512×512 slice with a 300×300 tumour: no 3-D hull exists, and comparing every
    # pair of its 90 000 voxels would take 30 GiB.
    labels = np.zeros((512, 512, 1), np.uint8)
    labels[100:450, 100:450] = 1
    labels[120:420, 130:430] = 2
    affine = np.diag([0.7, 0.8, 5.0, 1.0])
    tracemalloc.start()
    started = time.perf_counter()
    try:
        stats = scan_stats(labels, affine)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 10 and peak < 200 * 2**20
    assert stats["largest_tumour_diameter_mm"] == pytest.approx(np.hypot(299 * 0.7, 299 * 0.8))


@pytest.mark.parametrize("seed", range(6))
def test_diameter_equals_every_pair_compared(seed):
    # Solid, holed, flat (one slice, one row) and oblique pieces, above and below the size
    # from which only the surface is measured.
    rng = np.random.default_rng(seed)
    shape = [(14, 12, 10), (30, 20, 1), (25, 1, 1), (20, 18, 9), (1, 30, 30), (9, 9, 9)][seed]
    voxels = np.argwhere(rng.random(shape) < (0.97 if seed % 2 else 0.4)).astype(float)
    affine = np.eye(4)
    affine[:3, :3] = rng.normal(size=(3, 3))
    every_pair = spatial.distance.pdist(voxels @ affine[:3, :3].T).max()
    assert max_diameter_mm(voxels, affine) == pytest.approx(every_pair, rel=1e-9)


def sprawling_tumours(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A liver block whose tumours are thresholded smooth noise: tens to hundreds of
    pieces, solid and sprawling, some of them thousands of voxels (as an untrained
    network predicts), on an oblique, sheared affine."""
    rng = np.random.default_rng(seed)
    labels = np.zeros((60, 50, 40), np.uint8)
    labels[5:55, 5:45, 3:37] = 1
    noise = ndimage.gaussian_filter(rng.normal(size=labels.shape), rng.uniform(0.7, 3.0))
    labels[(noise > np.quantile(noise, rng.uniform(0.8, 0.97))) & (labels == 1)] = 2
    affine = np.eye(4)
    affine[:3, :3] = rng.normal(size=(3, 3))
    return labels, affine


@pytest.mark.parametrize("seed", range(4))
def test_diameters_of_many_sprawling_tumours_equal_every_pair_compared(seed):
    labels, affine = sprawling_tumours(seed)
    stats = scan_stats(labels, affine)
    pieces, count = ndimage.label(labels == 2, structure=np.ones((3, 3, 3)))
    assert stats["tumour_count"] == count > MEASURED_TUMOURS
    sizes = np.bincount(pieces.ravel())[1:]
    largest = np.argsort(-sizes, kind="stable")[:MEASURED_TUMOURS] + 1
    assert sizes.max() > 1000  # measured from its hull's candidates, not from every voxel
    for tumour, piece in zip(stats["tumours"], largest, strict=False):
        points = np.argwhere(pieces == piece) @ affine[:3, :3].T
        every_pair = spatial.distance.pdist(points).max() if len(points) > 1 else 0.0
        # The same two voxels' distance, computed alike: equal, not merely close.
        assert tumour["diameter_mm"] == every_pair
    assert all("diameter_mm" not in t for t in stats["tumours"][MEASURED_TUMOURS:])


def test_keep_largest_liver_drops_other_pieces_with_their_tumour():
    labels, _ = phantom()
    labels[52:58, 52:58, 20:25] = 1  # a small detached "liver"
    labels[54, 54, 22] = 2
    cleaned = clean_labels(labels, keep_largest_liver=True, tumour_inside_liver=False)
    assert not cleaned[52:58, 52:58, 20:25].any()
    np.testing.assert_array_equal(cleaned[:50, :50], labels[:50, :50])
    assert largest_component(np.zeros((3, 3, 3), bool)).sum() == 0


def test_tumour_outside_liver_is_dropped():
    labels, _ = phantom()
    labels[52:55, 52:55, 20:23] = 2  # tumour with no liver around it
    labels[55:58, 0:3, 0:3] = 1  # a separate liver piece, kept without keep_largest_liver
    cleaned = clean_labels(labels, keep_largest_liver=False, tumour_inside_liver=True)
    assert not cleaned[52:55, 52:55, 20:23].any()
    assert (cleaned[55:58, 0:3, 0:3] == 1).all()
    assert np.count_nonzero(cleaned == 2) == np.count_nonzero(phantom()[0] == 2)
    unchanged = clean_labels(labels, keep_largest_liver=False, tumour_inside_liver=False)
    np.testing.assert_array_equal(unchanged, labels)


def test_default_post_processing_applies_both_rules_together():
    """A tumour inside a detached liver piece goes with the piece (keep-largest first)."""
    labels, _ = phantom()
    labels[52:58, 52:58, 20:25] = 1
    labels[54, 54, 22] = 2  # a tumour in the detached piece: inside *a* liver, not *the* liver
    labels[0:3, 55:58, 0:3] = 2  # a tumour with no liver at all
    cleaned = clean_labels(labels, keep_largest_liver=True, tumour_inside_liver=True)
    expected = phantom()[0]
    np.testing.assert_array_equal(cleaned, expected)
    from ctseg.config import PredictConfig

    defaults = PredictConfig()
    assert defaults.keep_largest_liver and defaults.tumour_inside_liver


def test_stats_on_a_negative_determinant_affine_equal_those_on_ras():
    labels, ras = phantom()
    lps = ras.copy()
    lps[0, 0] = -1.0  # one axis stored reversed: a negative determinant, no longer a rotation
    assert np.linalg.det(lps) < 0
    got, want = scan_stats(labels, lps), scan_stats(labels, ras)
    tumours = [v for t in got.pop("tumours") for v in (t["volume_ml"], t["diameter_mm"])]
    assert tumours == pytest.approx(
        [v for t in want.pop("tumours") for v in (t["volume_ml"], t["diameter_mm"])]
    )
    assert got == pytest.approx(want)  # where each tumour is mirrors along x; its size does not


def _scipy_clean_labels(labels: np.ndarray, keep_largest: bool, inside_liver: bool) -> np.ndarray:
    """`clean_labels` as scipy.ndimage.label made it on the whole map: the reference."""
    full = ndimage.generate_binary_structure(3, 3)
    labels = labels.copy()
    if keep_largest and (labels >= 1).any():
        pieces, _ = ndimage.label(labels >= 1, structure=full)
        sizes = np.bincount(pieces.ravel())
        sizes[0] = 0
        labels[pieces != sizes.argmax()] = 0
    if inside_liver:
        pieces, count = ndimage.label(labels >= 1, structure=full)
        has_liver = np.zeros(count + 1, bool)
        has_liver[np.unique(pieces[labels == 1])] = True
        has_liver[0] = True
        labels[~has_liver[pieces]] = 0
    return labels


def _hand_built_maps() -> list[np.ndarray]:
    """Pieces touching only at an edge or a corner (26- but not 6-connected), two equal
    largest pieces (the first in C order wins), tumour alone, and noise."""
    maps = []
    corner = np.zeros((8, 8, 8), np.uint8)
    corner[1:3, 1:3, 1:3] = 1
    corner[3:5, 3:5, 3:5] = 2  # meets the first block at one corner voxel
    corner[6:8, 0:2, 6:8] = 1
    maps.append(corner)
    ties = np.zeros((10, 6, 6), np.uint8)
    ties[6:9, 1:4, 1:4] = 1  # equal size, later in C order
    ties[1:4, 1:4, 1:4] = 1
    ties[2, 2, 2] = 2
    maps.append(ties)
    alone = np.zeros((6, 6, 6), np.uint8)
    alone[1:3, 1:3, 1:3] = 2  # the largest piece holds no liver
    alone[4, 4, 4] = 1
    maps.append(alone)
    rng = np.random.default_rng(5)
    for density in (0.1, 0.3):
        maps.append(rng.choice(3, size=(17, 13, 11), p=[1 - density, density / 2, density / 2]))
    return [m.astype(np.uint8) for m in maps]


@pytest.mark.parametrize("rules", [(True, True), (True, False), (False, True), (False, False)])
def test_clean_labels_equals_scipy_s(rules):
    for labels in _hand_built_maps():
        np.testing.assert_array_equal(
            clean_labels(labels, *rules), _scipy_clean_labels(labels, *rules)
        )


def test_components_are_numbered_as_scipy_numbers_them():
    """cc3d's numbering (C order of each piece's first voxel) is scipy's, on views too:
    `scan_stats` lists tumours of equal volume in that order."""
    full = ndimage.generate_binary_structure(3, 3)
    for labels in _hand_built_maps():
        mask = labels >= 1
        for view in (mask, mask[1:, ::2], mask[::-1], np.asfortranarray(mask)):
            pieces, count = components(view)
            expected, expected_count = ndimage.label(view, structure=full)
            assert count == expected_count
            np.testing.assert_array_equal(pieces, expected)
