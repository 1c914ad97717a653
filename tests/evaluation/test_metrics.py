"""Metrics on hand-built masks with known answers."""

import time

import numpy as np
import pytest
from scipy import ndimage

from ctseg import labels
from ctseg.evaluation import metrics
from ctseg.labels import bounding_box


def box_mask(shape, *ranges) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask[tuple(slice(a, b) for a, b in ranges)] = True
    return mask


def ball(shape, centre, radius) -> np.ndarray:
    grid = np.ogrid[tuple(slice(0, n) for n in shape)]
    return sum((g - c) ** 2 for g, c in zip(grid, centre, strict=True)) <= radius**2


def brute_force_distances(pred, ref, spacing):
    """Pooled surface distances by comparing every pair of surface voxels."""
    pred_points = np.argwhere(metrics.surface(pred)) * np.asarray(spacing)
    ref_points = np.argwhere(metrics.surface(ref)) * np.asarray(spacing)
    pairwise = np.linalg.norm(pred_points[:, None, :] - ref_points[None, :, :], axis=-1)
    return np.concatenate([pairwise.min(axis=1), pairwise.min(axis=0)])


# ---------------------------------------------------------------- overlap and distances


def test_identical_masks_are_perfect():
    mask = box_mask((12, 12, 12), (2, 9), (3, 8), (4, 10))
    result = metrics.structure_metrics(mask, mask, (0.7, 0.7, 2.5))
    assert result["dice"] == result["jaccard"] == 1.0
    assert result["voe"] == result["rvd"] == 0.0
    assert result["assd"] == result["hd95"] == result["mssd"] == 0.0


def test_surface_is_face_connected_shell():
    cube = box_mask((7, 7, 7), (1, 6), (1, 6), (1, 6))  # 5³ cube → 3³ interior
    assert metrics.surface(cube).sum() == 5**3 - 3**3
    # The volume border counts as background: a full array is all surface on its faces.
    assert metrics.surface(np.ones((4, 4, 4), bool)).sum() == 4**3 - 2**3


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3])
def test_cubes_offset_along_one_axis(axis, k):
    spacing = (0.8, 1.5, 3.0)
    side = 6
    ranges = [(4, 4 + side)] * 3
    shifted = list(ranges)
    shifted[axis] = (4 + k, 4 + side + k)
    pred = box_mask((20, 20, 20), *ranges)
    ref = box_mask((20, 20, 20), *shifted)
    result = metrics.structure_metrics(pred, ref, spacing)
    overlap = (side - k) / side
    assert result["dice"] == pytest.approx(overlap)  # 2·(side-k)s² / (2·side³)
    assert result["jaccard"] == pytest.approx((side - k) / (side + k))
    assert result["rvd"] == 0.0
    assert result["mssd"] == pytest.approx(k * spacing[axis])
    pooled = brute_force_distances(pred, ref, spacing)
    assert result["assd"] == pytest.approx(pooled.mean())
    assert result["hd95"] == pytest.approx(np.percentile(pooled, 95))


def test_assd_by_hand_on_two_small_cubes():
    # 2×2×2 cubes shifted by one voxel along x (spacing 2 mm): every voxel is surface.
    # Each side has 4 voxels inside the other (distance 0) and 4 one step away (2 mm):
    # pooled distances = eight 0s and eight 2s → ASSD 1, MSSD 2, HD95 2.
    pred = box_mask((6, 6, 6), (1, 3), (1, 3), (1, 3))
    ref = box_mask((6, 6, 6), (2, 4), (1, 3), (1, 3))
    result = metrics.structure_metrics(pred, ref, (2.0, 0.5, 0.5))
    assert result["assd"] == pytest.approx(1.0)
    assert result["mssd"] == pytest.approx(2.0)
    assert result["hd95"] == pytest.approx(2.0)
    assert result["dice"] == pytest.approx(0.5)
    assert result["jaccard"] == pytest.approx(1 / 3)
    assert result["voe"] == pytest.approx(2 / 3)


def test_concentric_spheres_distance_is_radius_difference():
    shape = (40, 40, 40)
    small, large = ball(shape, (20, 20, 20), 8), ball(shape, (20, 20, 20), 12)
    result = metrics.structure_metrics(small, large, (1.0, 1.0, 1.0))
    assert result["assd"] == pytest.approx(4.0, abs=0.6)
    assert result["hd95"] == pytest.approx(4.0, abs=1.0)
    assert result["mssd"] == pytest.approx(4.0, abs=1.0)
    assert result["rvd"] == pytest.approx(8**3 / 12**3 - 1, abs=0.05)


