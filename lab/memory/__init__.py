"""Memory models: what one rank holds for a long-context step, as formulas, before running it.

Models, not run-time code: the library never imports them; ``lab/scripts/plan_context.py``,
``lab/scripts/bench_ring.py`` and the tests do. Each formula is written over the shapes the
implementation allocates, and the geometry (local branches, their block groups and chunks,
segment groups, heads per piece, who computes with whose block) comes from the attention
core's own planner, so a plan cannot drift from the code it models. Sizes are in **bytes per
rank** unless a name says otherwise.

By concern:

- ``setup``: the inputs of an attention plan (:class:`AttentionSetup`: shapes, pattern, ranks,
  transport, block budget) and the notation;
- ``workspace``: the block kernel's own working memory, modelled for ATen's CPU flash
  attention (the only device the attention plans model; on CUDA the kernels' workspaces are
  small and not modelled, and the block budget is set from the free memory at first use);
- ``local`` and ``ring``: the working sets of local branches and of branches spanning ranks
  (messages, receive buffers, dK/dV accumulators; bytes sent and received);
- ``rank``: per-rank totals of a forward + backward (:func:`plan_memory`);
- ``state``: parameters, gradients and AdamW moments under the DDP and FSDP strategies,
  from a model config (any device: it counts bytes of tensors).

How well the attention plans match measured peaks: docs/benchmarks.md (sequence-parallel
ring) and ``lab/scripts/bench_ring.py``, which prints both side by side.

Usage::

    import torch
    from longnet.attention import DilatedPattern
    from lab.memory import AttentionSetup, plan_memory

    setup = AttentionSetup(batch=1, seq_len=32768, world_size=4, num_heads=8, head_dim=64,
                           dtype=torch.float32, pattern=DilatedPattern.geometric(5),
                           causal=True, transport="ring")
    plan = plan_memory(setup)
    plan.peak_bytes            # worst rank: peak bytes above q, k, v and the upstream gradient
    plan.ranks[0].sent_forward_bytes
"""

from lab.memory.rank import MemoryPlan, RankMemory, format_bytes, plan_memory
from lab.memory.setup import AttentionSetup

__all__ = ["AttentionSetup", "MemoryPlan", "RankMemory", "format_bytes", "plan_memory"]
