"""Long-document corpora: splits, windows, cache, sources (small tmp corpora)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DistributedSampler

from longnet.data import (
    IGNORE_INDEX,
    CorpusSettings,
    LongDocumentDataModule,
    build_long_document_splits,
    files_source,
    stdlib_source,
)
from longnet.data.encoding import SPLITS, document_hash
from longnet.data.tokenizer import EOS_ID, PAD_ID, ByteTokenizer
from longnet.validation import UsageError

REPO = Path(__file__).resolve().parents[2]
SETTINGS = CorpusSettings(seq_len=32, val_fraction=0.25, test_fraction=0.25)


def _text(index: int) -> str:
    rng = np.random.default_rng(index)
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta\n", "東", "def f():\n    return 1\n"]
    return " ".join(rng.choice(words, size=int(rng.integers(1, 60))))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """40 text documents of 5-400 bytes, plus an empty file that must be dropped."""
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for index in range(40):
        (folder / ("sub" if index % 3 else "") / f"doc{index:02d}.txt").write_text(_text(index))
    (folder / "empty.txt").write_text("")
    return folder


def _build(folder: Path, cache: Path, settings: CorpusSettings = SETTINGS):
    return build_long_document_splits(files_source(str(folder / "**" / "*.txt")), settings, cache)


def _texts_by_id(folder: Path) -> dict[str, np.ndarray]:
    tokenizer = ByteTokenizer()
    tokens = [tokenizer.encode_array(path.read_text()) for path in folder.rglob("*.txt")]
    return {document_hash(t): t for t in tokens if len(t)}


def _rows(dataset) -> list[dict]:
    return list(dataset.with_format(None))


def test_splits_are_deterministic_disjoint_and_complete(corpus: Path, tmp_path: Path) -> None:
    first = _build(corpus, tmp_path / "cache_a")
    second = _build(corpus, tmp_path / "cache_b")
    assert first.built and second.built and first.path != second.path
    assert _rows(first.documents) == _rows(second.documents)
    for split in SPLITS:
        assert _rows(getattr(first, split)) == _rows(getattr(second, split))
    index = _rows(first.documents)
    by_split = {s: {row["doc_id"] for row in index if row["split"] == s} for s in SPLITS}
    assert all(by_split.values())
    assert not by_split["train"] & by_split["validation"]
    assert not by_split["train"] & by_split["test"]
    assert not by_split["validation"] & by_split["test"]
    assert set().union(*by_split.values()) == set(_texts_by_id(corpus))  # empty file dropped
    for split in ("validation", "test"):
        assert {row["doc_id"] for row in _rows(getattr(first, split))} == by_split[split]


@pytest.mark.parametrize("split", ["validation", "test"])
def test_evaluation_windows_never_cross_a_document(corpus: Path, tmp_path: Path, split) -> None:
    splits = _build(corpus, tmp_path / "cache")
    seq_len, texts = SETTINGS.seq_len, _texts_by_id(corpus)
    seen: dict[str, list[int]] = {}
    for row in _rows(getattr(splits, split)):
        framed = np.r_[EOS_ID, texts[row["doc_id"]], EOS_ID].astype(np.int64)
        start = row["offset"]
        inputs = framed[start : start + seq_len]
        labels = framed[start + 1 : start + seq_len + 1]
        assert row["input_ids"] == inputs.tolist() + [PAD_ID] * (seq_len - len(inputs))
        assert row["labels"] == labels.tolist() + [IGNORE_INDEX] * (seq_len - len(labels))
        seen.setdefault(row["doc_id"], []).append(start)
    for doc_id, offsets in seen.items():  # each document is tiled exactly once, in order
        count = -(-(len(texts[doc_id]) + 1) // seq_len)
        assert offsets == [seq_len * k for k in range(count)]


def test_train_windows_are_the_packed_train_stream(corpus: Path, tmp_path: Path) -> None:
    splits = _build(corpus, tmp_path / "cache")
    texts, seq_len = _texts_by_id(corpus), SETTINGS.seq_len
    train_ids = [row["doc_id"] for row in _rows(splits.documents) if row["split"] == "train"]
    stream = np.concatenate([np.r_[EOS_ID, texts[d]] for d in train_ids] + [[EOS_ID]])
    sample = splits.train[0]
    assert set(sample) == {"input_ids", "labels"}
    assert sample["input_ids"].shape == sample["labels"].shape == (seq_len,)
    assert str(sample["input_ids"].dtype) == "torch.int64"
    inputs = splits.train[:]["input_ids"]
    labels = splits.train[:]["labels"]
    count = (len(stream) - 1) // seq_len
    assert inputs.shape == (count, seq_len)
    assert inputs.reshape(-1).tolist() == stream[: count * seq_len].tolist()
    assert labels[:, :-1].tolist() == inputs[:, 1:].tolist()  # labels are the shifted inputs
    assert labels.reshape(-1).tolist() == stream[1 : count * seq_len + 1].tolist()


def _mtimes(entry: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in entry.rglob("*") if path.is_file()}


def test_second_build_hits_the_cache(corpus: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _build(corpus, cache)
    before = _mtimes(first.path)
    second = _build(corpus, cache)
    assert first.built and not second.built
    assert second.path == first.path and _mtimes(second.path) == before
    assert second.train[:]["input_ids"].tolist() == first.train[:]["input_ids"].tolist()
    assert [p.name for p in cache.iterdir()] == [first.path.name]  # no staging left behind


def test_changed_settings_or_files_rebuild(corpus: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    base = _build(corpus, cache)
    other_len = _build(
        corpus, cache, CorpusSettings(seq_len=16, val_fraction=0.25, test_fraction=0.25)
    )
    assert other_len.built and other_len.path != base.path
    assert other_len.train[0]["input_ids"].shape == (16,)
    limited = _build(
        corpus,
        cache,
        CorpusSettings(seq_len=32, val_fraction=0.25, test_fraction=0.25, max_documents=30),
    )
    assert limited.built and len(limited.documents) == 30
    edited = corpus / "doc00.txt"
    edited.write_text(edited.read_text() + " and more")
    os.utime(edited, ns=(1, 1))  # make the change visible even on coarse-mtime filesystems
    after_edit = _build(corpus, cache)
    assert after_edit.built and after_edit.path not in (base.path, other_len.path)
    (corpus / "new.txt").write_text("a brand new document " * 5)
    assert _build(corpus, cache).built
    assert not _build(corpus, cache).built


def test_size_limits_keep_leading_documents(corpus: Path, tmp_path: Path) -> None:
    everything = _rows(_build(corpus, tmp_path / "cache").documents)
    settings = CorpusSettings(seq_len=8, val_fraction=0.25, test_fraction=0.25, max_bytes=2000)
    kept = _rows(_build(corpus, tmp_path / "cache", settings).documents)
    sizes = [row["num_bytes"] for row in kept]
    assert sum(sizes[:-1]) < 2000 <= sum(sizes)
    assert kept == everything[: len(kept)]


def test_min_document_bytes_drops_short_documents(corpus: Path, tmp_path: Path) -> None:
    sizes = sorted(len(t) for t in _texts_by_id(corpus).values())
    threshold = sizes[len(sizes) // 3]
    settings = CorpusSettings(seq_len=8, val_fraction=0.25, test_fraction=0.25,
                              min_document_bytes=threshold)
    kept = _rows(_build(corpus, tmp_path / "cache", settings).documents)
    expected = {doc_id for doc_id, t in _texts_by_id(corpus).items() if len(t) >= threshold}
    assert {row["doc_id"] for row in kept} == expected
    assert min(row["num_bytes"] for row in kept) >= threshold
    with pytest.raises(ValueError, match="min_document_bytes"):
        _build(corpus, tmp_path / "cache",
               CorpusSettings(seq_len=8, min_document_bytes=sizes[-1] + 1))
    with pytest.raises(ValueError, match="min_document_bytes"):
        CorpusSettings(seq_len=8, min_document_bytes=0)


def test_missing_data_files_name_the_glob(tmp_path: Path) -> None:
    pattern = str(tmp_path / "nowhere" / "*.txt")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        files_source(pattern)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        LongDocumentDataModule(data_files=[pattern], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="data_files is empty"):
        files_source([])


def test_bad_corpora_fail_clearly(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no document for the validation split"):
        _build(corpus, tmp_path / "cache", CorpusSettings(seq_len=8, max_documents=1))
    with pytest.raises(ValueError, match="no window"):
        _build(
            corpus,
            tmp_path / "cache",
            CorpusSettings(seq_len=100_000, val_fraction=0.25, test_fraction=0.25),
        )
    with pytest.raises(ValueError, match="val_fraction"):
        CorpusSettings(seq_len=8, val_fraction=0.6, test_fraction=0.5)
    with pytest.raises(ValueError, match="seq_len"):
        CorpusSettings(seq_len=0)
    assert not list((tmp_path / "cache").iterdir())  # failed builds leave nothing behind
    (tmp_path / "mixed.json").write_text("{}\n")
    with pytest.raises(ValueError, match="mixes formats"):
        files_source([str(corpus / "*.txt"), str(tmp_path / "mixed.json")])


def test_window_longer_than_every_document_is_refused(corpus: Path, tmp_path: Path) -> None:
    longest = max(len(path.read_bytes()) for path in corpus.rglob("*.txt"))
    files = str(corpus / "**" / "*.txt")
    args = dict(data_files=files, val_fraction=0.25, test_fraction=0.25,
                cache_dir=str(tmp_path / "cache"))
    LongDocumentDataModule(seq_len=longest + 1, **args).setup()  # document + closing EOS
    with pytest.raises(UsageError, match=(
        f"seq_len {longest + 2} is longer than every document .*longest: {longest} bytes.*"
        f"Lower seq_len to at most {longest + 1}"
    )):
        LongDocumentDataModule(seq_len=longest + 2, **args).setup()


def test_json_and_parquet_rows_are_documents(tmp_path: Path) -> None:
    texts = [_text(index) for index in range(30)]
    with (tmp_path / "rows.jsonl").open("w") as handle:
        for index, text in enumerate(texts):
            handle.write(json.dumps({"id": index, "body": text}) + "\n")
    pq.write_table(pa.table({"body": texts, "id": list(range(30))}), tmp_path / "rows.parquet")
    results = []
    for name in ("rows.jsonl", "rows.parquet"):
        source = files_source(str(tmp_path / name), text_column="body")
        results.append(build_long_document_splits(source, SETTINGS, tmp_path / "cache"))
        with pytest.raises(UsageError, match="text_column='text'"):
            build_long_document_splits(
                files_source(str(tmp_path / name)), SETTINGS, tmp_path / "cache"
            )
        with pytest.raises(UsageError, match="not strings"):
            build_long_document_splits(
                files_source(str(tmp_path / name), text_column="id"), SETTINGS, tmp_path / "cache"
            )
    assert _rows(results[0].documents) == _rows(results[1].documents)
    assert len(results[0].documents) == 30


def test_datamodule_with_passkey_mixing(corpus: Path, tmp_path: Path) -> None:
    module = LongDocumentDataModule(
        seq_len=256,
        batch_size=3,
        data_files=str(corpus / "**" / "*.txt"),
        val_fraction=0.25,
        test_fraction=0.25,
        passkey_fraction=0.5,
        cache_dir=str(tmp_path / "cache"),
    )
    assert module.vocab_size == 256
    with pytest.raises(RuntimeError, match="setup"):
        module.train_dataloader()
    module.prepare_data()
    module.setup("fit")
    assert not module.splits.built  # prepare_data built it, setup loaded it
    text_windows = len(module.splits.train)
    assert len(module.train_dataset) == 2 * text_windows
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 256)
    passkey = module.train_dataset[text_windows]
    assert b"pass key" in bytes(passkey["input_ids"].tolist())
    for loader in (module.val_dataloader(), module.test_dataloader()):
        batch = next(iter(loader))
        assert batch["input_ids"].shape[1] == 256 and str(batch["labels"].dtype) == "torch.int64"
    # map-style: a DistributedSampler splits it across data-parallel replicas
    shards = [
        list(DistributedSampler(module.train_dataset, num_replicas=2, rank=r, shuffle=False))
        for r in range(2)
    ]
    assert sorted(shards[0] + shards[1])[: len(module.train_dataset)] == list(
        range(len(module.train_dataset))
    )
    with pytest.raises(ValueError, match="passkey_fraction"):
        LongDocumentDataModule(data_files=str(corpus / "*.txt"), passkey_fraction=1.0)
    with pytest.raises(ValueError, match="raise seq_len"):
        LongDocumentDataModule(seq_len=64, data_files=str(corpus / "*.txt"), passkey_fraction=0.1)


def test_default_stdlib_corpus_and_json_offline(tmp_path: Path) -> None:
    """The default source and a json source in a fresh interpreter, HF_DATASETS_OFFLINE=1."""
    with (tmp_path / "rows.jsonl").open("w") as handle:
        for index in range(30):
            handle.write(json.dumps({"text": _text(index)}) + "\n")
    script = f"""
