"""Chunked training on machines that share nothing (``lab.handoff``): the full
state packed into small shards resumes a killed run bit-exactly; the compact handoff is small
and a chunk starts from it at the recorded step and data position with a re-warmed optimizer;
the GPU chunk configs run on the CPU."""

from __future__ import annotations

import csv
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from lab.handoff import (
    HANDOFF,
    INDEX,
    WEIGHTS,
    handoff_checkpoint,
    pack_state,
    restart_clock,
    restore_newest,
    unpack_state,
    write_handoff,
)
from longnet import files
from longnet.training.run_folder import RUN_ID_KEY
from longnet.validation import UsageError
from tests.chunked import (
    CRASH_AT,
    REWARMUP,
    STEPS,
    callback,
    chunk_config,
    fit,
    load,
    probed,
)
from tests.gpu_configs import tiny_gpu_config
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # module-wide: the module fixtures' runs too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    assert started["longnet_tokenizer"] == checkpoint["longnet_tokenizer"] == {"name": "bytes"}
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
    with pytest.raises(FileNotFoundError, match="no index.json in .*chunk_state pack"):
        unpack_state(tmp_path, tmp_path / "last.ckpt")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="other holds other files \\(notes.txt\\)"):
        pack_state(last, tmp_path / "other")
    with pytest.raises(UsageError, match="state already holds .*pass --overwrite"):
        pack_state(last, tmp_path / "state", max_shard_size=1 << 20)
    pack_state(last, tmp_path / "state", max_shard_size=1 << 20, overwrite=True)  # 1 for many
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        INDEX, "state-00001-of-00001.bin"]


def edited(source: Path, path: Path, **entries) -> Path:
    """A copy at ``path`` of the checkpoint ``source`` with ``entries`` replaced (a
    ``state_dict`` entry: its tensors updated)."""
    checkpoint = load(source)
    checkpoint["state_dict"].update(entries.pop("state_dict", {}))
    checkpoint.update(entries)
    torch.save(checkpoint, path)
    return path


def test_restore_picks_the_newest_handover_the_exact_one_at_equal_steps(runs, tmp_path):
    full = runs / "full" / "checkpoints" / "last.ckpt"
    earlier = edited(full, tmp_path / "step4.ckpt", global_step=4)  # the same run, at step 4
    pack_state(full, tmp_path / "state6")
    pack_state(earlier, tmp_path / "state4")
    write_handoff(full, tmp_path / "handoff6")
    write_handoff(earlier, tmp_path / "handoff4")
    target = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert restore_newest(target) is None
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


