"""Exact LongNet dilated attention on one device or across ranks (docs/architecture.md §2-4).

Forward: the call's :class:`~longnet.attention.plan.AttentionPlan` is built once; every
branch's selected rows are gathered into dense blocks, one kernel call per chunk returns
``(out, lse)``, and each block is merged into a running result by log-sum-exp: one softmax
over the multiset union of all branches' keys (``local``). Branches whose segments span ranks
run in pieces of a few heads, exchanging the selected K/V rows by ring or all-gather
(``ring``).

Backward: each block's kernel backward runs with the GLOBAL merged ``out`` and ``lse`` (the
flash-attention identity), which is exactly that block's share of the gradient of the mixture.
Only ``q, k, v, out, lse`` are saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor

from longnet.attention.document_ring import global_documents
from longnet.attention.documents import document_lengths
from longnet.attention.kernels import kernel_names
from longnet.attention.local import attend_local, attend_local_backward
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan import AttentionPlan, default_block_elements, plan_attention
from longnet.attention.ring import run_backward_, run_forward_
from longnet.attention.transport import agree_on_call, transports_per_branch
from longnet.distributed.shards import check_layout
from longnet.validation import check_bool, check_positive_float, is_int


class _DilatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan):
        out, lse = attend_local(q, k, v, plan)
        for pieces in plan.pieces:
            run_forward_(pieces, out, lse, q, k, v, plan)
        # a NaN query gives a NaN row, as in dense attention (ATen's CPU flash kernel returns
        # such a row as empty: out 0, lse 0); a row sum is NaN when the row holds one, and
        # costs an lse-sized temporary where isnan() would hold a bool per element of q
        nan_queries = q.sum(-1, keepdim=True).isnan()
        out.masked_fill_(nan_queries, float("nan"))
        lse.masked_fill_(nan_queries, float("nan"))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, rearrange(lse, "b n h 1 -> b h n").contiguous()

    @staticmethod
    def backward(ctx, d_out, d_lse):
        saved = ctx.saved_tensors
        q, _, _, out, lse = saved
        plan = ctx.plan
        if d_out is None:
            d_out = torch.zeros_like(out)
        if d_lse is not None:
            d_lse = rearrange(d_lse, "b h n -> b n h 1").to(lse.dtype)
        grads = attend_local_backward(d_out, *saved, d_lse, plan)
        for pieces in plan.pieces:
            run_backward_(pieces, grads, d_out, d_lse, saved, plan)
        d_q, d_k, d_v = (grad.to(q.dtype) for grad in grads)
        return d_q, d_k, d_v, None


def dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: DilatedPattern | Sequence[tuple[int, int]],
    *,
    causal: bool = False,
    scale: float | None = None,
    process_group: dist.ProcessGroup | None = None,
    return_lse: bool = False,
    transport: str | Sequence[str] = "ring",
    check_finite: bool = False,
    kernel: str = "auto",
    block_elements: int | None = None,
    document_ids: Tensor | None = None,
    layout: str = "contiguous",
) -> Tensor | tuple[Tensor, Tensor]:
    """LongNet dilated attention, exact in forward and backward.

    Args:
        q, k, v: ``(batch, seq, heads, head_dim)``, same shape, dtype and device.
        pattern: a :class:`DilatedPattern` or ``[(segment_length, dilation_rate), ...]``.
        causal: queries see only keys at positions ``<=`` their own.
        scale: score scale, default ``head_dim ** -0.5``.
        process_group: sequence-parallel process group of ``P`` ranks. ``q, k, v`` are then
            this rank's contiguous shard (group-rank order, equal lengths ``L = N / P``) and the
            result is this rank's shard of the single-device result. Every segment length
            (capped at ``N``) must divide ``L`` or be a multiple of it (see ``padded_length``).
        layout: how the sequence is sharded over the ranks of ``process_group``:
            ``"contiguous"`` (rank ``r`` holds tokens ``r L .. (r + 1) L - 1``) or ``"zigzag"``
            (``2P`` chunks of ``C = N / 2P`` tokens; rank ``r`` holds chunks ``r`` and
            ``2P - 1 - r``, concatenated, so that causal work is balanced across ranks; every
            segment length must divide ``C`` or be a multiple of it, and branches spanning
            chunks use the ``ring`` transport).
        return_lse: also return the log-sum-exp of the scores.
        transport: how branches spanning several ranks move K/V: ``"ring"`` or ``"allgather"``,
            one for all branches or one per branch.
        check_finite: raise ``ValueError`` if ``q``, ``k`` or ``v`` holds a NaN or an infinity
            (one reduction per tensor; on CUDA it waits for the device). Without it a NaN gives
            NaN in the rows it reaches, as in dense attention: a NaN query its own row, a NaN
            key the rows that attend to it; a NaN value may reach every row of its block, as
            the fused kernels multiply it by zero weights too.
        kernel: the block kernel, ``"auto"`` (the first of ``kernels.KERNELS`` that runs the
            call: FlashAttention on CUDA sm80+ for fp16/bf16, memory-efficient on CUDA
            otherwise, ATen's flash kernel on the CPU, math for the rest) or one of those names.
        block_elements: the most elements of one gathered block tensor (bounds the working
            memory); default from the device (``plan.default_block_elements``).
        document_ids: ``(batch, seq)`` integer ids, non-decreasing along the sequence, for
            packed documents: each run of equal ids is a document, attended exactly as if it
            were called alone (its segments start at its first token, no key from another
            document; docs/architecture.md §2, "Packed documents"). Batch elements may hold
            different documents. Costs one transfer of the ids to the host. With a
            ``process_group``: this rank's shard of the ids (contiguous layout); documents may
            span ranks, and the ranks agree on them with one all-gather of the ids
            (docs/architecture.md §4, "Packed documents across ranks").
    Returns:
        ``out`` ``(batch, seq, heads, head_dim)`` in the input dtype, and with ``return_lse``
        ``lse`` ``(batch, heads, seq)`` in float32 (float64 for float64 inputs). Queries that no
        branch covers get ``out = 0`` and ``lse = -inf``.
    """
    _check_inputs(q, k, v, scale)
    for name, flag in (("causal", causal), ("return_lse", return_lse),
                       ("check_finite", check_finite)):
        check_bool(f"dilated_attention: {name}", flag)
    check_process_group("dilated_attention: process_group", process_group)
    if kernel != "auto" and kernel not in kernel_names():
        raise ValueError(
            f"dilated_attention: kernel must be 'auto' or one of {kernel_names()}, got {kernel!r}."
        )
    if block_elements is not None and (not is_int(block_elements) or block_elements < 1):
        raise ValueError(
            f"dilated_attention: block_elements must be a positive integer or None (the "
            f"device's default), got {block_elements!r}."
        )
    check_layout(layout, "dilated_attention")
    if check_finite:
        _check_finite(q, k, v)
    grouped = process_group is not None and dist.get_world_size(process_group) > 1
    documents = None
    if document_ids is not None and not grouped:
        documents = document_lengths(document_ids, q.shape, q.device)
    if document_ids is not None and grouped and layout != "contiguous":
        raise ValueError(
            "dilated_attention: document_ids with a process_group run on contiguous shards "
            f"only (not layout={layout!r} yet); pass layout='contiguous'."
        )
    pattern = DilatedPattern.coerce(pattern)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    transports = transports_per_branch(transport, len(pattern.branches))
    budget = default_block_elements(q.device) if block_elements is None else int(block_elements)
    if grouped:
        budget = agree_on_call(
            f"shape={tuple(q.shape)} dtype={q.dtype} pattern={pattern.branches} causal={causal} "
            f"scale={scale} transport={transports} kernel={kernel} layout={layout} "
            f"documents={document_ids is not None}",
            budget,
            process_group,
            q.device,
        )
        if document_ids is not None:
            documents = global_documents(document_ids, q.shape, q.device, process_group)
    plan = plan_attention(
        pattern, q.shape, q.dtype, q.device, causal=causal, scale=scale,
        process_group=process_group, transports=transports, kernel=kernel, block_elements=budget,
        documents=documents, layout=layout,
    )
    out, lse = _DilatedAttention.apply(q, k, v, plan)
    return (out, lse) if return_lse else out


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
    if 0 in q.shape:
        raise ValueError(
            f"dilated_attention: q has an empty dimension, shape {tuple(q.shape)}; every "
            "dimension (batch, seq, heads, head_dim) must be at least 1."
        )
    if scale is not None:
        check_positive_float("dilated_attention: scale", scale)


def check_process_group(name: str, group: object) -> None:
    """Raise ``TypeError`` unless ``group`` (the argument ``name``) is a
    ``torch.distributed.ProcessGroup`` or None."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name} must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__} {group!r}; "
            "pass the group of the ranks sharing the sequence (torch.distributed.new_group, "
            "or torch.distributed.group.WORLD), or None on one device."
        )


def _check_finite(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(
                f"dilated_attention: {name} holds {bad} NaN or infinite value(s) (shape "
                f"{tuple(t.shape)}, {t.dtype}); find where they come from (a diverged "
                "training step, an unmasked padding value) before attention."
            )
