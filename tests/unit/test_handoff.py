"""Chunked training on machines that share nothing (``longnet.training.handoff``): the full
state packed into small shards resumes a killed run bit-exactly; the compact handoff is small
and a chunk starts from it at the recorded step and data position with a re-warmed optimizer;
the GPU chunk configs run on the CPU."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from longnet.cli import main
from longnet.training.handoff import (
    HANDOFF,
    INDEX,
    WEIGHTS,
    Rewarmup,
    handoff_checkpoint,
    pack_state,
    restore_newest,
    unpack_state,
    write_handoff,
)
from longnet.validation import UsageError
from tests.gpu_configs import tiny_gpu_config

REPO = Path(__file__).resolve().parents[2]
HERE = "tests.unit.test_handoff"
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


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # module-wide: the module fixtures' runs too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``full``: the uninterrupted run of ``STEPS`` steps; ``crashed``: the same run killed in
    step ``CRASH_AT`` (its ``last.ckpt`` is of step 4). Each with its probe file."""
    root = tmp_path_factory.mktemp("runs")
    cache = root / "cache"
    full = chunk_config(root / "full.yaml", cache, callback("Probe", path=str(root / "full.jsonl")))
    assert fit(full, root, "full") == 0
    crashing = chunk_config(root / "crash.yaml", cache, callback("CrashAtStep", step=CRASH_AT),
                            callback("Probe", path=str(root / "crashed.jsonl")))
    with pytest.raises(RuntimeError, match=f"crash at step {CRASH_AT}"):
        fit(crashing, root, "crashed")
    assert load(root / "crashed" / "checkpoints" / "last.ckpt")["global_step"] == 4
    return root


def fresh_machine(runs: Path, tmp_path: Path, name: str, probe: str) -> tuple[Path, Path]:
    """A config writing ``probe`` and an empty run folder ``name`` (nothing of the earlier
    chunk's machine: no run folder, its own data cache)."""
    config = chunk_config(tmp_path / "chunk.yaml", tmp_path / "cache",
                          callback("Probe", path=str(tmp_path / probe)))
    return config, tmp_path / name / "checkpoints" / "last.ckpt"


