"""An experiment: SelfExtend's position rule, exact inside a dilated branch.

    python -m lab.scripts.divided_positions eval perplexity --models smollm2-135m \\
        --overrides '{"max_positions": 32768, "pattern": [[2048, 1], [4096, 2], ...]}' ...

Inside branch ``(w, r)`` a query and the keys it sees are aligned (``p ≡ t (mod r)``, every
segment starting at a multiple of ``w``), so ``p // r - t // r = (p - t) / r`` exactly: with
each branch rotated by positions divided by its rate, the branch sees distances of at most
``w / r``, inside a base's trained range without any RoPE extension. This runs ``longnet`` (its
arguments as given) with every rotary ``MultiheadDilatedAttention`` computing each branch
with its own rotated ``q, k`` and merging the branches (and the retrieval branches, given to
the largest rate-1 branch's call) by log-sum-exp: the same softmax over the same multiset of keys as
the library's layer, only the scores' positions differ. Forward on one device only (no KV
cache, no sequence parallelism, no packed documents, no key/value convolution): enough for
``eval perplexity``; not in the library unless it measures better than YaRN
(lab/notes/retrofit-pilots.md).
"""

from __future__ import annotations

import sys

from einops import rearrange
from torch import Tensor

from longnet.attention import dilated_attention
from longnet.attention.retrieval import merge_attention
from longnet.attention.selection import local_segment_length
from longnet.nn.attention import MultiheadDilatedAttention
from longnet.nn.positional import RotaryEmbedding, check_position_ids, default_position_ids


def divided_forward(self: MultiheadDilatedAttention, x: Tensor, position_ids: Tensor | None = None,
                    cache=None, document_ids=None) -> Tensor:
    """:meth:`MultiheadDilatedAttention.forward` with branch ``(w, r)`` rotated by
    ``position // r``; ``x`` ``(batch, seq, embed_dim)`` -> the same."""
    unsupported = {"a KV cache": cache is not None, "document_ids": document_ids is not None,
                   "sequence parallelism": self.sequence_parallel is not None,
                   "kv_conv_size": self.kv_conv is not None,
                   "a positional module other than RoPE": type(self.positional)
                   is not RotaryEmbedding}
    if any(unsupported.values()):
        named = ", ".join(name for name, given in unsupported.items() if given)
        raise NotImplementedError(f"divided positions: {named} not supported by this experiment")
    self._check_input(x)
    batch, seq, _ = x.shape
    if position_ids is None:
        position_ids = default_position_ids(seq, x.device)
    check_position_ids(position_ids, batch, seq)
    q = rearrange(self.q_proj(x), "b n (h d) -> b n h d", h=self.num_heads)
    k = rearrange(self.k_proj(x), "b n (h d) -> b n h d", h=self.num_kv_heads)
    v = rearrange(self.v_proj(x), "b n (h d) -> b n h d", h=self.num_kv_heads)
    far = None if self.retrieval_positions == "own" else self._far_rows(q, k, position_ids)
    window = local_segment_length(self.pattern)  # the retrieval branches go with its call
    parts = []
    for w, r in self.pattern.branches:
        q_r, k_r = self.positional(q, k, position_ids // r)
        retrieval = self.retrieval if (w, r) == (window, 1) else None
        parts.append(dilated_attention(
            q_r, k_r, v, [(w, r)], causal=self.causal, scale=self.scale, return_lse=True,
            retrieval=retrieval, retrieval_qk=far if retrieval is not None else None))
    out, _ = merge_attention(parts, q.dtype)
    out = rearrange(out, "b n h d -> b n (h d)")
    if self.sub_norm is not None:
        out = self.sub_norm(out)
    return self.output_dropout(self.out_proj(out))


def main(argv: list[str] | None = None) -> int:
    from longnet.cli.entry import main as longnet_main

    MultiheadDilatedAttention.forward = divided_forward
    return longnet_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
