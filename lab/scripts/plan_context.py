"""Plan a long context: per-device memory and communication of LongNet attention, from formulas,
and with a model, the training state per rank under DDP and FSDP.

    python -m lab.scripts.plan_context --seq-len 1000000000 --devices 1024 --layers 12 --heads 12 \
        --head-dim 64 --pattern longnet-base-like
    python -m lab.scripts.plan_context --seq-len 65536 --devices 8 --layers 12 --heads 12 \
        --head-dim 64 --segments 2048,4096,8192 --rates 1,2,4 --transport allgather --no-pad
    python -m lab.scripts.plan_context --seq-len 1000000 --devices 64 --model longnet-base \
        --set hidden_size=2048 num_layers=20 num_heads=16 --pattern longnet-base-like

Prints the padded length (``longnet.attention.padded_length``: the smallest length the devices
can run the pattern on; ``--no-pad`` refuses lengths that need padding, with the library's
error), the branches (local or spanning ranks), and per device, per layer and for the model:
saved activations, gradient buffers, transient buffers, the peak, and bytes sent per step. All
numbers come from ``lab.memory`` (formulas derived from the implementation) and
cover the attention core only: no projections, MLP, embeddings, parameters or optimizer state.

``--model`` (a zoo name, a model folder or a ``config.json`` path; ``--set FIELD=VALUE`` replaces
config fields, values in JSON) takes layers, heads, head size and, unless ``--pattern`` or
``--segments`` is given, the dilated pattern from the config, and adds a table per rank:
parameters, gradients, DDP's gradient buckets, AdamW's moments, FSDP's gathered block, the
attention activations above, and their total, for ``SequenceParallelStrategy`` (DDP) and
``ShardedSequenceParallelStrategy`` (FSDP2 over all ``--world-size`` ranks), from
``lab.memory.state`` (parameter shapes from a ``meta``-device build of the model;
element sizes from ``--precision``).

Patterns: ``longnet-base-like`` (the paper's base branches ``w = 2048..32768``, ``r = 1, 2, 4,
6, 12``, continued with ``w`` and ``r`` doubling until ``w`` reaches the sequence length),
``longnet-base`` (those five branches only), ``geometric`` (``(2048 * 2**i, 2**i)`` up to the
length), ``dense``; or ``--segments`` and ``--rates``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from lab.memory import (
    AttentionSetup,
    MemoryPlan,
    RankMemory,
    format_bytes,
    plan_memory,
)
from lab.memory.state import (
    LAYOUTS,
    PRECISIONS,
    ParameterShapes,
    StateMemory,
    check_world,
    model_config,
    state_memory,
)
from lab.scripts.arguments import ScriptParser, run_cli
from longnet.attention import DilatedPattern, padded_length
from longnet.cli.arguments import (
    float_argument,
    length_argument,
    path_argument,
    positive_int_argument,
)
from longnet.modeling import LongNetConfig
from longnet.validation import UsageError

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
BASE_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
BASE_RATES = (1, 2, 4, 6, 12)
PRECISION_DTYPES = {"32-true": "float32", "bf16-mixed": "bfloat16", "bf16-true": "bfloat16"}
"""The activations' dtype of each precision, when ``--dtype`` is not given."""
MODEL_SHAPE_FLAGS = ("layers", "heads", "head_dim")


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
    """argparse type for ``--segments`` and ``--rates``: ``"2048,4096"`` -> ``(2048, 4096)``
    (at least one)."""
    try:
        values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, e.g. 2048,4096, got {text!r}."
        )
    return values


def parse_overrides(items: list[str]) -> dict[str, object]:
    """``["num_layers=24", "segment_lengths=[2048,4096]"]`` -> config fields (JSON values; a
    value that is not JSON is taken as a string)."""
    overrides: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--set takes FIELD=VALUE, got {item!r} (e.g. num_layers=24).")
        try:
            overrides[name] = json.loads(text)
        except json.JSONDecodeError:
            overrides[name] = text
    return overrides


def resolve_model(args: argparse.Namespace) -> LongNetConfig | None:
    """The config of ``--model`` with ``--set`` applied, and ``args.layers``, ``heads``,
    ``head_dim`` filled from it (or their defaults 12, 12, 64 without a model)."""
    given = [
        f"--{name.replace('_', '-')}"
        for name in MODEL_SHAPE_FLAGS
        if getattr(args, name) is not None
    ]
    if args.model is None:
        if args.set:
            raise UsageError("--set changes the fields of --model's config; give --model too.")
        for name, default in zip(MODEL_SHAPE_FLAGS, (12, 12, 64)):
            if getattr(args, name) is None:
                setattr(args, name, default)
        return None
    if given:
        raise UsageError(
            f"{', '.join(given)} and --model both give the model's shape; with --model, "
            "change it with --set (num_layers=..., num_heads=..., head_dim=...)."
        )
    config = model_config(args.model, parse_overrides(args.set))
    args.layers, args.heads, args.head_dim = (
        config.num_layers,
        config.num_heads,
        config.resolved_head_dim,
    )
    return config


def build_setup(
    args: argparse.Namespace, config: LongNetConfig | None = None
) -> tuple[AttentionSetup, int]:
    """The setup to plan (at the padded length unless ``--no-pad``) and the padded length;
    ``config``'s pattern unless ``--pattern`` or ``--segments`` is given."""
    if args.segments or args.rates:
        if not (args.segments and args.rates):
            raise ValueError("give --segments and --rates together")
        pattern = DilatedPattern(args.segments, args.rates)
    elif args.pattern is None and config is not None:
        pattern = config.pattern
    else:
        pattern = named_pattern(args.pattern or "longnet-base-like", args.seq_len)
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


