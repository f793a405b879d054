"""``LongDocumentDataModule(pack_documents=True)``: training windows of whole framed documents
back to back, with ``document_ids`` and no label that crosses into the next document."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from longnet.constants import IGNORE_INDEX
from longnet.data import LongDocumentDataModule
from longnet.data.encoding import document_hash
from longnet.data.tokenizer import EOS_ID, ByteTokenizer

SEQ_LEN = 64


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """30 documents of 1-100 bytes: most windows of 64 tokens hold several of them, and a few
    documents are cut into pieces by the windows."""
    folder = tmp_path / "docs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for index in range(30):
        size = int(rng.integers(1, 100))
        (folder / f"doc{index:02d}.txt").write_text("".join(rng.choice(list("abcdef \n"), size)))
    return folder


def _module(corpus: Path, cache: Path, **kwargs) -> LongDocumentDataModule:
    module = LongDocumentDataModule(
        seq_len=SEQ_LEN, batch_size=4, data_files=str(corpus / "*.txt"), val_fraction=0.2,
        test_fraction=0.2, cache_dir=str(cache), **kwargs,
    )
    module.setup("fit")
    return module


def test_packed_windows_hold_whole_documents_with_their_ids(corpus: Path, tmp_path: Path):
    module = _module(corpus, tmp_path / "cache", pack_documents=True)
    splits = module.splits
    tokenizer = ByteTokenizer()
    tokens = [tokenizer.encode_array(path.read_text()) for path in corpus.glob("*.txt")]
    by_hash = {document_hash(t): t for t in tokens}
    train = [row["doc_id"] for row in splits.documents.with_format(None) if row["split"] == "train"]
    framed = [np.r_[EOS_ID, by_hash[doc], EOS_ID] for doc in train]
    stream = np.concatenate(framed)
    owner = np.repeat(np.arange(len(framed)), [len(part) for part in framed])

    rows = splits.train[:]
    inputs, labels, ids = (rows[key].numpy() for key in ("input_ids", "labels", "document_ids"))
    count = (len(stream) - 1) // SEQ_LEN
    assert inputs.shape == labels.shape == ids.shape == (count, SEQ_LEN)
    assert inputs.reshape(-1).tolist() == stream[: count * SEQ_LEN].tolist()
    several = 0
    for window in range(count):
        span = slice(window * SEQ_LEN, (window + 1) * SEQ_LEN + 1)
        owners, tokens = owner[span], stream[span].astype(np.int64)
        assert ids[window].tolist() == (owners[:-1] - owners[0]).tolist()
        assert (np.diff(ids[window]) >= 0).all() and ids[window][0] == 0
        crossing = owners[1:] != owners[:-1]
        expected = np.where(crossing, IGNORE_INDEX, tokens[1:])
        assert labels[window].tolist() == expected.tolist()
        several += ids[window][-1] > 0
    assert several >= count // 2  # most windows hold several documents

    batch = next(iter(module.train_dataloader()))
    assert batch["document_ids"].shape == batch["input_ids"].shape == (4, SEQ_LEN)
    assert (batch["document_ids"].diff(dim=1) >= 0).all()
    validation = next(iter(module.val_dataloader()))  # evaluation windows are unchanged
    assert set(validation) == {"input_ids", "labels"}


def test_default_windows_are_unchanged_and_passkeys_are_refused(corpus: Path, tmp_path: Path):
    plain = _module(corpus, tmp_path / "cache")
    packed = _module(corpus, tmp_path / "cache", pack_documents=True)
    assert plain.splits.path != packed.splits.path
    assert set(plain.splits.train[0]) == {"input_ids", "labels"}
    with pytest.raises(ValueError, match="pack_documents cannot be combined with passkey"):
        LongDocumentDataModule(data_files=str(corpus / "*.txt"), pack_documents=True,
                               passkey_fraction=0.1)
