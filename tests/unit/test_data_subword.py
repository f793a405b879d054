"""The data's tokenizer option: bytes unchanged, a BPE trained on the training split only
(deterministic, cached), a tokenizer.json, a tokenizer folder, a zoo model's tokenizer; windows
in tokens with the UTF-8 bytes of every label; the bad inputs of each form."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from longnet.constants import IGNORE_INDEX
from longnet.data import CorpusSettings, LongDocumentDataModule, files_source
from longnet.data.corpus import build_long_document_splits, corpus_cache_key
from longnet.data.subword import (
    SubwordTokenizer,
    _token_bytes,
    from_backend,
    load_tokenizer_folder,
    load_tokenizer_json,
)
from longnet.data.tokenizer import (
    EOS_TOKEN,
    MAX_VOCAB,
    MIN_BPE_VOCAB,
    parse_tokenizer,
    train_bpe,
)
from longnet.modeling import LongNetConfig, LongNetLM
from longnet.validation import UsageError

SETTINGS = CorpusSettings(seq_len=32, val_fraction=0.25, test_fraction=0.25)
WORDS = ["alpha", "beta", "gamma", "délta", "ε", "zeta\n", "東京", "def f():\n    return 1\n",
         "😀", "    "]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """40 documents of up to ~600 bytes (ASCII, Latin, Greek, CJK, emoji, indentation)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for index in range(40):
        rng = np.random.default_rng(index)
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 90))))
        (folder / f"doc{index:02d}.txt").write_text(text)
    return folder


def _module(corpus: Path, cache: Path, tokenizer: str, **options) -> LongDocumentDataModule:
    options = {"seq_len": 32, "batch_size": 2, "val_fraction": 0.25, "test_fraction": 0.25,
               **options}
    return LongDocumentDataModule(data_files=str(corpus / "*.txt"), cache_dir=str(cache),
                                  tokenizer=tokenizer, **options)


def _texts_by_split(module: LongDocumentDataModule, corpus: Path) -> dict[str, list[str]]:
    """The documents' texts per split, from the files (independent of the windows)."""
    by_id = {}
    for path in sorted(corpus.glob("*.txt")):
        data = path.read_bytes()
        by_id[hashlib.blake2b(data, digest_size=8).hexdigest()] = data.decode("utf-8")
    index = module.splits.documents
    out: dict[str, list[str]] = {}
    for doc_id, split in zip(index["doc_id"], index["split"]):
        out.setdefault(split, []).append(by_id[doc_id])
    return out


def _bpe_tokenizer_json(path: Path, vocab_size: int = 320) -> Path:
    texts = [" ".join(WORDS) * 3, "def g(x):\n    return x\n" * 5]
    train_bpe(texts, vocab_size).save(str(path))
    return path


# ---------------------------------------------------------------------- bytes unchanged
def test_bytes_is_the_default_with_the_same_cache_key(corpus: Path, tmp_path: Path):
    source = files_source(str(corpus / "*.txt"))
    key = corpus_cache_key(source, SETTINGS)
    assert corpus_cache_key(source, SETTINGS, parse_tokenizer("bytes")) == key
    assert corpus_cache_key(source, SETTINGS, parse_tokenizer("bpe:300")) != key
    default = build_long_document_splits(source, SETTINGS, tmp_path / "a")
    chosen = build_long_document_splits(source, SETTINGS, tmp_path / "b", "bytes")
    assert default.path.name == chosen.path.name
    for split in ("train", "validation"):
        assert default.__dict__[split].column_names == chosen.__dict__[split].column_names
        assert "label_bytes" not in default.__dict__[split].column_names
        assert (default.__dict__[split][:]["input_ids"] ==
                chosen.__dict__[split][:]["input_ids"]).all()
    module = _module(corpus, tmp_path / "c", "bytes")
    assert (module.vocab_size, module.eos_id, module.pad_id) == (256, 255, 254)


# ---------------------------------------------------------------------- BPE
def test_bpe_is_trained_on_the_training_split_only_and_cached(corpus, tmp_path, capsys):
    module = _module(corpus, tmp_path, "bpe:300")
    assert (module.vocab_size, module.eos_id, module.pad_id) == (300, 0, 1)
    module.setup()
    assert "Trained a byte-level BPE" in capsys.readouterr().err
    texts = _texts_by_split(module, corpus)
    on_train = train_bpe(texts["train"], 300).to_str()
    everything = train_bpe([t for split in texts.values() for t in split], 300).to_str()
    assert module.tokenizer.backend.to_str() == on_train != everything
    assert train_bpe(texts["train"], 300).to_str() == on_train  # deterministic
    again = _module(corpus, tmp_path, "bpe:300", seq_len=16)  # another corpus entry ...
    again.setup()
    assert again.splits.path != module.splits.path
    assert "Trained" not in capsys.readouterr().err  # ... the same cached BPE
    assert again.tokenizer.fingerprint == module.tokenizer.fingerprint


