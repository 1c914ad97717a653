"""The prepared store: manifest, memory maps, splits, resuming and refusals."""

import json
import shutil

import nibabel as nib
import numpy as np
import pytest

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.store import Store, assign_splits, prepare
from data_prep.layouts import find_cases
from data_prep.synth import write_dataset

RESOLUTION = 16


def _config(resolution=RESOLUTION, **data):
    overrides = [f"data.resolution={resolution}"] + [f"data.{k}={v}" for k, v in data.items()]
    return cfg.load(None, overrides)


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("raw")
    write_dataset(out, 3, 24, seed=1)
    return out


@pytest.fixture
def store(raw, tmp_path):
    return prepare(raw, tmp_path / "prep", _config())


def test_manifest_contents(store, raw):
    manifest = json.loads((store.path / "manifest.json").read_text())
    assert manifest["format"] == "ctseg-store" and manifest["version"] == 1
    assert manifest["resolution"] == RESOLUTION
    assert [c["id"] for c in manifest["cases"]] == ["lits-0", "lits-1", "lits-2"]
    case = manifest["cases"][0]
    assert case["image_source"] == str((raw / "volume-0.nii.gz").resolve())
    assert case["label_source"] == str((raw / "segmentation-0.nii.gz").resolve())
    original = nib.load(raw / "volume-0.nii.gz")
    assert case["original_shape"] == list(original.shape)
    np.testing.assert_allclose(case["original_affine"], original.affine)
    canonical = nib.as_closest_canonical(original)
    np.testing.assert_allclose(case["canonical_affine"], canonical.affine)
    assert case["canonical_shape"] == list(canonical.shape)
    np.testing.assert_allclose(case["spacing"], canonical.header.get_zooms())
    assert sum(case["label_counts"]) == RESOLUTION**3 and case["label_counts"][1] > 0
    assert {c["split"] for c in manifest["cases"]} == {"train", "val"}


def test_arrays_are_read_only_memory_maps(store):
    for case in store.cases:
        image, label = store.image(case.id), store.label(case.id)
        assert isinstance(image, np.memmap) and not image.flags.writeable
        assert image.dtype == np.int16 and label.dtype == np.uint8
        assert image.shape == label.shape == (RESOLUTION,) * 3
        assert list(np.bincount(label.ravel(), minlength=3)) == list(case.label_counts)
        assert image.min() >= -1024 and image.max() > 300  # air and bone survive resampling
    slab = store.image("lits-0")[:4, 8:, :]
    assert slab.shape == (4, 8, RESOLUTION)


def test_reopen_and_splits(store):
    reopened = Store.open(store.path)
    assert reopened == store
    assert len(store.split("train")) + len(store.split("val")) == 3
    assert len(store.split("val")) == 1
    with pytest.raises(CtsegError, match="no case"):
        store.image("lits-99")


def test_split_is_deterministic():
    ids = [f"lits-{i}" for i in range(10)]
    first = assign_splits(ids, 0.3, seed=4)
    assert first == assign_splits(ids, 0.3, seed=4)
    assert sum(s == "val" for s in first.values()) == 3
    assert any(assign_splits(ids, 0.3, seed=s) != first for s in range(1, 5))
    assert list(assign_splits(ids[:2], 0.01, seed=0).values()).count("val") == 1
    assert set(assign_splits(ids, 0.0, seed=0).values()) == {"train"}


def test_resume_skips_finished_cases(raw, store):
    image = store.path / "cases" / "lits-1" / "image.npy"
    before = image.stat().st_mtime_ns
    (store.path / "cases" / "lits-2" / "label.npy").unlink()  # as if killed mid-case
    calls = []
    again = prepare(raw, store.path, _config(), progress=lambda *a: calls.append(a))
    assert image.stat().st_mtime_ns == before
    assert (store.path / "cases" / "lits-2" / "label.npy").is_file()
    assert again == store
    assert calls[-1] == (3, 3, "lits-2")
    prepare(raw, store.path, _config(), force=True)
    assert image.stat().st_mtime_ns != before


