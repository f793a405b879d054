"""Sliding-window scoring: every target once, inside its document, equal to direct
computation; documents; compressor baselines; length parsing."""

from __future__ import annotations

import bz2
import gzip
import itertools
import lzma
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from longnet.data import CorpusSettings, build_long_document_splits, files_source
from longnet.data.tokenizer import EOS_ID
from longnet.eval import (
    compressor_baselines,
    load_eval_documents,
    parse_length,
    plan_windows,
    powers_of_two,
    resolve_stride,
    score_documents,
)
from longnet.eval.documents import EvalDocument
from longnet.modeling import LongNetConfig, LongNetLM

PATTERN = dict(segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4))


def tiny_lm(seed: int = 0, dtype=torch.float64, **overrides) -> LongNetLM:
    config = dict(
        vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, max_positions=32,
        xpos_scale_base=16.0, sub_ln=True, initializer_range=0.2, eos_token_id=EOS_ID, **PATTERN,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return LongNetLM(LongNetConfig(**config)).to(dtype).eval()


def docs(*lengths: int, seed: int = 0) -> list[EvalDocument]:
    rng = np.random.default_rng(seed)
    return [
        EvalDocument(doc_id=f"d{i}", tokens=rng.integers(0, 128, n).astype(np.uint8))
        for i, n in enumerate(lengths)
    ]


def reference_nll(model: LongNetLM, tokens: np.ndarray, start: int, end: int) -> np.ndarray:
    """NLL of targets of input positions [start, end) of framed ``tokens``, from ONE forward
    pass over framed[start:end] (the targets' context is everything from ``start``)."""
    framed = torch.tensor(np.concatenate(([EOS_ID], tokens, [EOS_ID])), dtype=torch.long)
    with torch.no_grad():
        logits = model(framed[None, start:end]).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return -logp.gather(-1, framed[start + 1:end + 1, None])[:, 0].numpy()


@pytest.mark.parametrize("num_targets", [1, 2, 7, 16, 17, 33, 100])
@pytest.mark.parametrize("context,stride", [(1, 1), (4, 1), (16, 16), (16, 5), (16, 8), (64, 32)])
def test_windows_partition_targets_and_give_enough_context(num_targets, context, stride):
    windows = plan_windows(num_targets, context, stride)
    covered = list(itertools.chain.from_iterable(range(w.score_from, w.end) for w in windows))
    assert covered == list(range(num_targets))  # every target once, in order
    for index, w in enumerate(windows):
        assert 0 <= w.start <= w.score_from < w.end <= num_targets
        assert w.length <= context
        for p in range(w.score_from, w.end):
            if index == 0:
                assert w.start == 0  # first window: all preceding tokens of the document
            else:
                assert p - w.start >= context - stride
            assert p - w.start == min(p, p - w.start)  # never context from before the document


def test_stride_one_gives_every_target_the_full_window():
    for w in plan_windows(40, 8, 1):
        for p in range(w.score_from, w.end):
            assert p - w.start == min(p, 7)


def test_window_covering_the_document_equals_full_sequence_computation():
    model = tiny_lm()
    documents = docs(5, 23, 31)
    result = score_documents(model, documents, 32, return_token_nll=True, batch_size=2)
    for doc, nll in zip(documents, result.token_nll):
        expected = reference_nll(model, doc.tokens, 0, doc.num_bytes + 1)
        np.testing.assert_allclose(nll, expected, rtol=1e-10, atol=1e-10)
    total = sum(float(values.sum()) for values in result.token_nll)
    assert result.nll_sum == pytest.approx(total, rel=1e-12)
    assert result.num_bytes == 59 and result.num_tokens == 62 and result.num_windows == 3
    assert result.longest_window == 32
    assert result.bits_per_byte == pytest.approx(total / math.log(2) / 59)
    assert result.perplexity == pytest.approx(math.exp(total / 62))


@pytest.mark.parametrize("stride", [5, 0.5, None])
def test_sliding_windows_score_each_target_once_with_its_window_context(stride):
    model = tiny_lm()
    documents = docs(40, 9, seed=1)
    context = 16
    step = resolve_stride(context, stride)
    one = score_documents(model, documents, context, stride, return_token_nll=True)
    batched = score_documents(model, documents, context, stride, batch_size=4,
                              return_token_nll=True)
    for index, doc in enumerate(documents):
        for w in plan_windows(doc.num_bytes + 1, context, step):
            expected = reference_nll(model, doc.tokens, w.start, w.end)[w.score_from - w.start:]
            np.testing.assert_allclose(one.token_nll[index][w.score_from:w.end], expected,
                                       rtol=1e-10, atol=1e-10)
        # right-padding in a batch never changes a causal score
        np.testing.assert_allclose(batched.token_nll[index], one.token_nll[index],
                                   rtol=1e-10, atol=1e-10)
    assert one.num_windows == sum(
        len(plan_windows(d.num_bytes + 1, context, step)) for d in documents
    )


@pytest.mark.parametrize("scored_rows", [1, 3, 50])
def test_logits_in_chunks_of_scored_rows_give_the_same_scores(monkeypatch, scored_rows):
    """The LM head runs on the scored positions only, ``SCORED_ROWS`` at a time: any chunk
    size, across windows of a batch and across its padding, gives the one-pass scores."""
    monkeypatch.setattr("longnet.eval.sliding.SCORED_ROWS", scored_rows)
    model = tiny_lm()
    documents = docs(40, 9, 23, seed=2)
    result = score_documents(model, documents, 16, 0.5, batch_size=3, return_token_nll=True)
    for index, doc in enumerate(documents):
        for w in plan_windows(doc.num_bytes + 1, 16, resolve_stride(16, 0.5)):
            expected = reference_nll(model, doc.tokens, w.start, w.end)[w.score_from - w.start:]
            np.testing.assert_allclose(result.token_nll[index][w.score_from:w.end], expected,
                                       rtol=1e-10, atol=1e-10)


def test_more_context_changes_scores_but_not_the_token_count():
    model = tiny_lm()
    documents = docs(60, seed=2)
    short = score_documents(model, documents, 8)
    long = score_documents(model, documents, 32, 16)
    assert short.num_tokens == long.num_tokens == 61
    assert short.nll_sum != pytest.approx(long.nll_sum)


def test_bad_arguments_are_refused():
    model = tiny_lm()
    documents = docs(10)
    with pytest.raises(ValueError, match="context length must be a positive integer, got 0"):
        score_documents(model, documents, 0)
    with pytest.raises(ValueError, match="stride"):
        score_documents(model, documents, 8, 9)
    with pytest.raises(ValueError, match="stride"):
        score_documents(model, documents, 8, 0)
    with pytest.raises(ValueError, match="fraction"):
        resolve_stride(8, 1.5)
    with pytest.raises(ValueError, match="batch_size"):
        score_documents(model, documents, 8, batch_size=0)
    with pytest.raises(ValueError, match="empty"):
        score_documents(model, [], 8)
    learned = tiny_lm(position_encoding="learned")
    with pytest.raises(ValueError, match="longer than possible.*32 learned positions"):
        score_documents(learned, documents, 64)


def test_lengths_are_parsed_in_binary_units():
    assert parse_length("2048") == 2048
    assert parse_length("16K") == parse_length("16k") == 16384
    assert parse_length("1M") == 1 << 20
    for bad in ("0", "-1", "1.5K", "abc"):
        with pytest.raises(ValueError):
            parse_length(bad)
    assert powers_of_two(1024, 16384) == [1024, 2048, 4096, 8192, 16384]
    assert powers_of_two(1024, 3000) == [1024, 2048, 3000]


def test_compressor_baselines_are_eight_times_compressed_over_raw():
    documents = [b"abc " * 300, bytes(range(200)) * 3, b"hello world\n" * 50]
    results = {(r.compressor, r.mode): r for r in compressor_baselines(documents)}
    raw = sum(map(len, documents))
    tools = {
        "gzip": lambda d: gzip.compress(d, compresslevel=9, mtime=0),
        "bzip2": lambda d: bz2.compress(d, 9),
        "xz": lambda d: lzma.compress(d, preset=9 | lzma.PRESET_EXTREME),
    }
    for name, compress in tools.items():
        separate = results[name, "separate"]
        assert separate.raw_bytes == raw
        assert separate.compressed_bytes == sum(len(compress(d)) for d in documents)
        assert separate.bits_per_byte == 8 * separate.compressed_bytes / raw
        assert results[name, "concatenated"].compressed_bytes == len(compress(b"".join(documents)))
    with pytest.raises(ValueError, match="unknown compressor"):
        compressor_baselines(documents, compressors=["zstd"])
    with pytest.raises(ValueError, match="no bytes"):
        compressor_baselines([b""])


def test_eval_documents_are_the_data_layers_split(tmp_path: Path):
    folder = tmp_path / "docs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for index in range(30):
        words = rng.choice(["def", "return", "x = 1\n", "élan", "class"], size=5 + 7 * index)
        (folder / f"doc{index:02d}.txt").write_text(" ".join(words))
    (folder / "empty.txt").write_text("")
    pattern = str(folder / "*.txt")
    splits = build_long_document_splits(
        files_source(pattern), CorpusSettings(seq_len=16, val_fraction=0.2, test_fraction=0.3),
        tmp_path / "cache",
    )
    rows = splits.documents.with_format(None)
    expected = {r["doc_id"]: r["num_bytes"] for r in rows if r["split"] == "test"}
    documents = load_eval_documents(pattern, val_fraction=0.2, test_fraction=0.3)
    assert {d.doc_id: d.num_bytes for d in documents} == expected
    everything = load_eval_documents(pattern, split="all", val_fraction=0.2, test_fraction=0.3)
    assert len(everything) == 30
    long_ones = load_eval_documents(pattern, split="all", min_bytes=500)
    assert long_ones and all(d.num_bytes >= 500 for d in long_ones)
    with pytest.raises(ValueError, match="no test document"):
        load_eval_documents(pattern, min_bytes=10**9)
    with pytest.raises(ValueError, match="split"):
        load_eval_documents(pattern, split="dev")
