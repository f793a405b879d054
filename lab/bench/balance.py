"""Per-rank busy and idle time of a sequence-parallel training step, contiguous against zigzag
shards (``lab/scripts/bench_load_balance.py``).

Every rank of a fresh gloo group builds the same randomly initialised zoo model, cuts the same
random byte sequence into its shard (``shard_batch`` with the layout) and runs training steps:
forward over the group, summed cross-entropy divided by the sequence's scored tokens, backward,
then one all-reduce of every gradient (the reduction DDP does across a sequence-parallel
group; no optimizer update, which costs every rank the same). Each timed step starts after a
barrier and ends after one: its wall time is the slowest rank's. A rank's busy time is the CPU
time its process spent in the step (``time.process_time``, one compute thread); the rest of
the wall time it waited for its peers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longnet.attention import DilatedPattern
from longnet.denormals import denormals_kept
from longnet.distributed.sequence_parallel import SequenceParallel, parallelize
from longnet.modeling import LongNetLM
from longnet.modeling.zoo import ZOO
from longnet.training.parallel.batches import shard_batch


@dataclass
class RankSteps:
    """One rank's timed steps (seconds)."""

    rank: int
    busy: list[float]
    wall: list[float]

    @property
    def busy_median(self) -> float:
        return statistics.median(self.busy)

    @property
    def idle_share(self) -> float:
        """Median share of the step this rank waited: ``1 - busy / wall``."""
        return statistics.median(1 - b / w for b, w in zip(self.busy, self.wall))


def step_worker(
    rank: int, world_size: int, device: torch.device, model_name: str, seq_len: int,
    layout: str, steps: int, seed: int,
) -> RankSteps:
    """One rank: a warm-up step, then ``steps`` timed steps (see the module docstring)."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(not denormals_kept())
    config = ZOO[model_name].config
    torch.manual_seed(seed)
    model = LongNetLM(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (1, seq_len + 1),
                           generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    pattern = DilatedPattern(config.segment_lengths, config.dilation_rates)
    shard = {key: value.to(device) for key, value in
             shard_batch(batch, rank, world_size, pattern=pattern, layout=layout).items()}
    parallelize(model, SequenceParallel(dist.group.WORLD, layout))

    def step() -> None:
        out = model(shard["input_ids"], targets=shard["labels"],
                    position_ids=shard["position_ids"])
        (out.loss_sum / seq_len).backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
        model.zero_grad(set_to_none=True)

    step()
    busy, wall = [], []
    for _ in range(steps):
        dist.barrier()
        started, cpu = time.perf_counter(), time.process_time()
        step()
        busy.append(time.process_time() - cpu)
        dist.barrier()
        wall.append(time.perf_counter() - started)
    return RankSteps(rank, busy, wall)