def test_refuses_other_resolution_unless_forced(raw, store):
    with pytest.raises(CtsegError, match="resolution 16, not 8; .*--force"):
        prepare(raw, store.path, _config(8))
    assert prepare(raw, store.path, _config(8), force=True).resolution == 8


def _copy_case(raw, tmp_path, index=0):
    out = tmp_path / "bad"
    out.mkdir()
    for name in (f"volume-{index}.nii.gz", f"segmentation-{index}.nii.gz"):
        shutil.copy(raw / name, out / name)
    return out


def test_geometry_mismatch(raw, tmp_path):
    bad = _copy_case(raw, tmp_path)
    seg = nib.load(bad / "segmentation-0.nii.gz")
    shifted = seg.affine.copy()
    shifted[0, 3] += 2.0
    nib.save(nib.Nifti1Image(np.asarray(seg.dataobj), shifted), bad / "segmentation-0.nii.gz")
    with pytest.raises(
        CtsegError, match="volume-0.nii.gz and segmentation-0.nii.gz differ in geometry: .*2 mm"
    ):
        prepare(bad, tmp_path / "prep", _config())


def test_label_value_three(raw, tmp_path):
    bad = _copy_case(raw, tmp_path)
    seg = nib.load(bad / "segmentation-0.nii.gz")
    data = np.asarray(seg.dataobj).copy()
    data[0, 0, 0] = 3
    nib.save(nib.Nifti1Image(data, seg.affine), bad / "segmentation-0.nii.gz")
    with pytest.raises(CtsegError, match="segmentation-0.nii.gz has label values outside .*: 3"):
        prepare(bad, tmp_path / "prep", _config())
    assert not (tmp_path / "prep" / "manifest.json").exists()


def test_missing_and_empty(tmp_path):
    with pytest.raises(CtsegError, match="raw data folder not found"):
        prepare(tmp_path / "nothing", tmp_path / "prep", _config())
    with pytest.raises(CtsegError, match="no prepared store at .*run `ctseg preprocess`"):
        Store.open(tmp_path / "nothing")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "manifest.json").write_text(
        json.dumps({"format": "ctseg-store", "version": 1, "resolution": 16, "cases": []})
    )
    with pytest.raises(CtsegError, match="holds no cases"):
        Store.open(empty)
    (empty / "manifest.json").write_text("{not json")
    with pytest.raises(CtsegError, match="cannot read"):
        Store.open(empty)


def test_store_with_missing_arrays(store):
    (store.path / "cases" / "lits-0" / "image.npy").unlink()
    with pytest.raises(CtsegError, match="lacks image.npy of case lits-0"):
        Store.open(store.path)


def test_layouts(tmp_path):
    lits = tmp_path / "LiTS" / "Training Batch 1"
    lits.mkdir(parents=True)
    for name in (
        "volume-10.nii",
        "segmentation-10.nii",
        "volume-2.nii.gz",
        "segmentation-2.nii.gz",
        "volume-7.nii",
    ):
        (lits / name).write_bytes(b"")
    msd = tmp_path / "Task03_Liver"
    for folder in ("imagesTr", "labelsTr"):
        (msd / folder).mkdir(parents=True)
        (msd / folder / "liver_3.nii.gz").write_bytes(b"")
        (msd / folder / "._liver_3.nii.gz").write_bytes(b"")  # macOS litter in the MSD tarball
    layout = find_cases(tmp_path)
    assert [p.case_id for p in layout.pairs] == ["lits-2", "lits-10", "msd-3"]
    assert layout.pairs[2].label == msd / "labelsTr" / "liver_3.nii.gz"
    assert [p.name for p in layout.unlabelled] == ["volume-7.nii"]
    only_images = tmp_path / "only"
    only_images.mkdir()
    (only_images / "volume-1.nii").write_bytes(b"")
    with pytest.raises(CtsegError, match="no LiTS .* found in .*only .*volume-1.nii"):
        find_cases(only_images)
