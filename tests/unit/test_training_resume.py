"""A ``longnet fit`` stopped anywhere ends, after ``--ckpt_path last``, as if it had never
stopped: killed (no cleanup) mid-step, during the final validation, while saving a checkpoint,
before the export or in the test after fit,
stopped by SIGTERM or SIGINT (exit status 143 / 130 with a checkpoint), or finished and then
extended. The same batches, the same updates, the same parameters as an uninterrupted run, and
a complete run folder whose checkpoints name only files that exist."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Checkpoint

from longnet.cli import main
from longnet.modeling import LongNetLM
from longnet.training.schedule import WarmupCosine

REPO = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY, KILL_AT = 8, 3, 7  # checkpoint at steps 3 and 6; killed during step 7
HERE = "tests.unit.test_training_resume"


class KillAtStep(L.Callback):
    """Kill the process (no cleanup, like SIGKILL) when ``step`` optimizer steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os._exit(17)


class KillAtFitEnd(L.Callback):
    """Kill the process when ``fit`` ends, before the export (listed before it)."""

    def on_fit_end(self, trainer, pl_module) -> None:
        os._exit(17)


class KillAfterBest(Checkpoint):
    """Kill the process in the final validation, after the best checkpoint is written and
    before ``last.ckpt`` is (a ``Checkpoint``: Lightning runs it among those)."""

    dirpath = None  # writes nothing

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_step == trainer.max_steps and not trainer.sanity_checking:
            os._exit(17)


class KillInTest(L.Callback):
    """Kill the process in the test after ``fit`` (after the export)."""

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        os._exit(17)


