"""``longnet.denormals``: subnormal floats flushed to zero inside the block and kept
after it, the opt-out through the environment, and the ``longnet`` command flushing while it
runs."""

from __future__ import annotations

import pytest
import torch

import longnet.cli.entry
from longnet.denormals import KEEP_DENORMALS_ENV, denormals_kept, flushing_denormals

SUBNORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


def survives(value: float = SUBNORMAL) -> bool:
    """Whether a float32 subnormal survives a multiplication on this thread."""
    return (torch.tensor([value], dtype=torch.float32) * 1.0).item() != 0.0


def test_subnormals_are_flushed_inside_the_block_and_kept_after():
    assert survives()
    with flushing_denormals() as flushing:
        if not flushing:
            pytest.skip("this CPU cannot flush subnormal floats")
        assert not survives()
        assert survives(1e-37)  # normal numbers are untouched
    assert survives()


def test_disabled_keeps_subnormals():
    with flushing_denormals(enabled=False) as flushing:
        assert flushing is False
        assert survives()


@pytest.mark.parametrize("value, kept", [("1", True), ("true", True), ("0", False), ("", False)])
def test_the_environment_keeps_subnormals(monkeypatch, value, kept):
    monkeypatch.setenv(KEEP_DENORMALS_ENV, value)
    assert denormals_kept() is kept


@pytest.mark.parametrize("keep", ["", "1"])
def test_the_command_runs_with_subnormals_flushed_unless_kept(monkeypatch, keep):
    seen = []
    monkeypatch.setattr(longnet.cli.entry, "run_cli", lambda args: seen.append(survives()))
    monkeypatch.setenv(KEEP_DENORMALS_ENV, keep)
    assert longnet.cli.main(["fit"]) == 0
    flushable = torch.set_flush_denormal(False)  # whether this CPU can; False is the default
    assert seen == [bool(keep) or not flushable]
    assert survives()
