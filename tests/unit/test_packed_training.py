"""Training on packed documents through the ``longnet`` command (configs/packed_documents.yaml):
a few steps in-process on short documents (several per window), every batch's
``document_ids`` reaching the model, a finite loss."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from longnet.cli import main
from longnet.modeling import LongNetLM

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "packed_documents.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_packed_documents_config_trains(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    (tmp_path / "docs").mkdir()
    for index in range(60):
        words = rng.choice(["def", "f(x):", "return", "x", "+", "1\n"], rng.integers(2, 30))
        text = " ".join(words)
        (tmp_path / "docs" / f"doc{index:02d}.py").write_text(text)
    documents_seen = []
    forward = LongNetLM.forward

    def recording(self, input_ids, *args, document_ids=None, **kwargs):
        if self.training:
            documents_seen.append(None if document_ids is None else
                                  int((document_ids.diff(dim=1) != 0).sum()) + len(input_ids))
        return forward(self, input_ids, *args, document_ids=document_ids, **kwargs)

    monkeypatch.setattr(LongNetLM, "forward", recording)
    assert main([
        "fit", "--config", str(CONFIG), f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.default_root_dir={tmp_path / 'packed_documents'}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--trainer.max_steps=6",
        f"--data.init_args.data_files={tmp_path / 'docs' / '*.py'}",
        "--data.init_args.val_fraction=0.2", "--data.init_args.test_fraction=0.2",
        "--trainer.val_check_interval=3",
    ]) == 0
    assert len(documents_seen) == 6 and None not in documents_seen
    assert min(documents_seen) > 2 * 8  # windows hold several documents
    with open(tmp_path / "packed_documents" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    val = [float(row["val/loss"]) for row in rows if row.get("val/loss")]
    assert losses and val and all(math.isfinite(x) for x in losses + val)
