"""Data files and the cache folder as a new user gives them (lab/bad_inputs/probe_data.yaml):
link loops under ``**``, file names with glob characters, CSV/TSV tables, damaged parquet and
JSON files, empty paths, and the user cache folder that is the default ``cache_dir``."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longnet.data import (
    CorpusSettings,
    LongDocumentDataModule,
    build_long_document_splits,
    files_source,
)
from longnet.data.cache import default_cache_dir
from longnet.data.reading import load_documents
from longnet.validation import UsageError

SETTINGS = CorpusSettings(seq_len=32, val_fraction=0.25, test_fraction=0.25)


def _texts(source, tmp_path: Path) -> list[str]:
    return list(load_documents(source, tmp_path / "scratch")["text"])


# ---------------------------------------------------------------------- globs
@pytest.mark.timeout(20)
def test_a_link_loop_under_a_recursive_glob_ends_and_each_file_is_read_once(tmp_path):
    docs, elsewhere = tmp_path / "docs", tmp_path / "elsewhere"
    (docs / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (docs / "a.txt").write_text("a")
    (docs / "sub" / "b.txt").write_text("b")
    (elsewhere / "c.txt").write_text("c")
    (docs / "sub" / "up").symlink_to("..")  # two loops: 2**depth paths for a glob following them
    (docs / "self").symlink_to(".")
    (docs / "linked").symlink_to(elsewhere)  # a linked folder is read, once
    (docs / "again").symlink_to(elsewhere)
    source = files_source(str(docs / "**" / "*.txt"))
    assert source.files == (docs / "a.txt", docs / "sub" / "b.txt", elsewhere / "c.txt")


def test_a_recursive_glob_keeps_glob_semantics(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    (docs / "x" / "y").mkdir(parents=True)
    (docs / ".hidden").mkdir()
    for path in ("top.txt", "x/one.txt", "x/y/two.txt", "x/y/two.md", ".hidden/no.txt",
                 "x/.no.txt"):
        (docs / path).write_text(path)
    found = files_source(str(docs / "**" / "*.txt")).files
    assert found == tuple(docs / p for p in ("top.txt", "x/one.txt", "x/y/two.txt"))
    assert files_source(str(docs / "**" / "y" / "*.txt")).files == (docs / "x/y/two.txt",)
    assert files_source(str(docs / "x" / "**")).files == (
        docs / "x/one.txt", docs / "x/y/two.md", docs / "x/y/two.txt")
    monkeypatch.chdir(docs)  # a relative pattern that starts with **
    assert files_source("**/two.*").files == (docs / "x/y/two.md", docs / "x/y/two.txt")


def test_a_file_named_with_glob_characters_is_that_file(tmp_path):
    (tmp_path / "a[1].txt").write_text("the file named")
    (tmp_path / "a1.txt").write_text("what the glob a[1].txt matches")
    assert files_source(str(tmp_path / "a[1].txt")).files == (tmp_path / "a[1].txt",)
    assert files_source(str(tmp_path / "a[12].txt")).files == (tmp_path / "a1.txt",)


@pytest.mark.parametrize("data_files", ["", [""], ["   "], [str(Path.cwd()), ""]])
def test_an_empty_data_files_path_is_refused(data_files):
    with pytest.raises(ValueError, match="data_files .*empty"):
        files_source(data_files)


# ---------------------------------------------------------------------- tables
def test_csv_and_tsv_rows_are_documents_of_the_text_column(tmp_path):
    texts = ["plain", "NA", "", "a, comma", "two\nlines", "42"]
    with (tmp_path / "rows.csv").open("w", newline="") as handle:
        handle.write("id,body\n")
        handle.writelines(f'{i},"{t}"\n' for i, t in enumerate(texts))
    (tmp_path / "rows.tsv").write_text(
        "body\tid\n" + "".join(f"{t.replace(chr(10), ' ')}\t{i}\n" for i, t in enumerate(texts)))
    csv = files_source(str(tmp_path / "rows.csv"), text_column="body")
    assert csv.format == "csv"
    assert _texts(csv, tmp_path) == texts
    tsv = files_source(str(tmp_path / "rows.tsv"), text_column="body")
    assert tsv.format == "tsv"
    assert _texts(tsv, tmp_path) == [t.replace("\n", " ") for t in texts]
    with pytest.raises(UsageError, match=(r"text_column='text' is not a column of .*rows\.csv "
                                          r"\(columns: \['id', 'body'\]\)")):
        load_documents(files_source(str(tmp_path / "rows.csv")), tmp_path / "scratch")
    (tmp_path / "ragged.csv").write_text("text\none\ntwo, unquoted\n")  # a row of 2 fields
    with pytest.raises(UsageError, match=rf"{tmp_path / 'ragged.csv'} is damaged .*line 3"):
        load_documents(files_source(str(tmp_path / "ragged.csv")), tmp_path / "scratch")


def test_an_empty_table_file_holds_no_rows(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "the one document"}) + "\n")
    assert _texts(files_source(str(tmp_path / "*.jsonl")), tmp_path) == ["the one document"]
    assert _texts(files_source(str(tmp_path / "a.jsonl")), tmp_path) == []


def test_a_truncated_parquet_file_is_named_as_damaged(tmp_path):
    table = pa.table({"text": [f"document {i} " * 20 for i in range(50)]})
    pq.write_table(table, tmp_path / "good.parquet")
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    source = files_source(str(tmp_path / "*.parquet"))
    with pytest.raises(UsageError) as caught:
        load_documents(source, tmp_path / "scratch")
    message = str(caught.value)
    assert f"{tmp_path / 'cut.parquet'} is damaged" in message and "good.parquet" not in message
    assert "\n" not in message


def test_a_damaged_json_file_among_several_is_the_one_named(tmp_path):
    lines = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20))
    (tmp_path / "a.jsonl").write_text(lines)
    (tmp_path / "b.jsonl").write_text(lines[:-9])  # cut inside the last record
    with pytest.raises(UsageError, match=rf"{tmp_path / 'b.jsonl'} is damaged") as caught:
        load_documents(files_source(str(tmp_path / "*.jsonl")), tmp_path / "scratch")
    assert "a.jsonl" not in str(caught.value)


def test_json_files_that_disagree_on_a_column_type_are_named_together(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "words", "n": 1}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "words", "n": "one"}) + "\n")
    with pytest.raises(UsageError, match="read alone but not together"):
        load_documents(files_source(str(tmp_path / "*.jsonl")), tmp_path / "scratch")


# ---------------------------------------------------------------------- the cache folder
@pytest.mark.parametrize(("env", "expected"), [
    ({"LONGNET_CACHE": "{tmp}/mine", "XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/mine"),
    ({"LONGNET_CACHE": "~/mine"}, "{tmp}/home/mine"),
    ({"XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/longnet"),
    ({"XDG_CACHE_HOME": "relative"}, "{tmp}/home/.cache/longnet"),  # the XDG spec: ignored
    ({"XDG_CACHE_HOME": ""}, "{tmp}/home/.cache/longnet"),
    ({}, "{tmp}/home/.cache/longnet"),
])
def test_the_default_cache_is_the_users_cache_folder(tmp_path, monkeypatch, env, expected):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("LONGNET_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    assert default_cache_dir() == Path(expected.format(tmp=tmp_path))
    data = LongDocumentDataModule(seq_len=32)
    assert data.cache_dir == Path(expected.format(tmp=tmp_path))
    mine = LongDocumentDataModule(seq_len=32, cache_dir=str(tmp_path / "explicit"))
    assert mine.cache_dir == tmp_path / "explicit"
    assert LongDocumentDataModule(seq_len=32, cache_dir="~/c").cache_dir == tmp_path / "home/c"


def test_an_empty_cache_folder_setting_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where an empty path would put the cache
    with pytest.raises(ValueError, match="cache_dir is empty"):
        LongDocumentDataModule(seq_len=32, cache_dir="")
    with pytest.raises(ValueError, match="cache_dir is empty"):
        build_long_document_splits(files_source(__file__), SETTINGS, " ")
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv("LONGNET_CACHE", "")
    with pytest.raises(UsageError, match="LONGNET_CACHE is set but empty"):
        LongDocumentDataModule(seq_len=32)
