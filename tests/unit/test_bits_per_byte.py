"""Bits per byte is the one comparable number: for a BPE model and a byte model, the training
metric and the evaluation equal an independent count (summed NLL / ln 2 / the UTF-8 bytes of
the documents' text) within 1e-6, in float64."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from longnet.constants import IGNORE_INDEX
from longnet.data import LongDocumentDataModule
from longnet.eval import score_documents, tokenize_documents
from longnet.eval.documents import EvalDocument
from longnet.training import CausalLMModule

CONFIG = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "segment_lengths": [8, 16],
          "dilation_rates": [1, 2], "initializer_range": 0.2}
WORDS = ["alpha", "beta", "délta", "ε", "zeta\n", "東京", "def f():\n    return 1\n", "😀"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    for index in range(24):
        rng = np.random.default_rng(index)
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 60))))
        (folder / f"doc{index:02d}.txt").write_text(text)
    return folder


def _data(corpus: Path, cache: Path, tokenizer: str) -> LongDocumentDataModule:
    module = LongDocumentDataModule(
        seq_len=16, batch_size=2, eval_batch_size=3, data_files=str(corpus / "*.txt"),
        val_fraction=0.3, test_fraction=0.2, cache_dir=str(cache), tokenizer=tokenizer)
    module.setup()
    return module


def _validation_texts(data: LongDocumentDataModule, corpus: Path) -> list[str]:
    texts = {hashlib.blake2b(p.read_bytes(), digest_size=8).hexdigest(): p.read_text()
             for p in corpus.glob("*.txt")}
    index = data.splits.documents
    return [texts[i] for i, split in zip(index["doc_id"], index["split"]) if split == "validation"]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_validation_bits_per_byte_equal_an_independent_count(corpus, tmp_path, tokenizer,
                                                             one_thread):
    data = _data(corpus, tmp_path, tokenizer)
    torch.manual_seed(0)
    module = CausalLMModule(config=dict(CONFIG), warmup_steps=1)
    trainer = L.Trainer(precision="64-true", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    (metrics,) = trainer.validate(module, datamodule=data, verbose=False)
    assert module.model.config.vocab_size == data.vocab_size  # the tokenizer set it
    nll = 0.0
    with torch.no_grad():
        for row in data.splits.validation:
            logits = module.model(row["input_ids"][None]).logits[0].double()
            labels = row["labels"]
            scored = labels != IGNORE_INDEX
            nll -= float(torch.log_softmax(logits, -1)[scored, labels[scored]].sum())
    texts = _validation_texts(data, corpus)
    utf8 = sum(len(text.encode("utf-8")) for text in texts)
    expected = nll / math.log(2) / utf8
    assert metrics["val/bytes"] == utf8
    assert metrics["val/bpb"] == pytest.approx(expected, rel=1e-6)
    if tokenizer != "bytes":  # fewer tokens than bytes: the two counts differ
        assert metrics["val/tokens"] < utf8
        assert metrics["val/bpb"] != pytest.approx(metrics["val/loss"] / math.log(2), rel=1e-3)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_evaluation_bits_per_byte_equal_an_independent_count(corpus, tmp_path, tokenizer,
                                                             one_thread):
    data = _data(corpus, tmp_path, tokenizer)
    torch.manual_seed(0)
    module = CausalLMModule(config=dict(CONFIG))
    module.fit_tokenizer(data)
    model = module.model.double().eval()
    texts = _validation_texts(data, corpus)
    documents = [EvalDocument(f"d{i}", np.frombuffer(t.encode(), dtype=np.uint8))
                 for i, t in enumerate(texts)]
    tokenized = tokenize_documents(documents, data.tokenizer)
    longest = max(doc.num_tokens for doc in tokenized) + 1
    result = score_documents(model, tokenized, longest, return_token_nll=True)
    nll = 0.0
    eos = data.eos_id
    with torch.no_grad():
        for text in texts:  # one forward per whole document, tokens read anew
            framed = torch.tensor([eos, *data.tokenizer.encode(text), eos])
            logits = model(framed[None, :-1]).logits[0].double()
            nll -= float(torch.log_softmax(logits, -1).gather(-1, framed[1:, None]).sum())
    utf8 = sum(len(text.encode("utf-8")) for text in texts)
    assert result.num_bytes == utf8
    assert result.bits_per_byte == pytest.approx(nll / math.log(2) / utf8, rel=1e-6)
    assert sum(float(v.sum()) for v in result.token_nll) == pytest.approx(nll, rel=1e-9)
    if tokenizer != "bytes":
        assert result.token_bytes is not None
        assert sum(int(b.sum()) for b in result.token_bytes) == utf8
        assert result.bytes_per_token > 1.5
