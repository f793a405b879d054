"""Worker bodies for the sequence-parallel tests: every rank builds the same global float64
inputs, runs its shard through the ring and compares out, lse, dq, dk, dv with the
single-device result and with the independent dense reference; an attention layer with a K/V
convolution (whose rows cross shard boundaries) is compared with the single-device layer. Some
cases run again with every message tagged 0 (``tags_forced_to_zero``), as NCCL sees them."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
import torch.distributed as dist

from longnet.attention import Retrieval, dilated_attention
from longnet.attention.plan import CPU_BLOCK_ELEMENTS
from longnet.distributed.layouts import shard_positions
from longnet.distributed.sequence_parallel import SequenceParallel, parallelize
from longnet.nn import MultiheadDilatedAttention, RotaryEmbedding
from tests.reference import dense_dilated_attention, document_ids_of, per_document_reference

TOL = 1e-10


def ring_cases(world_size: int) -> list[dict]:
    """Cases for a world size: shard length ``L``, branches local / spanning part of the ring /
    spanning the whole ring, rates not dividing ``L`` (offsets drifting across ranks), a last
    segment spanning fewer ranks, no r = 1 branch, an r = 1 branch spanning ranks, batch > 1,
    both transports, both directions, then ``random_ring_cases``.
    Fixed causal cases run with a tiny ``block_elements``: ring branches then travel as
    pieces of one head each and local branches run in many chunks. Half of the cases also send
    a random upstream gradient into ``lse`` (the math-kernel backward); the other half do not
    (the fused-kernel backward)."""
    L = 12
    n = L * world_size
    patterns = {
        "local+whole": [(6, 1), (n, 2)],
        "drift": [(L, 5), (2 * L, 4), (4 * L, 9)],
        "no_unit_rate": [(L, 2), (3 * L, 3)],
        "beyond_seq": [(4, 1), (L, 3), (8 * n, 7)],
        "unit_rate_span": [(L // 2, 2), (2 * L, 1)],
    }
    fixed = [
        dict(
            name=f"{name}-{transport}-{'causal' if causal else 'bidir'}",
            seq_len=n,
            branches=b,
            causal=causal,
            transport=transport,
            block_elements=64 if causal else CPU_BLOCK_ELEMENTS,
            lse_grad=(index + by_ring + causal) % 2 == 0,
        )
        for index, (name, b) in enumerate(patterns.items())
        for by_ring, transport in enumerate(("ring", "allgather"))
        for causal in (True, False)
    ]
    return (fixed + zigzag_cases(world_size) + document_cases(world_size)
            + random_ring_cases(world_size, count=12))


def zigzag_cases(world_size: int) -> list[dict]:
    """The zigzag layout: ``2P`` chunks of ``C`` tokens, rank ``r`` holding chunks ``r`` and
    ``2P - 1 - r``; branches local to a chunk, spanning two chunks (members of one segment
    group on one rank: the middle pair), spanning the whole sequence, drifting offsets and a
    last segment cut short, both directions, tiny budgets, an lse gradient."""
    C = 6
    n = 2 * world_size * C
    patterns = {
        "zigzag-pairs": [(3, 1), (2 * C, 2)],
        "zigzag-whole": [(C, 1), (n, 3)],
        "zigzag-drift": [(C, 5), (2 * C, 4), (4 * C, 7)],
    }
    return [
        dict(name=f"{name}-{'causal' if causal else 'bidir'}", seq_len=n, branches=b,
             causal=causal, transport="ring", block_elements=budget, lse_grad=causal,
             layout="zigzag")
        for name, b in patterns.items()
        for causal, budget in ((True, 20), (False, CPU_BLOCK_ELEMENTS))
    ]


def document_cases(world_size: int) -> list[dict]:
    """Packed documents over contiguous shards of 12 tokens: seeded random document lengths
    (odd ones, documents spanning several ranks, one shorter than a segment, both batch
    elements different), branches local to a document, spanning ranks, longer than any
    document, rates not dividing segments; both transports and directions, tiny budgets."""
    rng = random.Random(100 + world_size)
    n = 12 * world_size
    cases = []
    for index, branches in enumerate(([(5, 1), (16, 3)], [(4, 2), (9, 1), (40, 5)],
                                      [(12, 1), (24, 2)], [(7, 3), (n, 4)])):
        rows = []
        for _ in range(2):
            cuts = sorted(rng.sample(range(1, n), rng.randint(1, max(1, n // 7))))
            rows.append(tuple(b - a for a, b in zip([0, *cuts], [*cuts, n])))
        for causal in (True, False):
            cases.append(dict(
                name=f"documents-{index}-{'causal' if causal else 'bidir'}", seq_len=n,
                branches=branches, causal=causal,
                transport=("ring", "allgather")[(index + causal) % 2],
                block_elements=rng.choice((8, 40, CPU_BLOCK_ELEMENTS)),
                lse_grad=(index + causal) % 2 == 1, documents=rows,
            ))
    return cases


def random_ring_cases(world_size: int, count: int) -> list[dict]:
    """Seeded random cases: shard length 3..16, one to four branches whose segments divide the
    shard or are multiples of it (up to beyond the sequence), rates 1..9, random direction,
    transport, block budget and lse gradient (the same list on every rank)."""
    rng = random.Random(world_size)
    cases = []
    for index in range(count):
        shard = rng.randint(3, 16)
        lengths = {d for d in range(2, shard + 1) if shard % d == 0}
        lengths |= {m * shard for m in range(1, world_size + 2)}
        segments = sorted(rng.sample(sorted(lengths), rng.randint(1, min(4, len(lengths)))))
        branches = [(w, rng.randint(1, min(w, 9))) for w in segments]
        if rng.random() < 0.6:
            branches[0] = (segments[0], 1)
        cases.append(
            dict(
                name=f"random-{index}",
                seq_len=shard * world_size,
                branches=branches,
                causal=rng.random() < 0.5,
                transport=rng.choice(("ring", "allgather")),
                block_elements=rng.choice((1, 40, CPU_BLOCK_ELEMENTS)),
                lse_grad=rng.random() < 0.5,
            )
        )
    return cases


@contextlib.contextmanager
def tags_forced_to_zero() -> Iterator[list[int]]:
    """Every point-to-point message of the block tagged 0, as NCCL treats them (it ignores
    tags): messages must then match by posting order alone. Yields the list of the tags the
    code asked for (so that a test can see the patch took effect)."""
    original = dist.P2POp
    asked: list[int] = []

    class TagZero(original):
        def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
            asked.append(tag)
            super().__init__(op, tensor, peer, group, 0, group_peer)

    dist.P2POp = TagZero
    try:
        yield asked
    finally:
        dist.P2POp = original


def check_ring_cases(rank: int, world_size: int, device: torch.device,
                     tag_free: str = "some") -> list[str]:
    """Run every case; return descriptions of the failures (empty when all match). Then,
    with every tag forced to 0 (:func:`tags_forced_to_zero`), the zigzag cases (two members
    of a segment group on one rank), the cases of packed documents across ranks, and the
    first causal and bidirectional case of each transport (``tag_free="some"``), every case
    again (``"all"``) or none (``"none"``)."""
    failures: list[str] = []
    cases = ring_cases(world_size)
    for seed, case in enumerate(cases):
        collect_failure(failures, f"{case['name']} {case['branches']}", _check_case, rank,
                        world_size, device, case, seed)
    chosen = {"all": list(enumerate(cases)), "none": [],
              "some": [(seed, case) for seed, case in enumerate(cases)
                       if case.get("layout") == "zigzag" or "documents" in case
                       or case["name"].startswith("local+whole")]}[tag_free]
    with tags_forced_to_zero() as asked:
        for seed, case in chosen:
            collect_failure(failures, f"tags forced to 0: {case['name']} {case['branches']}",
                            _check_case, rank, world_size, device, case, seed)
    if chosen and world_size > 1 and not any(asked):
        failures.append("tags forced to 0: no message asked for a tag other than 0")
    for layout in ("contiguous", "zigzag"):
        collect_failure(failures, f"attention layer with a K/V convolution, {layout}",
                        _check_kv_conv_layer, rank, world_size, device, layout)
    return failures


def collect_failure(failures: list[str], label: str, check, *args) -> None:
    """Run ``check(*args)``; an ``AssertionError`` is appended to ``failures`` as ``label:
    message`` (so one rank reports every failing case, not the first)."""
    try:
        check(*args)
    except AssertionError as error:
        failures.append(f"{label}: {error}")


def _check_kv_conv_layer(rank: int, world_size: int, device: torch.device, layout: str) -> None:
    """A ``MultiheadDilatedAttention`` with a K/V convolution (random taps, so the rows before
    each chunk matter) and rotary positions (the default positions of the ``layout``'s shard)
    on this rank's shard equals the single-device layer: output, input gradient and (summed
    over ranks) every parameter gradient."""
    torch.manual_seed(11)
    shard_len = 8
    n = shard_len * world_size
    attn = MultiheadDilatedAttention(
        24, 4, [(4, 1), (8, 2), (32, 4)], num_kv_heads=2, positional=RotaryEmbedding(6),
        kv_conv_size=4,
    ).double()
    with torch.no_grad():
        attn.kv_conv.weight.normal_()
    check_layer_on_shards(attn, n, rank, world_size, device, layout)


def check_layer_on_shards(attn: torch.nn.Module, n: int, rank: int, world_size: int,
                          device: torch.device, layout: str) -> None:
    """``attn`` (an attention layer of width 24) on this rank's shard of a random float64
    input of ``n`` tokens, under ``SequenceParallel(WORLD, layout)``, equals the layer on one
    device: output, input gradient and (summed over ranks) every parameter's gradient."""
    x = torch.randn(2, n, 24, dtype=torch.float64)
    upstream = torch.randn(2, n, 24, dtype=torch.float64)
    params = list(attn.parameters())

    def run(inputs, sequence_parallel, grad_out):
        inputs = inputs.detach().clone().requires_grad_()
        out = parallelize(attn, sequence_parallel)(inputs)
        grads = torch.autograd.grad(out, [inputs, *params], grad_out.to(out.device))
        return out.detach(), grads[0], list(grads[1:])

    full_out, full_dx, full_dparams = run(x, None, upstream)
    shard = shard_positions(n, rank, world_size, layout)
    attn.to(device)
    params = list(attn.parameters())
    sequence_parallel = SequenceParallel(dist.group.WORLD, layout=layout)
    out, dx, dparams = run(x[:, shard].to(device), sequence_parallel, upstream[:, shard])
    for grad in dparams:
        dist.all_reduce(grad)
    checks = [("out", out, full_out[:, shard]), ("dx", dx, full_dx[:, shard])]
    checks += [(f"d{name}", got, want) for (name, _), got, want in
               zip(attn.named_parameters(), dparams, full_dparams)]
    for name, got, want in checks:
        error = (got.cpu() - want).abs().max().item()
        assert error <= TOL, f"rank {rank}: {name} vs single-device: max error {error:.2e}"


