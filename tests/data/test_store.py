"""The prepared store: manifest, memory maps, splits, resuming, failed cases, predict-only."""

import json
import re
import shutil

import nibabel as nib
import numpy as np
import pytest
from helpers import prepare_store

from ctseg import config as cfg
from ctseg.data.store import Store
from ctseg.data_prep.raw import find_cases
from ctseg.data_prep.splits import assign_splits
from ctseg.errors import CtsegError
from ctseg.synth.dataset import write_dataset

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
    result = prepare_store(raw, tmp_path / "prep", _config())
    assert result.failures == []
    return result.store


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
    again = prepare_store(raw, store.path, _config(), progress=lambda *a: calls.append(a))
    assert image.stat().st_mtime_ns == before
    assert (store.path / "cases" / "lits-2" / "label.npy").is_file()
    assert again.store == store
    assert [o.status for o in again.outcomes] == ["resumed", "resumed", "prepared"]
    assert calls[-1] == (3, 3, "lits-2")
    prepare_store(raw, store.path, _config(), force=True)
    assert image.stat().st_mtime_ns != before


def test_refuses_other_resolution_unless_forced(raw, store):
    with pytest.raises(CtsegError, match="store of 16³ cube, not 8³ cube; .*`force`"):
        prepare_store(raw, store.path, _config(8))
    assert prepare_store(raw, store.path, _config(8), force=True).store.resolution == 8


# --- failed cases ------------------------------------------------------------------------

AFFINE = np.diag([0.8, 0.8, 2.0, 1.0])


def _save(path, data, affine=AFFINE):
    nib.save(nib.Nifti1Image(data, affine), path)


def _write_pair(folder, number, image, label, label_affine=AFFINE):
    _save(folder / f"volume-{number}.nii.gz", image)
    _save(folder / f"segmentation-{number}.nii.gz", label, label_affine)


