"""The synthetic LiTS-like data set: deterministic, at physical scale, stored as CT is."""

import hashlib
import json

import nibabel as nib
import numpy as np
import pytest
from scipy import ndimage

from ctseg.errors import CtsegError
from ctseg.io.scans import read_scan
from ctseg.synth.cases import (
    KINDS,
    MAX_SLICES_PER_SIZE,
    SLICE_MM,
    Z_EXTENT_MM,
    extent_group,
    random_case,
)
from ctseg.synth.dataset import SIDECAR, write_dataset
from ctseg.synth.phantoms import make_phantom

CASES, SIZE = 3, 32
# Enough cases for every kind of scan; a matrix small enough to write them in a blink, and
# large enough that a 500 mm field of view has voxels a CT can have (ctseg reads none over
# 25 mm: 500 / 24 = 20.8).
MANY, SMALL = 40, 24
# Pixels of 4.5–8 mm: livers measured to within a few per cent, small tumours a few voxels.
PHYSICAL, MEDIUM = 10, 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    write_dataset(out, CASES, SIZE, seed=7)
    return out


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    out = tmp_path_factory.mktemp("many")
    write_dataset(out, MANY, SMALL, seed=3)
    return out


@pytest.fixture(scope="module")
def physical(tmp_path_factory):
    out = tmp_path_factory.mktemp("physical")
    write_dataset(out, PHYSICAL, MEDIUM, seed=11)
    return out


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sidecar(folder) -> dict[str, dict]:
    return {entry["case"]: entry for entry in json.loads((folder / SIDECAR).read_text())["cases"]}


def _read(folder, index):
    """(canonical image, canonical labels) of a case, as ctseg reads them."""
    image = read_scan(folder / f"volume-{index}.nii.gz")
    return image, read_scan(folder / f"segmentation-{index}.nii.gz").array


def test_writes_lits_names_and_reports_progress(tmp_path):
    calls = []
    written = write_dataset(tmp_path, 2, 16, seed=0, progress=lambda *a: calls.append(a))
    assert [(v.name, s.name) for v, s in written] == [
        ("volume-0.nii.gz", "segmentation-0.nii.gz"),
        ("volume-1.nii.gz", "segmentation-1.nii.gz"),
    ]
    assert calls == [(1, 2, "volume-0"), (2, 2, "volume-1")]


def test_same_seed_same_voxels(dataset, tmp_path):
    write_dataset(tmp_path, 1, SIZE, seed=7)
    for name in ("volume-0.nii.gz", "segmentation-0.nii.gz"):
        again = np.asarray(nib.load(tmp_path / name).dataobj)
        np.testing.assert_array_equal(again, np.asarray(nib.load(dataset / name).dataobj))
    assert _sidecar(tmp_path)["volume-0"] == _sidecar(dataset)["volume-0"]
    other = tmp_path / "other"
    write_dataset(other, 1, SIZE, seed=8)
    assert _digest(other / "volume-0.nii.gz") != _digest(dataset / "volume-0.nii.gz")


def test_labels_and_anatomy(dataset):
    tumours = 0
    for index in range(CASES):
        image, labels = _read(dataset, index)
        assert labels.dtype == np.uint8 and set(np.unique(labels)) <= {0, 1, 2}
        assert image.array.shape == labels.shape
        liver = labels == 1
        assert liver.any()
        # The liver lies on the patient's right: high x in canonical RAS order.
        assert np.argwhere(labels > 0)[:, 0].mean() > SIZE / 2
        if (labels == 2).any():
            tumours += 1
            assert image.array[labels == 2].mean() < image.array[liver].mean() - 15
        assert image.array.min() >= -1024 and image.array[0, 0, 0] < -900  # air outside
    assert tumours > 0


