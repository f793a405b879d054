"""``lab/scripts/gpu_check.py`` without a GPU: it refuses clearly, and every step it would run names
files and options that exist (a typo there would only show on the GPU machine)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check",
                                                  ROOT / "lab" / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "lab.scripts.gpu_check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device is visible" in done.stderr


def test_every_step_names_existing_files_and_options(tmp_path):
    steps = _script().steps(tmp_path)
    assert len(steps) == 8 and sum(limit for _, _, limit in steps) <= 9 * 60
    for name, command, _ in steps:
        for word in command:
            if word.endswith((".py", ".yaml")) and not word.startswith(str(tmp_path)):
                assert (ROOT / word).exists(), (name, word)


def test_benchmark_steps_parse(tmp_path, monkeypatch):
    """The benchmark steps' arguments are accepted by the scripts' own parsers."""
    monkeypatch.syspath_prepend(str(ROOT / "lab" / "scripts"))
    import bench_attention
    import bench_training

    longest = 0
    for _, command, _ in _script().steps(tmp_path):
        if len(command) > 1 and command[1:3] == ["-m", "lab.scripts.bench_attention"]:
            args = bench_attention.parse_args(command[3:])
            assert args.device == "cuda" and "ours" in args.systems
            longest = max(longest, *args.lengths)
        if len(command) > 1 and command[1:3] == ["-m", "lab.scripts.bench_training"]:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            args = bench_training.parse_args(command[3:])
            assert args.device == "cuda" and args.precision == "bf16"
    assert longest == 2**20


def test_gpu_systems_are_refused_on_the_cpu(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "lab" / "scripts"))
    import bench_attention

    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--systems", "sdpa-flash"])
    assert "not run with --device cpu" in capsys.readouterr().err