def same(a: object, b: object) -> bool:
    """Equal nested checkpoint contents: tensors bit for bit, containers entry by entry."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_restore_restarts_the_max_time_clock_for_the_chunk(runs, tmp_path, capsys):
    """Lightning's ``Timer`` adds the training time a checkpoint recorded to the next fit's, so
    a chunk resumed after one that used up ``max_time`` would stop after one step: ``restore``
    zeroes it (from the full state and from the handoff alike) and says so, leaving the rest
    of the checkpoint as it was; a checkpoint without recorded time is not rewritten."""
    script = load_script("chunk_state")
    full = runs / "full" / "checkpoints" / "last.ckpt"
    elapsed = {"train": 282.9, "sanity_check": 0, "validate": 2.2, "test": 0, "predict": 0}
    timed = edited(full, tmp_path / "timed.ckpt", callbacks={
        **load(full)["callbacks"], "Timer": {"time_elapsed": elapsed}})
    pack_state(timed, tmp_path / "state")
    write_handoff(timed, tmp_path / "handoff")
    for option in ("state", "handoff"):
        target = tmp_path / f"run-{option}" / "last.ckpt"
        assert script.main(["restore", str(target), f"--{option}", str(tmp_path / option)]) == 0
        assert "earlier chunks' 283 s of training no longer count against max_time" in (
            capsys.readouterr().out)
        restored, before = load(target), load(timed)
        assert restored["callbacks"]["Timer"]["time_elapsed"] == {**elapsed, "train": 0.0}
        assert restored["global_step"] == before["global_step"]
        if option == "state":  # the exact handover: everything else as it was
            restored["callbacks"]["Timer"]["time_elapsed"]["train"] = 282.9
            assert same(restored, before)
        assert restart_clock(target) == 0.0
    untouched = shutil.copy(full, tmp_path / "untimed.ckpt")
    assert restart_clock(untouched) == 0.0
    assert Path(untouched).read_bytes() == full.read_bytes()


def test_restore_refuses_another_runs_state_or_handoff_and_keeps_the_checkpoint(runs, tmp_path):
    """A leftover state or handoff of another run (another run id, or the same run id with
    other tensor shapes) at a higher step does not replace the run's only ``last.ckpt``, nor,
    on a fresh machine, win over the other folder given, of another run; the same run's newer
    one does."""
    full, crashed = (runs / name / "checkpoints" / "last.ckpt" for name in ("full", "crashed"))
    target = tmp_path / "run" / "checkpoints" / "last.ckpt"
    target.parent.mkdir(parents=True)
    target.write_bytes(crashed.read_bytes())  # step 4
    mine = load(crashed)
    pack_state(full, tmp_path / "other-state")  # another run id, step 6
    write_handoff(full, tmp_path / "other-handoff")
    for option in ("state", "handoff"):
        with pytest.raises(UsageError, match=rf"other-{option} holds another run than "
                           rf"{target} \(run id {load(full)[RUN_ID_KEY]} at step 6, .*run id "
                           rf"{mine[RUN_ID_KEY]} at step 4\)\. Nothing was written: .* is "
                           "kept.*move .* away first"):
            restore_newest(target, **{option: tmp_path / f"other-{option}"})
        assert target.read_bytes() == crashed.read_bytes()
    name, tensor = next(iter(mine["state_dict"].items()))
    wider = edited(crashed, tmp_path / "wider.ckpt", global_step=6,
                   state_dict={name: torch.zeros(*tensor.shape[:-1], tensor.shape[-1] + 1)})
    pack_state(wider, tmp_path / "wider-state")
    with pytest.raises(UsageError, match=rf"1 tensor\(s\) of other shapes, e\.g\. {name}"):
        restore_newest(target, tmp_path / "wider-state")
    assert target.read_bytes() == crashed.read_bytes()
    target.unlink()  # a fresh machine: the newest folder given must be the other one's run
    write_handoff(crashed, tmp_path / "crashed-handoff")
    with pytest.raises(UsageError, match=r"other-state holds another run than .*crashed-handoff"
                       r" \(run id .*Nothing was written"):
        restore_newest(target, tmp_path / "other-state", tmp_path / "crashed-handoff")
    assert not target.exists()
    target.write_bytes(crashed.read_bytes())
    pack_state(edited(crashed, tmp_path / "newer.ckpt", global_step=6), tmp_path / "newer")
    assert restore_newest(target, tmp_path / "newer") == ("state", 6)
    assert load(target)["global_step"] == 6


def test_restore_refuses_a_given_folder_that_is_absent_a_file_or_not_written_by_pack(
        runs, tmp_path):
    target = tmp_path / "run" / "checkpoints" / "last.ckpt"
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    for option, writer in (("state", "pack"), ("handoff", "handoff")):
        with pytest.raises(FileNotFoundError, match=rf"{option} .*no-such does not exist; give "
                           rf"the folder written by lab\.scripts\.chunk_state {writer}"):
            restore_newest(target, **{option: tmp_path / "no-such"})
        with pytest.raises(UsageError, match=rf"{option} .*notes.txt is a file, not a folder"):
            restore_newest(target, **{option: tmp_path / "notes.txt"})
        with pytest.raises(FileNotFoundError, match=r"no .*\.json in .*empty: not a folder "
                           rf"written by lab\.scripts\.chunk_state {writer}"):
            restore_newest(target, **{option: tmp_path / "empty"})
    assert not target.exists()


def test_a_damaged_index_or_handoff_record_is_named(runs, tmp_path):
    crashed = runs / "crashed" / "checkpoints" / "last.ckpt"
    pack_state(crashed, tmp_path / "state", max_shard_size=128 * 1024, max_files=64)
    write_handoff(crashed, tmp_path / "handoff")
    index = json.loads((tmp_path / "state" / INDEX).read_text())
    for key in ("shards", "sha256"):
        damaged = {k: v for k, v in index.items() if k != key}
        (tmp_path / "state" / INDEX).write_text(json.dumps(damaged))
        with pytest.raises(UsageError, match=r"index\.json lacks entries .*pack writes"):
            unpack_state(tmp_path / "state", tmp_path / "last.ckpt")
    (tmp_path / "state" / INDEX).write_text(json.dumps({**index, "sha256": "0" * 64}))
    with pytest.raises(UsageError, match=r"the shards in .*state make [\d,]+ bytes with another "
                       r"SHA-256 than the [\d,]+ bytes of last\.ckpt that index\.json records"):
        unpack_state(tmp_path / "state", tmp_path / "last.ckpt")
    weights = tmp_path / "handoff" / WEIGHTS
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-1] + bytes([intact[-1] ^ 1]))  # one bit flipped in transit
    with pytest.raises(UsageError, match=r"weights\.safetensors is damaged: [\d,]+ bytes with "
                       r"another SHA-256 than the [\d,]+ bytes handoff\.json records"):
        handoff_checkpoint(tmp_path / "handoff", tmp_path / "last.ckpt")
    weights.write_bytes(intact)
    record = json.loads((tmp_path / "handoff" / HANDOFF).read_text())
    del record["dtypes"]
    (tmp_path / "handoff" / HANDOFF).write_text(json.dumps(record))
    with pytest.raises(UsageError, match=r"handoff\.json lacks entries .*handoff writes"):
        restore_newest(tmp_path / "last.ckpt", handoff=tmp_path / "handoff")
    assert not (tmp_path / "last.ckpt").exists()


def test_chunk_state_reports_a_full_disk_or_a_read_only_file_system_in_two_lines(
        runs, tmp_path, monkeypatch, capsys):
    """The script ends as the ``longnet`` command does: the message naming the file and the
    fix, a line naming --verbose, exit status 2 (no traceback, no second error from removing
    the temporary file)."""
    script = load_script("chunk_state")
    crashed = runs / "crashed" / "checkpoints" / "last.ckpt"
    pack_state(crashed, tmp_path / "state")

    def no_room(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_bytes", no_room)
        assert script.run_cli(lambda: script.main(["pack", str(crashed),
                                                   str(tmp_path / "new")])) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: a write to {tmp_path / 'new'} failed: No space left on device (errno "
        f"{errno.ENOSPC}). Free space on the disk, then run the command again.",
        "(run again with --verbose to see the traceback)"]

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    target = tmp_path / "run" / "last.ckpt"
    with monkeypatch.context() as patch:
        patch.setattr(files, "open", read_only, raising=False)
        patch.setattr(Path, "unlink", read_only)
        assert script.run_cli(lambda: script.main(["restore", str(target), "--state",
                                                   str(tmp_path / "state")])) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: a write to {target} failed: Read-only file system (errno {errno.EROFS}). "
        "Give a path on a writable file system, then run the command again.",
        "(run again with --verbose to see the traceback)"]


@pytest.mark.parametrize("argv", [["restore", "last.ckpt", "--state", ""],
                                  ["unpack", "state", ""], ["pack", "", "state"]])
def test_chunk_state_refuses_an_empty_path(argv, capsys):
    """An empty path is the current folder: refused when parsed, naming the argument."""
    with pytest.raises(SystemExit) as exit_info:
        load_script("chunk_state").main(argv)
    assert exit_info.value.code == 2
    assert "expected a path, got ''" in capsys.readouterr().err


def test_the_chunk_script_refuses_a_state_folder_set_but_absent_or_another_runs(runs, tmp_path):
    """``$WHEELS`` or ``$STATE`` set to a folder that does not exist, or a leftover state of
    another run in the default ``$STATE`` folder, stops the chunk before training (exit 2), the
    run's checkpoint kept."""
    crashed = runs / "crashed" / "checkpoints" / "last.ckpt"
    name = f"chunk-probe-{tmp_path.name}"
    config = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    config["trainer"]["logger"]["init_args"] = {"save_dir": str(tmp_path / "runs"), "name": name}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))

    def chunk(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(REPO / "lab" / "gpu" / "train_chunk.sh"), str(tmp_path / "c.yaml"),
             "--trainer.max_steps=0"], capture_output=True, text=True, timeout=300,
            env={**os.environ, "OUT": str(tmp_path / "out"), **env})

    done = chunk(WHEELS=str(tmp_path / "no-wheels"))
    assert done.returncode == 2 and "WHEELS=" in done.stderr and "is not a folder" in done.stderr
    done = chunk(STATE=str(tmp_path / "typo"))
    assert done.returncode == 2 and "typo does not exist" in done.stdout, done.stdout
    assert "fit exited" not in done.stdout
    target = tmp_path / "runs" / name / "checkpoints" / "last.ckpt"
    target.parent.mkdir(parents=True)
    target.write_bytes(crashed.read_bytes())
    leftover = REPO / "runs" / f"{name}-state"
    pack_state(runs / "full" / "checkpoints" / "last.ckpt", leftover)
    try:
        done = chunk()
    finally:
        shutil.rmtree(leftover)
    assert done.returncode == 2 and "holds another run than" in done.stdout, done.stdout
    assert target.read_bytes() == crashed.read_bytes()


@pytest.fixture(scope="module")
def gpu_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-cache")


@pytest.mark.parametrize("name", ["longnet_tiny_64k", "longnet_tiny_64k_dense"])
def test_the_gpu_chunk_configs_run_on_the_cpu(name, tmp_path, gpu_cache):
    """Each GPU config as the chunk script runs it, at 1/128 of its lengths on the CPU
    (``tiny_gpu_config``): 3 steps, one per stage, on the standard library's packages."""
    data = yaml.safe_load((REPO / "lab" / "configs" / "gpu" / f"{name}.yaml").read_text())["data"]
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
