"""The inputs of an attention memory plan: one ``dilated_attention`` call on a group of ranks.

Notation (per rank): ``L = N / P`` shard length, ``E = batch * L * heads * head_dim`` elements of
one shard tensor, ``s`` the input element size, ``a`` the accumulator element size (4 for
fp32/bf16/fp16 inputs, 8 for fp64). All sizes are in **bytes** per rank unless a name says
otherwise; "elements" are tensor elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longnet.attention.blocks import BlockGroup
from longnet.attention.dilated import transports_per_branch
from longnet.attention.kernels import accumulation_dtype, select_kernel
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan import CPU_BLOCK_ELEMENTS, adopted_branch
from longnet.attention.plan.spanning import padded_length, plan_sequence_parallel

MODELLED_DEVICE = torch.device("cpu")
"""The device whose kernels the plans model (ATen's CPU flash attention, a fused kernel)."""
MERGE_TEMPORARIES = 3
"""lse-sized temporaries alive at once in ``longnet.attention.kernels.lse_merge_``."""

@dataclass(frozen=True)
class AttentionSetup:
    """One ``dilated_attention`` call on a sequence-parallel group.

    ``seq_len`` is the total length ``N`` the group runs (a multiple of ``world_size`` that fits
    the pattern: see ``padded_length``); ``transport`` is one name or one per branch;
    ``threads`` is the intra-op thread count (the CPU kernel keeps one workspace per thread);
    ``block_elements`` the block budget of the call (``dilated_attention(block_elements=...)``;
    the CPU's default).
    Invalid setups raise the library's own errors (the planner's, for the pattern).
    """

    batch: int
    seq_len: int
    world_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    pattern: DilatedPattern
    causal: bool = True
    transport: str | tuple[str, ...] = "ring"
    threads: int = 1
    block_elements: int = CPU_BLOCK_ELEMENTS
    local_branches: list[list[BlockGroup]] = field(init=False, repr=False, compare=False)
    """The block groups of every local branch (``w <= L``), as the planner builds them (the
    same on every rank)."""
    adopted: BlockGroup | None = field(init=False, repr=False, compare=False)
    """``plan.adopted_branch`` of the local branches: the first one when ``attend_local`` runs
    it as one kernel call whose outputs become the accumulators."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", DilatedPattern.coerce(self.pattern))
        names = ("batch", "seq_len", "world_size", "num_heads", "head_dim", "threads",
                 "block_elements")
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"AttentionSetup: {name} must be a positive integer, got {value!r}."
                )
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(
                f"AttentionSetup: dtype must be a floating torch.dtype, got {self.dtype!r}."
            )
        transports = self.transports
        if self.seq_len % self.world_size:
            fit = padded_length(self.seq_len, self.pattern, self.world_size)
            raise ValueError(
                f"dilated_attention: a sequence of {self.seq_len} tokens cannot be split into "
                f"{self.world_size} equal shards. Pad it to longnet.attention.padded_length("
                f"{self.seq_len}, pattern, {self.world_size}) = {fit} tokens."
            )
        local, _ = plan_sequence_parallel(
            self.pattern,
            self.shard_len,
            self.world_size,
            0,
            self.num_heads,
            transports,
            self.row_elements,
            self.block_elements,
        )
        object.__setattr__(self, "local_branches", local)
        kernel = select_kernel(MODELLED_DEVICE, self.dtype, self.head_dim)
        adopted = adopted_branch(local, self.shard_len, self.num_heads, self.dtype, kernel)
        object.__setattr__(self, "adopted", adopted)

    @property
    def transports(self) -> tuple[str, ...]:
        """One transport name per branch."""
        return transports_per_branch(self.transport, len(self.pattern.branches))

    @property
    def shard_len(self) -> int:
        """``L = N / P`` tokens per rank."""
        return self.seq_len // self.world_size

    @property
    def row_elements(self) -> int:
        """``batch * head_dim``: elements per row and head of a block."""
        return self.batch * self.head_dim

    @property
    def input_size(self) -> int:
        """``s``: bytes per input element."""
        return self.dtype.itemsize

    @property
    def acc_size(self) -> int:
        """``a``: bytes per accumulator element (``out``/``lse``/gradient accumulators)."""
        return accumulation_dtype(self.dtype).itemsize

    @property
    def shard_elements(self) -> int:
        """``E = batch * L * heads * head_dim``: elements of one shard tensor."""
        return self.batch * self.shard_len * self.num_heads * self.head_dim

    @property
    def lse_elements(self) -> int:
        """``batch * L * heads``: elements of one shard's lse."""
        return self.batch * self.shard_len * self.num_heads