def test_a_killed_chunk_resumes_bit_exactly_through_small_shards(runs, tmp_path):
    last = runs / "crashed" / "checkpoints" / "last.ckpt"
    size = last.stat().st_size
    shard = 64 * 1024
    files = pack_state(last, tmp_path / "state", max_shard_size=shard, max_files=64)
    assert files[0].name == INDEX and len(files) == 1 + -(-size // shard) >= 4
    assert all(path.stat().st_size <= shard for path in files[1:])
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == sorted(f.name for f in files)

    config, target = fresh_machine(runs, tmp_path, "resumed", "resumed.jsonl")
    unpack_state(tmp_path / "state", target)
    assert target.read_bytes() == last.read_bytes()
    assert fit(config, tmp_path, "resumed", "--ckpt_path=last") == 0
    # the state came from another folder: it still writes last.ckpt (Lightning's version
    # counter wrote last-v1.ckpt, and the next --ckpt_path last resumed the stale one)
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]

    expected = load(runs / "full" / "checkpoints" / "last.ckpt")
    resumed = load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == expected["global_step"] == STEPS
    for name, value in expected["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], value), name
    moments, resumed_moments = (c["optimizer_states"][0]["state"] for c in (expected, resumed))
    assert moments.keys() == resumed_moments.keys()
    for index, state in moments.items():
        for key, value in state.items():
            assert torch.equal(resumed_moments[index][key], value), (index, key)
    full, after = probed(runs / "full.jsonl"), probed(tmp_path / "resumed.jsonl")
    assert sorted(after) == [4, 5]
    for step in (4, 5):
        assert after[step] == full[step]  # the same batches and learning rates
    assert_same_losses(runs / "full" / "metrics.csv", tmp_path / "resumed" / "metrics.csv",
                       steps=(4, 5))


def assert_same_losses(full: Path, resumed: Path, steps: tuple[int, ...]) -> None:
    """The logged training losses of ``steps`` are the same, to the last digit."""

    def losses(path: Path) -> dict[int, str]:
        with open(path) as handle:
            return {int(row["step"]): row["train/loss"] for row in csv.DictReader(handle)
                    if row.get("train/loss")}

    expected, got = losses(full), losses(resumed)
    assert [got[step] for step in steps] == [expected[step] for step in steps]


def test_the_compact_handoff_is_small_and_a_chunk_starts_from_it(runs, tmp_path):
    last = runs / "crashed" / "checkpoints" / "last.ckpt"
    checkpoint = load(last)
    files = write_handoff(last, tmp_path / "handoff")
    assert [f.name for f in files] == [WEIGHTS, HANDOFF]
    parameters = sum(v.numel() for v in checkpoint["state_dict"].values())
    weights_bytes = files[0].stat().st_size
    assert 2 * parameters <= weights_bytes < 2 * parameters + 16_384  # bfloat16 + header
    assert files[1].stat().st_size < 20_000 and sum(f.stat().st_size for f in files) < 10 ** 7
    handoff = json.loads(files[1].read_text())
    assert handoff["checkpoint"]["global_step"] == 4
    position = handoff["checkpoint"]["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert position == {"seed": 7, "epoch": 0, "consumed": 4}

    config, target = fresh_machine(runs, tmp_path, "started", "started.jsonl")
    handoff_checkpoint(tmp_path / "handoff", target)
    started = load(target)
    assert started["optimizer_states"][0]["state"] == {}
    for name, value in checkpoint["state_dict"].items():
        assert started["state_dict"][name].dtype == value.dtype
        assert torch.equal(started["state_dict"][name], value.to(torch.bfloat16).to(value.dtype))
    assert fit(config, tmp_path, "started", "--ckpt_path=last") == 0

    assert load(tmp_path / "started" / "checkpoints" / "last.ckpt")["global_step"] == STEPS
    full, after = probed(runs / "full.jsonl"), probed(tmp_path / "started.jsonl")
    assert sorted(after) == [4, 5]
    for step in (4, 5):  # the recorded data position and schedule, the rate re-warmed
        assert after[step]["sha"] == full[step]["sha"]
        ramp = (step - 4 + 1) / (REWARMUP + 1)
        assert after[step]["lr"] == pytest.approx(full[step]["lr"] * ramp, rel=1e-12)
    metrics = (tmp_path / "started" / "metrics.csv").read_text()
    assert checkpoint["longnet_run_id"] in metrics  # the run goes on under its id


def test_rewarmup_ramps_from_the_resumed_step_only():
    ramp = Rewarmup(steps=3)
    assert [ramp.factor(step) for step in (0, 10)] == [1.0, 1.0]  # no fresh start seen
    ramp.load_state_dict({"start": 10})
    assert [ramp.factor(step) for step in (9, 10, 11, 12, 13)] == [1.0, 0.25, 0.5, 0.75, 1.0]
    assert ramp.state_dict() == {"start": 10}
    assert Rewarmup(steps=0).factor(0) == 1.0
    with pytest.raises(ValueError, match="steps must be a non-negative integer, got -1"):
        Rewarmup(steps=-1)


def test_pack_refuses_more_files_than_allowed_and_unpack_names_a_bad_shard(runs, tmp_path):
    last = runs / "crashed" / "checkpoints" / "last.ckpt"
    with pytest.raises(UsageError, match=r"needs \d+ shards .* more than max_files 3.*compact"):
        pack_state(last, tmp_path / "state", max_shard_size=64 * 1024, max_files=3)
    assert not (tmp_path / "state").exists()
    files = pack_state(last, tmp_path / "state", max_shard_size=128 * 1024, max_files=64)
    files[2].write_bytes(files[2].read_bytes()[:-1] + b"!")
    with pytest.raises(UsageError, match=f"{files[2].name} is damaged.*Copy it again"):
        unpack_state(tmp_path / "state", tmp_path / "last.ckpt")
    files[1].unlink()
    with pytest.raises(UsageError, match=f"{files[1].name} is missing"):
        unpack_state(tmp_path / "state", tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").exists()
    with pytest.raises(FileNotFoundError, match="no index.json in .*chunk_state.py pack"):
        unpack_state(tmp_path, tmp_path / "last.ckpt")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="other holds other files \\(notes.txt\\)"):
        pack_state(last, tmp_path / "other")
    pack_state(last, tmp_path / "state", max_shard_size=1 << 20)  # one shard replaces many
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        INDEX, "state-00001-of-00001.bin"]


def test_restore_picks_the_newest_handover_the_exact_one_at_equal_steps(runs, tmp_path):
    full, crashed = (runs / name / "checkpoints" / "last.ckpt" for name in ("full", "crashed"))
    pack_state(full, tmp_path / "state6")
    pack_state(crashed, tmp_path / "state4")
    write_handoff(full, tmp_path / "handoff6")
    write_handoff(crashed, tmp_path / "handoff4")
    target = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert restore_newest(target, tmp_path / "absent", tmp_path / "absent") is None
    assert not target.exists()
    assert restore_newest(target, tmp_path / "state6", tmp_path / "handoff4") == ("state", 6)
    assert target.read_bytes() == full.read_bytes()
    assert restore_newest(target, tmp_path / "state6", tmp_path / "handoff6") == (
        "checkpoint", 6)  # this machine's own: kept
    target.unlink()
    assert restore_newest(target, tmp_path / "state6", tmp_path / "handoff6") == ("state", 6)
    target.unlink()
    assert restore_newest(target, tmp_path / "state4", tmp_path / "handoff6") == ("handoff", 6)
    assert load(target)["optimizer_states"][0]["state"] == {}


@pytest.fixture(scope="module")
def gpu_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-cache")


@pytest.mark.parametrize("name", ["longnet_tiny_64k", "longnet_tiny_64k_dense"])
def test_the_gpu_chunk_configs_run_on_the_cpu(name, tmp_path, gpu_cache):
    """Each GPU config as the chunk script runs it, at 1/128 of its lengths on the CPU
    (``tiny_gpu_config``): 3 steps, one per stage, on the standard library's packages."""
    data = yaml.safe_load((REPO / "configs" / "gpu" / f"{name}.yaml").read_text())["data"]
    assert data["init_args"]["packages"] == ["stdlib", "installed"]
    assert data["init_args"]["held_out"] == {"validation": ["networkx"], "test": ["sympy"]}
    config = tiny_gpu_config(name, gpu_cache)
    curriculum = next(c for c in config["trainer"]["callbacks"] if isinstance(c, dict)
                      and c["class_path"].endswith("LengthCurriculum"))["init_args"]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    assert fit(path, tmp_path, "run") == 0

    assert load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 3
    exported = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    overrides = config["model"]["init_args"]["overrides"]
    assert exported["segment_lengths"] == overrides["segment_lengths"]
    assert exported["rope_theta"] == curriculum["stages"][-1]["rope_theta"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test"]["step"] == 3
