"""The accelerator benchmark (``lab/bench/device.py``) run on the CPU, where it times with
perf_counter and reports no memory: every system measured on the same inputs, errors checked,
a backend that cannot run the call recorded as a row with its reason."""

from __future__ import annotations

import torch

from lab.bench import device
from longnet.attention import DilatedPattern


def test_device_benchmark_runs_every_system_and_notes_the_ones_that_cannot_run():
    pattern = DilatedPattern((64, 128, 256), (1, 2, 4))
    points = device.measure_length(
        256, pattern, ["ours", "sdpa", "sdpa-cudnn"], batch=1, heads=4, head_dim=16,
        dtype=torch.float32, device=torch.device("cpu"), causal=True, repeats=2,
        check_rows=8, seed=0,
    )
    by_name = {p.system: p for p in points}
    for name in ("ours", "sdpa"):
        point = by_name[name]
        assert len(point.fwd_ms) == len(point.fwd_bwd_ms) == 2 and point.extra_bytes is None
        assert point.max_error is not None and point.max_error < 1e-5, (name, point.max_error)
    assert not by_name["sdpa-cudnn"].fwd_bwd_ms
    assert by_name["sdpa-cudnn"].note.startswith("failed: ")
    rows = device.table_rows(points)
    assert [row[1] for row in rows] == ["ours", "sdpa", "sdpa-cudnn"]
    assert rows[1][5] == "1.000x" and rows[2][-1].startswith("failed: ")
