"""The typed tile request: the config's and the command line's int read once, checked once."""

import numpy as np
import pytest

from ctseg.config import TileRequest
from ctseg.errors import CtsegError


@pytest.mark.parametrize(
    ("tile", "expected"),
    [
        (-1, TileRequest.auto()),
        (0, TileRequest.whole()),
        (2, TileRequest.size(2)),
        (64, TileRequest.size(64)),
        (np.int64(8), TileRequest.size(8)),
    ],
)
def test_from_int_reads_auto_whole_and_even_sizes(tile, expected):
    request = TileRequest.from_int(tile)
    assert request == expected and request.to_int() == tile
    assert TileRequest.of(request) is request


@pytest.mark.parametrize(
    ("tile", "words"),
    [
        (-2, ["predict.tile must be -1 (auto), 0 (whole volume) or a size, got -2"]),
        (7, ["predict.tile = 7 must be even"]),
        (2.0, ["predict.tile must be an integer", "2.0"]),
        ("8", ["predict.tile must be an integer", "'8'"]),
        (True, ["predict.tile must be an integer"]),
    ],
)
def test_from_int_refuses_in_one_line_naming_the_option(tile, words):
    with pytest.raises(CtsegError) as raised:
        TileRequest.from_int(tile, "predict.tile")
    message = str(raised.value)
    assert "\n" not in message and "--" not in message
    assert all(word in message for word in words), message


def test_size_takes_only_even_positive_cores():
    assert TileRequest.size(6).core == 6
    for core in (0, -1, 5):
        with pytest.raises(CtsegError, match="tile"):
            TileRequest.size(core)
    assert str(TileRequest.auto()) == "automatic" and str(TileRequest.size(6)) == "cores of 6³"
