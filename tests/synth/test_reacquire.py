"""The robustness set: each re-acquisition changes what it says, and nothing else."""

import nibabel as nib
import numpy as np
import pytest

from ctseg.synth import reacquire

SPACING = (1.0, 1.0, 2.5)


def scan():
    """A 32 × 32 × 20 scan: soft tissue, a liver ball of 60 HU with a tumour inside."""
    x, y, z = np.meshgrid(*(np.arange(n) for n in (32, 32, 20)), indexing="ij")
    r2 = (x - 15.5) ** 2 + (y - 15.5) ** 2 + ((z - 9.5) * 2.5) ** 2
    labels = np.where(r2 < 10**2, 1, 0).astype(np.uint8)
    labels[r2 < 3**2] = 2
    hu = np.where(labels == 1, 60.0, np.where(labels == 2, 20.0, 40.0)).astype(np.float32)
    affine = np.diag([*SPACING, 1.0])
    affine[:3, 3] = (-10.0, 5.0, 30.0)
    return hu, labels, affine


def liver_ml(labels, affine):
    return np.count_nonzero(labels) * np.prod(np.linalg.norm(affine[:3, :3], axis=0)) / 1000


@pytest.mark.parametrize("change", list(reacquire.CHANGES))
def test_every_change_keeps_the_classes_and_what_it_should(change):
    hu, labels, affine = scan()
    new_hu, new_labels, new_affine = reacquire.reacquire(change, hu, labels, affine)
    assert set(np.unique(new_labels)) <= {0, 1, 2}
    assert 2 in new_labels
    volume = liver_ml(new_labels, new_affine) / liver_ml(labels, affine)
    expected = {"larger": 1.15**3, "smaller": 1.15**-3}.get(change, 1.0)
    assert volume == pytest.approx(expected, rel=0.1)
    if change in ("clean", "noise", "soft", "contrast"):
        np.testing.assert_array_equal(new_labels, labels)
        np.testing.assert_array_equal(new_affine, affine)
    liver = new_labels == 1
    shift = float(new_hu[liver].mean() - hu[labels == 1].mean())
    assert shift == pytest.approx(40.0 if change == "contrast" else 0.0, abs=5.0)  # edges blur
    if change == "noise":
        assert 20 < float(np.std(new_hu - hu)) < 30


def test_thick_slices_lie_where_the_thin_ones_they_average_lay():
    hu, labels, affine = scan()
    thick_hu, thick_labels, thick = reacquire.reacquire("thick", hu, labels, affine)
    assert thick_hu.shape == (32, 32, 10) and thick[2, 2] == 5.0
    centre_of_first = (affine @ [0, 0, 0.5, 1])[:3]  # between thin slices 0 and 1
    np.testing.assert_allclose((thick @ [0, 0, 0, 1])[:3], centre_of_first)
    np.testing.assert_allclose(thick_hu[:, :, 3], hu[:, :, 6:8].mean(axis=2))


def test_sets_are_written_beside_each_other(tmp_path):
    hu, labels, affine = scan()
    held = tmp_path / "held"
    held.mkdir()
    nib.save(nib.Nifti1Image(hu.astype(np.int16), affine), held / "volume-0.nii.gz")
    nib.save(nib.Nifti1Image(labels, affine), held / "segmentation-0.nii.gz")
    folders = reacquire.write_sets(held, tmp_path / "sets", ["clean", "rotated"])
    assert [f.name for f in folders] == ["clean", "rotated"]
    clean = nib.load(tmp_path / "sets" / "clean" / "volume-0.nii.gz")
    np.testing.assert_array_equal(np.asarray(clean.dataobj), hu.astype(np.int16))
    rotated = nib.load(tmp_path / "sets" / "rotated" / "segmentation-0.nii.gz")
    assert not np.array_equal(np.asarray(rotated.dataobj), labels)