def test_one_voxel_lesion():
    pred = box_mask((5, 5, 5), (2, 3), (2, 3), (2, 3))
    ref = box_mask((5, 5, 5), (2, 3), (2, 3), (3, 4))
    result = metrics.structure_metrics(pred, ref, (1.0, 1.0, 2.5))
    assert result["dice"] == 0.0
    assert result["assd"] == result["hd95"] == result["mssd"] == pytest.approx(2.5)
    same = metrics.structure_metrics(pred, pred, (1.0, 1.0, 2.5))
    assert same["dice"] == 1.0 and same["mssd"] == 0.0


def test_random_masks_match_brute_force_and_are_symmetric():
    rng = np.random.default_rng(0)
    spacing = (0.6, 0.9, 2.0)
    a = rng.random((10, 11, 9)) < 0.3
    b = rng.random((10, 11, 9)) < 0.3
    ab = metrics.structure_metrics(a, b, spacing)
    ba = metrics.structure_metrics(b, a, spacing)
    pooled = brute_force_distances(a, b, spacing)
    assert ab["assd"] == pytest.approx(pooled.mean())
    assert ab["hd95"] == pytest.approx(np.percentile(pooled, 95))
    assert ab["mssd"] == pytest.approx(pooled.max())
    for key in ("dice", "jaccard", "voe", "assd", "hd95", "mssd"):
        assert ab[key] == pytest.approx(ba[key]), key


EMPTY = np.zeros((6, 6, 6), bool)
FULL = box_mask((6, 6, 6), (1, 4), (1, 4), (1, 4))


@pytest.mark.parametrize(
    ("pred", "ref", "expected"),
    [
        (EMPTY, EMPTY, {"dice": 1.0, "jaccard": 1.0, "voe": 0.0, "rvd": 0.0}),
        (FULL, EMPTY, {"dice": 0.0, "jaccard": 0.0, "voe": 1.0, "rvd": None}),
        (EMPTY, FULL, {"dice": 0.0, "jaccard": 0.0, "voe": 1.0, "rvd": -1.0}),
    ],
    ids=["both-empty", "ref-empty", "pred-empty"],
)
def test_empty_mask_convention(pred, ref, expected):
    result = metrics.structure_metrics(pred, ref, (1.0, 1.0, 1.0))
    for key, value in expected.items():
        assert result[key] == value, key
    assert result["assd"] is None and result["hd95"] is None and result["mssd"] is None


def test_grid_dice_follows_empty_convention():
    ref = np.zeros((4, 4, 4), np.uint8)
    ref[1:3, 1:3, 1:3] = 1
    assert labels.grid_dice(ref, ref) == {"liver": 1.0, "tumour": 1.0}
    pred = ref.copy()
    pred[1, 1, 1] = 2
    assert labels.grid_dice(pred, ref) == {"liver": 1.0, "tumour": 0.0}


def test_mask_dice_is_twice_the_overlap_over_the_sizes():
    pred = np.zeros((6, 6, 6), bool)
    ref = np.zeros((6, 6, 6), bool)
    pred[0:3, 0:2, 0:2] = True  # 12 voxels
    ref[1:4, 0:2, 0:1] = True  # 6 voxels, 4 of them in pred
    assert labels.mask_dice(pred, ref) == pytest.approx(2 * 4 / (12 + 6))
    assert labels.mask_dice(ref, ref) == 1.0
    assert labels.mask_dice(pred & False, ref & False) == 1.0  # both empty
    assert labels.mask_dice(pred, ref & False) == 0.0


# ---------------------------------------------------------------- lesions and burden


