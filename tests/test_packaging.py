"""What `pip install` puts into site-packages: the `ctseg` package alone, with the command
line (cli/) and the data preparation (data_prep/) inside its namespace, and the `ctseg`
console script."""

import subprocess
import sys
import tomllib
import zipfile

from helpers import REPO

# The folders at the repository's top level that install inside ctseg's namespace.
BESIDE_CTSEG = {"ctseg.cli": "cli", "ctseg.data_prep": "data_prep"}


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_once():
    root = REPO / "ctseg"
    inside = {
        ".".join(("ctseg", *init.parent.relative_to(root).parts))
        for init in root.rglob("*/__init__.py")
    }
    assert set(_setuptools()["packages"]) == {"ctseg", *inside, *BESIDE_CTSEG}
    assert _setuptools()["package-dir"] == BESIDE_CTSEG
    # Only ctseg/ and the folders mapped into it are importable packages at the top level.
    top_level = {init.parent.name for init in REPO.glob("*/__init__.py")}
    assert top_level == {"ctseg", *BESIDE_CTSEG.values()}


def test_the_wheel_holds_ctseg_alone(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("ctseg-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = wheel.name.split("-py3")[0] + ".dist-info"
    assert {name.split("/")[0] for name in names} == {"ctseg", dist_info}
    for module in ("ctseg/cli/main.py", "ctseg/data_prep/build.py", "ctseg/data/store.py"):
        assert module in names
    assert any(name.startswith("ctseg/targets/specs/") for name in names)
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "ctseg = ctseg.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_python_m_ctseg_is_the_command_line():
    # What scripts run (scripts/gpu_check.py): no console script needed beside the Python.
    done = subprocess.run(
        [sys.executable, "-m", "ctseg", "--help"], capture_output=True, text=True, check=True
    )
    assert "preprocess" in done.stdout and "predict" in done.stdout
