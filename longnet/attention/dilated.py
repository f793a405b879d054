"""Exact LongNet dilated attention on one device (DESIGN.md section 3).

Forward: for every branch, gather each block shape's selected rows into dense blocks, run a
block kernel returning ``(out, lse)`` and merge it into a running result by log-sum-exp. The
result is one softmax over the multiset union of all branches' keys.

Backward: every block's kernel backward runs with the global merged ``out`` and ``lse`` (the
flash-attention identity), which is exactly that block's share of the gradient of the mixture.
Only ``q, k, v, out, lse`` are saved; blocks are processed in chunks of whole segments so no
per-branch full-size buffer ever exists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.kernels import accumulation_dtype, math_backward, select_kernels
from longnet.attention.layout import BlockGroup, branch_groups, gather, scatter_
from longnet.attention.merge import lse_merge
from longnet.attention.pattern import DilatedPattern

CHUNK_ELEMENTS = 2**24
"""Upper bound on the elements of one gathered tensor (bounds the working memory)."""


def block_groups(pattern: DilatedPattern, seq_len: int, num_heads: int) -> list[BlockGroup]:
    """All block groups of all branches of ``pattern`` over ``seq_len`` tokens."""
    return [group for w, r in pattern.branches for group in branch_groups(seq_len, num_heads, w, r)]


def _chunks(groups: Sequence[BlockGroup], batch: int, head_dim: int) -> Iterator[BlockGroup]:
    for group in groups:
        yield from group.chunks(CHUNK_ELEMENTS, batch * head_dim)


def dilated_forward(
    q: Tensor, k: Tensor, v: Tensor, groups: Sequence[BlockGroup], causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Merged attention of all ``groups``.

    Args:
        q, k, v: ``(batch, seq, heads, dim)``.
    Returns:
        ``out`` ``(batch, seq, heads, dim)`` and ``lse`` ``(batch, seq, heads, 1)``, both in the
        accumulation dtype; rows no block covers have ``out = 0`` and ``lse = -inf``.
    """
    batch, seq_len, heads, dim = q.shape
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros(batch, seq_len, heads, dim, dtype=acc)
    lse = q.new_full((batch, seq_len, heads, 1), float("-inf"), dtype=acc)
    forward, _ = select_kernels(q.device, q.dtype)
    for chunk in _chunks(groups, batch, dim):
        block_out, block_lse = forward(
            gather(q, chunk), gather(k, chunk), gather(v, chunk), causal, scale
        )
        merged_out, merged_lse = lse_merge(
            gather(out, chunk), gather(lse, chunk)[..., 0], block_out, block_lse
        )
        scatter_(out, chunk, merged_out)
        scatter_(lse, chunk, merged_lse[..., None])
    return out, lse


def dilated_backward(
    d_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    groups: Sequence[BlockGroup],
    causal: bool,
    scale: float,
    d_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact gradients of :func:`dilated_forward`.

    Args:
        d_out, q, k, v, out: ``(batch, seq, heads, dim)``; ``out`` is the merged output.
        lse: ``(batch, seq, heads, 1)`` merged log-sum-exp; ``d_lse`` its upstream gradient.
    Returns:
        ``dq, dk, dv`` ``(batch, seq, heads, dim)`` in the accumulation dtype.
    """
    batch, _, _, dim = q.shape
    acc = accumulation_dtype(q.dtype)
    grads = [torch.zeros(q.shape, dtype=acc, device=q.device) for _ in range(3)]
    _, backward = select_kernels(q.device, q.dtype)
    for chunk in _chunks(groups, batch, dim):
        blocks = [gather(t, chunk) for t in (d_out, q, k, v, out)]
        block_lse = gather(lse, chunk)[..., 0].contiguous()
        if d_lse is None:
            block_grads = backward(*blocks, block_lse, causal, scale)
        else:  # a gradient into lse shifts delta; only the math kernel takes delta directly
            d_out_b, out_b = blocks[0], blocks[4]
            delta = (d_out_b.to(acc) * out_b.to(acc)).sum(-1) - gather(d_lse, chunk)[..., 0]
            block_grads = math_backward(*blocks, block_lse, causal, scale, delta=delta)
        for grad, block_grad in zip(grads, block_grads):
            scatter_(grad, chunk, block_grad, accumulate=True)
    return tuple(grads)


class _DilatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, groups, causal, scale):
        out, lse = dilated_forward(q, k, v, groups, causal, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.groups, ctx.causal, ctx.scale = groups, causal, scale
        ctx.set_materialize_grads(False)
        return out, rearrange(lse, "b n h 1 -> b h n").contiguous()

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        if d_lse is not None:
            d_lse = rearrange(d_lse, "b h n -> b n h 1").to(lse.dtype)
        d_q, d_k, d_v = dilated_backward(
            d_out, q, k, v, out, lse, ctx.groups, ctx.causal, ctx.scale, d_lse
        )
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None, None, None


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"dilated_attention: {name} must be a torch.Tensor, got {type(t).__name__}."
            )
        if not t.is_floating_point():
            raise TypeError(
                f"dilated_attention: {name} has dtype {t.dtype}; use a floating dtype "
                "(float64, float32, bfloat16 or float16)."
            )
        if t.dim() != 4:
            raise ValueError(
                f"dilated_attention: {name} must be 4-D (batch, seq, heads, head_dim), "
                f"got shape {tuple(t.shape)}."
            )
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            "dilated_attention: q, k, v must have the same shape (batch, seq, heads, head_dim), "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expand grouped "
            "K/V heads to the query heads before calling."
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"dilated_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
            "cast them to one dtype."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"dilated_attention: q, k, v are on different devices ({q.device}, {k.device}, "
            f"{v.device}); move them to one device."
        )
    if q.shape[1] == 0 or q.shape[0] == 0 or q.shape[2] == 0 or q.shape[3] == 0:
        raise ValueError(
            f"dilated_attention: q has an empty dimension, shape {tuple(q.shape)}; every "
            "dimension (batch, seq, heads, head_dim) must be at least 1."
        )
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"dilated_attention: scale must be a positive number, got {scale!r}.")


def dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: DilatedPattern | Sequence[tuple[int, int]],
    *,
    causal: bool = False,
    scale: float | None = None,
    group: torch.distributed.ProcessGroup | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """LongNet dilated attention, exact in forward and backward.

    Args:
        q, k, v: ``(batch, seq, heads, head_dim)``, same shape, dtype and device.
        pattern: a :class:`DilatedPattern` or ``[(segment_length, dilation_rate), ...]``.
        causal: queries see only keys at positions ``<=`` their own.
        scale: score scale, default ``head_dim ** -0.5``.
        group: sequence-parallel process group; ``q, k, v`` are then this rank's contiguous
            shard and the result is this rank's shard of the single-device result.
        return_lse: also return the log-sum-exp of the scores.
    Returns:
        ``out`` ``(batch, seq, heads, head_dim)`` in the input dtype, and with ``return_lse``
        ``lse`` ``(batch, heads, seq)`` in float32 (float64 for float64 inputs). Queries that no
        branch covers get ``out = 0`` and ``lse = -inf``.
    """
    _check_inputs(q, k, v, scale)
    pattern = DilatedPattern.coerce(pattern)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if group is not None and torch.distributed.get_world_size(group) > 1:
        raise NotImplementedError(
            "dilated_attention: sequence-parallel groups are not supported yet."
        )
    groups = block_groups(pattern, q.shape[1], q.shape[2])
    out, lse = _DilatedAttention.apply(q, k, v, groups, bool(causal), scale)
    return (out, lse) if return_lse else out
