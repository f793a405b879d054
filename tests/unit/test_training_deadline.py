"""``TrainingDeadline``: training stops after the first step that ends past the deadline, runs to
``max_steps`` when the deadline is far, and a deadline that is not a time is refused."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from longnet.training import TrainingDeadline
from longnet.validation import UsageError


class Slow(L.LightningModule):
    """Steps of about 50 ms; records when each one started and when its work ended."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.started: list[float] = []
        self.ended: list[float] = []

    def training_step(self, batch, batch_idx):
        self.started.append(time.time())
        time.sleep(0.05)
        self.ended.append(time.time())
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(torch.randn(400, 4), batch_size=2)


def fit(deadline: TrainingDeadline, tmp_path) -> tuple[L.Trainer, Slow]:
    module = Slow()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=100, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[deadline])
    trainer.fit(module)
    return trainer, module


def test_training_stops_after_the_step_that_ends_past_the_deadline(tmp_path):
    at = time.time() + 1.0
    trainer, module = fit(TrainingDeadline(at=at), tmp_path)
    assert trainer.global_step == len(module.started) < 100  # 100 steps take 5 s
    # every step but the last ended before the deadline (the last may even start after it,
    # when the one before ended just short of it) ...
    assert all(end < at for end in module.ended[:-1])
    assert time.time() - at < 0.5  # ... and training stopped right after the last one


def test_a_deadline_already_past_stops_after_one_step(tmp_path):
    trainer, _ = fit(TrainingDeadline(at=time.time() - 60), tmp_path)
    assert trainer.global_step == 1


def test_a_far_deadline_leaves_max_steps_in_charge(tmp_path):
    trainer, _ = fit(TrainingDeadline(at=time.time() + 3600), tmp_path)
    assert trainer.global_step == 100


@pytest.mark.parametrize("at", [0, -5.0, float("nan"), float("inf"), "soon", None])
def test_a_deadline_that_is_not_a_time_is_refused(at):
    with pytest.raises(UsageError, match="at must be a time in UNIX seconds"):
        TrainingDeadline(at=at)
