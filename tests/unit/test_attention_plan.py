"""The attention plan's parts on their own: strided gathers and scatters, the kernel registry,
the block budget, and what the CUDA kernels are handed (checked on the CPU)."""

from __future__ import annotations

import pytest
import torch

from longnet.attention import dilated, dilated_attention, kernels, op
from longnet.attention.blocks import branch_groups, gather, region_groups, scatter_
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan import (
    CPU_BLOCK_ELEMENTS,
    CUDA_WORKING_TENSORS,
    default_block_elements,
    plan_attention,
)
from tests.kernel_calls import count_kernel_calls


def _selected(x: torch.Tensor, group) -> torch.Tensor:
    """``gather`` written with explicit loops: ``(batch * segments, heads, rows, dim)``."""
    batch = x.shape[0]
    blocks = torch.empty(batch * group.num_segments, len(group.heads), group.rows, x.shape[3],
                         dtype=x.dtype)
    for b in range(batch):
        for s in range(group.num_segments):
            base = group.start + s * group.segment_length
            for i, (head, offset) in enumerate(zip(group.heads, group.offsets)):
                rows = [base + offset + j * group.rate for j in range(group.rows)]
                blocks[b * group.num_segments + s, i] = x[b, rows, head]
    return blocks


GEOMETRIES = [  # (seq_len, heads, segment, rate, shift)
    (64, 8, 16, 4, 0), (64, 8, 16, 2, 0), (64, 16, 64, 16, 0), (60, 7, 12, 3, 0),
    (45, 5, 10, 3, 0), (30, 3, 30, 8, 0), (24, 8, 24, 4, 1), (24, 6, 24, 5, 3),
    (33, 4, 11, 1, 0), (40, 12, 40, 9, 7),
]


@pytest.mark.parametrize("seq_len,heads,segment,rate,shift", GEOMETRIES)
@pytest.mark.parametrize("batch", [1, 2])
def test_gather_and_scatter_match_explicit_selection(seq_len, heads, segment, rate, shift, batch):
    gen = torch.Generator().manual_seed(seq_len * heads + rate)
    x = torch.randn(batch, seq_len, heads, 3, generator=gen, dtype=torch.float64)
    if shift:
        groups = region_groups(0, seq_len, 1, heads, rate, shift=shift)
    else:
        groups = branch_groups(seq_len, heads, segment, rate)
    covered = torch.zeros(batch, seq_len, heads, 3, dtype=torch.float64)
    for group in groups:
        expected = _selected(x, group)
        assert torch.equal(gather(x, group), expected)
        written = torch.zeros_like(x)
        scatter_(written, group, expected)
        assert torch.equal(_selected(written, group), expected)
        scatter_(covered, group, torch.ones_like(expected), accumulate=True)
    rows = torch.arange(seq_len)
    in_segment = rows + shift if shift else rows % segment
    # every head selects the rows of its offset, each exactly once
    selected = in_segment[:, None] % rate == torch.arange(heads)[None, :] % rate
    assert torch.equal(covered, selected[None, :, :, None].double().expand_as(covered))


@pytest.mark.parametrize(
    "heads,rate",
    [(h, r) for h in (4, 8, 12, 16) for r in (1, 2, 4, 8, 16) if r >= h or h % r == 0],
)
def test_usual_branches_move_as_one_strided_copy(heads, rate):
    """A branch whose rate divides its segment and whose heads divide by the rate (or are
    fewer than it) is one group moved by one strided view: one copy per gather, whatever the
    sequence length."""
    for seq_len in (2048, 65536):
        groups = branch_groups(seq_len, heads, 2048, rate)
        assert len(groups) == 1 and len(groups[0].lattices) == 1


def test_kernel_registry_picks_per_device_and_dtype():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert kernels.select_kernel(cpu, torch.float32, 64).name == "cpu-flash"
    assert kernels.select_kernel(cpu, torch.float64, 64).name == "cpu-flash"
    assert kernels.select_kernel(meta, torch.bfloat16, 64).name == "math"
    assert kernels.select_kernel(cpu, torch.float32, 64, "math").name == "math"
    with pytest.raises(ValueError, match="'cuda-flash' cannot run this call: it runs on cuda"):
        kernels.select_kernel(cpu, torch.bfloat16, 64, "cuda-flash")
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        kernels.select_kernel(cpu, torch.float32, 64, "flash3")
    flash = next(k for k in kernels.KERNELS if k.name == "cuda-flash")
    assert "head_dim a multiple of 8" in flash.unsupported(torch.device("cuda"), torch.half, 36)
    assert "head_dim <= 256" in flash.unsupported(torch.device("cuda"), torch.half, 512)
    assert "float32" in flash.unsupported(torch.device("cuda"), torch.float32, 64)
    # the memory-efficient kernel loads rows 16 bytes at a time too (seen on an H100: a head of
    # 36 in bf16 failed "query is not correctly aligned"); float32 rows need a multiple of 4
    efficient = next(k for k in kernels.KERNELS if k.name == "cuda-efficient")
    assert "multiple of 8" in efficient.unsupported(torch.device("cuda"), torch.bfloat16, 36)
    assert "multiple of 4" in efficient.unsupported(torch.device("cuda"), torch.float32, 6)


