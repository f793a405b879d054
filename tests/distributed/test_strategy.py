"""SequenceParallelStrategy trains exactly like one device: 4 gloo processes as (2 x 2) and
(1 x 4) meshes, three AdamW steps with gradient clipping on sequences padded to fit the
pattern, give the single-process parameters to 1e-6 and the same validation loss; a
checkpoint saved on all ranks resumes to the same parameters."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.launcher import run_workers
from tests.distributed.strategy_cases import (
    STEPS,
    sequence_parallel_runs,
    single_device_run,
)

pytestmark = pytest.mark.distributed

MESHES = ((2, 2), (1, 4))  # (data-parallel, sequence-parallel)


@pytest.fixture(scope="module")
def reference():
    return single_device_run()


def test_meshes_equal_single_device_training(reference, tmp_path):
    sizes = tuple(sp for _, sp in MESHES)
    per_rank = run_workers(sequence_parallel_runs, 4, sizes, str(tmp_path), timeout=600)
    for index, (dp, sp) in enumerate(MESHES):
        runs = [rank_runs[index] for rank_runs in per_rank]
        for rank, run in enumerate(runs):
            where = f"mesh {dp}x{sp}, rank {rank}"
            assert run["mesh"] == (dp, sp), where
            assert run["sp_ranks"] == list(range(rank // sp * sp, rank // sp * sp + sp)), where
            assert run["global_step"] == STEPS, where
            for name, value in reference["params"].items():
                np.testing.assert_allclose(run["params"][name], value, rtol=0, atol=1e-6,
                                           err_msg=f"{where}: {name}")
            assert run["val_tokens"] == reference["val_tokens"], where
            assert run["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-6), where
            assert run["resume_global_step"] == STEPS, where
            assert run["resume_max_diff"] <= 1e-7, where
