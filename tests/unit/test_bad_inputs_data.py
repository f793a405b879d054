"""Bad inputs and faults of the data and its files (lab/bad_inputs/data.yaml), each fixed
where it was found: NumPy sizes in the cache key, fractions that are not numbers, a folder
given as data_files, an empty corpus named by its folder, a cache folder that is a file or
an entry that is damaged, writes that find no room, and packed documents on zigzag shards."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longnet.data import LongDocumentDataModule
from longnet.data.corpus import CorpusSettings, build_long_document_splits, corpus_cache_key
from longnet.data.encoding import check_fractions
from longnet.data.sources import files_source
from longnet.files import replace_folder, write_atomic
from longnet.training.parallel.batches import shard_batch
from longnet.training.parallel.strategy import SequenceParallelStrategy
from longnet.validation import UsageError


def _documents(folder: Path, count: int) -> Path:
    """``count`` text files of a few hundred distinct bytes each in ``folder``."""
    folder.mkdir()
    for i in range(count):
        (folder / f"d{i}.txt").write_text("\n".join(str(n) for n in range(i, i + 120)))
    return folder


def test_numpy_sizes_and_fractions_give_the_same_cache_key_as_python_numbers(tmp_path):
    source = files_source(str(_documents(tmp_path / "docs", 3) / "*.txt"))
    python = CorpusSettings(seq_len=64, val_fraction=0.1, max_documents=3)
    numpy = CorpusSettings(seq_len=np.int64(64), val_fraction=np.float32(0.1),
                           max_documents=np.int32(3))
    assert type(numpy.seq_len) is int and type(numpy.val_fraction) is float
    assert corpus_cache_key(source, numpy) == corpus_cache_key(
        source, CorpusSettings(seq_len=64, val_fraction=float(np.float32(0.1)), max_documents=3))
    assert corpus_cache_key(source, python)  # a key, as before


def test_a_fraction_that_is_not_a_number_is_named():
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got '0.1'"):
        check_fractions("0.1", 0.05)


def test_a_folder_given_as_data_files_says_to_glob_its_files(tmp_path):
    folder = _documents(tmp_path / "docs", 3)
    with pytest.raises(FileNotFoundError, match=rf"'{folder}' is a folder.*'{folder}/\*\.txt'"):
        files_source(str(folder))


def test_a_corpus_of_empty_files_names_their_folder(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(5):
        (tmp_path / "docs" / f"d{i}.txt").write_text("")
    source = files_source(str(tmp_path / "docs" / "*.txt"))
    with pytest.raises(UsageError, match=rf"no document .* in 5 files under {tmp_path / 'docs'}"):
        build_long_document_splits(source, CorpusSettings(seq_len=64), tmp_path / "cache")


def test_a_cache_dir_that_is_a_file_is_refused_before_reading_and_kept(tmp_path):
    source = files_source(str(_documents(tmp_path / "docs", 3) / "*.txt"))
    (tmp_path / "cache").write_text("keep")
    with pytest.raises(UsageError, match=r"cache_dir .*cache is a file, not a folder"):
        build_long_document_splits(source, CorpusSettings(seq_len=64), tmp_path / "cache")
    assert (tmp_path / "cache").read_text() == "keep"


def test_a_damaged_cache_entry_is_named_with_the_fix(tmp_path):
    source = files_source(str(_documents(tmp_path / "docs", 120) / "*.txt"))
    settings = CorpusSettings(seq_len=64)
    entry = build_long_document_splits(source, settings, tmp_path / "cache").path
    for arrow in (entry / "train").glob("*.arrow"):
        arrow.unlink()
    with pytest.raises(UsageError, match=rf"cache entry {entry} is damaged .*rm -r {entry}"):
        build_long_document_splits(source, settings, tmp_path / "cache")


def test_a_folder_replaced_with_no_room_names_it_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("old")

    class SafetensorError(Exception):  # what safetensors raises for a failed write
        pass

    failures = ((SafetensorError("Error while serializing: I/O error: File too large "
                                 "(os error 27)"), errno.EFBIG),
                (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC))
    for failure, code in failures:
        with pytest.raises(OSError, match="model") as caught, replace_folder(target) as temp:
            (temp / "config.json").write_text("new")
            raise failure
        assert caught.value.errno == code
        assert caught.value.filename == str(target)
        assert (target / "config.json").read_text() == "old"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary left


def test_a_file_written_over_the_size_limit_names_it_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")
    code = textwrap.dedent(f"""
        import resource, sys
        from longnet.files import write_atomic
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            write_atomic({str(path)!r}, "x" * 100_000)
        except OSError as err:
            sys.exit(f"{{err.errno}} {{err.filename}}")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stderr.strip() == f"{errno.EFBIG} {path}"
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [path.name]
    write_atomic(path, "new")  # an ordinary write still works
    assert path.read_text() == "new"


def test_packed_documents_on_zigzag_shards_are_refused_before_the_mesh(tmp_path):
    datamodule = LongDocumentDataModule(seq_len=64, pack_documents=True,
                                        cache_dir=str(tmp_path))
    assert datamodule.pack_documents
    for load_balance, stage, refused in ((True, "fit", True), (False, "fit", False),
                                         (True, "validate", False)):
        strategy = SequenceParallelStrategy(2, load_balance=load_balance)
        strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(
            datamodule=datamodule, state=SimpleNamespace(fn=stage)))
        if refused:
            with pytest.raises(UsageError, match="load_balance: false"):
                strategy._start_layout()
        else:
            strategy._check_packed_documents()


def test_shard_batch_refuses_document_ids_on_zigzag_shards_as_a_usage_error():
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long),
             "document_ids": torch.zeros(1, 8, dtype=torch.long)}
    with pytest.raises(UsageError, match="load_balance: false"):
        shard_batch(batch, 0, 2, layout="zigzag")


def test_numpy_batch_sizes_make_loaders(tmp_path):
    datamodule = LongDocumentDataModule(
        seq_len=np.int64(64), batch_size=np.int32(4), eval_batch_size=np.int64(2),
        num_workers=np.int64(0), data_files=str(_documents(tmp_path / "docs", 120) / "*.txt"),
        cache_dir=str(tmp_path / "cache"))
    datamodule.setup()
    assert next(iter(datamodule.train_dataloader()))["input_ids"].shape == (4, 64)
    assert next(iter(datamodule.val_dataloader()))["input_ids"].shape == (2, 64)