def run_with_gradients(tensors, d_out, d_lse, fn):
    """``fn(q, k, v) -> (out, lse)`` with a random upstream gradient into ``out`` (and into
    ``lse`` unless ``d_lse`` is None); returns ``[out, lse, dq, dk, dv]`` on the CPU."""
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = fn(*tensors)
    loss = (out * d_out.to(out.device)).sum()
    if d_lse is not None:
        loss = loss + (lse.masked_fill(torch.isinf(lse), 0) * d_lse.to(out.device)).sum()
    return [t.detach().cpu() for t in (out, lse, *torch.autograd.grad(loss, tensors))]


def _check_case(rank: int, world_size: int, device: torch.device, case: dict, seed: int) -> None:
    n, branches, causal = case["seq_len"], case["branches"], case["causal"]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(2, n, 5, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    if "documents" in case:
        def exact(a, b, c):
            return per_document_reference(a, b, c, case["documents"], branches, causal)
    else:
        def exact(a, b, c):
            return dense_dilated_attention(a, b, c, branches, causal)
    _, ref_lse = exact(q, k, v)
    d_lse = torch.randn(2, 5, n, generator=gen, dtype=torch.float64).masked_fill(ref_lse.isinf(), 0)
    d_lse = d_lse if case["lse_grad"] else None
    shard = shard_positions(n, rank, world_size, case.get("layout", "contiguous"))
    ring, single = _run_library(q, k, v, d_out, d_lse, shard, case, device)
    reference = run_with_gradients((q, k, v), d_out, d_lse, exact)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, mine, one, ref in zip(names, ring, single, reference):
        index = (Ellipsis, shard) if name == "lse" else (slice(None), shard)
        for label, expected in (("single-device", one[index]), ("dense reference", ref[index])):
            same_inf = torch.equal(torch.isneginf(mine), torch.isneginf(expected))
            error = (mine - expected).nan_to_num(0, 0, 0).abs().max().item()
            assert same_inf and error <= TOL, (
                f"rank {rank}: {name} vs {label}: max error {error:.2e}"
            )


def _run_library(q, k, v, d_out, d_lse, shard, case, device):
    """``(ring shard results, single-device results)`` of ``dilated_attention``."""
    branches, causal = case["branches"], case["causal"]
    ids = document_ids_of(case["documents"]) if "documents" in case else None
    ring = run_with_gradients(
        [t[:, shard].to(device) for t in (q, k, v)],
        d_out[:, shard],
        None if d_lse is None else d_lse[..., shard],
        lambda a, b, c: dilated_attention(
            a,
            b,
            c,
            branches,
            causal=causal,
            sequence_parallel=SequenceParallel(
                dist.group.WORLD, case.get("layout", "contiguous"), case["transport"]
            ),
            return_lse=True,
            block_elements=case["block_elements"],
            document_ids=None if ids is None else ids[:, shard].to(device),
        ),
    )
    single = run_with_gradients(
        (q, k, v),
        d_out,
        d_lse,
        lambda a, b, c: dilated_attention(
            a, b, c, branches, causal=causal, return_lse=True,
            block_elements=case["block_elements"], document_ids=ids,
        ),
    )
    return ring, single


def check_ring_errors(rank: int, world_size: int, device: torch.device) -> list[str]:
    """Bad sequence-parallel calls raise a clear error on every rank instead of hanging."""
    failures = []

    def expect(message: str, **kwargs) -> None:
        shard_len = kwargs.pop("shard_len", 12)
        split = {name: kwargs.pop(name) for name in ("layout", "transport") if name in kwargs}
        q = torch.randn(1, shard_len, 2, 4, dtype=torch.float64, device=device)
        try:
            sequence_parallel = SequenceParallel(dist.group.WORLD, **split)
            dilated_attention(q, q, q, sequence_parallel=sequence_parallel, **kwargs)
        except (ValueError, NotImplementedError) as error:
            if message not in str(error):
                failures.append(f"expected {message!r}, got {error}")
        else:
            failures.append(f"no error for {kwargs} (expected {message!r})")

    expect("another rank passed different", pattern=[(12, 1)], shard_len=12 + (rank == 0))
    expect("another rank passed different", pattern=[(12, 1 + (rank == 1))])
    expect("padded_length", pattern=[(5, 1)], shard_len=6)
    expect("transport must be one of", pattern=[(12, 1)], transport="broadcast")
    expect("layout must be one of", pattern=[(12, 1)], layout="striped")
    if world_size > 1:
        expect("cuts each shard into two equal stripes", pattern=[(3, 1)], shard_len=9,
               layout="zigzag")
        expect("runs the ring transport only", pattern=[(6, 1), (24, 2)], layout="zigzag",
               transport="allgather")
        ids = torch.zeros(1, 12, dtype=torch.long, device=device)
        expect("run on contiguous shards only", pattern=[(6, 1)], layout="zigzag",
               document_ids=ids)
        decreasing = torch.full((1, 12), 1 - rank, dtype=torch.long, device=device)
        expect("must not decrease along the sequence", pattern=[(6, 1)], document_ids=decreasing)
        expect("another rank passed different", pattern=[(6, 1)],
               retrieval=Retrieval(sinks=2, top_k=1 + rank, block=2))
    return failures
