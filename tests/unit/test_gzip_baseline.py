"""gzip's score of the held-out documents, recorded when a corpus is built and printed by the
command beside the model's: equal to compressing the split's documents (read independently by
the evaluation) one by one, whatever the tokenizer; the verdict line for each case."""

from __future__ import annotations

import json

import pytest

from longnet.cli.run_checks import gzip_comparison
from longnet.data import LongDocumentDataModule
from longnet.data.compressors import compressor_baselines
from longnet.eval import load_eval_documents

DOCUMENTS = 80


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_the_recorded_gzip_score_is_the_splits_documents_compressed_alone(tokenizer, tmp_path):
    data = LongDocumentDataModule(seq_len=64, batch_size=2, max_documents=DOCUMENTS,
                                  tokenizer=tokenizer, cache_dir=str(tmp_path))
    data.prepare_data()
    data.setup("fit")
    recorded = data.splits.gzip_bits_per_byte
    assert set(recorded) == {"validation", "test"}
    for split in ("validation", "test"):
        documents = load_eval_documents(split=split, max_documents=DOCUMENTS)
        expected = compressor_baselines([d.utf8 for d in documents], ["separate"], ["gzip"])
        assert recorded[split] == expected[0].bits_per_byte
    assert 1.0 < recorded["test"] < 4.0  # source code: gzip's usual 2-3 bits per byte


def write_metrics(folder, val: float, test: float) -> None:
    (folder / "metrics.json").write_text(json.dumps(
        {"validate": {"val/bpb": val}, "test": {"test/bpb": test}}))


@pytest.mark.parametrize("val, test, verdict", [
    (1.8, 1.9, "; below gzip."),
    (1.8, 2.5, "; below gzip on the validation split."),
    (2.5, 2.6, "; not below gzip: train longer"),
])
def test_the_command_says_whether_the_model_is_below_gzip(val, test, verdict, tmp_path):
    write_metrics(tmp_path, val, test)
    line = gzip_comparison(tmp_path, {"validation": 2.0, "test": 2.1})
    assert line.startswith(f"Bits per byte on the held-out documents: validation {val:.3f} "
                           f"(gzip -9: 2.000), test {test:.3f} (gzip -9: 2.100)")
    assert verdict in line


def test_no_line_without_both_sides(tmp_path):
    assert gzip_comparison(tmp_path, {"validation": 2.0}) is None  # no metrics.json
    write_metrics(tmp_path, 1.0, 1.0)
    assert gzip_comparison(tmp_path, {}) is None  # a cache entry from before the record
