"""ctseg.reading: only regular files are opened, and records are read key by key."""

import hashlib
import os

import pytest

from ctseg.errors import CtsegError
from ctseg.reading import (
    NotRegularFile,
    Record,
    check_regular,
    read_json,
    read_text,
    sha256_of,
)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "quality.json"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFile, match="pipe"):
        read_json(fifo)  # would block forever on a plain open()
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    with pytest.raises(NotRegularFile):
        check_regular(link)
    with pytest.raises(NotRegularFile, match="folder"):
        read_json(tmp_path)


def test_absence_is_left_to_the_caller(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "none.json")


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"a": ' + "1" * 5000 + "}", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("{", "not valid JSON"),
        ("[1, 2]", "its top level must be an object"),
    ],
)
def test_bad_records_are_one_line_naming_the_file(tmp_path, text, words):
    path = tmp_path / "stats.json"
    path.write_text(text)
    with pytest.raises(CtsegError, match=words) as caught:
        Record.read(path, "stats")
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_keys_are_checked_and_named_by_their_whole_path():
    record = Record({"a": {"b": [{"n": "3"}], "x": None}, "f": float("nan")}, "s.json", "stats")
    with pytest.raises(CtsegError, match=r"key 'a\.b\[0\]\.n' must be an integer, not \"3\""):
        [item.integer("n") for item in record.record("a").records("b")]
    with pytest.raises(CtsegError, match="key 'a.x' is null"):
        record.record("a").text("x")
    assert record.record("a").text("x", optional=True) is None
    with pytest.raises(CtsegError, match="key 'f' must be a finite number"):
        record.number("f")
    with pytest.raises(CtsegError, match="key 'missing' is missing"):
        record.flag("missing")
    with pytest.raises(CtsegError, match=r"must lie in \[0, 1\]"):
        Record({"p": 2}, "s.json").number("p", low=0, high=1)
    with pytest.raises(CtsegError, match="must be an integer, not true"):
        Record({"n": True}, "s.json").integer("n")


def test_lists_of_numbers_and_text_are_checked_too(tmp_path):
    record = Record({"min": [1, 2.5, "3"], "max": [1, 2]}, "f.json", "fingerprint")
    with pytest.raises(CtsegError, match=r"key 'min\[2\]' must be a number, not \"3\""):
        record.numbers("min")
    with pytest.raises(CtsegError, match="key 'max' must be a list of 3 numbers"):
        record.numbers("max", length=3)
    assert record.numbers("max", length=2) == [1.0, 2.0]
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"\xff\n")
    with pytest.raises(CtsegError, match="log.jsonl"):
        read_text(path, "metrics")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotRegularFile):
        read_text(tmp_path / "fifo")


def test_a_nested_value_that_is_no_object_is_named_by_its_key_once(tmp_path):
    record = Record({"request": {"region": "the whole scan"}}, tmp_path / "s.json", "stats")
    with pytest.raises(CtsegError, match=r"key 'request\.region' must be an object, not \"the"):
        record.record("request").record("region")


def test_a_files_digest_is_its_size_and_sha256_and_never_waits_on_a_fifo(tmp_path):
    path = tmp_path / "scan.nii.gz"
    path.write_bytes(b"voxels" * 1000)
    assert sha256_of(path) == (6000, hashlib.sha256(b"voxels" * 1000).hexdigest())
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotRegularFile, match="pipe"):
        sha256_of(tmp_path / "fifo", "scan")
    record = Record({"a": sha256_of(path)[1], "b": "abc", "c": 5}, path)
    assert record.sha256("a") == sha256_of(path)[1]
    for key in "bc":
        with pytest.raises(CtsegError, match=f"key '{key}' must be a"):
            record.sha256(key)


def test_a_report_that_is_a_fifo_or_nested_too_deeply_is_none_of_ours(tmp_path):
    from ctseg.atomic import is_json_with

    fifo = tmp_path / "bench.json"
    os.mkfifo(fifo)
    deep = tmp_path / "plan.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert not is_json_with(fifo, ["config"])  # answered at once, not on a writer's arrival
    assert not is_json_with(deep, ["config"])
    good = tmp_path / "ok.json"
    good.write_text('{"config": 1}')
    assert is_json_with(good, ["config"])
