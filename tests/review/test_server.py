"""`ctseg review`'s server without a browser: the batch's order, its routes, the marks file,
and every hostile request (no token, traversal, links, huge bodies, bad JSON, unknown scans)."""

import csv
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import nibabel as nib
import numpy as np
import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from ctseg.cli.main import app as cli
from ctseg.errors import CtsegError
from ctseg.io.scans import read_scan
from ctseg.review.batch import read_batch
from ctseg.review.marks import MARKS_FILE, Marks
from ctseg.review.server import BODY_LIMIT, bind, make_app

TOKEN = "t0ken-of-the-test"


def _client(folder, reviewer="dr. test") -> TestClient:
    client = TestClient(make_app(folder, TOKEN, reviewer), base_url="http://127.0.0.1")
    client.headers["X-Ctseg-Token"] = TOKEN
    return client


def test_the_batch_is_in_verdict_order_with_its_stats(batch, verdicts, page_order):
    read = read_batch(batch)
    assert [c.name for c in read.cases] == page_order
    assert read.kind == "predict"
    for case in read.cases:
        stats = json.loads((batch / f"{case.name}_stats.json").read_text())
        assert (case.verdict, case.score) == verdicts[case.name]
        assert case.numbers["liver_volume_ml"] == stats["liver_volume_ml"]
        assert case.numbers["tumour_count"] == stats["tumour_count"]
        assert case.reasons[0] == stats["quality"]["reason"]
        assert case.warnings == tuple(stats["warnings"])
        assert set(case.files) == {"seg", "preview", "scan"}
    page = _client(batch).get("/api/batch").json()
    assert [c["name"] for c in page["cases"]] == page_order
    assert page["cases"][0]["files"]["scan"] == "scan.nii"  # the series, made NIfTI
    assert page["cases"][1]["files"] == {
        "preview": "preview.png", "scan": "scan.nii.gz", "seg": "seg.nii.gz"
    }  # fmt: skip
    assert str(batch) not in json.dumps(page["cases"])  # names, never paths


def test_an_unreadable_stats_file_is_a_row_that_says_so(batch):
    (batch / "volume-1_stats.json").write_text('{"quality": {"verdict": 3}}')
    case = read_batch(batch).case("volume-1")
    assert case.verdict is None and "quality.verdict" in case.problems[0]
    assert [c.name for c in read_batch(batch).cases][-2:] == ["volume-1", "volume-0"]


def test_a_dicom_seg_prediction_shows_its_scan_and_says_why_not_its_labels(batch):
    record = json.loads((batch / ".ctseg-outputs.json").read_text())
    record["outputs"]["series_seg.dcm"] = record["outputs"].pop("series_seg.nii.gz")
    (batch / ".ctseg-outputs.json").write_text(json.dumps(record))
    case = read_batch(batch).case("series")
    assert set(case.files) == {"scan", "preview"} and "DICOM SEG" in case.problems[0]
    assert case.verdict == "review"