def test_lesion_detection_on_a_constructed_case():
    shape = (60, 20, 20)
    ref = np.zeros(shape, bool)
    pred = np.zeros(shape, bool)
    # 1. detected: prediction equals the lesion.
    ref[2:6, 2:6, 2:6] = pred[2:6, 2:6, 2:6] = True
    # 2. missed: nothing predicted.
    ref[10:14, 2:6, 2:6] = True
    # 3. split: the lesion predicted as two pieces with a one-slice gap (IoU 48/64 > 0.5).
    ref[18:22, 2:6, 2:6] = True
    pred[18:22, 2:6, 2:4] = pred[18:22, 2:6, 5:6] = True
    # 4. merged: one blob covers two lesions and the 2-voxel gap between them.
    ref[28:31, 2:6, 2:6] = ref[33:36, 2:6, 2:6] = True
    pred[28:36, 2:6, 2:6] = True
    # 5. false positive far from every lesion.
    pred[50:53, 10:13, 10:13] = True
    # 6. a predicted piece overlapping lesion 2 too little to detect it (neither TP nor FP).
    pred[10, 2, 2] = True

    result = metrics.lesion_detection(pred, ref, (1, 1, 1))
    assert result["n_ref"] == 5  # lesions 1, 2, 3, and the two merged ones
    # IoU of each merged lesion with the blob minus the other lesion: 48 / (48 + 32) = 0.6.
    assert result["n_detected"] == 4
    assert result["n_pred"] == 6  # 1, two pieces of 3, blob, false positive, stray voxel
    assert result["n_pred_tp"] == 4
    assert result["n_pred_fp"] == 1
    summary = metrics.summarize(
        [metrics.case_metrics(pred.astype(np.uint8) * 2, ref * 2, (1, 1, 1))]
    )
    assert summary["tumour"]["detection_recall"] == pytest.approx(4 / 5)
    assert summary["tumour"]["detection_precision"] == pytest.approx(4 / 6)


def test_measurable_lesions_are_counted_apart():
    """Lesions from 10 mm across (the diameter of a ball of their volume) are measurable:
    a missed lesion of 5 mm lowers the recall, not the measurable lesions' recall."""
    shape = (40, 40, 40)
    ref, pred = np.zeros(shape, bool), np.zeros(shape, bool)
    ref[2:12, 2:12, 2:12] = pred[2:12, 2:12, 2:12] = True  # 1000 mm³: 12.4 mm, detected
    ref[20:29, 2:11, 2:11] = True  # 729 mm³: 11.2 mm, missed
    ref[2:6, 20:24, 20:24] = True  # 64 mm³: 5.0 mm, missed
    ref[30:38, 30:38, 30:31] = True  # 64 mm³ too, however flat its 8 × 8 mm
    result = metrics.lesion_detection(pred, ref, (1.0, 1.0, 1.0))
    assert (result["n_ref"], result["n_detected"]) == (4, 1)
    assert (result["n_ref_measurable"], result["n_detected_measurable"]) == (2, 1)
    # The same voxels at 0.5 mm: 125 and 91 mm³, nothing measurable.
    assert metrics.lesion_detection(pred, ref, (0.5, 0.5, 0.5))["n_ref_measurable"] == 0
    cases = [metrics.case_metrics(pred.astype(np.uint8) * 2, ref * 2, (1, 1, 1))]
    tumour = metrics.summarize(cases)["tumour"]
    assert tumour["detection_recall"] == pytest.approx(1 / 4)
    assert tumour["detection_recall_measurable"] == pytest.approx(1 / 2)


def naive_lesion_detection(pred, ref, spacing):
    """The documented rule, one lesion and one component at a time."""
    full = np.ones((3, 3, 3), bool)
    ref_labels, n_ref = ndimage.label(ref, full)
    pred_labels, n_pred = ndimage.label(pred, full)
    detected, measurable = [], []
    for r in range(1, n_ref + 1):
        lesion = ref_labels == r
        touching = np.setdiff1d(pred_labels[lesion], [0])
        predicted = np.isin(pred_labels, touching) & ~(ref & ~lesion)
        detected.append((lesion & predicted).sum() / (lesion | predicted).sum() > 0.5)
        diameter = np.cbrt(6 * lesion.sum() * np.prod(spacing) / np.pi)
        measurable.append(diameter >= 10)
    detected_measurable = sum(d and m for d, m in zip(detected, measurable, strict=True))
    tp = fp = 0
    for p in range(1, n_pred + 1):
        lesions = np.setdiff1d(ref_labels[pred_labels == p], [0])
        fp += lesions.size == 0
        tp += any(detected[r - 1] for r in lesions)
    return {"n_ref": n_ref, "n_detected": sum(detected), "n_pred": n_pred, "n_pred_tp": tp,
            "n_pred_fp": fp, "n_ref_measurable": sum(measurable),
            "n_detected_measurable": detected_measurable}  # fmt: skip


def test_lesion_detection_matches_the_naive_rule_on_random_cases():
    rng = np.random.default_rng(1)
    for _ in range(20):
        ref = ndimage.binary_opening(rng.random((14, 14, 10)) < 0.35)
        pred = ref ^ (rng.random(ref.shape) < rng.choice([0.02, 0.1]))
        spacing = rng.uniform(2.0, 6.0, 3)  # lesions either side of 10 mm (6 of 11 above)
        found = metrics.lesion_detection(pred, ref, spacing)
        assert found == naive_lesion_detection(pred, ref, spacing)