@pytest.mark.parametrize("pack_documents", [False, True])
def test_bpe_windows_keep_their_meaning_in_tokens(corpus, tmp_path, pack_documents):
    module = _module(corpus, tmp_path, "bpe:300", pack_documents=pack_documents)
    module.setup()
    tokenizer: SubwordTokenizer = module.tokenizer
    texts = _texts_by_split(module, corpus)
    # evaluation windows: each document framed by EOS, all its bytes counted once
    validation = module.splits.validation.with_format("numpy")[:]
    firsts = validation["input_ids"][:, 0].tolist()
    assert firsts.count(tokenizer.eos_id) >= len(texts["validation"])
    assert int(validation["label_bytes"].sum()) == sum(len(t.encode()) for t in texts["validation"])
    assert (validation["label_bytes"][validation["labels"] == IGNORE_INDEX] == 0).all()
    first = texts["validation"][0]
    ids, counts = tokenizer.encode_documents([first])[0]
    rows = module.splits.validation.with_format("numpy")
    window = rows[0]
    assert window["input_ids"][0] == tokenizer.eos_id
    length = min(len(ids), 31)
    assert (window["input_ids"][1:1 + length] == ids[:length]).all()
    assert (window["label_bytes"][:length] == counts[:length]).all()
    # training windows: labels are the next inputs, their bytes those of the tokens
    train = module.splits.train.with_format("numpy")[:]
    assert (train["labels"][:-1, -1] == train["input_ids"][1:, 0]).all() or pack_documents
    scored = train["labels"] != IGNORE_INDEX
    assert ((train["label_bytes"] > 0) <= scored).all()
    if pack_documents:
        assert (train["document_ids"][:, 0] == 0).all()
        starts = train["input_ids"][:, 1:] == tokenizer.eos_id
        assert (np.diff(train["document_ids"], axis=1)[starts] <= 1).all()


@pytest.mark.parametrize("text", ["plain ascii", "é東😀 mixed\n\n  spaces  ", "\ud800 lone",
                                  "   ", "x"])
def test_token_bytes_sum_to_the_utf8_length(tmp_path: Path, text: str):
    tokenizer = load_tokenizer_json(_bpe_tokenizer_json(tmp_path / "t.json"))
    (ids, counts), = tokenizer.encode_documents([text])
    assert len(ids) == len(counts) and (counts >= 0).all()
    assert counts.sum() == len(text.encode("utf-8", errors="replace"))
    assert _token_bytes("", []).shape == (0,)


# ---------------------------------------------------------------------- user tokenizers
def test_a_tokenizer_json_file(corpus, tmp_path):
    path = _bpe_tokenizer_json(tmp_path / "tokenizer.json")
    module = _module(corpus, tmp_path / "cache", str(path))
    vocab = Tokenizer.from_file(str(path)).get_vocab()
    assert (module.vocab_size, module.eos_id, module.pad_id) == (len(vocab), 0, 1)
    module.setup()
    batch = next(iter(module.val_dataloader()))
    assert batch["input_ids"][0, 0] == 0 and batch["input_ids"].max() < len(vocab)
    assert set(module.tokenizer.files) == {"tokenizer.json", "tokenizer_config.json"}


def test_a_tokenizer_folder_and_a_zoo_models_tokenizer(corpus, tmp_path):
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(_bpe_tokenizer_json(tmp_path / "t.json")))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN).save_pretrained(
        tmp_path / "folder")
    folder = _module(corpus, tmp_path / "cache", str(tmp_path / "folder"))
    assert (folder.vocab_size, folder.eos_id, folder.pad_id) == (backend.get_vocab_size(), 0, 0)
    zoo = parse_tokenizer("longnet-tiny")  # its byte-level tokenizer files, via AutoTokenizer
    assert (zoo.kind, zoo.vocab_size, zoo.eos_id, zoo.pad_id) == ("folder", 256, 255, 254)
    assert zoo.loaded.encode("é") == list("é".encode())