def test_the_liver_has_a_real_size_whatever_the_scan_covers(physical):
    shares = []
    for index in range(PHYSICAL):
        image, labels = _read(physical, index)
        voxel_ml = np.prod(image.spacing) / 1000
        liver_ml = np.count_nonzero(labels) * voxel_ml  # tumours included
        assert 1200 <= liver_ml <= 2200, (index, liver_ml)
        shares.append(np.count_nonzero(labels) / labels.size)
        # On the patient's right: most of it right of the field of view's centre.
        x = (np.argwhere(labels > 0)[:, 0] + 0.5) * image.spacing[0]
        assert np.mean(x > MEDIUM * image.spacing[0] / 2) > 0.75
        # Its height (cranio-caudal) is a liver's, whatever the slice thickness.
        slices = np.flatnonzero(labels.any(axis=(0, 1)))
        assert 100 <= (slices[-1] - slices[0] + 1) * image.spacing[2] <= 260
    # Unlike phantoms stretched over the field of view, the liver's share of the scan
    # varies as much as the scans do.
    assert max(shares) > 3 * min(shares)


def test_the_liver_borders_fat_and_bowel_as_real_livers_do(physical):
    """Bowel loops in visceral fat fill the abdomen: around every liver lies fat, not one
    soft tissue (drawn as before this was added, 4–9 % of the voxels within two of the
    liver measured as fat, all of it blur, noise and the kidneys' fat; now 13–30 %)."""
    shares = []
    for index in range(PHYSICAL):
        image, labels = _read(physical, index)
        liver = labels > 0
        around = ndimage.binary_dilation(liver, iterations=2) & ~liver
        hu = image.array[around]
        shares.append(np.mean((hu > -160) & (hu < -40)))
    assert min(shares) > 0.11 and np.mean(shares) > 0.15, shares


def test_kinds_of_scan_and_where_the_liver_lies(many):
    entries = _sidecar(many)
    heights = {kind: [] for kind in KINDS}
    for index in range(MANY):
        image, labels = _read(many, index)
        entry = entries[f"volume-{index}"]
        extent = image.array.shape[2] * image.spacing[2]
        low, high = Z_EXTENT_MM[entry["kind"]]
        assert low - 1e-3 <= extent <= high + 1e-3, (index, entry["kind"], extent)
        assert extent_group(extent) == entry["kind"]
        assert 290 - 1e-3 <= image.array.shape[0] * image.spacing[0] <= 500 + 1e-3
        per_slice = np.count_nonzero(labels, axis=(0, 1))
        heights[entry["kind"]].append(
            per_slice @ (np.arange(labels.shape[2]) + 0.5) / per_slice.sum() / labels.shape[2]
        )
        if entry["kind"] == "abdominal":  # from just above the liver (10–60 mm) down
            above = (labels.shape[2] - 1 - np.flatnonzero(per_slice)[-1]) * image.spacing[2]
            assert above < 60 + 2 * image.spacing[2]
    assert all(len(h) >= 5 for h in heights.values()), {k: len(h) for k, h in heights.items()}
    assert all(0.3 < h < 0.7 for h in heights["liver-only"])  # about centred
    assert all(h > 0.45 for h in heights["abdominal"])  # in the upper part
    assert all(1 / 3 < h < 2 / 3 for h in heights["chest-abdomen-pelvis"])  # middle third
    everything = sum(heights.values(), [])
    assert max(everything) - min(everything) > 0.25


def test_slices_are_capped_by_thickening_them_never_by_cutting_the_scan(many):
    for index in range(MANY):
        image, _ = _read(many, index)
        assert image.array.shape[2] <= MAX_SLICES_PER_SIZE * SMALL
    cap = [e for e in _sidecar(many).values() if e["kind"] == "chest-abdomen-pelvis"]
    # 600–900 mm of ≤ 5 mm slices would be ≥ 120 of them: 40, each thicker.
    assert cap and all(e["shape"][2] == MAX_SLICES_PER_SIZE * SMALL for e in cap)
    assert all(e["spacing_mm"][2] > SLICE_MM[1] for e in cap)