def test_an_evaluation_folder_shows_dice_scan_and_reference(trained, tmp_path):
    run_dir, store, _ = trained
    out = tmp_path / "eval"
    args = ["evaluate", str(run_dir), "--data", str(store), "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    read = read_batch(out)
    assert read.kind == "evaluate" and len(read.cases) == len(summary["cases"])
    case = read.cases[0]
    assert case.dice["liver"] == summary["cases"][0]["liver"]["dice"]
    assert set(case.files) == {"seg", "scan", "reference"}
    client = _client(out)
    for kind in ("reference", "seg", "scan"):
        sent = client.get(f"/files/{case.name}/{kind}.nii.gz")
        assert sent.status_code == 200 and sent.content == case.files[kind].read_bytes(), kind
    assert case.files["seg"].parent == out / "predictions"


def test_files_are_sent_as_written_and_a_dicom_series_as_nifti(batch, trained):
    _, _, raw = trained
    client = _client(batch)
    seg = client.get("/files/volume-1/seg.nii.gz")
    assert seg.status_code == 200 and seg.content == (batch / "volume-1_seg.nii.gz").read_bytes()
    scan = client.get("/files/volume-1/scan.nii.gz")
    assert scan.content == (raw / "volume-1.nii.gz").read_bytes()
    assert client.get("/files/volume-1/preview.png").content[:4] == b"\x89PNG"
    series = client.get("/files/series/scan.nii")
    assert series.status_code == 200
    image = nib.Nifti1Image.from_bytes(series.content)
    expected = read_scan(read_batch(batch).case("series").files["scan"])
    assert image.shape == expected.original_shape
    np.testing.assert_allclose(image.affine, expected.original_affine, atol=1e-4)
    labels = nib.load(batch / "series_seg.nii.gz")
    np.testing.assert_allclose(image.affine, labels.affine, atol=1e-4)  # the labels' geometry
    assert client.head("/files/series/scan.nii").status_code == 200


def test_every_request_needs_the_token(batch):
    client = TestClient(make_app(batch, TOKEN, "x"), base_url="http://127.0.0.1")
    for path in ("/", "/api/batch", "/files/volume-1/seg.nii.gz", "/static/review.js",
                 "/static/niivue.js", "/marks.csv", "/nothing"):  # fmt: skip
        assert client.get(path).status_code == 403, path
        assert client.get(path, headers={"X-Ctseg-Token": "wrong"}).status_code == 403
    client.cookies["ctseg-review-80"] = "wrong"
    assert client.get("/api/batch").status_code == 403
    client.cookies.clear()
    assert client.put("/api/marks/volume-1", json={"mark": "accept"}).status_code == 403
    assert not (batch / MARKS_FILE).exists()
    # The link's token sets the cookie that the page's later requests carry.
    page = client.get(f"/?token={TOKEN}")
    assert page.status_code == 200 and "ctseg review" in page.text
    assert "HttpOnly" in page.headers["set-cookie"] and page.headers["x-content-type-options"]
    assert client.get("/api/batch").status_code == 200
    script = client.get("/static/niivue.js")
    assert script.headers["content-encoding"] == "gzip" and b"Niivue" in script.content


@pytest.mark.parametrize(
    "path",
    [
        "/files/volume-1/../../etc/passwd",
        "/files/volume-1/..%2f..%2f..%2fetc%2fpasswd",
        "/files/..%2fvolume-1/seg.nii.gz",
        "/files/%2fetc%2fpasswd/seg.nii.gz",
        "/files//etc/passwd",
        "/files/volume-1/stats.json",
        "/files/volume-1/seg.nii",
        "/files/volume-1/reference.nii.gz",
        "/files/nobody/seg.nii.gz",
        "/static/../server.py",
        "/static/..%2fserver.py",
        "/files/volume-1/.ctseg-outputs.json",
    ],
)
def test_paths_outside_the_record_are_not_found(batch, path):
    assert _client(batch).get(path).status_code == 404


def test_links_out_of_the_folder_and_files_not_regular_are_refused(batch, tmp_path):
    client = _client(batch)
    secret = tmp_path / "secret.nii.gz"
    secret.write_bytes(b"secret")
    (batch / "volume-1_seg.nii.gz").unlink()
    (batch / "volume-1_seg.nii.gz").symlink_to(secret)
    assert client.get("/files/volume-1/seg.nii.gz").status_code == 403
    (batch / "volume-1_preview.png").unlink()
    os.mkfifo(batch / "volume-1_preview.png")  # opened without blocking, then refused
    assert client.get("/files/volume-1/preview.png").status_code == 403
    # A file of an output's name that predict's record does not list is no case's.
    (batch / "extra_stats.json").write_text((batch / "volume-0_stats.json").read_text())
    (batch / "extra_seg.nii.gz").write_bytes(b"x")
    assert client.get("/files/extra/seg.nii.gz").status_code == 404
    assert "extra" not in [c["name"] for c in client.get("/api/batch").json()["cases"]]


def test_a_scan_that_is_gone_or_replaced_by_a_folder_is_not_sent(batch, trained, tmp_path):
    stats = json.loads((batch / "volume-2_stats.json").read_text())
    record = json.loads((batch / ".ctseg-outputs.json").read_text())
    gone = tmp_path / "gone.nii.gz"
    record["outputs"]["volume-2_stats.json"]["scan"] = str(gone)
    record["outputs"]["volume-0_stats.json"]["scan"] = str(tmp_path)  # no DICOM series
    record["outputs"]["volume-1_stats.json"]["scan"] = "relative/volume-1.nii.gz"
    os.mkfifo(tmp_path / "pipe.mha")  # read by ctseg's reader: never opened to wait
    record["outputs"]["series_stats.json"]["scan"] = str(tmp_path / "pipe.mha")
    (batch / ".ctseg-outputs.json").write_text(json.dumps(record))
    client = _client(batch)
    assert client.get("/files/series/scan.nii").status_code == 403
    assert client.get("/files/volume-2/scan.nii.gz").status_code == 404
    assert client.get("/files/volume-0/scan.nii").status_code == 404
    assert client.get("/files/volume-1/scan.nii.gz").status_code == 404  # never relative
    assert stats["scan"]  # the stats name it too; the record, written first, decides


def test_marks_are_saved_with_who_and_when_and_survive_a_restart(batch, page_order):
    client = _client(batch)
    saved = client.put("/api/marks/volume-1", json={"mark": "reject", "comment": "=cmd|x"})
    assert saved.status_code == 200 and saved.json()["mark"]["reviewer"] == "dr. test"
    other = _client(batch, reviewer="dr. other")  # a second tab, or a server restarted
    assert other.get("/api/batch").json()["marks"]["volume-1"]["mark"] == "reject"
    assert other.put("/api/marks/volume-0", json={"mark": "accept"}).status_code == 200
    record = json.loads((batch / MARKS_FILE).read_text())
    assert record["written_by"] == "ctseg review"
    assert record["marks"]["volume-1"]["reviewer"] == "dr. test"
    assert record["marks"]["volume-0"] == {
        "mark": "accept", "comment": "", "reviewer": "dr. other",
        "at": record["marks"]["volume-0"]["at"],
    }  # fmt: skip
    assert record["marks"]["volume-0"]["at"].endswith("Z")
    rows = list(csv.reader(io.StringIO(client.get("/marks.csv").text)))
    assert [r[0] for r in rows[1:]] == page_order
    assert rows[2][1:4] == ["reject", "'=cmd|x", "dr. test"]  # no formula for a spreadsheet
    # Cleared: the mark and its comment gone.
    assert client.put("/api/marks/volume-1", json={"mark": None}).status_code == 200
    assert "volume-1" not in json.loads((batch / MARKS_FILE).read_text())["marks"]
    assert not list(batch.glob(".ctseg-tmp*"))


def test_saves_from_many_tabs_at_once_lose_no_mark(tmp_path):
    marks = Marks(tmp_path, "x")
    names = [f"scan-{i}" for i in range(24)]

    def save(name):
        for mark in ("reject", "accept"):
            marks.save(name, mark, f"of {name}")

    threads = [threading.Thread(target=save, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    saved = Marks(tmp_path, "y").read()
    assert {n: m.mark for n, m in saved.items()} == dict.fromkeys(names, "accept")


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"mark": 3}', 400),
        (b'{"mark": "accept", "comment": ["x"]}', 400),
        (b"[" * 8000 + b"]" * 8000, 400),  # nested past Python's recursion limit
        (b'{"mark": "maybe"}', 422),
        (json.dumps({"mark": "accept", "comment": "x" * 5000}).encode(), 422),
        (b"\xff\xfe", 400),
    ],
)
def test_bad_marks_are_refused_and_nothing_is_written(batch, body, status):
    answer = _client(batch).put("/api/marks/volume-1", content=body)
    assert answer.status_code == status, answer.text
    assert not (batch / MARKS_FILE).exists()


