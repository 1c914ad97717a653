"""Hostile and careless use of the Python API, round four: every option checked before a
model loads, as the CLI checks it; arrays that are no CT; `save`/`segment(out=…)` never
over the scan, a folder, or a file ctseg did not write."""

import math

import nibabel as nib
import numpy as np
import pytest

from ctseg import Segmenter, segment
from ctseg.errors import CtsegError, OptionError
from ctseg.inference import inputs
from ctseg.inference.scan.region import check_margin, region_of


@pytest.fixture(scope="module")
def segmenter(trained):
    run_dir, _, _ = trained
    return Segmenter(run_dir, tile=0, checkpoint=2)  # a step number as an int, as documented


@pytest.fixture(scope="module")
def volume(trained):
    _, _, raw = trained
    image = nib.load(raw / "volume-0.nii.gz")
    return raw / "volume-0.nii.gz", np.asarray(image.dataobj), image.affine


def _one_line(call, *words) -> None:
    with pytest.raises(CtsegError) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"tile": "abc"}, ["tile must be an integer", "'abc'"]),
        ({"tile": 2.5}, ["tile must be an integer"]),
        ({"tile": True}, ["tile must be an integer"]),
        ({"tile": 3}, ["`tile` 3", "must be even"]),
        ({"tile": -7}, ["`tile` -7", "predict.tile must be -1"]),
        ({"checkpoint": True}, ["`checkpoint` must be best, latest or a step number"]),
        ({"checkpoint": 2.0}, ["`checkpoint` must be best, latest or a step number"]),
        ({"checkpoint": 999}, ["no checkpoint '999'"]),
        ({"backend": "tensorrt"}, ["`backend` must be jax or onnx"]),
        ({"device": "npu"}, ["`device` must be one of auto, cpu, gpu, tpu"]),
        ({"tta": "yes"}, ["`tta` must be True, False or None"]),
        ({"margin_mm": -5}, ["`margin_mm` must not be negative"]),
        ({"margin_mm": 5}, ["`margin_mm` applies only around a region", "`locate`"]),
        ({"margin_mm": float("nan"), "locate": "x"}, ["`margin_mm` must be a finite number"]),
        ({"margin_mm": math.inf, "locate": "x"}, ["`margin_mm` must be a finite number"]),
        ({"margin_mm": "20", "locate": "x"}, ["`margin_mm` must be a number"]),
    ],
)
def test_options_are_one_line_before_a_model_loads(trained, options, words, monkeypatch):
    run_dir, _, _ = trained

    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before the options were checked")

    monkeypatch.setattr("ctseg.inference.predictor.load_model", no_loading)
    if "checkpoint" in options and options["checkpoint"] == 999:
        monkeypatch.undo()  # a step that is not there is known by reading the run
    _one_line(lambda: Segmenter(run_dir, **options), *words)


def test_the_cli_and_the_api_share_one_check_of_each_option(trained):
    """The CLI's names in the CLI's messages; the same check under them."""
    run_dir, _, _ = trained
    from ctseg.cli.flags import said
    from ctseg.run import rundir

    config = rundir.load_config(run_dir)
    for call, words in [
        (lambda: inputs.inference_options(config, tile=5), "--tile 5"),
        (lambda: check_margin(math.nan, True), "--margin must be a finite number"),
    ]:
        with pytest.raises(OptionError) as raised:
            call()
        assert said(str(raised.value)).startswith(words)
    assert inputs.inference_options(config, checkpoint=4, tile=np.int64(8)).checkpoint == "4"


def test_a_margin_beyond_the_scan_takes_all_of_it():
    liver = np.zeros((10, 12, 14), np.uint8)
    liver[4:6, 5:7, 6:8] = 1
    for margin in (1e6, 1e308, np.finfo(float).max):
        region, why = region_of(liver, (0.5, 0.7, 2.0), margin, located=False)
        assert why is None and region.lo == (0, 0, 0) and region.hi == (10, 12, 14)


def test_arrays_that_are_no_ct_are_refused_or_taken_exactly(segmenter, volume):
    _, hu, affine = volume
    _one_line(lambda: segmenter(hu > 0, affine), "boolean array", "mask, not a CT")
    as_float32 = segmenter(hu.astype(np.float32), affine)
    as_float16 = segmenter(hu.astype(np.float16).astype(np.float32), affine)
    assert np.array_equal(segmenter(hu.astype(np.float16), affine).labels, as_float16.labels)
    assert as_float32.labels.shape == hu.shape


def test_save_never_over_the_scan_a_folder_or_a_file_ctseg_did_not_write(
    segmenter, volume, tmp_path
):
    path, _, _ = volume
    result = segmenter(path)
    kept = path.read_bytes()
    _one_line(lambda: result.save(path), "is the scan being segmented")
    _one_line(lambda: result.save(path, force=True), "is the scan being segmented")
    assert path.read_bytes() == kept
    _one_line(lambda: result.save(tmp_path), "is a folder", "give a file name")
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind
    foreign = tmp_path / "notes.nii.gz"
    foreign.write_bytes(b"someone's")
    _one_line(lambda: result.save(foreign), "is not a label map ctseg wrote", "force=True")
    assert foreign.read_bytes() == b"someone's"
    result.save(foreign, force=True)
    result.save(foreign)  # now ctseg's own: replaced without force
    assert np.array_equal(np.asarray(nib.load(foreign).dataobj), result.labels)


def test_segment_out_is_checked_before_the_model_loads(trained, volume, tmp_path, monkeypatch):
    run_dir, _, _ = trained
    path, _, _ = volume
    kept = path.read_bytes()
    monkeypatch.setattr(
        "ctseg.inference.api.Segmenter", lambda *a, **k: pytest.fail("the model loaded")
    )
    _one_line(lambda: segment(path, run_dir, out=path), "is the scan being segmented")
    _one_line(lambda: segment(str(path), run_dir, out=path.parent / "." / path.name), "scan")
    _one_line(lambda: segment(path, run_dir, out=tmp_path), "is a folder")
    assert path.read_bytes() == kept and list(tmp_path.iterdir()) == []
    # The run and the scan swapped: said as such, not as a scan that is no run directory.
    _one_line(lambda: segment(run_dir, path), "is a run directory, given as the scan")


def test_saving_over_a_fifo_is_one_line_without_waiting(tmp_path):
    """A FIFO where the labels would go is no label map ctseg wrote: refused in one line,
    never opened (its open would wait for a writer for ever)."""
    import os
    import signal

    from ctseg.inference.api import check_out

    fifo = tmp_path / "labels.nii.gz"
    os.mkfifo(fifo)

    def hung(*_):
        raise TimeoutError("check_out waited on the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        _one_line(lambda: check_out(fifo), "is not a label map ctseg wrote")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