def test_lesion_detection_iou_threshold_and_empty():
    ref = box_mask((10, 10, 10), (2, 6), (2, 6), (2, 6))  # 64 voxels
    half = box_mask((10, 10, 10), (2, 4), (2, 6), (2, 6))  # IoU exactly 0.5: not detected
    assert metrics.lesion_detection(half, ref, (1, 1, 1))["n_detected"] == 0
    more = box_mask((10, 10, 10), (2, 5), (2, 6), (2, 6))  # IoU 0.75
    assert metrics.lesion_detection(more, ref, (1, 1, 1))["n_detected"] == 1
    empty = np.zeros_like(ref)
    assert metrics.lesion_detection(empty, empty, (1, 1, 1)) == {
        "n_ref": 0, "n_detected": 0, "n_pred": 0, "n_pred_tp": 0, "n_pred_fp": 0,
        "n_ref_measurable": 0, "n_detected_measurable": 0,
    }  # fmt: skip


def test_burden():
    ref = np.zeros((10, 10, 10), np.uint8)
    ref[0:5] = 1
    ref[0:1] = 2  # 100 tumour voxels in a 500-voxel liver → 0.2
    pred = ref.copy()
    pred[1:2] = 2  # 200 of 500 → 0.4
    burden = metrics.case_metrics(pred, ref, (1, 1, 1))["burden"]
    assert burden == pytest.approx({"ref": 0.2, "pred": 0.4, "error": 0.2})
    assert metrics.burden_metrics(np.zeros_like(ref), ref)["error"] is None


# ---------------------------------------------------------------- data set


def test_global_dice_differs_from_mean_dice():
    shape = (20, 20, 20)
    big = np.zeros(shape, np.uint8)
    big[0:10] = 1  # 4000 voxels, predicted exactly
    small_ref = np.zeros(shape, np.uint8)
    small_ref[0:1, 0:2, 0:2] = 1  # 4 voxels
    small_pred = np.zeros(shape, np.uint8)
    small_pred[0:1, 0:2, 0:1] = 1  # 2 of them
    cases = [
        metrics.case_metrics(big, big, (1, 1, 1)),
        metrics.case_metrics(small_pred, small_ref, (1, 1, 1)),
    ]
    liver = metrics.summarize(cases)["liver"]
    assert liver["dice_per_case"] == pytest.approx((1.0 + 2 * 2 / 6) / 2)
    assert liver["dice_global"] == pytest.approx(2 * (4000 + 2) / (8000 + 6))
    assert liver["dice_global"] != pytest.approx(liver["dice_per_case"])


def test_summary_skips_undefined_values():
    labels = np.zeros((6, 6, 6), np.uint8)
    labels[1:5, 1:5, 1:5] = 1
    with_tumour = labels.copy()
    with_tumour[2:4, 2:4, 2:4] = 2
    cases = [
        metrics.case_metrics(labels, labels, (1, 1, 1)),  # no tumour anywhere: distances None
        metrics.case_metrics(with_tumour, with_tumour, (1, 1, 1)),
    ]
    tumour = metrics.summarize(cases)["tumour"]
    assert tumour["dice_per_case"] == 1.0
    assert tumour["assd"] == 0.0
    assert metrics.summarize([])["liver"]["dice_global"] is None


# ---------------------------------------------------------------- speed


def test_bounding_box_keeps_large_sparse_volumes_fast():
    shape = (256, 256, 200)
    ref = np.zeros(shape, np.uint8)
    pred = np.zeros(shape, np.uint8)
    ref[100:140, 90:150, 80:120] = 1
    pred[102:141, 92:150, 80:121] = 1
    ref[110:115, 100:105, 90:95] = pred[111:116, 100:105, 90:95] = 2
    start = time.perf_counter()
    result = metrics.case_metrics(pred, ref, (0.8, 0.8, 2.0))
    elapsed = time.perf_counter() - start
    assert result["liver"]["mssd"] == pytest.approx(np.hypot(2 * 0.8, 2 * 0.8))
    # Two whole-volume distance transforms take ~5 s on a dev machine; the crop, ~0.2 s.
    assert elapsed < 3.0, elapsed


def test_bounding_box_helper():
    mask = np.zeros((5, 6, 7), bool)
    assert bounding_box(mask) is None
    mask[1, 2, 6] = True
    assert bounding_box(mask, pad=1) == (slice(0, 3), slice(1, 4), slice(5, 7))
