"""The synthetic LiTS-like data set: deterministic, plausible, stored as scanners store CT."""

import hashlib

import nibabel as nib
import numpy as np
import pytest

from ctseg.errors import CtsegError
from ctseg.volume import read_scan
from data_prep.synth import write_dataset

CASES, SIZE = 3, 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    write_dataset(out, CASES, SIZE, seed=7)
    return out


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    other = tmp_path / "other"
    write_dataset(other, 1, SIZE, seed=8)
    assert _digest(other / "volume-0.nii.gz") != _digest(dataset / "volume-0.nii.gz")


def test_labels_and_anatomy(dataset):
    tumours = 0
    for index in range(CASES):
        image = read_scan(dataset / f"volume-{index}.nii.gz")
        labels = read_scan(dataset / f"segmentation-{index}.nii.gz").array
        assert labels.dtype == np.uint8 and set(np.unique(labels)) <= {0, 1, 2}
        assert image.array.shape == labels.shape
        assert 8 <= image.array.shape[2] <= round(1.25 * SIZE)
        # A real abdominal field of view, whatever the matrix size.
        extent = np.asarray(image.array.shape) * np.asarray(image.spacing)
        assert 320 <= extent[0] <= 420 and 40 <= extent[2] <= 260
        liver = labels == 1
        assert liver.any()
        # The liver lies on the patient's right: high x in canonical RAS order.
        assert np.argwhere(labels > 0)[:, 0].mean() > SIZE / 2
        if (labels == 2).any():
            tumours += 1
            assert image.array[labels == 2].mean() < image.array[liver].mean() - 15
        assert image.array.min() >= -1024 and image.array[0, 0, 0] < -900  # air outside
    assert tumours > 0


def test_tumours_lie_inside_the_liver(dataset):
    for index in range(CASES):
        labels = read_scan(dataset / f"segmentation-{index}.nii.gz").array
        tumour = np.argwhere(labels == 2)
        liver_box = np.argwhere(labels > 0)
        assert np.all(tumour >= liver_box.min(0)) and np.all(tumour <= liver_box.max(0))


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


def test_synth_never_overwrites_a_folder_it_did_not_write(tmp_path):
    precious = tmp_path / "lits" / "volume-0.nii.gz"
    precious.parent.mkdir()
    precious.write_bytes(b"a real scan")
    with pytest.raises(CtsegError, match="already holds files that ctseg did not write"):
        write_dataset(precious.parent, 1, 16, seed=0)
    assert precious.read_bytes() == b"a real scan"
    write_dataset(tmp_path / "own", 1, 16, seed=0)
    write_dataset(tmp_path / "own", 1, 16, seed=0)  # its own folder: written again
    write_dataset(precious.parent, 1, 16, seed=0, force=True)
    assert precious.read_bytes() != b"a real scan"
