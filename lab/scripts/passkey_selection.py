"""Whether the block selection reaches a passkey: for one prompt of the evaluation's grid, the
rank of the needle's block among each layer's and K/V head's candidate blocks, for the queries
that choose the answer's first tokens.

    python -m lab.scripts.passkey_selection --model smollm2-135m-32k --length 112000 \
        --depth 0.75 [--example 0 --num-examples 1 --seed 0]

The prompt is example ``--example`` of the cell ``(--length, --depth)`` drawn as
``longnet eval passkey --num-examples N --seed S`` draws it. The model answers it greedily
(as the evaluation does); every call of the selection that scores one of the queries from the
prompt's last token to the one that predicts the answer's first digit (``copy_positions``; a
subword tokenizer may put a space between them) records the needle's block (the block holding
the key's first token), its rank by the selection's bound among the query's candidates (0: the
highest) and whether it, or the block after it, is among the chosen ``top_k``. One line per
query and layer, then the generated answer. A miss with the
needle's block chosen in every layer is the model's reading, not the selection.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
from einops import rearrange

import longnet.attention.selection as selection
from lab.scripts.arguments import ScriptParser, run_cli
from longnet.cli.arguments import non_negative_int_argument, positive_int_argument
from longnet.data.synthetic import passkey_examples
from longnet.eval.loading import load_model
from longnet.eval.passkey import copy_positions, prompt_text
from longnet.validation import UsageError


@dataclass
class NeedleRank:
    """One selection call's view of the needle: its block ``[start, end)``, its rank per K/V
    head among the answering query's candidates, and whether each head chose it (or the next
    block)."""

    block: int
    start: int
    end: int
    ranks: list[int]
    chosen: list[bool]


def needle_ranks(q: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor],
                 row: selection.RowGeometry, chosen: torch.Tensor, key: int,
                 query: int) -> NeedleRank | None:
    """The needle's rank for query position ``query`` in one call of
    :func:`~longnet.attention.selection.select_blocks` (``q`` ``(queries, heads, dim)``,
    ``bounds`` its blocks' key minima and maxima ``(blocks, kv_heads, dim)``, ``chosen`` its
    result); None when the call holds no such query or the key lies in no block."""
    i = query - row.offset
    starts, ends = row.block_start, row.block_end
    needle = int(torch.searchsorted(starts, torch.tensor(key), right=True)) - 1
    if not 0 <= i < q.shape[0] or needle < 0 or key >= int(ends[needle]):
        return None
    low, high = (t.double() for t in bounds)
    kv_heads = low.shape[1]
    qg = rearrange(q[i:i + 1].double(), "n (g h) d -> n g h d", g=kv_heads)
    bound = (torch.einsum("ngd,jgd->ngj", qg.clamp(min=0).sum(2), high)
             + torch.einsum("ngd,jgd->ngj", qg.clamp(max=0).sum(2), low))[0]
    bound = bound.masked_fill(~(ends <= row.reach_lo[i])[None], float("-inf"))
    ranks = (bound > bound[:, needle:needle + 1]).sum(-1).tolist()
    hits = [bool(((chosen[i, g] == needle) | (chosen[i, g] == needle + 1)).any())
            for g in range(kv_heads)]
    return NeedleRank(needle, int(starts[needle]), int(ends[needle]), ranks, hits)


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a zoo name or model folder")
    parser.add_argument("--overrides", type=str, default=None,
                        help="config overrides as JSON, as longnet eval passkey takes them")
    parser.add_argument("--length", type=positive_int_argument, required=True,
                        help="the prompt's length in bytes")
    parser.add_argument("--depth", type=float, required=True, help="the needle's depth in [0, 1]")
    parser.add_argument("--example", type=non_negative_int_argument, default=0)
    parser.add_argument("--num-examples", type=positive_int_argument, default=1)
    parser.add_argument("--seed", type=non_negative_int_argument, default=0)
    args = parser.parse_args(argv)
    if args.example >= args.num_examples:
        raise UsageError(f"--example {args.example} is not below --num-examples "
                         f"{args.num_examples}; lower it or draw more examples.")
    overrides = json.loads(args.overrides) if args.overrides else None
    loaded = load_model(args.model, overrides=overrides)
    model, tokenizer = loaded.model, loaded.tokenizer
    if not model.config.select_top_k:
        raise UsageError(f"{args.model} has no block selection (select_top_k 0); give "
                         "--overrides '{\"attention_sinks\": 4, \"select_top_k\": 16}'.")
    example = passkey_examples(args.num_examples, args.length, args.depth, args.seed)[args.example]
    key, query = copy_positions(example, tokenizer)
    ids = tokenizer.encode(prompt_text(example.prompt, tokenizer)[0])
    records: list[tuple[int, NeedleRank]] = []
    select = selection.select_blocks

    def recording(q, bounds, row, retrieval, causal):
        chosen = select(q, bounds, row, retrieval, causal)
        for position in range(len(ids) - 1, query + 1):
            record = needle_ranks(q, bounds, row, chosen, key, position)
            if record is not None:
                records.append((position, record))
        return chosen

    selection.select_blocks = recording
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), len(example.answer) + 2, temperature=0)
    finally:
        selection.select_blocks = select
    print(f"{len(ids):,} tokens; key at {key}, answering query at {query} "
          f"({query - key:,} tokens back); answer {example.answer}")
    layers: dict[int, int] = {}
    for position, record in records:
        layer = layers[position] = layers.get(position, -1) + 1
        print(f"query {position} layer {layer:2d}: needle block {record.block} "
              f"[{record.start}, {record.end}), rank per K/V head {record.ranks}, "
              f"chosen {record.chosen}")
    print(f"generated {tokenizer.decode(out[0, len(ids):].tolist())!r}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
