"""Hostile and careless use of `ctseg predict`, round four: what predict writes is its own
(never an input, never another's file without --force), an output is kept only for the
request that made it, and every option is checked before anything runs."""

import json
import shutil

import nibabel as nib
import numpy as np
import pytest
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.errors import CtsegError
from ctseg.inference.inputs import OUTPUTS_RECORD

runner = CliRunner(env={"COLUMNS": "400"})  # no reason folded over lines


def _predict(run_dir, *args) -> tuple[int, str]:
    result = runner.invoke(app, ["predict", str(run_dir), *map(str, args), "--tile", "0"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return 2, str(result.exception)  # a usage error: `error: …` in the console script
    return result.exit_code, " ".join(result.output.split())


def _refused_up_front(run_dir, out, *args, words=()) -> None:
    """One line (CtsegError, exit 2 in the console script) before anything is written."""
    result = runner.invoke(app, ["predict", str(run_dir), *map(str, args), "--out", str(out)])
    assert isinstance(result.exception, CtsegError), result.output
    message = str(result.exception)
    assert "\n" not in message and all(word in message for word in words), message
    assert not out.exists()  # not even the folder or its lock


@pytest.fixture(scope="module")
def scan(trained):
    run_dir, _, raw = trained
    return run_dir, raw / "volume-0.nii.gz", raw / "segmentation-0.nii.gz"


# ---------------------------------------------------------------- class 1: ownership


def test_a_roi_mask_among_the_outputs_is_never_replaced_even_with_force(scan, tmp_path):
    run_dir, volume, reference = scan
    folder = tmp_path / "d"
    folder.mkdir()
    mask = shutil.copy(reference, folder / "volume-0_seg.nii.gz")  # the user's own mask
    kept = mask.read_bytes()
    for roi in (folder, mask):  # the folder of masks, or the one mask, as --out's file
        for force in ([], ["--force"]):
            code, output = _predict(run_dir, volume, "--out", folder, "--roi", roi, *force)
            assert code == 1, output
            assert f"its output {mask} would overwrite a --roi mask, an input" in output
            assert mask.read_bytes() == kept
    assert not (folder / "volume-0_stats.json").exists()


def test_a_file_ctseg_did_not_write_is_replaced_only_with_force(scan, tmp_path):
    run_dir, volume, reference = scan
    out = tmp_path / "out"
    out.mkdir()
    foreign = shutil.copy(reference, out / "volume-0_seg.nii.gz")  # no stats, no record
    kept = foreign.read_bytes()
    code, output = _predict(run_dir, volume, "--out", out)
    assert code == 1 and f"{foreign} was not written by ctseg predict" in output, output
    assert "--force" in output and foreign.read_bytes() == kept
    # Another tool's preview or stats of the name (a dangling link too) is no different.
    foreign.unlink()
    (out / "volume-0_preview.png").symlink_to(tmp_path / "nowhere.png")
    code, output = _predict(run_dir, volume, "--out", out)
    assert code == 1 and "volume-0_preview.png was not written by ctseg predict" in output
    code, output = _predict(run_dir, volume, "--out", out, "--force")
    assert code == 0, output
    record = json.loads((out / OUTPUTS_RECORD).read_text())
    assert set(record["outputs"]) == {
        f"volume-0_{s}" for s in ("seg.nii.gz", "stats.json", "preview.png")
    }
    assert record["outputs"]["volume-0_seg.nii.gz"]["scan"] == str(volume.resolve())
    # Now ctseg's own: an interrupted write (no stats file) is redone without --force.
    (out / "volume-0_stats.json").unlink()
    code, output = _predict(run_dir, volume, "--out", out)
    assert code == 0 and "earlier" not in output, output


def test_an_earlier_output_is_no_scan_by_its_record(scan, tmp_path):
    """The output folder given as an input: ctseg's own label maps are left out by the
    record (not by a stats file beside them), a foreign one is a scan like any."""
    run_dir, volume, _ = scan
    out = tmp_path / "out"
    assert _predict(run_dir, volume, "--out", out)[0] == 0
    (out / "volume-0_stats.json").unlink()  # interrupted: only the record says it is ours
    code, output = _predict(run_dir, out, "--out", tmp_path / "again")
    assert code == 0 and "0 scan(s)" in output, output


# ---------------------------------------------------------------- class 2: the same request


def test_a_rerun_for_another_request_names_the_difference(scan, tmp_path):
    run_dir, volume, reference = scan
    out = tmp_path / "out"
    mask = shutil.copy(reference, tmp_path / "mask.nii.gz")
    whole = [volume, "--out", out]
    region = [*whole, "--roi", mask]
    assert _predict(run_dir, *whole)[0] == 0
    code, output = _predict(run_dir, *region)
    assert (
        code == 1 and "is of another request (the whole scan, not the region of the mask" in output
    )
    assert _predict(run_dir, *region, "--force")[0] == 0
    stats = json.loads((out / "volume-0_stats.json").read_text())
    assert stats["request"]["region"]["mask"] == str(mask.resolve())
    code, output = _predict(run_dir, *region)
    assert code == 0 and "done earlier" in output, output
    code, output = _predict(run_dir, *region, "--margin", "5")
    assert code == 1 and "margin 20.0 mm, not 5.0 mm" in output, output
    code, output = _predict(run_dir, *whole)  # the reverse: a region's result is not whole
    assert code == 1 and "not the whole scan" in output, output
    # The same mask file with another content is another request.
    image = nib.load(mask)
    shifted = np.roll(np.asarray(image.dataobj), 3, axis=0)
    nib.save(nib.Nifti1Image(shifted, image.affine, image.header), mask)
    code, output = _predict(run_dir, *region)
    assert code == 1 and f"the mask {mask.resolve()} changed since" in output, output
    # Another backend's class, and a stats file of an earlier ctseg that records no request.
    assert _predict(run_dir, *whole, "--force")[0] == 0
    code, output = _predict(run_dir, *whole, "--locate", run_dir)
    located = f"not the region of the locator {run_dir.resolve()} (step 2), margin 20.0 mm"
    assert code == 1 and located in output, output
    code, output = _predict(run_dir, *whole, "--backend", "jax")
    assert code == 1 and "backend onnx float32, not jax float32" in output, output
    del stats["request"]
    (out / "volume-0_stats.json").write_text(json.dumps(stats))
    code, output = _predict(run_dir, *region)
    assert code == 1 and "its request is not recorded" in output, output


# ---------------------------------------------------------------- class 3: checked up front


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--margin", "nan"], ["--margin", "finite"]),
        (["--margin", "inf"], ["--margin", "finite"]),
        (["--margin", "-1"], ["--margin", "negative"]),
        (["--margin", "5"], ["--margin applies only around a region", "--roi"]),
        (["--tile", "3"], ["--tile 3", "must be even"]),
        (["--tile", "-2"], ["--tile -2", "predict.tile must be -1"]),
        (["--checkpoint", "999"], ["no checkpoint '999'"]),
    ],
    ids=["nan", "inf", "negative", "no-region", "odd-tile", "tile-below-1", "checkpoint"],
)
def test_options_are_one_line_before_anything_runs(scan, tmp_path, options, words):
    run_dir, volume, _ = scan
    _refused_up_front(run_dir, tmp_path / "out", volume, *options, words=words)


