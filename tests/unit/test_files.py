"""longnet.files: files and folders replaced whole (save_pretrained's use of it:
tests/unit/test_modeling.py), and the output checks of the scripts."""

from __future__ import annotations

import os
import stat

import pytest

from longnet import files
from longnet.files import (
    check_output_folder,
    check_replaceable_folder,
    open_files,
    replace_folder,
    write_atomic,
)
from longnet.validation import UsageError


def test_write_atomic_replaces_whole_files_with_the_umask_and_leaves_no_temporary(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_atomic(tmp_path / "new" / "metrics.json", '{"step": 1}\n')
    finally:
        os.umask(old)
    assert path.read_text() == '{"step": 1}\n' and stat.S_IMODE(path.stat().st_mode) == 0o644
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    with pytest.raises(TypeError):
        write_atomic(path, 3.5)  # fails while writing: the old content stays
    assert path.read_bytes() == b"\x00\x01" and os.listdir(path.parent) == ["metrics.json"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replace_folder_swaps_whole_folders_or_leaves_the_old_one(tmp_path, monkeypatch,
                                                                  exchange):
    if not exchange:  # a system or file system without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(files, "_exchange", lambda first, second: False)
    target = tmp_path / "model"
    for version in ("1", "2"):
        with replace_folder(target, owned=["weights"]) as folder:
            (folder / "config").write_text(version)
            (folder / "weights").write_text(version)
    (target / "notes").write_text("kept")
    with replace_folder(target, owned=["weights"]) as folder:
        (folder / "config").write_text("3")
    assert {p.name: p.read_text() for p in target.iterdir()} == {"config": "3", "notes": "kept"}
    with pytest.raises(RuntimeError), replace_folder(target) as folder:
        (folder / "config").write_text("4")
        raise RuntimeError("stopped")
    assert (target / "config").read_text() == "3" and os.listdir(tmp_path) == ["model"]


def test_open_files_leaves_out_absent_names_and_names_an_absent_folder(tmp_path):
    (tmp_path / "a").write_bytes(b"A")
    with open_files(tmp_path, ["a", "b"]) as handles:
        assert {name: handle.read() for name, handle in handles.items()} == {"a": b"A"}
    gone = tmp_path / "gone"
    with pytest.raises(FileNotFoundError, match=f"no folder at {gone}"), open_files(gone, ["a"]):
        pass


def test_output_checks_name_the_path_and_the_fix(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    assert check_output_folder(tmp_path / "a" / "b", ["x.csv"]) == tmp_path / "a" / "b"
    assert check_replaceable_folder(tmp_path / "model") == tmp_path / "model"
    with pytest.raises(UsageError, match=f"--out {file}/b: {file} is a file, not a folder; "
                                         "give another --out or move the file away"):
        check_output_folder(file / "b")
    (tmp_path / "x.csv").mkdir()
    with pytest.raises(UsageError, match="x.csv is a folder where a file is to be written"):
        check_output_folder(tmp_path, ["x.csv"])
    with pytest.raises(UsageError, match=f"OUTPUT {file} is a file, not a folder"):
        check_replaceable_folder(file, what="OUTPUT")
    with pytest.raises(UsageError, match=f"folder {file} is a file"), replace_folder(file):
        pass

