"""Time whole zoo models' forward pass at long lengths, side by side in one run.

    python -m lab.scripts.bench_zoo_forward --lengths 8192 16384 32768 [--update-docs]

Arms (``--models`` with ``--overrides``, as ``longnet eval``; default: SmolLM2-135M read at 32K
two ways):

* ``dense + YaRN x4``: ``smollm2-135m`` with one dense branch of 32,768 tokens and YaRN x4
  (dense SDPA in every layer);
* ``smollm2-135m-32k``: the zoo entry (a 2,048-token window and the one before it, sinks and
  block selection).

Each length times ``model(ids)`` under ``torch.no_grad`` (random token ids, batch 1, float32),
arms interleaved repeat by repeat, and reports the median seconds. Every model first runs
once on ``--warmup-tokens`` tokens (thread pools, kernels; a warm-up round at 32K would add
minutes per arm). Keys per query are not counted here (``bench_retrieval`` counts them per
attention call).

Outputs: a table on stdout, ``<out>/bench_zoo_forward.png`` and the run's block in
``<out>/benchmarks.md``; ``--update-docs`` writes both into ``docs/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from lab.bench import common
from longnet.eval import load_model

SECTION = "## Whole zoo models' forward pass (CPU)"
INTRO = ("A whole model's forward pass (`lab/scripts/bench_zoo_forward.py`): SmolLM2-135M read "
         "at long lengths with dense attention (YaRN x4) against the zoo's retrieval settings, "
         "all in one run. The retrieval settings should cost less than dense attention at 32K.")
YARN_32K = {"max_positions": 32768, "pattern": [[32768, 1]],
            "rope_extension": {"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 8192}}
DEFAULT_ARMS = (("dense + YaRN x4", "smollm2-135m", YARN_32K), ("smollm2-135m-32k",
                                                                 "smollm2-135m-32k", {}))


@torch.no_grad()
def seconds(model: torch.nn.Module, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(ids)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[dict]:
    models = {label: load_model(name, overrides=overrides).model
              for label, name, overrides in args.arms}
    vocab = min(model.config.vocab_size for model in models.values())
    for model in models.values():
        seconds(model, torch.randint(vocab, (1, args.warmup_tokens)))
    rows = []
    for n in args.lengths:
        ids = torch.randint(vocab, (1, n), generator=torch.Generator().manual_seed(n))
        times: dict[str, list[float]] = {label: [] for label in models}
        for repeat in range(args.repeats):
            for label in list(models) if repeat % 2 else list(models)[::-1]:
                took = seconds(models[label], ids)
                times[label].append(took)
                print(f"  n={n} {label}: {took:.1f} s", file=sys.stderr)
        rows += [{"n": n, "system": label, "seconds": statistics.median(times[label])}
                 for label in models]
    return rows


def table(rows: list[dict]) -> str:
    first = rows[0]["system"]
    lines = [f"| tokens | model | median s | vs {first} |", "|---:|---|---:|---:|"]
    for row in rows:
        base = next(r["seconds"] for r in rows if r["n"] == row["n"] and r["system"] == first)
        lines.append(f"| {row['n']:,} | {row['system']} | {row['seconds']:.1f} | "
                     f"{row['seconds'] / base:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        ax.plot(*zip(*[(r["n"], r["seconds"]) for r in rows if r["system"] == system]),
                marker="o", label=system)
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="median seconds",
           title="whole-model forward, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_arms(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    if not args.models:
        return list(DEFAULT_ARMS)
    overrides = [json.loads(text) for text in args.overrides] or [{}]
    if len(overrides) not in (1, len(args.models)):
        raise SystemExit("give one --overrides object for all models or one per model")
    labels = args.labels or args.models
    return [(label, name, overrides[i % len(overrides)])
            for i, (label, name) in enumerate(zip(labels, args.models))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--models", nargs="+", default=[])
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--overrides", nargs="+", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_zoo_forward"))
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args(argv)
    args.arms = parse_arms(args)
    rows = run(args)
    text = table(rows)
    print(text)
    out = common.DOCS if args.update_docs else args.out
    out.mkdir(parents=True, exist_ok=True)
    png = out / "bench_zoo_forward.png"
    plot(rows, png)
    command = common.command_line("bench_zoo_forward", sys.argv[1:] if argv is None else argv)
    arms = "; ".join(f"{label}: `{name}` {json.dumps(over) if over else ''}".rstrip()
                     for label, name, over in args.arms)
    block = "\n".join([
        f"Machine: {common.machine(threads=True)}; nothing else running. float32, batch 1, "
        f"random token ids, medians of {args.repeats} after a warm-up of {args.warmup_tokens:,} "
        f"tokens per model; "
        f"{time.strftime('%Y-%m-%d')}. Arms: {arms}. Command: `{command}`.", "", text, "",
        f"![whole-model forward]({png.name})"])
    common.write_blocks(out / "benchmarks.md", SECTION, "bench_zoo_forward", {"cpu": block},
                        INTRO)
    print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
