"""The review page's files are package data: a wheel (and an install from it) serves them."""

import tomllib

from helpers import REPO

from ctseg.review.server import NIIVUE_GZ, STATIC

TRACKED_LIMIT = 2 << 20  # every tracked file stays under 2 MiB


def test_every_static_file_is_package_data_and_small():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data["package-data"]["ctseg.review"]
    package = STATIC.parent
    listed = {p for g in globs for p in package.glob(g) if p.is_file()}
    present = {p for p in STATIC.rglob("*") if p.is_file()}
    assert present == listed
    assert NIIVUE_GZ in present and (STATIC / "niivue" / "LICENSE").is_file()
    assert all(p.stat().st_size < TRACKED_LIMIT for p in present)