def test_huge_bodies_are_refused_unread_and_unknown_scans_not_found(batch):
    client = _client(batch)
    chunks = (b"x" * 4096 for _ in range(10_000))  # 40 MB, chunked: no length said
    assert client.put("/api/marks/volume-1", content=chunks).status_code == 413
    big = b"x" * (BODY_LIMIT + 1)
    assert client.put("/api/marks/volume-1", content=big).status_code == 413
    assert client.put("/api/marks/nobody", json={"mark": "accept"}).status_code == 404
    assert client.put("/api/marks/..%2f..%2fx", json={"mark": "accept"}).status_code == 404
    assert client.post("/api/marks/volume-1", json={"mark": "accept"}).status_code == 405
    assert not (batch / MARKS_FILE).exists()


def test_a_marks_file_not_of_ctseg_review_is_one_line(batch):
    (batch / MARKS_FILE).write_text('{"marks": {}}')
    with pytest.raises(CtsegError, match="not written by ctseg review"):
        Marks(batch, "x")
    result = CliRunner().invoke(cli, ["review", str(batch)])  # before anything listens
    assert isinstance(result.exception, CtsegError), result.output
    assert "not written by ctseg review" in str(result.exception)
    (batch / MARKS_FILE).write_text('{"written_by": "ctseg review", "marks": {"a": {"mark": 1}}}')
    with pytest.raises(CtsegError, match=r"marks\.a\.mark"):
        Marks(batch, "x")


def test_the_one_line_says_when_other_machines_can_reach_the_page(batch):
    command = [sys.executable, "-m", "ctseg", "review", str(batch), "--host", "0.0.0.0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)
    host = re.escape(socket.gethostname())
    assert re.fullmatch(rf"review: http://{host}:\d+/\?token=[\w-]{{32}}  .*\n", line), line
    assert "listening on 0.0.0.0, not only this machine" in line


def test_a_port_in_use_or_a_host_unknown_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(CtsegError, match=r"cannot listen on 127\.0\.0\.1 port \d+"):
            bind("127.0.0.1", taken.getsockname()[1])
    with pytest.raises(CtsegError, match="cannot listen on no-such-host.invalid"):
        bind("no-such-host.invalid", 0)


def test_review_of_a_folder_without_predictions_is_one_line(tmp_path):
    for folder, problem in ((tmp_path, "holds no predictions"), (tmp_path / "x", "not a folder")):
        result = CliRunner().invoke(cli, ["review", str(folder)])
        assert isinstance(result.exception, CtsegError) and problem in str(result.exception)
    result = CliRunner().invoke(cli, ["review", str(tmp_path), "--reviewer", " "])
    assert "--reviewer" in str(result.exception)
