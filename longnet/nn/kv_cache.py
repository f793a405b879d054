"""Incremental causal decoding: the KV cache and the attention of new tokens against it."""

from __future__ import annotations

import torch
from torch import Tensor

from longnet.attention import DilatedPattern, Retrieval
from longnet.attention.retrieval import merge_attention, retrieval_attention
from longnet.validation import check_non_negative_int


class LayerKVCache:
    """Keys and values ``(batch, length, kv_heads, head_dim)`` of one layer's positions
    ``start .. end - 1``, with the convolution's tail and retrieval's own keys."""

    def __init__(self) -> None:
        self.key: Tensor | None = None
        self.value: Tensor | None = None
        self.far_key: Tensor | None = None
        self.conv_tail: Tensor | None = None
        self.start = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, key: Tensor, value: Tensor, conv_tail: Tensor | None = None,
               far_key: Tensor | None = None) -> None:
        """Add the keys/values of positions ``end .. end + key.shape[1] - 1``."""
        self.conv_tail = conv_tail
        if self.key is None:
            self.key, self.value, self.far_key = key, value, far_key
        else:
            self.key = torch.cat((self.key, key), dim=1)
            self.value = torch.cat((self.value, value), dim=1)
            if far_key is not None:
                self.far_key = torch.cat((self.far_key, far_key), dim=1)
        self.end += key.shape[1]

    def trim(self, keep_from: int) -> None:
        """Drop the entries before global position ``keep_from``."""
        drop = keep_from - self.start
        if drop <= 0 or self.key is None:
            return
        self.key = self.key[:, drop:].clone()
        self.value = self.value[:, drop:].clone()
        if self.far_key is not None:
            self.far_key = self.far_key[:, drop:].clone()
        self.start = keep_from

    def select_rows(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` ``(new_batch,)`` in order (beam search reordering)."""
        if self.key is not None and self.value is not None:
            self.key = self.key.index_select(0, index)
            self.value = self.value.index_select(0, index)
        if self.far_key is not None:
            self.far_key = self.far_key.index_select(0, index)
        if self.conv_tail is not None:
            self.conv_tail = self.conv_tail.index_select(0, index)

    def window(self, from_position: int) -> tuple[Tensor, Tensor]:
        """Cached keys/values of positions ``from_position .. end - 1``."""
        assert self.key is not None and self.value is not None
        offset = from_position - self.start
        if offset < 0:
            raise RuntimeError(
                f"KV cache: position {from_position} was already dropped (cache starts at "
                f"{self.start}); this is a bug, please report it."
            )
        return self.key[:, offset:], self.value[:, offset:]


class KVCache:
    """One :class:`LayerKVCache` per layer; ``next_position`` is the next global position."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [
            LayerKVCache() for _ in range(check_non_negative_int("num_layers", num_layers))
        ]

    @property
    def next_position(self) -> int:
        return self.layers[0].end if self.layers else 0

    def select_rows(self, index: Tensor) -> None:
        """:meth:`LayerKVCache.select_rows` on every layer."""
        for layer in self.layers:
            layer.select_rows(index)

    def __getitem__(self, index: int) -> LayerKVCache:
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)


def multiplicity_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    query_positions: Tensor,
    key_positions: Tensor,
    pattern: DilatedPattern,
    *,
    causal: bool,
    scale: float,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Dilated attention written out: ``softmax(q k^T * scale + log C) v``, ``C`` the key
    multiplicities (docs/architecture.md §2); a query with no key outputs 0. ``O(q * k)``.

    Shapes: ``q`` ``(batch, q, heads, head_dim)``, ``k, v`` ``(batch, k, heads, head_dim)``
    -> ``(batch, q, heads, head_dim)`` (and ``lse`` ``(batch, heads, q)``).
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    counts = pattern.key_multiplicity(query_positions, key_positions, q.shape[2], causal)
    bias = counts.to(compute).log()  # log 0 = -inf
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(compute), k.to(compute)) * scale + bias
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0))  # rows without keys: all zeros
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v.to(compute)).to(q.dtype)
    return (out, lse[..., 0]) if return_lse else out


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_start: int,
    pattern: DilatedPattern,
    *,
    scale: float,
    retrieval: Retrieval | None = None,
    retrieval_qk: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Causal attention of the last ``q.shape[1]`` positions against cached keys: the dilated
    branches (:func:`multiplicity_attention`) merged with the retrieval branches.

    Shapes: ``q`` ``(batch, q, heads, head_dim)``, ``k, v`` ``(batch, keys, kv_heads,
    head_dim)`` from position ``key_start`` -> ``(batch, q, heads, head_dim)``.
    """
    end = key_start + k.shape[1]
    first = end - q.shape[1]
    window = max(key_start, min((first // w) * w for w in pattern.segment_lengths))
    groups = q.shape[2] // k.shape[2]
    near_k, near_v = (t[:, window - key_start:].repeat_interleave(groups, dim=2) for t in (k, v))
    device = q.device
    near = multiplicity_attention(
        q, near_k, near_v, torch.arange(first, end, device=device),
        torch.arange(window, end, device=device), pattern, causal=True, scale=scale,
        return_lse=True,
    )
    if retrieval is None or not retrieval.active:
        return near[0]
    if key_start != 0:
        raise RuntimeError(
            f"decode_attention: the retrieval branches read every key, but the keys start at "
            f"position {key_start}; this is a bug, please report it."
        )
    far = retrieval_attention(q, k, v, pattern, retrieval, causal=True, scale=scale,
                              far_qk=retrieval_qk)
    return merge_attention((near, far), q.dtype)[0]


def check_cache(cache: object, kind: type) -> None:
    """Raise ``TypeError`` unless ``cache`` is a ``kind`` or None."""
    if cache is None or isinstance(cache, kind):
        return
    hint = ""
    if isinstance(cache, torch.distributed.ProcessGroup):
        hint = (" (a process group is not an argument of forward: apply it to the model "
                "once with longnet.distributed.parallelize(model, SequenceParallel(group)))")
    raise TypeError(
        f"cache must be a {kind.__name__} or None, got {type(cache).__name__} "
        f"{cache!r}{hint}."
    )
