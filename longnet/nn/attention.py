"""Multi-head dilated attention and the checks its settings share with ``LongNetConfig``."""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from longnet.attention import DilatedPattern, Retrieval, dilated_attention
from longnet.attention.documents import PackedDocuments
from longnet.attention.selection import block_offsets, check_retrieval, local_segment_length
from longnet.compiled import refuse
from longnet.distributed.halo import previous_rows
from longnet.distributed.layouts import stripes_per_rank
from longnet.distributed.sequence_parallel import SequenceParallel
from longnet.nn.kv_cache import LayerKVCache, check_cache, decode_attention
from longnet.nn.norm import build_norm, check_norm
from longnet.nn.positional import (
    RotaryEmbedding,
    XPos,
    apply_rotary,
    check_position_ids,
    default_position_ids,
    document_position_ids,
)
from longnet.nn.short_conv import CausalShortConv, check_kv_conv_size
from longnet.validation import (
    check_bool,
    check_choice,
    check_dropout,
    check_positive_float,
    check_positive_int,
)


class MultiheadDilatedAttention(nn.Module):
    """Multi-head LongNet dilated self-attention with optional grouped K/V heads: q, k, v
    projections -> [short convolution of k, v] -> positions -> dilated attention -> [sub-LN]
    -> output projection -> dropout.

    Args:
        embed_dim: model width.
        num_heads: query heads.
        pattern: a :class:`DilatedPattern` or ``[(segment_length, dilation_rate), ...]``.
        causal: queries see only keys at positions ``<=`` their own.
        output_dropout: dropout after the output projection (none on attention probabilities).
        bias: biases on the four projections.
        num_kv_heads: K/V heads (default ``num_heads``), each serving ``num_heads //
            num_kv_heads`` consecutive query heads.
        head_dim: per-head width, default ``embed_dim // num_heads``.
        positional: a module ``(q, k, position_ids) -> (q, k)`` (:class:`RotaryEmbedding`,
            :class:`XPos`) or None.
        sub_ln: MAGNETO sub-LN before the output projection; ``norm``, ``norm_eps`` its kind.
        scale: score scale, default ``head_dim ** -0.5``.
        kv_conv_size: width of a :class:`CausalShortConv` over keys and values (0: none).
        retrieval: sinks and block selection (:class:`~longnet.attention.Retrieval`) or None.
        retrieval_positions: ``"own"`` or ``"before_segment"``, as in ``LongNetConfig``.

    Attributes:
        sequence_parallel: how the sequence is split over a process group, or None on one
            device; set by :func:`longnet.distributed.parallelize`, not saved.

    Shapes: ``x`` ``(batch, seq, embed_dim)`` -> same (``seq``: this rank's shard).
    """

    sequence_parallel: SequenceParallel | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        pattern: DilatedPattern | list[tuple[int, int]],
        *,
        causal: bool = True,
        output_dropout: float = 0.0,
        bias: bool = True,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        positional: nn.Module | None = None,
        sub_ln: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        scale: float | None = None,
        kv_conv_size: int = 0,
        retrieval: Retrieval | None = None,
        retrieval_positions: str = "own",
    ) -> None:
        super().__init__()
        embed_dim, num_heads, num_kv_heads, head_dim = check_heads(
            embed_dim, num_heads, num_kv_heads, head_dim)
        for name, flag in (("causal", causal), ("bias", bias), ("sub_ln", sub_ln)):
            check_bool(name, flag)
        output_dropout = check_dropout("output_dropout", output_dropout)
        kv_conv_size = check_kv_conv_size(kv_conv_size)
        check_norm(norm, norm_eps)
        if positional is not None and not isinstance(positional, nn.Module):
            raise TypeError(
                "positional must be a module (q, k, position_ids) -> (q, k) such as "
                "RotaryEmbedding(head_dim) or XPos(head_dim, block_size), or None, got "
                f"{type(positional).__name__} {positional!r}."
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.pattern = DilatedPattern.coerce(pattern)
        self.retrieval = check_retrieval("MultiheadDilatedAttention", retrieval, self.pattern)
        self.retrieval_positions = check_retrieval_positions(
            retrieval_positions, self.retrieval is not None, type(positional) is RotaryEmbedding)
        self.causal = causal
        self.scale = check_positive_float("scale", scale) if scale is not None else head_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias)
        self.kv_conv = (
            CausalShortConv(2 * num_kv_heads * head_dim, kv_conv_size) if kv_conv_size else None
        )
        self.positional = positional
        if isinstance(positional, XPos):
            positional.check_pattern(self.pattern)
        self.sub_norm = build_norm(norm, num_heads * head_dim, norm_eps) if sub_ln else None
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias)
        self.output_dropout = nn.Dropout(output_dropout)
        self.sequence_parallel = None

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"pattern={self.pattern.branches}, causal={self.causal}"
            + ("" if self.retrieval is None else f", retrieval={self.retrieval}")
            + ("" if self.retrieval_positions == "own"
               else f", retrieval_positions={self.retrieval_positions!r}")
        )

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        cache: LayerKVCache | None = None,
        document_ids: Tensor | PackedDocuments | None = None,
    ) -> Tensor:
        """Self-attention over ``x`` ``(batch, seq, embed_dim)``; returns the same shape.

        ``position_ids``, ``document_ids`` (or resolved :class:`PackedDocuments`), ``cache``:
        as :meth:`longnet.modeling.LongNetModel.forward`.
        """
        sequence_parallel = self.sequence_parallel
        self._check_input(x)
        check_cache(cache, LayerKVCache)
        group = None if sequence_parallel is None else sequence_parallel.process_group
        batch, seq, _ = x.shape
        documents = document_ids  # for the core: the ids, or their resolved lengths too
        if isinstance(document_ids, PackedDocuments):
            document_ids = document_ids.ids
        if document_ids is not None and cache is not None:
            raise ValueError(
                "document_ids cannot be combined with a KV cache; decode one document at a time."
            )
        if position_ids is None and document_ids is not None:
            if group is not None:
                raise ValueError(
                    "with document_ids under sequence parallelism, pass position_ids: each "
                    "token's position in its document over the whole sequence."
                )
            position_ids = document_position_ids(document_ids)
        if position_ids is None:
            offset = cache.end if cache is not None else 0
            position_ids = default_position_ids(
                seq, x.device, offset=offset, group=group,
                layout="contiguous" if sequence_parallel is None else sequence_parallel.layout,
            )
        check_position_ids(position_ids, batch, seq)
        q = rearrange(self.q_proj(x), "b n (h d) -> b n h d", h=self.num_heads)
        k, v = self.k_proj(x), self.v_proj(x)
        conv_tail = None
        if self.kv_conv is not None:
            in_document = None  # place in document: from the ids, or across ranks the positions
            if document_ids is not None:
                in_document = (document_position_ids(document_ids) if group is None
                               else position_ids.expand(batch, seq))
            k, v, conv_tail = self._convolve_kv(k, v, sequence_parallel, cache, in_document)
        k = rearrange(k, "b n (h d) -> b n h d", h=self.num_kv_heads)
        v = rearrange(v, "b n (h d) -> b n h d", h=self.num_kv_heads)
        far = None if self.retrieval_positions == "own" else self._far_rows(q, k, position_ids)
        if self.positional is not None:
            q, k = self.positional(q, k, position_ids)
        if cache is None:
            out = dilated_attention(
                q,
                k,
                v,
                self.pattern,
                causal=self.causal,
                scale=self.scale,
                sequence_parallel=sequence_parallel,
                document_ids=documents,
                retrieval=self.retrieval,
                retrieval_qk=far,
            )
        else:
            out = self._cached_attention(q, k, v, position_ids, group, cache, conv_tail, far)
        out = rearrange(out, "b n h d -> b n (h d)")
        if self.sub_norm is not None:
            out = self.sub_norm(out)
        return self.output_dropout(self.out_proj(out))

    def _check_input(self, x: Tensor) -> None:
        """``x``: ``(batch, seq, embed_dim)`` of the weights' dtype (any float under autocast)."""
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
            refuse(ValueError,
                   f"MultiheadDilatedAttention: x must be a (batch, seq, embed_dim) tensor with "
                   f"embed_dim {self.embed_dim}, got {shape}; add a batch dimension with x[None] "
                   "or project x to the layer's width.")
        weight = self.q_proj.weight
        if x.dtype != weight.dtype and not (
            x.is_floating_point() and torch.is_autocast_enabled(x.device.type)
        ):
            refuse(TypeError,
                   f"MultiheadDilatedAttention: x has dtype {x.dtype}, the layer's weights "
                   f"{weight.dtype}; cast one to the other (x.to({weight.dtype}) or "
                   f"layer.to({x.dtype})).")

    def _convolve_kv(
        self,
        k: Tensor,
        v: Tensor,
        sequence_parallel: SequenceParallel | None,
        cache: LayerKVCache | None,
        positions: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Convolve ``k, v`` ``(batch, seq, kv_heads * head_dim)`` after the previous rows
        (ranks' halos or the cache's tail); returns them and the cache's next tail."""
        assert self.kv_conv is not None
        kv = torch.cat((k, v), dim=-1)
        width = self.kv_conv.kernel_size - 1
        if sequence_parallel is not None:
            layout = sequence_parallel.layout
            halos = previous_rows(kv, width, sequence_parallel.process_group, layout).chunk(
                stripes_per_rank(layout), 1
            )
            chunks = kv.chunk(len(halos), dim=1)
            places = [None] * len(halos) if positions is None else positions.chunk(len(halos), -1)
            kv = torch.cat([self.kv_conv(chunk, halo, place)
                            for chunk, halo, place in zip(chunks, halos, places)], dim=1)
            return *kv.split(k.shape[-1], dim=-1), None
        history, tail = None, None
        if cache is not None:
            history = cache.conv_tail
            if history is None:
                history = kv.new_zeros(kv.shape[0], width, kv.shape[2])
            tail = torch.cat((history, kv.detach()), dim=1)[:, -width:]
        k, v = self.kv_conv(kv, history, positions).split(k.shape[-1], dim=-1)
        return k, v, tail

    def _cached_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        position_ids: Tensor,
        group: torch.distributed.ProcessGroup | None,
        cache: LayerKVCache,
        conv_tail: Tensor | None,
        far: tuple[Tensor, Tensor] | None,
    ) -> Tensor:
        if not self.causal:
            raise ValueError("a KV cache needs causal attention; this layer is bidirectional.")
        if group is not None:
            raise ValueError(
                "a KV cache cannot be combined with sequence parallelism; decode on one device "
                "(longnet.distributed.parallelize(model, None))."
            )
        positions = position_ids if position_ids.dim() == 1 else position_ids[0]
        seq = q.shape[1]
        expected = torch.arange(cache.end, cache.end + seq, device=positions.device)
        if position_ids.dim() == 2 and not bool((position_ids == positions).all()):
            raise ValueError("with a KV cache every row of position_ids must be the same.")
        if not torch.equal(positions, expected):
            raise ValueError(
                f"with a KV cache the new tokens must continue the cached ones: expected "
                f"positions {cache.end}..{cache.end + seq - 1}, got {positions.tolist()[:8]}..."
            )
        first = cache.end
        if len(cache) == 0 and first == 0:
            # Prefill from position 0: the ordinary O(n) dilated attention.
            out = dilated_attention(q, k, v, self.pattern, causal=True, scale=self.scale,
                                    retrieval=self.retrieval, retrieval_qk=far)
        else:
            keys, values, far_keys = k, v, None if far is None else far[1]
            if len(cache):
                past_k, past_v = cache.window(cache.start)
                keys, values = torch.cat((past_k, k), dim=1), torch.cat((past_v, v), dim=1)
                if far is not None:
                    far_keys = torch.cat((cache.far_key, far[1]), dim=1)
            out = decode_attention(
                q, keys, values, first - len(cache), self.pattern, scale=self.scale,
                retrieval=self.retrieval, retrieval_qk=None if far is None else (far[0], far_keys),
            )
        cache.append(k.detach(), v.detach(), conv_tail,
                     None if far is None else far[1].detach())
        if self.retrieval is None:  # keys no future query's segment holds are dropped
            next_position = cache.end
            cache.trim(min((next_position // w) * w for w in self.pattern.segment_lengths))
        return out

    def _far_rows(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``q`` ``(b, n, h, d)`` and ``k`` ``(b, n, kv_h, d)`` rotated for ``"before_segment"``:
        a query at ``p`` by ``p - segment start + neighbours' length + max(block, sinks)``, a
        key by its offset in its block (a sink by its position): the sinks and chosen blocks
        sit just before the query's reach."""
        assert isinstance(self.positional, RotaryEmbedding) and self.retrieval is not None
        window = local_segment_length(self.pattern)
        into_segment = positions % window if window else torch.zeros_like(positions)
        lead = (max(self.retrieval.block, self.retrieval.sinks)
                + self.retrieval.neighbors * (window or 0))
        q = apply_rotary(q, *self.positional.cos_sin(into_segment + lead))
        offsets = block_offsets(positions, window, self.retrieval)
        return q, apply_rotary(k, *self.positional.cos_sin(offsets))


RETRIEVAL_POSITIONS = ("own", "before_segment")


def check_retrieval_positions(rule: object, has_retrieval: bool, rotary: bool) -> str:
    """``rule`` from :data:`RETRIEVAL_POSITIONS`; ``"before_segment"`` needs retrieval branches
    and RoPE (``ValueError`` otherwise)."""
    check_choice("retrieval_positions", rule, RETRIEVAL_POSITIONS)
    if rule == "own":
        return rule
    if not has_retrieval:
        raise ValueError(
            f"retrieval_positions={rule!r} places the retrieval branches' keys, and there are "
            "none; set attention_sinks or select_top_k (retrieval=Retrieval(...)), or "
            "retrieval_positions='own'."
        )
    if not rotary:
        raise ValueError(
            f"retrieval_positions={rule!r} needs rotary positions (position_encoding='rope'): "
            "it rotates queries and keys to where they are seen; use retrieval_positions='own'."
        )
    return rule


def check_heads(width: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None,
                width_name: str = "embed_dim") -> tuple[int, int, int, int]:
    """The width, query heads, K/V heads and per-head width, defaults resolved.

    Raises:
        ValueError: a size that is not a positive integer, or heads that do not divide.
    """
    width = check_positive_int(width_name, width)
    num_heads = check_positive_int("num_heads", num_heads)
    num_kv_heads = (num_heads if num_kv_heads is None
                    else check_positive_int("num_kv_heads", num_kv_heads))
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}); use a divisor "
            "of num_heads (or None for one K/V head per query head)."
        )
    if head_dim is not None:
        return width, num_heads, num_kv_heads, check_positive_int("head_dim", head_dim)
    if width % num_heads:
        raise ValueError(
            f"{width_name} ({width}) is not divisible by num_heads ({num_heads}); change one of "
            "them or set head_dim explicitly."
        )
    return width, num_heads, num_kv_heads, width // num_heads