def _bad_folder(raw, tmp_path):
    """lits-0 is good; every other case has one of the defects users meet."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name in ("volume-0.nii.gz", "segmentation-0.nii.gz"):
        shutil.copy(raw / name, folder / name)
    hu = np.full((8, 8, 6), 40, np.int16)
    liver = np.zeros((8, 8, 6), np.uint8)
    (folder / "volume-1.nii.gz").write_bytes(b"\x1f\x8b not really gzip")
    _save(folder / "segmentation-1.nii.gz", liver)
    _write_pair(folder, 2, hu[:, :, 0], liver[:, :, 0])
    _write_pair(folder, 3, np.zeros((8, 8, 6, 2), np.int16), liver)
    _write_pair(folder, 4, hu, liver[:, :, :5])
    shifted = AFFINE.copy()
    shifted[0, 3] = 2.0
    _write_pair(folder, 5, hu, liver, shifted)
    _write_pair(folder, 6, hu, liver + 3)
    nan, inf = hu.astype(np.float32), hu.astype(np.float32)
    nan[1, 1, 1], inf[2, 2, 2] = np.nan, -np.inf
    _write_pair(folder, 7, nan, liver)
    _write_pair(folder, 8, inf, liver)
    _save(folder / "volume-9.nii.gz", hu)  # a training case without its label
    return folder


EXPECTED_REASONS = {
    "lits-1": r"cannot read .*volume-1\.nii\.gz: ",
    "lits-2": r"volume-2\.nii\.gz has 2 dimensions; ctseg expects one 3-D CT volume",
    "lits-3": r"volume-3\.nii\.gz is 4-D \(shape \(8, 8, 6, 2\)\)",
    "lits-4": r"volume-4\.nii\.gz and segmentation-4\.nii\.gz differ in geometry: shape",
    "lits-5": r"volume-5\.nii\.gz and segmentation-5\.nii\.gz differ in geometry: .*2 mm",
    "lits-6": r"segmentation-6\.nii\.gz has label values outside .*: 3",
    "lits-7": r"volume-7\.nii\.gz contains NaN or infinite voxels",
    "lits-8": r"volume-8\.nii\.gz contains NaN or infinite voxels",
    "lits-9": r"training case without its label: .*volume-9\.nii\.gz",
}


def test_bad_cases_are_named_and_the_others_complete(raw, tmp_path):
    result = prepare_store(_bad_folder(raw, tmp_path), tmp_path / "prep", _config())
    assert [c.id for c in result.store.cases] == ["lits-0"]
    assert [o.case_id for o in result.outcomes] == [f"lits-{i}" for i in range(10)]
    assert result.outcomes[0].status == "prepared"
    reasons = {f.case_id: f.reason for f in result.failures}
    assert reasons.keys() == EXPECTED_REASONS.keys()
    for case_id, pattern in EXPECTED_REASONS.items():
        assert re.search(pattern, reasons[case_id]), (case_id, reasons[case_id])
        assert "\n" not in reasons[case_id]
    assert not (tmp_path / "prep" / "cases" / "lits-6" / "case.json").exists()
    manifest = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    assert [c["id"] for c in manifest["cases"]] == ["lits-0"]


def test_fixed_case_is_added_on_rerun_and_splits_stay(raw, tmp_path):
    folder = _copy_case(raw, tmp_path, 0)
    shutil.copy(raw / "volume-1.nii.gz", folder / "volume-1.nii.gz")  # its label comes later
    first = prepare_store(folder, tmp_path / "prep", _config())
    assert [f.case_id for f in first.failures] == ["lits-1"]
    shutil.copy(raw / "segmentation-1.nii.gz", folder / "segmentation-1.nii.gz")
    second = prepare_store(folder, tmp_path / "prep", _config())
    assert second.failures == [] and [c.id for c in second.store.cases] == ["lits-0", "lits-1"]
    assert [o.status for o in second.outcomes] == ["resumed", "prepared"]
    assert [o.split for o in first.outcomes] == [o.split for o in second.outcomes]


def test_no_case_succeeded(raw, tmp_path):
    folder = _bad_folder(raw, tmp_path)
    for name in ("volume-0.nii.gz", "segmentation-0.nii.gz"):
        (folder / name).unlink()
    result = prepare_store(folder, tmp_path / "prep", _config())
    assert result.store is None and len(result.failures) == 9
    assert not (tmp_path / "prep" / "manifest.json").exists()


def test_workers_give_the_same_store(raw, tmp_path):
    serial = prepare_store(raw, tmp_path / "serial", _config()).store
    result = prepare_store(raw, tmp_path / "pool", _config(), workers=2)
    assert result.failures == []
    assert [c.id for c in result.store.cases] == [c.id for c in serial.cases]
    for case, other in zip(result.store.cases, serial.cases, strict=True):
        assert case.split == other.split and case.label_counts == other.label_counts
        np.testing.assert_array_equal(result.store.image(case.id), serial.image(case.id))
        np.testing.assert_array_equal(result.store.label(case.id), serial.label(case.id))


def _copy_case(raw, tmp_path, index=0):
    out = tmp_path / "bad"
    out.mkdir(exist_ok=True)
    for name in (f"volume-{index}.nii.gz", f"segmentation-{index}.nii.gz"):
        shutil.copy(raw / name, out / name)
    return out


# --- predict-only stores -----------------------------------------------------------------


def test_predict_only_store(raw, tmp_path):
    scans = tmp_path / "LITS-Challenge-Test-Data"
    scans.mkdir()
    shutil.copy(raw / "volume-0.nii.gz", scans / "test-volume-0.nii.gz")
    shutil.copy(raw / "volume-1.nii.gz", scans / "patient 7_arterial.nii.gz")
    result = prepare_store(scans, tmp_path / "prep", _config())
    store = result.store
    assert [c.id for c in store.cases] == ["patient-7-arterial", "test-volume-0"]
    assert [c.split for c in store.cases] == ["test", "test"]
    assert store.split("test") == store.cases and store.split("train") == []
    case = store.case("test-volume-0")
    assert case.label_source is None and case.label_counts is None and not case.labelled
    assert not (store.path / "cases" / "test-volume-0" / "label.npy").exists()
    assert store.image("test-volume-0").shape == (RESOLUTION,) * 3
    with pytest.raises(CtsegError, match="has no label: .*prediction only"):
        store.label("test-volume-0")
    assert Store.open(store.path) == store
    again = prepare_store(scans, tmp_path / "prep", _config())
    assert [o.status for o in again.outcomes] == ["resumed", "resumed"]


def test_missing_and_empty(tmp_path):
    with pytest.raises(CtsegError, match="raw data folder not found"):
        prepare_store(tmp_path / "nothing", tmp_path / "prep", _config())
    (tmp_path / "empty").mkdir()
    with pytest.raises(CtsegError, match="no scans found in .*empty"):
        prepare_store(tmp_path / "empty", tmp_path / "prep", _config())
    with pytest.raises(CtsegError, match="no prepared store at .*run `ctseg preprocess`"):
        Store.open(tmp_path / "nothing")
    empty = tmp_path / "empty-store"
    empty.mkdir()
    (empty / "manifest.json").write_text(
        json.dumps({"format": "ctseg-store", "version": 1, "resolution": 16, "cases": []})
    )
    with pytest.raises(CtsegError, match="holds no cases"):
        Store.open(empty)
    (empty / "manifest.json").write_text("{not json")
    with pytest.raises(CtsegError, match="manifest.json is not valid JSON"):
        Store.open(empty)


def test_store_with_missing_arrays(store):
    (store.path / "cases" / "lits-0" / "image.npy").unlink()
    with pytest.raises(CtsegError, match="lacks image.npy of case lits-0"):
        Store.open(store.path)


def test_unknown_split(store):
    with pytest.raises(ValueError, match="unknown split"):
        store.split("holdout")


# --- folder layouts ----------------------------------------------------------------------


def test_training_layouts(tmp_path):
    lits = tmp_path / "LiTS" / "Training Batch 1"
    lits.mkdir(parents=True)
    for name in (
        "volume-10.nii",
        "segmentation-10.nii",
        "volume-2.nii.gz",
        "segmentation-2.nii.gz",
        "volume-7.nii",
        "test-volume-3.nii",  # a test-set scan is not a case of a training folder
    ):
        (lits / name).write_bytes(b"")
    msd = tmp_path / "Task03_Liver"
    for folder in ("imagesTr", "labelsTr", "imagesTs"):
        (msd / folder).mkdir(parents=True)
        (msd / folder / "liver_3.nii.gz").write_bytes(b"")
        (msd / folder / "._liver_3.nii.gz").write_bytes(b"")  # macOS litter in the MSD tarball
    (msd / "imagesTr" / "liver_4.nii.gz").write_bytes(b"")
    layout = find_cases(tmp_path)
    assert not layout.predict_only
    assert [c.case_id for c in layout.cases] == ["lits-2", "lits-7", "lits-10", "msd-3", "msd-4"]
    assert layout.cases[3].label == msd / "labelsTr" / "liver_3.nii.gz"
    assert [c.case_id for c in layout.cases if c.label is None] == ["lits-7", "msd-4"]


def test_predict_only_layouts(tmp_path):
    (tmp_path / "imagesTs").mkdir()
    for name in ("imagesTs/liver_132.nii.gz", "test-volume-0.nii", "notes.txt", "a.mha"):
        (tmp_path / name).write_bytes(b"")
    layout = find_cases(tmp_path)
    assert layout.predict_only
    assert {c.case_id: c.label for c in layout.cases} == {
        "a": None,
        "liver-132": None,
        "test-volume-0": None,
    }
    (tmp_path / "a.nii").write_bytes(b"")
    with pytest.raises(CtsegError, match="a.mha and .*a.nii would both become case 'a'"):
        find_cases(tmp_path)


def test_labels_without_images(tmp_path):
    (tmp_path / "segmentation-1.nii").write_bytes(b"")
    with pytest.raises(CtsegError, match="holds labels but no LiTS volume-N"):
        find_cases(tmp_path)
    (tmp_path / "volume-1.nii").write_bytes(b"")
    (tmp_path / "volume-01.nii").write_bytes(b"")
    with pytest.raises(CtsegError, match="case 1 appears twice"):
        find_cases(tmp_path)


def _edit_manifest(store, **fields):
    path = store.path / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["cases"][0].update(fields)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("id", "../../elsewhere/x"),
        ("id", "/etc/passwd"),
        ("id", "lits-1"),  # a second lits-1: both would share one folder
        ("split", "../val"),
        ("image_source", "relative/volume-0.nii.gz"),
        ("label_source", "/data/../etc/secret.nii"),
    ],
)
def test_manifest_naming_paths_outside_the_store_is_refused(store, key, value):
    _edit_manifest(store, **{key: value})
    with pytest.raises(CtsegError) as error:
        Store.open(store.path)
    message = str(error.value)
    assert str(store.path / "manifest.json") in message and f"].{key} = {value!r}" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("original_affine", "eye", "a 4×4 matrix of finite numbers"),
        ("canonical_affine", [[1, 0, 0, 0]] * 3, "a 4×4 matrix of finite numbers"),
        ("original_shape", [512, 512, -1], "3 voxel counts"),
        ("canonical_shape", [1.5, 2, 3], "3 voxel counts"),
        ("spacing", [0.8, 0.8, 0], "3 positive numbers"),
        ("spacing", [0.8, True, 1.0], "3 positive numbers"),
        ("label_counts", None, "3 voxel counts"),
    ],
)
def test_manifest_numbers_that_are_not_numbers_are_refused(store, key, value, words):
    _edit_manifest(store, **{key: value})
    with pytest.raises(CtsegError, match=f"cases\\[0\\].{key} = .* is not {words}"):
        Store.open(store.path)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (lambda good: good[: len(good) // 2], "cannot be read"),  # truncated
        (lambda good: np.random.default_rng(0).bytes(len(good)), "cannot be read"),  # random
        (lambda good: b"", "cannot be read"),  # empty: np.load raises EOFError
        (lambda good: _npy(np.zeros((4, 4, 4), np.int16)), "not int16 [16, 16, 16]"),
        (lambda good: _npy(np.zeros((16,) * 3, np.float32)), "float32 [16, 16, 16]"),
        (lambda good: _npy(np.array([None] * 4, object)), "cannot be read"),  # pickled objects
    ],
)
def test_damaged_image_array_is_one_line_naming_it(store, content, expected):
    path = store.path / "cases" / "lits-0" / "image.npy"
    path.write_bytes(content(path.read_bytes()))
    with pytest.raises(CtsegError, match=re.escape(expected)) as error:
        Store.open(store.path)
    assert str(path) in str(error.value)


def _npy(array):
    """The bytes of a .npy file of `array`; an object array is written pickled (np.save's
    default), as a hostile store would hold it."""
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_preprocess_refuses_a_folder_of_other_files_unless_forced(raw, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.docx").write_text("precious")
    with pytest.raises(CtsegError, match="already holds files that ctseg did not write"):
        prepare_store(raw, out, _config())
    assert prepare_store(raw, out, _config(), force=True).store is not None
    assert (out / "thesis.docx").read_text() == "precious"


def test_manifest_that_is_a_folder_or_out_that_is_a_file(raw, tmp_path):
    (tmp_path / "prep" / "manifest.json").mkdir(parents=True)
    for force in (False, True):
        with pytest.raises(CtsegError, match="manifest.json is not a file"):
            prepare_store(raw, tmp_path / "prep", _config(), force=force)
    (tmp_path / "file").write_text("")
    with pytest.raises(CtsegError, match="is a file, not a folder"):
        prepare_store(raw, tmp_path / "file", _config())


def test_symlinked_folders_are_followed_and_loops_walked_once(tmp_path):
    elsewhere = tmp_path / "disk2" / "batch"
    elsewhere.mkdir(parents=True)
    (elsewhere / "volume-4.nii").write_bytes(b"")
    (elsewhere / "segmentation-4.nii").write_bytes(b"")
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "batch").symlink_to(elsewhere)
    (raw / "again").symlink_to(elsewhere)  # a second link to the same folder
    (elsewhere / "loop").symlink_to(raw)  # a link back up the tree
    layout = find_cases(raw)
    assert [(c.case_id, c.image.name) for c in layout.cases] == [("lits-4", "volume-4.nii")]


def test_raw_path_that_is_a_file_says_so(tmp_path):
    (tmp_path / "volume-0.nii").write_bytes(b"")
    with pytest.raises(CtsegError, match="is a file, not a folder"):
        find_cases(tmp_path / "volume-0.nii")
