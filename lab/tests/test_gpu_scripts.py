"""The GPU device-call scripts (``lab/gpu/``) on the CPU: ``chunk.sh`` trains a tiny chunk
of a GPU config and brings back exactly the files the next chunk needs, and a second chunk on a
fresh machine resumes from them (``slow``: the dry run before a GPU session); bad arguments are
refused before any work; ``core.sh`` passes gpu_check.py's refusal through; ``base_parts.sh``
cuts a wheel into parts that fit a call beside the tree and puts them back together there."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.gpu_configs import REPO, tiny_gpu_config

CHUNK, CORE = REPO / "lab" / "gpu" / "chunk.sh", REPO / "lab" / "gpu" / "core.sh"
PARTS = REPO / "lab" / "gpu" / "base_parts.sh"
BROUGHT_BACK = {"weights.safetensors", "handoff.json", "metrics.csv", "chunk.log"}


def run(script: Path, *args: str, cwd: Path, out: Path,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    ((), "give at least one config"),
    (("no/such.yaml",), "no config file no/such.yaml"),
    (("--seconds", "0", "x.yaml"), "--seconds must be a whole number"),
    (("--seconds", "2m", "x.yaml"), "--seconds must be a whole number"),
    (("--bogus",), "unknown option --bogus"),
    (("--train-until", "0", "x.yaml"), "--train-until must be a whole number"),
    (("--train-until", "60", "x.yaml", "x.yaml"), "--train-until takes one config"),
])
def test_chunk_refuses_bad_arguments_before_any_work(args, message, tmp_path):
    (tmp_path / "x.yaml").write_text("{}")  # paths are read from the checkout's root
    args = [str(tmp_path / arg) if arg == "x.yaml" else arg for arg in args]
    done = run(CHUNK, *args, cwd=tmp_path, out=tmp_path / "out")
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # about a minute: run it before a GPU session (docs/long_context_gpu.md)
def test_a_chunk_brings_back_the_handoff_and_the_next_chunk_resumes_from_it(tmp_path):
    """Two chunks of the tiny dilated config on two "machines" (fresh run folders): the first
    brings back its four files, the second starts from that handoff at its step, in its run."""
    config = tiny_gpu_config("longnet_tiny_64k", tmp_path / "cache", steps=2)
    name = config["trainer"]["logger"]["init_args"]["name"]
    handoff = tmp_path / "chunks" / name / "handoff"  # as committed between the two chunks

    def chunk(machine: str, options: list[str], fit_options: list[str],
              env: dict[str, str] | None = None) -> Path:
        config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / machine)
        path = tmp_path / f"{machine}.yaml"
        path.write_text(yaml.safe_dump(config))
        out = tmp_path / f"{machine}-out"
        done = run(CHUNK, *options, str(path), "--", *fit_options, cwd=REPO, out=out, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert {p.name for p in (out / name).iterdir()} == BROUGHT_BACK
        return out / name

    started = time.time()
    first = chunk("machine1", ["--seconds", "3600", "--train-until", "3600"], [])
    resolved = yaml.safe_load((tmp_path / "machine1" / name / "config.yaml").read_text())
    assert resolved["trainer"]["max_time"] == "00:01:00:00"
    (deadline,) = [c["init_args"]["at"] for c in resolved["trainer"]["callbacks"]
                   if c["class_path"] == "longnet.training.TrainingDeadline"]
    assert started + 3600 - 2 <= deadline <= time.time() + 3600
    recorded = json.loads((first / "handoff.json").read_text())["checkpoint"]
    assert recorded["global_step"] == 2
    handoff.mkdir(parents=True)
    for file in ("weights.safetensors", "handoff.json"):
        (handoff / file).write_bytes((first / file).read_bytes())

    second = chunk("machine2", [], ["--trainer.max_steps", "3"], env={"HANDOFF": str(handoff)})
    log = (second / "chunk.log").read_text()
    assert "step 2, made from the compact handoff" in log
    for phase in ("restored in", "fit took", "handoff and state written in"):
        assert re.search(rf"train_chunk.sh: {phase} \d+ s\.", log), phase
    rows = list(csv.DictReader((second / "metrics.csv").open()))
    assert {row["run_id"] for row in rows} == {recorded["longnet_run_id"]}
    assert max(int(row["step"]) for row in rows) == 3


def test_core_passes_gpu_checks_refusal_through(tmp_path):
    done = run(CORE, "--only", "environment", cwd=REPO, out=tmp_path / "out")
    assert done.returncode == 2
    assert "no CUDA device is visible" in done.stderr


def tree_bytes() -> int:
    """What every device call sends: tracked files and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
    paths = [REPO / name.decode() for name in listed.stdout.split(b"\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def test_base_parts_fit_a_call_beside_the_tree_and_join_back_byte_for_byte(tmp_path):
    """A 5 MB "wheel" with 2 MB of room per call beside the tree: three parts, each checked on
    arrival (``keep`` into a folder outside the repository, call by call) and joined into the
    wheels folder with the whole file's SHA-256; a part never kept, or damaged on the way, is
    named and nothing is joined."""
    wheel = tmp_path / "base-1.0-py3-none-any.whl"
    wheel.write_bytes(os.urandom(5_000_000))
    base, keep, wheels = tmp_path / "base", tmp_path / "keep", tmp_path / "wheels"
    env = {"BASE": str(base), "KEEP": str(keep), "WHEELS": str(wheels),
           "CALL_BYTES": str(tree_bytes() + 2**20 + 2_000_000)}
    done = run(PARTS, "split", str(wheel), cwd=REPO, out=tmp_path / "out", env=env)
    assert done.returncode == 0, done.stderr
    parts = sorted(base.glob("part-*"))
    assert [p.name for p in parts] == ["part-1", "part-2", "part-3"]
    assert all(p.stat().st_size <= 2_000_000 for p in parts)
    assert "call 4: carry" in done.stdout
    assert f"join && WHEELS={wheels} bash lab/gpu/chunk.sh" in done.stdout

    arrived = tmp_path / "arrived"  # the repository copy on the machine: one part a call
    for part in parts:
        arrived.mkdir(exist_ok=True)
        for old in arrived.glob("part-*"):
            old.unlink()
        (arrived / part.name).write_bytes(part.read_bytes())
        (arrived / "SHA256SUMS").write_bytes((base / "SHA256SUMS").read_bytes())
        done = run(PARTS, "keep", cwd=REPO, out=tmp_path / "out",
                   env={**env, "BASE": str(arrived)})
        assert done.returncode == 0, done.stderr
    missing = run(PARTS, "join", cwd=REPO, out=tmp_path / "out",
                  env={**env, "BASE": str(arrived), "KEEP": str(tmp_path / "nothing")})
    assert missing.returncode == 1 and "part-1 is neither in" in missing.stderr
    assert not (wheels / wheel.name).exists()
    done = run(PARTS, "join", cwd=REPO, out=tmp_path / "out", env={**env, "BASE": str(arrived)})
    assert done.returncode == 0, done.stderr
    assert (wheels / wheel.name).read_bytes() == wheel.read_bytes()

    damaged = bytearray(parts[1].read_bytes())
    damaged[7] ^= 1
    (arrived / "part-2").write_bytes(damaged)
    done = run(PARTS, "keep", cwd=REPO, out=tmp_path / "out", env={**env, "BASE": str(arrived)})
    assert done.returncode == 1 and "part-2 arrived damaged" in done.stderr
    assert run(PARTS, "bogus", cwd=REPO, out=tmp_path / "out").returncode == 2
