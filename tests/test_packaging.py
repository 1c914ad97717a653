"""What `pip install` puts into site-packages: the `ctseg` package alone (its command line
and phantom generator inside it), and the `ctseg` console script."""

import tomllib

from helpers import REPO


def test_only_ctseg_is_installed_at_the_top_level():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["ctseg*"]
    assert project["project"]["scripts"] == {"ctseg": "ctseg.cli.main:main"}
    # No other importable top-level package that a wider `include` would ship.
    packages = [p.parent.name for p in REPO.glob("*/__init__.py")]
    assert packages == ["ctseg"]