def test_masks_that_are_scans_or_ambiguous_are_refused_naming_them(scan, tmp_path):
    run_dir, volume, reference = scan
    raw = volume.parent
    out = tmp_path / "out"
    _refused_up_front(run_dir, out, volume, "--roi", volume, words=["is the scan", "itself"])
    words = ["--margin must be a finite number"]  # a real mask: the margin checked all the same
    _refused_up_front(run_dir, out, volume, "--roi", reference, "--margin", "nan", words=words)
    # The scans' folder as the masks' folder: each scan's "mask" is the scan itself.
    _refused_up_front(run_dir, out, volume, "--roi", raw, words=[f"--roi {raw}", "itself"])
    masks = tmp_path / "masks"
    masks.mkdir()
    shutil.copy(reference, masks / "volume-0.nii.gz")
    shutil.copy(reference, masks / "volume-0_seg.nii.gz")
    words = ["two masks for the scan volume-0.nii.gz", "volume-0.nii.gz and volume-0_seg.nii.gz"]
    _refused_up_front(run_dir, out, volume, "--roi", masks, words=words)
    # A link to the scan is the scan too.
    (masks / "volume-0_seg.nii.gz").unlink()
    (masks / "volume-0.nii.gz").unlink()
    (masks / "volume-0.nii.gz").symlink_to(volume)
    _refused_up_front(run_dir, out, volume, "--roi", masks, words=["itself"])
    # A mask beside the scan in its own folder: the scan is still the first candidate.
    shutil.copy(reference, masks / "volume-0_seg.nii.gz")
    _refused_up_front(run_dir, out, volume, "--roi", masks, words=["itself"])


def test_a_margin_beyond_the_scan_takes_all_of_it(scan, tmp_path):
    run_dir, volume, reference = scan
    out = tmp_path / "out"
    code, output = _predict(run_dir, volume, "--out", out, "--roi", reference, "--margin", "1e308")
    assert code == 0, output
    located = json.loads((out / "volume-0_stats.json").read_text())["located"]
    assert located["region"]["lo"] == [0, 0, 0]
    assert sorted(located["region"]["hi"]) == sorted(nib.load(volume).shape)


def test_a_copy_of_the_scan_as_its_mask_is_a_failed_row_and_a_mirrored_mask_is_the_mask(
    scan, tmp_path
):
    """A copy of the scan given as its mask holds HU, not labels: its row fails saying so.
    A mask stored mirrored along x with its affine to match lies on the scan's voxels: it
    gives the mask's own region."""
    run_dir, volume, reference = scan
    copy = tmp_path / "copy" / "volume-0.nii.gz"
    copy.parent.mkdir()
    shutil.copy(volume, copy)
    code, output = _predict(run_dir, volume, "--out", tmp_path / "a", "--roi", copy)
    assert code == 1 and "a scan, not a mask of labels" in output, output

    image = nib.load(reference)
    flip = np.diag([-1.0, 1.0, 1.0, 1.0])
    flip[0, 3] = image.shape[0] - 1  # voxel i of the mirror is voxel n − 1 − i
    mirrored = nib.Nifti1Image(np.asarray(image.dataobj)[::-1], image.affine @ flip)
    nib.save(mirrored, tmp_path / "mirrored.nii.gz")
    located = []
    for mask, out in ((reference, "b"), (tmp_path / "mirrored.nii.gz", "c")):
        code, output = _predict(run_dir, volume, "--out", tmp_path / out, "--roi", mask)
        assert code == 0, output
        located.append(json.loads((tmp_path / out / "volume-0_stats.json").read_text())["located"])
    assert located[0]["region"] == located[1]["region"]
