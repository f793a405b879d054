"""Adapters for the peer libraries the benchmarks compare against (optional; not dependencies).

Both take and return ``(batch, seq, heads, head_dim)`` tensors like ``dilated_attention``.
A library that does not import is a result the benchmarks record, not an error here.
"""

from __future__ import annotations

import torch


def dilated_attention_pytorch(
    segment_lengths, dilation_rates, causal: bool
) -> tuple[object | None, str]:
    """``(fn(q, k, v), "")`` calling ``dilated-attention-pytorch``'s ``DilatedAttention``, or
    ``(None, why it does not import)``."""
    try:
        from dilated_attention_pytorch.dilated_attention import DilatedAttention
    except Exception as error:  # any import failure is a result to record
        return None, f"not importable: {type(error).__name__}: {error}"
    module = DilatedAttention(segment_lengths, dilation_rates)
    return (lambda q, k, v: module(q, k, v, is_causal=causal)), ""


def ring_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bucket_size: int, ring: bool
) -> torch.Tensor:
    """``ring-attention-pytorch``'s ``ring_flash_attn`` on this rank's shards, as its
    ``RingAttention`` module calls it on CPU (``ring_reduce_col=True`` over the default
    process group when ``ring``)."""
    from ring_attention_pytorch import ring_flash_attn

    return ring_flash_attn(
        q,
        k,
        v,
        causal=causal,
        bucket_size=min(bucket_size, q.shape[1]),
        ring_reduce_col=ring,
    )


def version(distribution: str) -> str:
    """The installed version of ``distribution``, or ``not installed``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(distribution)
    except PackageNotFoundError:
        return "not installed"