import datasets, torch
from longnet.data import LongDocumentDataModule
assert datasets.config.HF_DATASETS_OFFLINE
for data_files in (None, "rows.jsonl"):
    module = LongDocumentDataModule(seq_len=128, batch_size=2, data_files=data_files,
                                    max_documents=30, val_fraction=0.3, test_fraction=0.3,
                                    cache_dir={str(tmp_path / "cache")!r})
    module.prepare_data()
    module.setup()
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape == (2, 128) and batch["input_ids"].dtype == torch.long
    assert len(module.splits.documents) == 30
print("ok")
"""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


def test_stdlib_source_skips_tests_and_site_packages() -> None:
    source = stdlib_source()
    parts = {part for path in source.files for part in path.parts}
    assert {"test", "tests", "idle_test", "site-packages"}.isdisjoint(parts)
    assert any(path.name == "json" or path.parent.name == "json" for path in source.files)
    assert list(source.files) == sorted(source.files, key=lambda p: p.as_posix())


# ---------------------------------------------------------------------- data a user points at
ELF = b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4


def _files(folder: Path, files: dict[str, bytes | str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = folder / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return folder


def _texts(count: int) -> dict[str, str]:
    return {f"doc{index:02d}.txt": _text(index) for index in range(count)}


BAD_DATA = [  # (files, data_files glob, source options, settings, exception, message)
    ({**_texts(30), "a.out": ELF}, "*", {}, {}, UsageError,
     r"1 of the 31 data_files are not UTF-8 text:\n  .*a\.out: binary: a NUL byte at offset 7"),
    ({**_texts(30), "latin1.txt": "caf\u00e9 cr\u00e8me".encode("latin-1")}, "*", {}, {},
     UsageError, r"latin1\.txt: not UTF-8: byte 0xe9 at offset 3.*iconv"),
    ({f"tool{index}": ELF for index in range(7)}, "*", {}, {}, UsageError,
     r"7 of the 7 data_files.*tool0: binary.*and 2 more"),
    ({f"tool{index}": ELF for index in range(3)}, "*", {"invalid_files": "skip"}, {},
     UsageError, r"3 of the 3 data_files"),  # skipping everything leaves nothing
    ({"empty.txt": ""}, "*", {}, {}, UsageError,
     r"no document of at least 1 bytes in .*empty\.txt"),
    ({"a.txt": "", "b.txt": "", "c.txt": ""}, "*", {}, {}, UsageError, r"no document .*a\.txt"),
    ({"book.txt": "word " * 20000}, "*", {}, {}, UsageError,
     r"no document for the \w+ split and the \w+ split: 1 document from .*book\.txt.*at least 3 "
     r"documents and about 13 .*val_fraction=0\.25"),
    (_texts(40), "*", {}, {"max_documents": 2}, UsageError,
     r"max_documents/max_bytes kept 2 of 40"),
    (_texts(40), "*", {}, {"seq_len": 100_000}, UsageError,
     r"make no window of seq_len \+ 1 = 100001 tokens"),
    (_texts(40), "*", {}, {"min_document_bytes": 10**6}, UsageError,
     r"no document of at least 1000000 bytes"),
    ({"rows.jsonl": '{"text": "a"}\n{"text": broken\n'}, "*.jsonl", {}, {}, UsageError,
     r"rows\.jsonl is damaged or not a valid json file"),
    ({"rows.jsonl": '{"body": "a"}\n'}, "*.jsonl", {}, {}, UsageError,
     r"text_column='text' is not a column.*\['body'\]"),
    ({"rows.jsonl": '{"text": 3}\n'}, "*.jsonl", {}, {}, UsageError,
     r"text_column='text' holds Value\('int64'\), not strings"),
    (_texts(3), "nothing-*.txt", {}, {}, FileNotFoundError, r"no file matches .*nothing-\*"),
    (_texts(3), [], {}, {}, ValueError, r"data_files is empty"),
    (_texts(3), "*", {"invalid_files": "maybe"}, {}, ValueError,
     r"invalid_files must be 'error' or 'skip', got 'maybe'"),
    ({**_texts(3), "rows.jsonl": "{}"}, "*", {}, {}, ValueError, r"mixes formats"),
]


@pytest.mark.parametrize(("files", "pattern", "options", "changes", "error", "match"), BAD_DATA)
def test_unusable_data_is_refused_naming_the_files(
    tmp_path: Path, files, pattern, options, changes, error, match
) -> None:
    folder = _files(tmp_path / "data", files)
    patterns = [str(folder / item) for item in pattern] if isinstance(pattern, list) \
        else str(folder / pattern)
    settings = dataclasses.replace(SETTINGS, **changes)
    with pytest.raises(error, match=f"(?s){match}"):
        build_long_document_splits(files_source(patterns, **options), settings, tmp_path / "c")


def test_invalid_files_skip_leaves_them_out_with_a_count(tmp_path: Path) -> None:
    folder = _files(tmp_path / "data", {**_texts(30), "a.out": ELF, "b.bin": b"\xff\xfe"})
    source = files_source(str(folder / "*"), invalid_files="skip")
    with pytest.warns(UserWarning, match=r"(?s)skipping 2 of the 32 data_files.*a\.out.*b\.bin"):
        splits = build_long_document_splits(source, SETTINGS, tmp_path / "cache")
    assert len(splits.documents) == 30
