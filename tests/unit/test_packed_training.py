"""Training on packed documents through the ``longnet`` command (configs/packed_documents.yaml):
a few steps in-process on short documents (several per window), every batch's
``document_ids`` reaching the model, a finite loss; a run killed mid-way resumes to the
parameters of the uninterrupted run."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from longnet.cli import main
from longnet.modeling import LongNetLM
from tests.unit.test_training_resume import callback, load, run_args, run_in_process, train_losses

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "packed_documents.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


def write_documents(folder: Path) -> Path:
    """60 short pseudo-Python files in ``folder``; returns their glob."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    for index in range(60):
        words = rng.choice(["def", "f(x):", "return", "x", "+", "1\n"], rng.integers(2, 30))
        (folder / f"doc{index:02d}.py").write_text(" ".join(words))
    return folder / "*.py"


def test_packed_documents_config_trains(tmp_path, monkeypatch):
    write_documents(tmp_path / "docs")
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


def test_killed_packed_run_resumes_exactly(tmp_path):
    """Killed (no cleanup) during step 5 of 6 with ``last.ckpt`` at step 3, then resumed: the
    same parameters and the same losses as the uninterrupted run (the packed windows come back
    in the same order)."""
    config = yaml.safe_load(CONFIG.read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=6, val_check_interval=3, log_every_n_steps=1,
                   enable_progress_bar=False)
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = 3
    config["data"]["init_args"].update(
        data_files=str(write_documents(tmp_path / "docs")), cache_dir=str(tmp_path / "cache"),
        val_fraction=0.2, test_fraction=0.2)
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(config))
    trainer["callbacks"].append(callback("KillAtStep", step=4))
    killing = tmp_path / "killing.yaml"
    killing.write_text(yaml.safe_dump(config))

    assert main(run_args(plain, tmp_path, "full")) == 0
    killed = run_in_process(run_args(killing, tmp_path, "resumed"))
    assert killed.returncode == 17, killed.stderr[-3000:]
    assert load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["global_step"] == 3
    assert main(run_args(plain, tmp_path, "resumed", "--ckpt_path=last")) == 0

    expected = load(tmp_path / "full" / "checkpoints" / "last.ckpt")
    resumed = load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert expected["global_step"] == resumed["global_step"] == 6
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][key], value, rtol=0, atol=1e-7)
    expected_losses = train_losses(tmp_path / "full")
    resumed_losses = train_losses(tmp_path / "resumed")
    for step in range(3, 6):
        assert resumed_losses[step] == pytest.approx(expected_losses[step], abs=1e-6)