def test_thin_and_thick_slices_over_the_same_anatomy():
    thickness, cases = [], {}
    for index in range(60):
        for size in (16, 512):
            case = random_case(np.random.default_rng((5, index)), size, index)
            cases.setdefault(index, []).append(case)
        slices, spacing = case.geometry.shape[2], case.geometry.spacing[2]
        assert slices <= MAX_SLICES_PER_SIZE * 512
        thickness.append(spacing)
    assert min(thickness) < 1.0 and max(thickness) > 3.5
    assert all(SLICE_MM[0] * 0.9 <= t <= SLICE_MM[1] * 1.1 for t in thickness)
    # The matrix changes the grid, not the patient nor what the scan covers.
    for small, large in cases.values():
        assert (small.kind, small.patient, small.z_top) == (large.kind, large.patient, large.z_top)
        extents = [c.geometry.shape[2] * c.geometry.spacing[2] for c in (small, large)]
        assert extents[0] == pytest.approx(extents[1])


def test_tumours_large_and_small(physical):
    with_tumours, volumes = 0, []
    for index in range(PHYSICAL):
        image, labels = _read(physical, index)
        components, count = ndimage.label(labels == 2)
        with_tumours += count > 0
        voxel_ml = np.prod(image.spacing) / 1000
        volumes += list(np.bincount(components.ravel())[1:] * voxel_ml)
    assert with_tumours >= 0.7 * PHYSICAL
    assert max(volumes) > 5  # sizeable: over 20 mm across
    assert min(volumes) < 0.6  # small: about 10 mm across or less


def test_tumours_lie_inside_the_liver(dataset):
    for index in range(CASES):
        labels = read_scan(dataset / f"segmentation-{index}.nii.gz").array
        tumour = np.argwhere(labels == 2)
        liver_box = np.argwhere(labels > 0)
        assert np.all(tumour >= liver_box.min(0)) and np.all(tumour <= liver_box.max(0))


def test_synth_json_agrees_with_the_files(many, physical):
    for folder, count in ((many, MANY), (physical, PHYSICAL)):
        entries = _sidecar(folder)
        assert sorted(entries) == sorted(f"volume-{i}" for i in range(count))
        for index in range(count):
            entry = entries[f"volume-{index}"]
            image, labels = _read(folder, index)
            nx, ny, nz = labels.shape
            assert entry["shape"] == [nx, ny, nz]
            np.testing.assert_allclose(entry["spacing_mm"], image.spacing, atol=1e-3)
            assert entry["z_extent_mm"] == pytest.approx(nz * image.spacing[2], abs=0.01)
            assert entry["in_plane_fov_mm"] == pytest.approx(nx * image.spacing[0], abs=0.01)
            liver_ml = np.count_nonzero(labels) * np.prod(image.spacing) / 1000
            assert entry["liver_ml"] == pytest.approx(liver_ml, abs=0.06)
            per_slice = np.count_nonzero(labels, axis=(0, 1))
            centre = per_slice @ (np.arange(nz) + 0.5) / per_slice.sum() / nz
            assert entry["liver_centre_height"] == pytest.approx(centre, abs=1e-4)
            assert (entry["tumours"] > 0) == (labels == 2).any()
            assert entry["kind"] == extent_group(entry["z_extent_mm"])
            stored = nib.aff2axcodes(nib.load(folder / f"volume-{index}.nii.gz").affine)
            assert "".join(stored) == entry["stored_as"]


def test_synth_json_keeps_the_cases_a_rewrite_leaves(tmp_path):
    write_dataset(tmp_path, 3, 16, seed=0)
    before = _sidecar(tmp_path)
    write_dataset(tmp_path, 1, 16, seed=1)
    after = _sidecar(tmp_path)
    assert sorted(after) == ["volume-0", "volume-1", "volume-2"]
    assert after["volume-0"]["seed"] == 1 and after["volume-1"] == before["volume-1"]
    (tmp_path / "volume-2.nii.gz").unlink()  # gone: no entry describes it any more
    write_dataset(tmp_path, 1, 16, seed=1)
    assert sorted(_sidecar(tmp_path)) == ["volume-0", "volume-1"]


