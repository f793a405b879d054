"""longnet.files: files and folders replaced whole (save_pretrained's use of it:
tests/unit/test_modeling.py), the output checks of the scripts, and empty paths and the current
folder refused (save_pretrained and from_pretrained included)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from longnet import files
from longnet.files import (
    check_output_folder,
    check_path_given,
    check_replaceable_folder,
    open_files,
    replace_folder,
    write_atomic,
)
from longnet.modeling import LongNetConfig, LongNetLM
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



def test_an_empty_path_is_refused_as_output_and_input(tmp_path, monkeypatch):
    """``Path("")`` is the current folder: an empty setting must not read or write there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"--out is empty; give a path \(an empty path would "
                                         r"be the current folder"):
        check_output_folder("")
    with pytest.raises(UsageError, match="OUTPUT is empty"):
        check_replaceable_folder("", what="OUTPUT")
    with pytest.raises(UsageError, match="file is empty"):
        write_atomic("", "x")
    with pytest.raises(UsageError, match="folder is empty"), open_files("", ["a"]):
        pass
    with pytest.raises(UsageError, match="folder is empty"), replace_folder(""):
        pass
    assert os.listdir(tmp_path) == []
    assert check_path_given("model", "OUTPUT") == Path("model")


@pytest.mark.parametrize("where", [".", "..", "sub/.."])
def test_the_current_folder_or_one_holding_it_is_never_replaced(tmp_path, monkeypatch, where):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "README.md").write_text("mine")
    monkeypatch.chdir(work)
    holds = "the current folder" if where != ".." else f"a folder holding the current folder {work}"
    with pytest.raises(UsageError, match=f"OUTPUT {re.escape(where)} is {holds}: it would be "
                                         "replaced whole"):
        check_replaceable_folder(where, what="OUTPUT")
    with pytest.raises(UsageError, match="is the current folder"), replace_folder(work):
        pass
    assert (work / "README.md").read_text() == "mine" and os.getcwd() == str(work)
    assert check_replaceable_folder("sub", what="OUTPUT") == Path("sub")


def test_save_pretrained_refuses_an_empty_path_and_the_current_folder(tmp_path, monkeypatch):
    """``save_pretrained("")`` replaced the current folder (its README.md overwritten, the
    shell left in a deleted folder)."""
    model = LongNetLM(LongNetConfig(hidden_size=16, num_layers=1, num_heads=2, max_positions=32,
                                    segment_lengths=(16, 32), dilation_rates=(1, 2)))
    (tmp_path / "README.md").write_text("mine")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="save_pretrained directory is empty"):
        model.save_pretrained("")
    with pytest.raises(UsageError, match=r"save_pretrained directory \. is the current folder"):
        model.save_pretrained(".")
    with pytest.raises(UsageError, match="model name or folder is empty"):
        LongNetLM.from_pretrained("")
    assert os.listdir(tmp_path) == ["README.md"] and os.getcwd() == str(tmp_path)
    assert (tmp_path / "README.md").read_text() == "mine"