class KillWhileSaving(L.Callback):
    """Kill the process while a checkpoint of ``step`` is being saved (its contents gathered,
    nothing written yet)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.step:
            os._exit(17)


class SignalAt(L.Callback):
    """Send this process ``signum`` when ``step`` optimizer steps are done: at the start of
    the next step, or (``during_validation``) in the validation of that step."""

    def __init__(self, step: int, signum: int, during_validation: bool = False) -> None:
        self.step, self.signum, self.during_validation = step, signum, during_validation

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.during_validation:
            os.kill(os.getpid(), self.signum)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx,
                                  dataloader_idx=0) -> None:
        if trainer.global_step == self.step and self.during_validation and batch_idx == 0 \
                and not trainer.sanity_checking:
            os.kill(os.getpid(), self.signum)


class SaveWeightsAtStart(L.Callback):
    """Save the module's state dict to ``path`` when training starts (after a resume: the
    weights restored from the checkpoint)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        torch.save(pl_module.state_dict(), self.path)


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # module-wide: the uninterrupted run (a module fixture) too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_config(path: Path, cache: Path, *callbacks: dict, first: dict | None = None,
                 steps: int = STEPS, val_every: int = 4, save_every: int = SAVE_EVERY,
                 test: bool = False) -> Path:
    """The smoke config, ``steps`` long, validating every ``val_every`` steps, ``last.ckpt``
    every ``save_every`` steps, with extra ``callbacks`` (``first``: before the others)."""
    config = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=steps, val_check_interval=val_every, log_every_n_steps=1,
                   enable_progress_bar=False)
    for callback in trainer["callbacks"]:
        if isinstance(callback, dict) and callback["class_path"].endswith("LastCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = save_every
    trainer["callbacks"] = ([first] if first else []) + trainer["callbacks"] + list(callbacks)
    config["test_after_fit"] = test
    config["data"]["init_args"]["cache_dir"] = str(cache)
    path.write_text(yaml.safe_dump(config))
    return path


def callback(name: str, **init_args) -> dict:
    return {"class_path": f"{HERE}.{name}", "init_args": init_args}


def run_args(config: Path, root: Path, name: str, *extra: str) -> list[str]:
    return ["fit", "--config", str(config), f"--trainer.logger.init_args.save_dir={root}",
            f"--trainer.logger.init_args.name={name}", f"--trainer.default_root_dir={root}",
            *extra]


def run_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m longnet ARGS`` in a process of its own."""
    python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "longnet", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def train_losses(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv") as handle:
        return {int(row["step"]): float(row["train/loss"])
                for row in csv.DictReader(handle) if row.get("train/loss")}


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """The uninterrupted run (``STEPS`` steps): its run folder."""
    root = tmp_path_factory.mktemp("full")
    config = write_config(root / "plain.yaml", root / "cache")
    assert main(run_args(config, root, "full")) == 0
    return root / "full"


def assert_same_as_full(run: Path, full: Path, first_resumed_step: int) -> None:
    expected = load(full / "checkpoints" / "last.ckpt")
    resumed = load(run / "checkpoints" / "last.ckpt")
    assert expected["global_step"] == resumed["global_step"] == STEPS
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][key], value, rtol=0, atol=1e-7)
    # the resumed steps saw the same batches (same losses), none lost or repeated
    expected_losses, resumed_losses = train_losses(full), train_losses(run)
    assert sorted(expected_losses) == list(range(STEPS))
    for step in range(first_resumed_step, STEPS):
        assert resumed_losses[step] == pytest.approx(expected_losses[step], abs=1e-6)


def test_killed_run_resumes_exactly(tmp_path, full):
    cache = tmp_path / "cache"
    plain = write_config(tmp_path / "plain.yaml", cache)
    killing = write_config(tmp_path / "killing.yaml", cache, callback("KillAtStep", step=KILL_AT))
    killed = run_in_process(run_args(killing, tmp_path, "resumed"))
    assert killed.returncode == 17, killed.stderr[-3000:]
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == 6

    assert main(run_args(plain, tmp_path, "resumed", "--ckpt_path=last")) == 0
    assert_same_as_full(tmp_path / "resumed", full, 6)


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resumes(tmp_path, full):
    """SIGTERM during step 5: the step ends, ``last.ckpt`` of step 5 is written, exit status
    143 (Lightning alone: no checkpoint, exit status 0, so a scheduler sees success)."""
    cache = tmp_path / "cache"
    plain = write_config(tmp_path / "plain.yaml", cache)
    signalling = write_config(tmp_path / "sigterm.yaml", cache,
                              callback("SignalAt", step=4, signum=int(signal.SIGTERM)))
    stopped = run_in_process(run_args(signalling, tmp_path, "resumed"))
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "longnet: received SIGTERM: stopping at the end of this step with a checkpoint." \
           in stopped.stderr
    assert f"longnet: stopped by SIGTERM after step 5 of {STEPS}; saved {last}. Run the same " \
           "command with --ckpt_path last to continue from the last checkpoint." \
           in stopped.stderr, stopped.stderr[-3000:]
    assert load(last)["global_step"] == 5  # not a multiple of SAVE_EVERY: saved by the stop

    assert main(run_args(plain, tmp_path, "resumed", "--ckpt_path=last")) == 0
    assert_same_as_full(tmp_path / "resumed", full, 5)


def test_a_signal_during_validation_stops_after_it(tmp_path, capsys):
    """SIGINT (Ctrl-C) in the validation of step 4: the validation ends, then the run stops
    with the checkpoint of step 4 and its validation, exit status 130 (Lightning alone: a
    KeyboardInterrupt wherever it lands, exit status 1, no checkpoint)."""
    config = write_config(tmp_path / "sigint.yaml", tmp_path / "cache",
                          callback("SignalAt", step=4, signum=int(signal.SIGINT),
                                   during_validation=True))
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where started in the background
    assert main(run_args(config, tmp_path, "run")) == 130
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    assert f"stopped by SIGINT after step 4 of {STEPS}; saved {last}." in capsys.readouterr().err
    assert load(last)["global_step"] == 4
    assert json.loads((run / "metrics.json").read_text())["validate"]["step"] == 4
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler restored


def best_path(checkpoint: dict) -> str:
    """The best checkpoint a checkpoint's ``ModelCheckpoint(monitor=...)`` state names."""
    states = [state for key, state in checkpoint["callbacks"].items()
              if key.startswith("ModelCheckpoint")]
    assert len(states) == 1
    return states[0]["best_model_path"]


def assert_complete(run: Path, steps: int) -> None:
    """The run folder of a finished run: ``last.ckpt`` at ``steps`` naming an existing best
    checkpoint (the only other one), ``model/`` its weights, ``metrics.json`` of that step."""
    last = load(run / "checkpoints" / "last.ckpt")
    best = Path(best_path(last))
    assert last["global_step"] == steps and best.is_file(), best
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == sorted(
        ["last.ckpt", best.name])
    state = load(best)["state_dict"]
    for key, value in LongNetLM.from_pretrained(run / "model").state_dict().items():
        assert torch.equal(value, state[f"model.{key}"]), key
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["validate"]["step"] == summary["test"]["step"] == steps


def test_a_float64_run_resumes_with_its_float64_weights(tmp_path):
    """Under ``precision: 64-true`` the checkpoint's float64 weights are resumed as they are
    (Lightning loads them before it converts the module: they were rounded to float32)."""
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", steps=3, val_every=3,
                          save_every=3)
    args = run_args(config, tmp_path, "run", "--trainer.precision=64-true")
    assert main(args) == 0
    saved = load(tmp_path / "run" / "checkpoints" / "last.ckpt")["state_dict"]
    probe = callback("SaveWeightsAtStart", path=str(tmp_path / "restored.pt"))
    resumed = write_config(tmp_path / "r.yaml", tmp_path / "cache", probe, steps=4, val_every=4,
                           save_every=4)
    assert main(run_args(resumed, tmp_path, "run", "--trainer.precision=64-true",
                         "--ckpt_path=last")) == 0
    restored = torch.load(tmp_path / "restored.pt", weights_only=True)
    assert saved["model.lm_head.weight"].dtype == torch.float64
    assert all(torch.equal(restored[name], value) for name, value in saved.items()), [
        name for name, value in saved.items() if not torch.equal(restored[name], value)][:3]


