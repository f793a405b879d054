"""The GPU device-call scripts (``scripts/gpu/``) on the CPU: ``chunk.sh`` trains a tiny chunk
of a GPU config and brings back exactly the files the next chunk needs, and a second chunk on a
fresh machine resumes from them (``slow``: the dry run before a GPU session); bad arguments are
refused before any work; ``core.sh`` passes gpu_check.py's refusal through."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.gpu_configs import REPO, tiny_gpu_config

CHUNK, CORE = REPO / "scripts" / "gpu" / "chunk.sh", REPO / "scripts" / "gpu" / "core.sh"
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

    first = chunk("machine1", ["--seconds", "3600"], [])
    resolved = yaml.safe_load((tmp_path / "machine1" / name / "config.yaml").read_text())
    assert resolved["trainer"]["max_time"] == "00:01:00:00"
    recorded = json.loads((first / "handoff.json").read_text())["checkpoint"]
    assert recorded["global_step"] == 2
    handoff.mkdir(parents=True)
    for file in ("weights.safetensors", "handoff.json"):
        (handoff / file).write_bytes((first / file).read_bytes())

    second = chunk("machine2", [], ["--trainer.max_steps", "3"], env={"HANDOFF": str(handoff)})
    assert "step 2, made from the compact handoff" in (second / "chunk.log").read_text()
    rows = list(csv.DictReader((second / "metrics.csv").open()))
    assert {row["run_id"] for row in rows} == {recorded["longnet_run_id"]}
    assert max(int(row["step"]) for row in rows) == 3


def test_core_passes_gpu_checks_refusal_through(tmp_path):
    done = run(CORE, "--only", "environment", cwd=REPO, out=tmp_path / "out")
    assert done.returncode == 2
    assert "no CUDA device is visible" in done.stderr