# ---------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("value, words", [
    ("bpe:100", [f"[{MIN_BPE_VOCAB}, {MAX_VOCAB}]", "'bpe:100'"]),
    ("bpe:eight", ["'bpe:eight'", "bpe:8192"]),
    (f"bpe:{MAX_VOCAB + 1}", [str(MAX_VOCAB + 1)]),
    ("no-such-model", ["'no-such-model'", "tokenizer.json"]),
    ("", ["tokenizer must be"]),
])
def test_bad_tokenizer_values_are_named(value: str, words: list[str]):
    with pytest.raises(UsageError) as error:
        parse_tokenizer(value)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_a_file_that_is_not_a_tokenizer_and_one_without_eos(tmp_path: Path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(UsageError, match=f"{bad} is not a tokenizer.json"):
        parse_tokenizer(str(bad))
    plain = train_bpe(["aaa bbb"], MIN_BPE_VOCAB)
    vocab = json.loads(plain.to_str())
    vocab["added_tokens"] = []
    vocab["model"]["vocab"] = {k: v for k, v in vocab["model"]["vocab"].items()
                               if not k.startswith("<|")}
    no_eos = tmp_path / "no_eos.json"
    no_eos.write_text(json.dumps(vocab))
    with pytest.raises(UsageError, match="no end-of-document token.*add one"):
        parse_tokenizer(str(no_eos))


def test_a_tokenizer_folder_missing_files(tmp_path: Path):
    folder = tmp_path / "folder"
    folder.mkdir()
    _bpe_tokenizer_json(folder / "tokenizer.json")
    with pytest.raises(UsageError, match="lacks tokenizer_config.json.*save_pretrained"):
        parse_tokenizer(str(folder))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="lacks tokenizer.json and tokenizer_config.json"):
        parse_tokenizer(str(model))


def test_a_changed_bpe_under_its_cache_entry_is_refused(corpus, tmp_path):
    _module(corpus, tmp_path, "bpe:300").setup()
    (entry,) = tmp_path.glob("bpe300-*")
    other = tmp_path / "other.json"
    _bpe_tokenizer_json(other)
    (entry / "tokenizer.json").write_text(other.read_text())
    with pytest.raises(UsageError, match=f"{entry} holds a tokenizer changed.*rm -r"):
        _module(corpus, tmp_path, "bpe:300").setup()


def test_a_corpus_entry_of_another_tokenizer_is_refused(corpus, tmp_path):
    module = _module(corpus, tmp_path, "bpe:300")
    module.setup()
    info = module.splits.path / "info.json"
    record = json.loads(info.read_text())
    record["tokenizer"]["fingerprint"] = "0123456789abcdef"  # windows of another tokenizer
    info.write_text(json.dumps(record))
    with pytest.raises(UsageError, match="built with tokenizer bpe:300 of fingerprint "
                       "0123456789abcdef.*rm -r"):
        _module(corpus, tmp_path, "bpe:300").setup()


@pytest.mark.parametrize("label_mode", ["answer", "recall", "all"])
def test_passkeys_mixed_in_are_in_tokens(corpus, tmp_path, label_mode):
    long = tmp_path / "long"
    long.mkdir()
    for index in range(12):
        words = np.random.default_rng(index).choice(WORDS, size=400)
        (long / f"doc{index:02d}.txt").write_text(" ".join(words))
    module = _module(long, tmp_path, "bpe:300", passkey_fraction=0.2, seq_len=256,
                     passkey_label_mode=label_mode)
    module.setup()
    batch = next(iter(DataLoader(module.train_dataset, batch_size=len(module.train_dataset))))
    assert set(batch) == {"input_ids", "labels", "label_bytes"}  # corpus and passkeys collate
    tokenizer = module.tokenizer
    passkeys = module.train_dataset.datasets[1]
    sample = passkeys[0]
    example = passkeys.example(0, len(tokenizer.decode(sample["input_ids"].tolist())) + 6)
    assert sample["input_ids"].shape == (256,) and sample["label_bytes"].shape == (256,)
    padded = int((sample["input_ids"] == tokenizer.pad_id).sum())
    assert padded < 16  # the longest example that fits: a few tokens of padding at most
    labels = sample["labels"][sample["labels"] != IGNORE_INDEX].tolist()
    key = example.answer
    if label_mode == "answer":
        assert tokenizer.decode(labels).strip() == key + "."
    if label_mode == "recall":
        assert tokenizer.decode(labels).replace(" ", "").count(key) == 2
    assert int(sample["label_bytes"].sum()) == len(tokenizer.decode(labels).encode())
    assert torch.equal(passkeys[0]["input_ids"], sample["input_ids"])  # deterministic


def test_a_longnet_folder_s_tokenizer_loads_without_transformers_model_type_warning(
        tmp_path, caplog):
    """transformers does not know ``model_type: longnet``; the tokenizer of such a folder is
    read without its config (tokenizer_config.json names the class), the same tokenizer."""
    model, alone = tmp_path / "model", tmp_path / "tokenizer"
    LongNetLM(LongNetConfig(num_layers=1)).save_pretrained(model)
    for folder in (model, alone):
        from_backend(train_bpe([" ".join(WORDS)] * 20, 300), "bpe:300").save(folder)
    with caplog.at_level("WARNING"):
        loaded = load_tokenizer_folder(model)
    assert not [r for r in caplog.records if "model of type" in r.getMessage()]
    assert loaded.fingerprint == load_tokenizer_folder(alone).fingerprint
