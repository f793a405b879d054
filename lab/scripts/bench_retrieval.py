"""Benchmark the retrieval branches beside the dilated pattern and dense SDPA, in one run.

    python -m lab.scripts.bench_retrieval --lengths 8192 32768 131072 [--update-docs]

Arms (SmolLM2-135M's attention shape by default: 9 query heads, 3 K/V heads, head_dim 64,
causal; the 32K recipe's pattern ``(2048, 1) .. (32768, 16)``):

* ``sdpa``: dense ``scaled_dot_product_attention`` (K/V heads expanded);
* ``dilated``: ``dilated_attention`` with the pattern;
* ``+sinks``: the pattern with ``--sinks`` attention sinks;
* ``+sinks+select``: and block selection (``--block``, ``--top-k``);
* ``window+neighbors+sinks+select``: the zoo's ``smollm2-135m-32k`` attention: the pattern's
  first branch alone with ``--neighbors`` neighbour segments, the sinks and the selection.

Each length times forward (``torch.no_grad``) and forward + backward (an upstream gradient
into ``out``) for every arm, interleaved repeat by repeat, and reports the median seconds
and the keys each query attends to (averaged over queries and heads, counted from the rules,
not timed). Inputs are random normal (the selection's attention costs the same whatever the
queries choose: each reads ``top_k`` blocks). ``--max-sdpa`` and ``--max-backward`` skip the
arms or modes beyond those lengths (dense attention's quadratic cost on a CPU).

Outputs: a table on stdout, ``<out>/bench_retrieval.png`` and the run's block in
``<out>/benchmarks.md``; ``--update-docs`` writes both into ``docs/``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.bench import common
from longnet.attention import DilatedPattern, Retrieval, dilated_attention

SECTION = "## Retrieval branches (CPU)"
RECIPE = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]


def arms(args: argparse.Namespace) -> dict[str, Callable | None]:
    """The systems by name: ``f(q, k, v) -> out``; None where it does not run at that length."""
    sinks = Retrieval(sinks=args.sinks)
    select = Retrieval(sinks=args.sinks, block=args.block, top_k=args.top_k)
    zoo = Retrieval(sinks=args.sinks, block=args.block, top_k=args.top_k,
                    neighbors=args.neighbors)

    def sdpa(q, k, v):
        groups = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(groups, 2),
                                                v.repeat_interleave(groups, 2)))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    return {
        "sdpa": sdpa,
        "dilated": lambda q, k, v: dilated_attention(q, k, v, RECIPE, causal=True),
        "+sinks": lambda q, k, v: dilated_attention(q, k, v, RECIPE, causal=True,
                                                    retrieval=sinks),
        "+sinks+select": lambda q, k, v: dilated_attention(q, k, v, RECIPE, causal=True,
                                                           retrieval=select),
        "window+neighbors+sinks+select": lambda q, k, v: dilated_attention(
            q, k, v, RECIPE[:1], causal=True, retrieval=zoo),
    }


def keys_per_query(name: str, n: int, heads: int, args: argparse.Namespace) -> float:
    """Mean keys per query and head, from the rules (``key_multiplicity`` on a sample of
    queries for the pattern; at most ``sinks + top_k * block`` more for the retrieval arms,
    counted exactly for the sampled queries)."""
    if name == "sdpa":
        return (n + 1) / 2
    pattern = DilatedPattern(RECIPE[:1] if name.startswith("window") else RECIPE)
    queries = torch.linspace(0, n - 1, 64).long()
    counts = pattern.key_multiplicity(queries, torch.arange(n), heads, causal=True)
    total = float((counts > 0).sum()) / (64 * heads)
    if name == "dilated":
        return total
    dense = max(w for w, r in RECIPE if r == 1)
    local_start = queries // dense * dense
    neighbors = args.neighbors if name.startswith("window") else 0
    reach_start = (local_start - neighbors * dense).clamp(min=0)
    sinks = torch.clamp(reach_start, max=args.sinks).float()
    blocks = torch.clamp((reach_start - args.sinks).clamp(min=0) // args.block, max=args.top_k)
    extra = sinks if name == "+sinks" else sinks + blocks.float() * args.block
    return total + float((local_start - reach_start + extra).mean())


def measure(fn: Callable, q, k, v, backward: bool) -> float:
    start = time.perf_counter()
    if backward:
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    else:
        with torch.no_grad():
            fn(q, k, v)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    systems = arms(args)
    for n in args.lengths:
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(1, n, args.heads, args.head_dim, generator=gen)
        k, v = (torch.randn(1, n, args.kv_heads, args.head_dim, generator=gen)
                for _ in range(2))
        for backward in (False, True):
            if backward and n > args.max_backward:
                continue
            names = [name for name in systems if name != "sdpa" or n <= args.max_sdpa]
            inputs = [t.clone().requires_grad_(backward) for t in (q, k, v)]
            times: dict[str, list[float]] = {name: [] for name in names}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for name in names if repeat % 2 else names[::-1]:
                    seconds = measure(systems[name], *inputs, backward)
                    if repeat:
                        times[name].append(seconds)
                    print(f"  n={n} {'fwd+bwd' if backward else 'fwd'} {name}: {seconds:.3f} s",
                          file=sys.stderr)
            for name in names:
                rows.append({"n": n, "mode": "fwd+bwd" if backward else "fwd", "system": name,
                             "seconds": statistics.median(times[name]),
                             "keys": keys_per_query(name, n, args.heads, args)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| tokens | mode | system | keys / query | median s | vs sdpa | vs dilated |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for row in rows:
        same = {r["system"]: r["seconds"] for r in rows
                if r["n"] == row["n"] and r["mode"] == row["mode"]}
        vs = [f"{row['seconds'] / same[base]:.2f}x" if base in same else "-"
              for base in ("sdpa", "dilated")]
        lines.append(f"| {row['n']:,} | {row['mode']} | {row['system']} | {row['keys']:,.0f} | "
                     f"{row['seconds']:.3f} | {vs[0]} | {vs[1]} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for system in dict.fromkeys(r["system"] for r in rows):
            points = [(r["n"], r["seconds"]) for r in rows
                      if r["mode"] == mode and r["system"] == system]
            if points:
                ax.plot(*zip(*points), marker="o", label=system)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="median seconds",
               title=f"CPU {mode}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--neighbors", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-sdpa", type=int, default=32768)
    parser.add_argument("--max-backward", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_retrieval"))
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args)
    text = table(rows)
    print(text)
    out = common.DOCS if args.update_docs else args.out
    out.mkdir(parents=True, exist_ok=True)
    png = out / "bench_retrieval.png"
    plot(rows, png)
    command = common.command_line("bench_retrieval", sys.argv[1:] if argv is None else argv)
    block = "\n".join([
        f"Machine: {common.machine(threads=True)}; nothing else running. float32, batch 1, "
        f"{args.heads} heads, "
        f"{args.kv_heads} K/V heads, head_dim {args.head_dim}; retrieval: {args.sinks} sinks, "
        f"blocks of {args.block}, top {args.top_k}, {args.neighbors} neighbour segment(s) in "
        f"the window arm; {time.strftime('%Y-%m-%d')}. "
        f"Command: `{command}`.", "", text, "", f"![retrieval benchmark]({png.name})"])
    common.write_blocks(out / "benchmarks.md", SECTION, "bench_retrieval", {"cpu": block})
    print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
