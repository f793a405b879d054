"""``StepProfiler``: the steps of its window, and only those, profiled and reported; a fit that
ends inside the window reports what it recorded, one that ends before it nothing; bad
arguments refused; a profiler that fails to start or to report is a warning, not the end of
the training."""

from __future__ import annotations

import re
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.autograd import DeviceType
from torch.utils.data import DataLoader

from lab.profiling import StepProfiler, step_report


class MarksSteps(L.LightningModule):
    """Each training step runs under a profiler label naming its global step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        with torch.profiler.record_function(f"marked-step-{self.global_step}"):
            return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(torch.randn(64, 4), batch_size=2)


def fit(root, max_steps: int, profiler: StepProfiler) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root,
                        callbacks=[profiler])
    trainer.fit(MarksSteps())


def profiled_steps(report: str) -> set[int]:
    return {int(step) for step in re.findall(r"marked-step-(\d+)", report)}


def test_the_window_holds_exactly_its_steps(tmp_path):
    fit(tmp_path, 8, StepProfiler(start=2, steps=3, row_limit=100))
    report = (tmp_path / "profile.txt").read_text()
    assert report.startswith("Profile of training steps 2-4 (3 steps) on cpu")
    assert profiled_steps(report) == {2, 3, 4}
    wall = float(re.search(r"wall time per step: +([0-9.]+) s", report).group(1))
    ops = int(re.search(r"host ATen ops per step: +([0-9,]+)", report).group(1).replace(",", ""))
    assert wall > 0 and ops > 0
    assert "device kernel time" not in report  # no device on the CPU: not reported as zero
    assert "device memory" not in report


class PackedBatches(MarksSteps):
    """Batches of packed documents: step ``i``'s batch has rows of ``i % 3 + 1`` and one
    documents."""

    def training_step(self, batch, batch_idx):
        return self.layer(batch["input_ids"].float()).square().mean()

    def train_dataloader(self):
        batches = []
        for i in range(16):
            first = torch.arange(6) * (i % 3 + 1) // 6  # i % 3 + 1 runs of equal ids
            ids = torch.stack([first, torch.full((6,), 7)])
            batches.append({"input_ids": torch.zeros(2, 6, 4), "document_ids": ids})
        return DataLoader(batches, batch_size=None)


def test_the_report_names_the_batches_of_its_steps(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[StepProfiler(start=2, steps=3)])
    trainer.fit(PackedBatches())
    report = (tmp_path / "profile.txt").read_text()
    lines = [line for line in report.splitlines() if line.startswith("batch of step")]
    assert lines == [
        "batch of step 2:               2 x 6 x 4, documents per row [3, 1]",
        "batch of step 3:               2 x 6 x 4, documents per row [1, 1]",
        "batch of step 4:               2 x 6 x 4, documents per row [2, 1]",
    ]


class Events(list):
    """Stand-ins for ``key_averages()`` of a GPU step: rows and their tables."""

    def table(self, sort_by: str, row_limit: int) -> str:
        rows = sorted(self, key=lambda e: -getattr(e, sort_by))[:row_limit]
        return "\n".join(f"{e.key} {getattr(e, sort_by)}" for e in rows)


def event(key, device_type, count, self_cpu=0.0, self_device=0.0):
    return SimpleNamespace(key=key, device_type=device_type, count=count,
                           self_cpu_time_total=self_cpu, self_device_time_total=self_device)


def test_the_report_sums_the_device_kernels_of_a_step():
    events = Events([
        event("aten::mm", DeviceType.CPU, 40, self_cpu=900.0, self_device=0.0),
        event("aten::add", DeviceType.CPU, 20, self_cpu=300.0),
        event("cudaLaunchKernel", DeviceType.CPU, 40, self_cpu=400.0),
        event("sm90_xmma_gemm", DeviceType.CUDA, 10, self_device=300_000.0),
        event("elementwise_kernel", DeviceType.CUDA, 30, self_device=100_000.0),
    ])
    report = step_report(events, steps=2, seconds=1.0, first_step=40, device="NVIDIA H200",
                         row_limit=2, memory=(int(41.5 * 2**30), int(139.8 * 2**30)))
    assert report.startswith("Profile of training steps 40-41 (2 steps) on NVIDIA H200")
    assert "device memory peak:            41.5 GiB of 139.8 GiB (30 %;" in report
    assert "wall time per step:            0.5000 s" in report
    assert "device kernel time per step:   0.2000 s (40.0 % of the wall time" in report
    assert "device kernels per step:       20\n" in report
    assert "host ATen ops per step:        30 (nested ones included)" in report
    device_table = report.split("By device time (self):\n")[1].split("\n\n")[0]
    assert device_table.splitlines() == ["sm90_xmma_gemm 300000.0", "elementwise_kernel 100000.0"]


def test_a_fit_ending_inside_the_window_reports_the_steps_it_ran(tmp_path):
    fit(tmp_path, 3, StepProfiler(start=1, steps=5, row_limit=100))
    report = (tmp_path / "profile.txt").read_text()
    assert report.startswith("Profile of training steps 1-2 (2 steps)")
    assert profiled_steps(report) == {1, 2}


def test_a_fit_ending_before_the_window_writes_nothing(tmp_path, caplog):
    with caplog.at_level("INFO"):
        fit(tmp_path, 2, StepProfiler(start=5, steps=2))
    assert not (tmp_path / "profile.txt").exists()
    assert "before the profile's first step (5); nothing was profiled" in caplog.text


def test_a_failed_report_warns_and_the_training_goes_on(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no events")
    monkeypatch.setattr("lab.profiling.step_report", broken)
    with pytest.warns(UserWarning, match="no profile written .RuntimeError: no events"):
        fit(tmp_path, 4, StepProfiler(start=1, steps=1))
    assert not (tmp_path / "profile.txt").exists()


def test_a_profiler_that_does_not_start_warns_and_the_training_goes_on(tmp_path, monkeypatch):
    class Refuses:
        def __init__(self, **kwargs):
            raise RuntimeError("CUPTI unavailable")
    monkeypatch.setattr("lab.profiling.profile", Refuses)
    with pytest.warns(UserWarning, match="profiler did not start .RuntimeError: CUPTI"):
        fit(tmp_path, 4, StepProfiler(start=1, steps=1))
    assert not (tmp_path / "profile.txt").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"start": -1}, "start must be a non-negative integer, got -1"),
    ({"start": 1.5}, "start must be a non-negative integer, got 1.5"),
    ({"steps": 0}, "steps"),
    ({"row_limit": 0}, "row_limit"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StepProfiler(**kwargs)
