"""Helpers of the tests that train the smoke config in chunks: callbacks that record each step
(:class:`Probe`) or kill a run (:class:`CrashAtStep`), the chunked config and the fit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning as L
import torch
import yaml

from longnet.cli import main

REPO = Path(__file__).resolve().parents[1]
HERE = "tests.chunked"
STEPS, SAVE_EVERY, CRASH_AT, REWARMUP = 6, 2, 5, 2  # last.ckpt at step 4, crash in step 5


class Probe(L.Callback):
    """Append a JSON line per optimizer step to ``path``: the step, the training batch's shape
    and SHA-256 (as the step sees it: list it after the callbacks that change it), the
    learning rate applied and the model's RoPE base."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._batch: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        ids = batch["input_ids"]
        self._batch = {"shape": list(ids.shape),
                       "sha": hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        record = {"step": trainer.global_step, **self._batch,
                  "lr": optimizer.param_groups[0]["lr"],
                  "rope_theta": pl_module.model.config.rope_theta}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


class CrashAtStep(L.Callback):
    """Fail when ``step`` optimizer steps are done, as a killed chunk: nothing is saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def callback(name: str, **init_args) -> dict:
    return {"class_path": f"{HERE}.{name}", "init_args": init_args}


def chunk_config(path: Path, cache: Path, *callbacks: dict, steps: int = STEPS) -> Path:
    """The smoke config as a chunked run: a schedule of ``STEPS`` steps whatever
    ``max_steps``, ``last.ckpt`` every ``SAVE_EVERY`` steps, ``Rewarmup``, then ``callbacks``
    (a ``Probe`` last)."""
    config = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=steps, val_check_interval=SAVE_EVERY, limit_val_batches=1,
                   log_every_n_steps=1, enable_progress_bar=False)
    trainer["callbacks"] = [
        {"class_path": "longnet.training.LastCheckpoint",
         "init_args": {"every_n_train_steps": SAVE_EVERY}},
        {"class_path": "longnet.training.Rewarmup", "init_args": {"steps": REWARMUP}},
        *callbacks,
    ]
    config["test_after_fit"] = False
    config["model"]["init_args"]["total_steps"] = STEPS
    config["data"]["init_args"].update(cache_dir=str(cache), batch_size=4)
    path.write_text(yaml.safe_dump(config))
    return path


def fit(config: Path, root: Path, name: str, *extra: str) -> int:
    return main(["fit", "--config", str(config), f"--trainer.logger.init_args.save_dir={root}",
                 f"--trainer.logger.init_args.name={name}",
                 f"--trainer.default_root_dir={root}", *extra])


def probed(path: Path) -> dict[int, dict]:
    """The ``Probe`` records by step (a step run twice: its last record)."""
    return {record["step"]: record for record in map(json.loads, path.read_text().splitlines())}


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