def test_a_finished_run_is_extended(tmp_path):
    """``last.ckpt`` at a validation step is written after the validation, so it names the
    best checkpoint that validation kept (Lightning's would name the one it deleted: the
    extended run then failed with FileNotFoundError, every retry the same). The extended
    steps follow the schedule of a 7-step run, not the end of the checkpoint's 4-step one."""
    config = write_config(tmp_path / "plain.yaml", tmp_path / "cache", steps=4, val_every=2,
                          save_every=2, test=True)
    warmup = "--model.init_args.warmup_steps=1"
    assert main(run_args(config, tmp_path, "run", warmup)) == 0
    assert_complete(tmp_path / "run", 4)
    assert main(run_args(config, tmp_path, "run", warmup, "--ckpt_path=last",
                         "--trainer.max_steps=7")) == 0
    assert_complete(tmp_path / "run", 7)  # validated at its last step, not only every 2
    checkpoint = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    hparams = checkpoint["hyper_parameters"]
    with open(tmp_path / "run" / "metrics.csv") as handle:
        rates = {int(row["step"]): float(row["lr-AdamW/pg1"])
                 for row in csv.DictReader(handle) if row.get("lr-AdamW/pg1")}
    for step in range(4, 7):
        expected = (WarmupCosine(1, hparams["min_lr_ratio"], ((0, 7),))(step)
                    * hparams["learning_rate"])
        assert rates[step] == pytest.approx(expected, rel=1e-9), step


def test_a_checkpoint_naming_deleted_files_is_resumed(tmp_path):
    """A ``last.ckpt`` written before this ordering (or by a run killed between a top-k update
    and the next ``last.ckpt``) names a best checkpoint deleted since: it is forgotten, and a
    checkpoint the interrupted run wrote after it is deleted (the resumed run writes it
    again), instead of a FileNotFoundError or a stale export."""
    config = write_config(tmp_path / "plain.yaml", tmp_path / "cache", steps=4, val_every=2,
                          save_every=2, test=True)
    assert main(run_args(config, tmp_path, "run")) == 0
    folder = tmp_path / "run" / "checkpoints"
    last = load(folder / "last.ckpt")
    best = Path(best_path(last))
    # as if the run had stopped at step 4 before its validation: the best of step 2 was
    # deleted, the best of step 4 was written after this last.ckpt
    state = next(state for key, state in last["callbacks"].items()
                 if key.startswith("ModelCheckpoint"))
    stale = str(folder / "best-step=2.ckpt")
    state.update(best_k_models={stale: torch.tensor(0.0)}, best_model_path=stale,
                 best_model_score=torch.tensor(0.0), kth_best_model_path=stale,
                 kth_value=torch.tensor(0.0))
    later = load(best)
    later["global_step"] = 6
    torch.save(later, folder / "best-step=6.ckpt")
    torch.save(last, folder / "last.ckpt")
    written = (folder / "last.ckpt").stat().st_mtime
    os.utime(folder / "last.ckpt", (written - 10, written - 10))  # written before both bests
    assert main(run_args(config, tmp_path, "run", "--ckpt_path=last",
                         "--trainer.max_steps=6")) == 0
    assert_complete(tmp_path / "run", 6)


KILLS = {  # where a run is killed: (its callback, listed first, the export was written)
    "after the best checkpoint": (callback("KillAfterBest"), False, False),
    "before the export": (callback("KillAtFitEnd"), True, False),
    "while saving the last checkpoint": (callback("KillWhileSaving", step=4), False, False),
    "in the test after fit": (callback("KillInTest"), False, True),
}


@pytest.mark.parametrize("kill", list(KILLS))
def test_a_run_killed_anywhere_ends_complete(tmp_path, kill):
    cache = tmp_path / "cache"
    plain = write_config(tmp_path / "plain.yaml", cache, steps=4, val_every=2, save_every=2,
                         test=True)
    killer, first, exported = KILLS[kill]
    extra = {"first": killer} if first else {}
    killing = write_config(tmp_path / "kill.yaml", cache, *([] if first else [killer]),
                           steps=4, val_every=2, save_every=2, test=True, **extra)
    killed = run_in_process(run_args(killing, tmp_path, "run"))
    assert killed.returncode == 17, killed.stderr[-3000:]
    run = tmp_path / "run"
    assert (run / "model").exists() == exported
    assert main(run_args(plain, tmp_path, "run", "--ckpt_path=last")) == 0
    assert_complete(run, 4)


def test_checkpoint_callbacks_are_ordered_for_the_last_one(tmp_path):
    """``LastCheckpoint`` listed before the best ``ModelCheckpoint`` still writes after it."""
    config = yaml.safe_load(write_config(tmp_path / "c.yaml", tmp_path / "cache", steps=2,
                                         val_every=2, save_every=2).read_text())
    callbacks = config["trainer"]["callbacks"]
    last = next(c for c in callbacks if isinstance(c, dict)
                and c["class_path"].endswith("LastCheckpoint"))
    callbacks.remove(last)
    callbacks.insert(0, last)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(run_args(tmp_path / "c.yaml", tmp_path, "run")) == 0
    assert Path(best_path(load(tmp_path / "run" / "checkpoints" / "last.ckpt"))).is_file()

