"""Atomic writes and output folders: modes, files in the way, folders of others."""

import os

import pytest

from ctseg.atomic import claim_folder, output_folder, write_text
from ctseg.errors import CtsegError


def test_written_files_get_the_users_umask_not_0600(tmp_path):
    write_text(tmp_path / "a.txt", "x")
    mask = os.umask(0o022)
    os.umask(mask)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~mask


def test_output_folder_that_is_a_file_or_under_a_file_is_one_error(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(CtsegError, match="is a file, not a folder"):
        output_folder(tmp_path / "f")
    with pytest.raises(CtsegError, match="could not create the folder"):
        output_folder(tmp_path / "f" / "sub")
    with pytest.raises(CtsegError, match="is a file, not a folder"):
        write_text(tmp_path / "f" / "x.json", "{}")


def test_claim_folder_takes_new_empty_own_or_forced_folders_only(tmp_path):
    assert claim_folder(tmp_path / "new", (".mine",)).is_dir()
    assert claim_folder(tmp_path / "new", (".mine",)).is_dir()  # empty
    (tmp_path / "new" / "data.nii").write_text("")
    with pytest.raises(CtsegError, match="did not write; give an empty or new folder, or `force`"):
        claim_folder(tmp_path / "new", (".mine",))
    with pytest.raises(CtsegError, match="new folder$"):
        claim_folder(tmp_path / "new", (".mine",), force=None)
    claim_folder(tmp_path / "new", (".mine",), force=True)
    (tmp_path / "new" / ".mine").write_text("")
    claim_folder(tmp_path / "new", (".mine",))