@pytest.mark.parametrize("kernel", ["math", "cpu-flash"])
def test_named_kernels_give_the_same_result(kernel):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    branches = [(8, 1), (20, 2), (40, 4)]
    auto = dilated_attention(q, k, v, branches, causal=True)
    named = dilated_attention(q, k, v, branches, causal=True, kernel=kernel)
    torch.testing.assert_close(named, auto, atol=1e-12, rtol=0)


def test_block_budget_defaults_to_the_cpu_value_and_bounds_every_chunk():
    assert default_block_elements(torch.device("cpu")) == CPU_BLOCK_ELEMENTS
    shape = (2, 4096, 8, 64)
    pattern = DilatedPattern((512, 1024, 4096), (1, 2, 4))
    for budget in (1000, 70_000, CPU_BLOCK_ELEMENTS):
        plan = plan_attention(pattern, shape, torch.float32, torch.device("cpu"), causal=True,
                              scale=0.125, block_elements=budget)
        sizes = [2 * c.num_segments * len(c.heads) * c.rows * 64 for _, c in plan.chunks]
        # a chunk is one segment of one head at least, else at most the budget
        assert all(s <= max(budget, 2 * 4096 * 64) for s in sizes)
        assert plan.adopted is not None and plan.kernel.name == "cpu-flash"


def _count_kernel_calls(monkeypatch, seq_len: int) -> int:
    calls = count_kernel_calls(monkeypatch)
    q, k, v = (torch.randn(1, seq_len, 8, 16, requires_grad=True) for _ in range(3))
    pattern = DilatedPattern.geometric(3, base_segment=512)
    dilated_attention(q, k, v, pattern, causal=True, block_elements=2**30).sum().backward()
    return len(calls)


def test_kernel_calls_do_not_grow_with_the_sequence(monkeypatch):
    """With a budget that holds a branch, each branch is one kernel call each way."""
    short, long = (_count_kernel_calls(monkeypatch, n) for n in (2048, 32768))
    assert short == long == 2 * 3


def test_block_elements_is_checked():
    q = torch.randn(1, 8, 2, 4)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="block_elements must be a positive integer"):
            dilated_attention(q, q, q, [(8, 1)], block_elements=bad)
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        dilated_attention(q, q, q, [(8, 1)], kernel="triton")


def test_efficient_backward_gets_out_with_the_row_stride_it_assumes(monkeypatch):
    """The memory-efficient CUDA backward reads ``out`` with row stride ``heads * dim``
    whatever its strides: a head-major ``out`` (what a gather's copy or a chunk of a few heads
    of a view gives) must be re-laid before the call, or bf16/fp16 gradients come out wrong."""
    seen = {}

    def fake_backward(d_out, q, k, v, bias, out, lse, seed, offset, dropout, mask, causal,
                      scale=None):
        seen["row_stride"] = out.transpose(1, 2).stride(1)
        seen["lse_length"] = lse.shape[-1]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward",
                        fake_backward)
    batch, heads, length, dim = 2, 3, 40, 8
    q = torch.randn(batch, heads, length, dim)  # head-major: row stride dim, not heads * dim
    out = torch.randn(batch, heads, length, dim)
    lse = torch.randn(batch, heads, length)
    kernels.cuda_efficient_backward(kernels.BlockBackward(q, q, q, q, out, lse), False, 0.3)
    assert seen == {"row_stride": heads * dim, "lse_length": 64}


def test_a_signature_is_planned_once(monkeypatch):
    """Two calls with one signature run the same plan object; another shape gets its own."""
    plans = []

    def recording(*args, **kwargs):
        plans.append(plan_attention(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(op, "plan_attention", recording)
    pattern = DilatedPattern((8, 16), (1, 2))
    for seq_len in (32, 32, 48):
        q, k, v = (torch.randn(2, seq_len, 4, 8) for _ in range(3))
        dilated_attention(q, k, v, pattern, causal=True)
    assert plans[0] is plans[1] and plans[2] is not plans[0]


def test_the_cuda_block_budget_is_read_once_per_device(monkeypatch):
    """The budget decides the chunking, and so the merge order: it is fixed at first use, not
    read from the free memory on every call."""
    free = [2**34]
    reads = []

    def mem_get_info(device):
        reads.append(device)
        return free[0], 2**35

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    default_block_elements.cache_clear()
    try:
        device = torch.device("cuda", 0)
        first = default_block_elements(device)
        free[0] //= 4
        assert default_block_elements(device) == first == 2**34 // (CUDA_WORKING_TENSORS * 4)
        assert len(reads) == 1
    finally:
        default_block_elements.cache_clear()


def test_ranks_agree_on_a_signature_once_per_group(monkeypatch):
    """``agree_on_call`` all-reduces (and waits for the host) the first time a group meets a
    signature only."""
    calls = []

    def all_agree(signature, block_elements, group, device):
        calls.append((signature, group))
        return block_elements - 1

    class Group:  # any weak-referenceable key stands in for a ProcessGroup here
        pass

    monkeypatch.setattr(dilated, "_all_agree", all_agree)
    one, two = Group(), Group()
    cpu = torch.device("cpu")
    assert [dilated.agree_on_call("a", 10, one, cpu) for _ in range(3)] == [9, 9, 9]
    dilated.agree_on_call("b", 10, one, cpu)
    dilated.agree_on_call("a", 10, two, cpu)
    assert calls == [("a", one), ("b", one), ("a", two)]