def test_extent_groups():
    assert [extent_group(z) for z in (42, 160, 279.9)] == ["liver-only"] * 3
    assert [extent_group(z) for z in (280, 450, 549.9)] == ["abdominal"] * 3
    assert [extent_group(z) for z in (550, 900, 2000)] == ["chest-abdomen-pelvis"] * 3
    for kind, (low, high) in Z_EXTENT_MM.items():
        assert extent_group(low) == extent_group(high) == kind


def test_orientations_and_storage(dataset):
    codes = set()
    for index in range(CASES):
        volume = nib.load(dataset / f"volume-{index}.nii.gz")
        labels = nib.load(dataset / f"segmentation-{index}.nii.gz")
        codes.add(nib.aff2axcodes(volume.affine))
        assert volume.get_data_dtype() == np.int16
        assert (volume.dataobj.slope, volume.dataobj.inter) == (1.0, -1024.0)
        assert labels.get_data_dtype() == np.uint8
        np.testing.assert_array_equal(labels.affine, volume.affine)
    assert {("L", "P", "S"), ("R", "A", "S")} <= codes


def test_lps_and_ras_cases_read_back_as_drawn(dataset):
    # Even cases are stored LPS, odd ones RAS; either way read_scan gives the phantom back.
    for index in (0, 1):
        rng = np.random.default_rng((7, index))
        phantom = make_phantom(rng, random_case(rng, SIZE, index))
        image, labels = _read(dataset, index)
        np.testing.assert_array_equal(labels, phantom.labels)
        raw = np.clip(np.rint(phantom.hu + 1024), 0, 4095)  # as stored: HU + 1024
        np.testing.assert_array_equal(image.array, raw - 1024)


def test_synth_never_overwrites_a_folder_it_did_not_write(tmp_path):
    precious = tmp_path / "lits" / "volume-0.nii.gz"
    precious.parent.mkdir()
    precious.write_bytes(b"a real scan")
    with pytest.raises(CtsegError, match="already holds files that ctseg did not write"):
        write_dataset(precious.parent, 1, 16, seed=0)
    assert precious.read_bytes() == b"a real scan"
    write_dataset(tmp_path / "own", 1, 16, seed=0)
    write_dataset(tmp_path / "own", 1, 16, seed=0)  # its own folder (and synth.json): again
    write_dataset(precious.parent, 1, 16, seed=0, force=True)
    assert precious.read_bytes() != b"a real scan"


def test_phases_change_what_enhances_and_nothing_else(physical, tmp_path):
    """`--phases`: each case's phase drawn as archives hold them, recorded in synth.json;
    the anatomy, labels and geometry are those of the same seed without phases (the phase
    has a stream of its own); livers of a portal venous scan are far brighter than of the
    one phase, and tumours stay darker than their liver in every phase. (On the physical
    cases: on a coarser matrix a tumour's few voxels are mostly its liver's, blurred.)"""
    phased = tmp_path / "phased"
    write_dataset(phased, PHYSICAL, MEDIUM, seed=11, phases=True)
    entries, plain = _sidecar(phased), _sidecar(physical)
    drawn = {entry["phase"] for entry in entries.values()}
    assert "portal venous" in drawn and len(drawn) >= 2
    assert {plain[f"volume-{i}"]["phase"] for i in range(PHYSICAL)} == {"one phase"}
    for index in range(PHYSICAL):
        name = f"volume-{index}"
        image, labels = _read(phased, index)
        before, labels_before = _read(physical, index)
        np.testing.assert_array_equal(labels, labels_before)
        assert image.array.shape == before.array.shape
        assert {k: v for k, v in entries[name].items() if k != "phase"} == {
            k: v for k, v in plain[name].items() if k != "phase"
        }
        liver = np.median(image.array[labels == 1])
        if entries[name]["phase"] == "portal venous":
            assert liver > np.median(before.array[labels == 1]) + 25
        if (labels == 2).sum() > 20:
            assert np.median(image.array[labels == 2]) < liver - 10
