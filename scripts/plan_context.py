"""Plan a long context: per-device memory and communication of LongNet attention, from formulas.

    python scripts/plan_context.py --seq-len 1000000000 --devices 1024 --layers 12 --heads 12 \
        --head-dim 64 --pattern longnet-base-like
    python scripts/plan_context.py --seq-len 65536 --devices 8 --layers 12 --heads 12 \
        --head-dim 64 --segments 2048,4096,8192 --rates 1,2,4 --transport allgather --no-pad

Prints the padded length (``longnet.attention.padded_length``: the smallest length the devices
can run the pattern on; ``--no-pad`` refuses lengths that need padding, with the library's
error), the branches (local or spanning ranks), and per device, per layer and for the model:
saved activations, gradient buffers, transient buffers, the peak, and bytes sent per step. All
numbers come from ``longnet.attention.memory`` (formulas derived from the implementation) and
cover the attention core only: no projections, MLP, embeddings, parameters or optimizer state.

Patterns: ``longnet-base-like`` (the paper's base branches ``w = 2048..32768``, ``r = 1, 2, 4,
6, 12``, continued with ``w`` and ``r`` doubling until ``w`` reaches the sequence length),
``longnet-base`` (those five branches only), ``geometric`` (``(2048 * 2**i, 2**i)`` up to the
length), ``dense``; or ``--segments`` and ``--rates``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from longnet.attention import DilatedPattern, padded_length  # noqa: E402
from longnet.attention.memory import (  # noqa: E402
    AttentionSetup,
    MemoryPlan,
    RankMemory,
    format_bytes,
    plan_memory,
)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
BASE_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
BASE_RATES = (1, 2, 4, 6, 12)


def named_pattern(name: str, seq_len: int) -> DilatedPattern:
    """A pattern preset for sequences of ``seq_len`` tokens."""
    if name == "dense":
        return DilatedPattern.dense(seq_len)
    if name == "longnet-base":
        return DilatedPattern(BASE_SEGMENTS, BASE_RATES)
    if name == "geometric":
        count = 1
        while 2048 * 2**count <= seq_len:
            count += 1
        return DilatedPattern.geometric(count)
    if name == "longnet-base-like":
        segments, rates = list(BASE_SEGMENTS), list(BASE_RATES)
        while segments[-1] < seq_len:
            segments.append(2 * segments[-1])
            rates.append(2 * rates[-1])
        return DilatedPattern(tuple(segments), tuple(rates))
    raise ValueError(f"unknown pattern {name!r}")


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def build_setup(args: argparse.Namespace) -> tuple[AttentionSetup, int]:
    """The setup to plan (at the padded length unless ``--no-pad``) and the padded length."""
    if args.segments or args.rates:
        if not (args.segments and args.rates):
            raise ValueError("give --segments and --rates together")
        pattern = DilatedPattern(parse_ints(args.segments), parse_ints(args.rates))
    else:
        pattern = named_pattern(args.pattern, args.seq_len)
    padded = padded_length(args.seq_len, pattern, args.devices)
    length = args.seq_len if args.no_pad else padded
    transport = args.transport[0] if len(args.transport) == 1 else tuple(args.transport)
    setup = AttentionSetup(
        batch=args.batch,
        seq_len=length,
        world_size=args.devices,
        num_heads=args.heads,
        head_dim=args.head_dim,
        dtype=DTYPES[args.dtype],
        pattern=pattern,
        causal=not args.bidirectional,
        transport=transport,
        threads=args.threads,
    )
    return setup, padded


def branch_lines(setup: AttentionSetup, plan: MemoryPlan) -> list[str]:
    """One line per branch: local, or spanning g ranks with its message and traffic."""
    rings = {(b.segment_length, b.rate): b for b in plan.worst_rank.branches}
    lines = []
    for (w, r), transport in zip(setup.pattern.branches, setup.transports):
        segment = min(w, setup.seq_len)
        branch = rings.get((segment, r))
        if branch is None:
            lines.append(f"  w={w:>13,} r={r:<6} local (segment fits in the shard)")
            continue
        lines.append(
            f"  w={w:>13,} r={r:<6} spans {branch.members} ranks, {transport}: message "
            f"{format_bytes(branch.message_bytes)} ({branch.pieces} piece(s) of "
            f"{branch.heads_per_piece} heads, {branch.rows_max} rows/head), sent per rank "
            f"fwd {format_bytes(branch.sent_forward_bytes)}, "
            f"bwd {format_bytes(branch.sent_backward_bytes)}"
        )
    return lines


def layer_lines(setup: AttentionSetup, rank: RankMemory) -> list[str]:
    """Per-device, per-layer memory terms of the worst rank."""
    inputs = 4 * setup.shard_elements * setup.input_size
    return [
        f"  saved for backward   q, k, v {format_bytes(rank.saved_qkv_bytes)} + out "
        f"{format_bytes(rank.saved_out_bytes)} + lse {format_bytes(rank.saved_lse_bytes)}",
        f"  gradient buffers     dq, dk, dv {format_bytes(rank.grad_bytes)}",
        f"  transient            local chunks fwd {format_bytes(rank.local_forward_bytes)} / "
        f"bwd {format_bytes(rank.local_backward_bytes)}; K/V messages + receive buffers "
        f"{format_bytes(rank.kv_buffer_bytes)}; dK/dV accumulators "
        f"{format_bytes(rank.dkv_buffer_bytes)}",
        f"  peak                 {format_bytes(rank.peak_bytes)} above q, k, v and d_out "
        f"({format_bytes(inputs)}); forward {format_bytes(rank.forward_peak_bytes)}, backward "
        f"{format_bytes(rank.backward_peak_bytes)}",
        f"  sent per step        fwd {format_bytes(rank.sent_forward_bytes)} + bwd "
        f"{format_bytes(rank.sent_backward_bytes)}",
    ]


def model_lines(
    setup: AttentionSetup, rank: RankMemory, layers: int, link_gbps: float
) -> list[str]:
    """The model: every layer keeps q, k, v, out, lse for its backward; one layer at a time runs
    its own peak (its q, k, v and upstream gradient on top)."""
    e, s = setup.shard_elements, setup.input_size
    per_layer = rank.saved_qkv_bytes + rank.saved_bytes
    peak = (layers - 1) * per_layer + 4 * e * s + rank.peak_bytes
    sent = layers * (rank.sent_forward_bytes + rank.sent_backward_bytes)
    lines = [
        f"  saved activations    {format_bytes(layers * per_layer)} ({layers} x "
        f"{format_bytes(per_layer)})",
        f"  peak                 {format_bytes(peak)}",
        f"  sent per step        {format_bytes(sent)} per device",
    ]
    if link_gbps > 0:
        seconds = sent * 8 / (link_gbps * 1e9)
        lines.append(f"  at {link_gbps:g} Gbit/s     >= {seconds:.3f} s of transfer per step")
    return lines


def report(args: argparse.Namespace) -> str:
    setup, padded = build_setup(args)
    plan = plan_memory(setup)
    worst = plan.worst_rank
    pad = padded - args.seq_len
    sent_mean = plan.sent_bytes_mean
    lines = [
        f"sequence {args.seq_len:,} tokens on {args.devices} devices; padded length "
        f"{padded:,} (+{pad:,}, {pad / args.seq_len:.2%})"
        + ("" if not args.no_pad else "; --no-pad: planning the length as given"),
        f"shard {setup.shard_len:,} tokens/device; batch {setup.batch}, {setup.num_heads} heads x "
        f"{setup.head_dim}, {args.dtype}, {'bidirectional' if args.bidirectional else 'causal'}",
        "branches:",
        *branch_lines(setup, plan),
        f"per device, per layer (worst rank: {worst.rank}; attention core only):",
        *layer_lines(setup, worst),
        f"  mean sent per rank   fwd {format_bytes(sent_mean[0])} + bwd "
        f"{format_bytes(sent_mean[1])}",
        f"per device, model of {args.layers} layers (attention core only):",
        *model_lines(setup, worst, args.layers, args.link_gbps),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--pattern",
        choices=("longnet-base-like", "longnet-base", "geometric", "dense"),
        default="longnet-base-like",
    )
    parser.add_argument("--segments", help="explicit segment lengths, e.g. 2048,4096")
    parser.add_argument("--rates", help="explicit dilation rates, e.g. 1,2")
    parser.add_argument(
        "--transport",
        nargs="+",
        default=["ring"],
        help="ring or allgather, one for all branches or one per branch",
    )
    parser.add_argument("--bidirectional", action="store_true")
    parser.add_argument(
        "--no-pad",
        action="store_true",
        help="refuse lengths that need padding (the library's error)",
    )
    parser.add_argument("--threads", type=int, default=1, help="kernel threads per device")
    parser.add_argument(
        "--link-gbps",
        type=float,
        default=0.0,
        help="also print transfer time per step at this link speed",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(report(args))
    except (ValueError, TypeError) as error:
        print(f"plan_context: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
