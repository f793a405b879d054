"""A killed ``longnet fit`` re-run with ``--ckpt_path last`` continues exactly: the same batches,
the same updates, the same parameters as a run that was never interrupted."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from longnet.cli import main

REPO = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY, KILL_AT = 8, 3, 7  # checkpoint at steps 3 and 6; killed during step 7


class KillAtStep(L.Callback):
    """Kill the process (no cleanup, like SIGKILL) when ``step`` optimizer steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os._exit(17)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_config(path: Path, cache: Path, kill: bool) -> Path:
    config = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=STEPS, val_check_interval=4, log_every_n_steps=1,
                   enable_progress_bar=False)
    for callback in trainer["callbacks"]:
        if isinstance(callback, dict) and callback["class_path"].endswith("LastCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = SAVE_EVERY
    if kill:
        trainer["callbacks"].append({"class_path": "tests.unit.test_training_resume.KillAtStep",
                                     "init_args": {"step": KILL_AT}})
    config["test_after_fit"] = False
    config["data"]["init_args"]["cache_dir"] = str(cache)
    path.write_text(yaml.safe_dump(config))
    return path


def run_args(config: Path, root: Path, name: str, *extra: str) -> list[str]:
    return ["fit", "--config", str(config), f"--trainer.logger.init_args.save_dir={root}",
            f"--trainer.logger.init_args.name={name}", f"--trainer.default_root_dir={root}",
            *extra]


def train_losses(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv") as handle:
        return {int(row["step"]): float(row["train/loss"])
                for row in csv.DictReader(handle) if row.get("train/loss")}


def test_killed_run_resumes_exactly(tmp_path):
    cache = tmp_path / "cache"
    plain = write_config(tmp_path / "plain.yaml", cache, kill=False)
    killing = write_config(tmp_path / "killing.yaml", cache, kill=True)

    assert main(run_args(plain, tmp_path, "full")) == 0

    python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-m", "longnet", *run_args(killing, tmp_path, "resumed")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert killed.returncode == 17, killed.stderr[-3000:]
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 6

    assert main(run_args(plain, tmp_path, "resumed", "--ckpt_path=last")) == 0

    full = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=False)
    resumed = torch.load(last, weights_only=False)
    assert full["global_step"] == resumed["global_step"] == STEPS
    for key, value in full["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][key], value, rtol=0, atol=1e-7)
    # the resumed steps saw the same batches (same losses), none lost or repeated
    full_losses, resumed_losses = train_losses(tmp_path / "full"), train_losses(
        tmp_path / "resumed")
    assert sorted(full_losses) == list(range(STEPS))
    for step in range(6, STEPS):
        assert resumed_losses[step] == pytest.approx(full_losses[step], abs=1e-6)