def attention_peak_bytes(setup: AttentionSetup, rank: RankMemory, layers: int) -> int:
    """The model's attention-core peak on one device: every layer keeps q, k, v, out, lse for
    its backward; one layer at a time runs its own peak (its q, k, v and upstream gradient on
    top)."""
    per_layer = rank.saved_qkv_bytes + rank.saved_bytes
    return (layers - 1) * per_layer + 4 * setup.shard_elements * setup.input_size + rank.peak_bytes


def model_lines(
    setup: AttentionSetup, rank: RankMemory, layers: int, link_gbps: float
) -> list[str]:
    """The model's saved activations, peak and traffic per device (attention core only)."""
    per_layer = rank.saved_qkv_bytes + rank.saved_bytes
    peak = attention_peak_bytes(setup, rank, layers)
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


def state_lines(args: argparse.Namespace, config: LongNetConfig, activations: int) -> list[str]:
    """Per-rank training state of both layouts, the attention activations and the total."""
    shapes = ParameterShapes.of_config(config)
    plans: list[StateMemory] = [
        state_memory(shapes, layout, args.world_size, args.devices, args.precision)
        for layout in LAYOUTS
    ]
    dtypes = PRECISIONS[args.precision]
    param, grad, moment, compute = (
        str(d).removeprefix("torch.")
        for d in (dtypes.param, dtypes.grad, dtypes.moment, dtypes.compute)
    )
    source = " ".join([str(args.model), *args.set])
    rows = [
        ("parameters", "parameter_bytes"),
        ("gradients", "gradient_bytes"),
        ("DDP gradient buckets", "bucket_bytes"),
        ("optimizer (AdamW x 2)", "optimizer_bytes"),
        ("FSDP gathered (peak)", "gathered_bytes"),
    ]
    width = 22
    lines = [
        f"model {source}: {shapes.count:,} parameters ({len(shapes.blocks)} blocks)",
        f"{args.precision}: parameters {param}, gradients {grad}, AdamW moments {moment}, FSDP "
        f"gathers {compute}",
        f"per rank, world {args.world_size} = {args.world_size // args.devices} data-parallel x "
        f"{args.devices} sequence-parallel:",
        f"  {'':<{width}} {'DDP':>12} {'FSDP':>12}",
    ]
    for label, attribute in rows:
        values = [format_bytes(getattr(plan, attribute)) for plan in plans]
        lines.append(f"  {label:<{width}} {values[0]:>12} {values[1]:>12}")
    act = format_bytes(activations)
    lines.append(f"  {'attention activations':<{width}} {act:>12} {act:>12}")
    totals = [format_bytes(plan.total_bytes + activations) for plan in plans]
    lines.append(f"  {'total':<{width}} {totals[0]:>12} {totals[1]:>12}")
    lines += [
        "  DDP: SequenceParallelStrategy; FSDP: ShardedSequenceParallelStrategy",
        "  not counted: activations outside the attention core, AdamW step counters, "
        "allocator overhead",
    ]
    return lines


def report(args: argparse.Namespace) -> str:
    if args.world_size is None:
        args.world_size = args.devices
    if args.dtype is None:
        args.dtype = PRECISION_DTYPES[args.precision]
    check_world(args.world_size, args.devices)
    config = resolve_model(args)
    setup, padded = build_setup(args, config)
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
    if config is not None:
        lines += state_lines(args, config, attention_peak_bytes(setup, worst, args.layers))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=length_argument, required=True,
                        help="tokens, e.g. 65536, 64K or 1M")
    parser.add_argument(
        "--devices", type=positive_int_argument, required=True,
        help="ranks per sequence (sequence-parallel size)",
    )
    parser.add_argument(
        "--world-size",
        type=positive_int_argument,
        help="all ranks, a multiple of --devices (default: --devices, no data parallelism)",
    )
    parser.add_argument(
        "--model", type=path_argument,
        help="zoo name, model folder or config.json: adds the training-state table",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="replace fields of --model's config (JSON values), e.g. num_layers=24",
    )
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="bf16-mixed",
        help="training-state dtypes (bf16-mixed: float32 state, FSDP gathers bfloat16)",
    )
    parser.add_argument("--layers", type=positive_int_argument,
                        help="default 12 (from --model's config)")
    parser.add_argument("--heads", type=positive_int_argument,
                        help="default 12 (from --model's config)")
    parser.add_argument("--head-dim", type=positive_int_argument,
                        help="default 64 (from --model's config)")
    parser.add_argument("--batch", type=positive_int_argument, default=1)
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="activations' dtype (default: float32 for --precision 32-true, else bfloat16)",
    )
    parser.add_argument(
        "--pattern",
        choices=("longnet-base-like", "longnet-base", "geometric", "dense"),
        help="default: --model's pattern, else longnet-base-like",
    )
    parser.add_argument("--segments", type=parse_ints,
                        help="explicit segment lengths, e.g. 2048,4096")
    parser.add_argument("--rates", type=parse_ints, help="explicit dilation rates, e.g. 1,2")
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
    parser.add_argument("--threads", type=positive_int_argument, default=1,
                        help="kernel threads per device")
    parser.add_argument(
        "--link-gbps",
        type=float_argument(0),
        default=0.0,
        help="also print transfer time per step at this link speed (0: do not)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def show() -> int:
        print(report(args))
        return 0

    return run_cli(show)


if __name__ == "__main__":
    sys.exit(main())
