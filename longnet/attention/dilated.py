"""``dilated_attention``: exact LongNet dilated attention on one device (``op``'s custom op) or
across a process group (the autograd function below); docs/architecture.md §2-4."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor

from longnet.attention.documents import PackedDocuments, resolve_documents
from longnet.attention.kernels import kernel_names
from longnet.attention.op import attend, attend_backward, dilated_attention_op, flat_documents
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan import AttentionPlan, default_block_elements, plan_attention
from longnet.attention.retrieval import dilated_with_retrieval, merge_attention
from longnet.attention.ring_retrieval import ring_retrieval
from longnet.attention.selection import Retrieval, check_retrieval
from longnet.compiled import refuse
from longnet.distributed.sequence_parallel import TRANSPORTS, SequenceParallel
from longnet.validation import check_bool, check_positive_float, is_int


class _DilatedAttention(torch.autograd.Function):
    """The sequence-parallel call: ``op``'s executors with the group's exchanges."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan, group: dist.ProcessGroup):
        out, lse = attend(q, k, v, plan, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.group = plan, group
        ctx.set_materialize_grads(False)
        return out, rearrange(lse, "b n h 1 -> b h n").contiguous()

    @staticmethod
    def backward(ctx, d_out, d_lse):
        if d_out is None:
            d_out = torch.zeros_like(ctx.saved_tensors[3])
        if d_lse is not None:
            d_lse = rearrange(d_lse, "b h n -> b n h 1")
        grads = attend_backward(d_out, d_lse, ctx.saved_tensors, ctx.plan, ctx.group)
        return *grads, None, None


def dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: DilatedPattern | Sequence[tuple[int, int]],
    *,
    causal: bool = False,
    scale: float | None = None,
    sequence_parallel: SequenceParallel | None = None,
    document_ids: Tensor | PackedDocuments | None = None,
    return_lse: bool = False,
    kernel: str = "auto",
    block_elements: int | None = None,
    check_finite: bool = False,
    retrieval: Retrieval | None = None,
    retrieval_qk: tuple[Tensor, Tensor] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """LongNet dilated attention, exact in forward and backward.

    Args:
        q: ``(batch, seq, heads, head_dim)``.
        k, v: ``(batch, seq, kv_heads, head_dim)``, ``kv_heads`` dividing ``heads`` (K/V head
            ``j`` serves query heads ``j * g .. (j + 1) * g - 1``); ``q``'s dtype and device.
        pattern: a :class:`DilatedPattern` or ``[(segment_length, dilation_rate), ...]``.
        retrieval: attention sinks and block selection (:class:`~longnet.attention.Retrieval`)
            in the same softmax (docs/architecture.md §2, "Retrieval branches"); one device.
        retrieval_qk: ``(far_q, far_k)`` of ``q``'s and ``k``'s shapes that the retrieval
            branches score with (default ``q, k``; a rotary model's ``retrieval_positions``).
        causal: queries see only keys at positions ``<=`` their own.
        scale: score scale, default ``head_dim ** -0.5``.
        sequence_parallel: a :class:`~longnet.distributed.sequence_parallel.SequenceParallel`
            or None; ``q, k, v`` and the result are then this rank's shard, whose length (zigzag:
            chunk length) every segment length, capped at ``N``, must divide or be a multiple of
            (``padded_length``). A group of one rank runs as one device.
        document_ids: ``(batch, seq)`` non-decreasing integer ids, each run a document attended
            as if alone (docs/architecture.md §2, §4); one host transfer. With
            ``sequence_parallel``: this rank's shard (documents may span ranks; one all-gather).
            Or ``PackedDocuments`` resolved once for many calls (``documents.resolve_documents``):
            no transfer, no all-gather.
        return_lse: also return the log-sum-exp of the scores.
        check_finite: raise ``ValueError`` if ``q``, ``k`` or ``v`` holds a NaN or an infinity
            (a host sync; under ``torch.compile`` a ``RuntimeError`` from the graph). Without
            it a NaN reaches the rows it touches (a NaN value: possibly its whole block).
        kernel: ``"auto"`` (the first of ``kernels.KERNELS`` that runs the call: CUDA flash,
            CUDA memory-efficient, CPU flash, math) or one of those names.
        block_elements: the most elements of one gathered block tensor; default by device.
    Returns:
        ``out`` ``(batch, seq, heads, head_dim)`` in the input dtype, and with ``return_lse``
        ``lse`` ``(batch, heads, seq)`` in float32 (float64 for float64 inputs). Queries that no
        branch covers get ``out = 0`` and ``lse = -inf``.
    """
    if sequence_parallel is not None and not isinstance(sequence_parallel, SequenceParallel):
        raise TypeError(
            "dilated_attention: sequence_parallel must be a "
            "longnet.distributed.SequenceParallel or None, got "
            f"{type(sequence_parallel).__name__} {sequence_parallel!r}; wrap a process group "
            "as SequenceParallel(group)."
        )
    _check_inputs(q, k, v, scale)
    for name, flag in (("causal", causal), ("return_lse", return_lse),
                       ("check_finite", check_finite)):
        check_bool(f"dilated_attention: {name}", flag)
    if kernel != "auto" and kernel not in kernel_names():
        raise ValueError(
            f"dilated_attention: kernel must be 'auto' or one of {kernel_names()}, got {kernel!r}."
        )
    if block_elements is not None and (not is_int(block_elements) or block_elements < 1):
        raise ValueError(
            f"dilated_attention: block_elements must be a positive integer or None (the "
            f"device's default), got {block_elements!r}."
        )
    if check_finite:
        _check_finite(q, k, v)
    pattern = DilatedPattern.coerce(pattern)
    retrieval = check_retrieval("dilated_attention", retrieval, pattern)
    if retrieval_qk is not None:
        _check_retrieval_qk(q, k, retrieval, retrieval_qk)
    if sequence_parallel is None:
        layout, transports, world_size = "contiguous", None, 1
    else:  # checked on a one-rank group too, where it is not used
        layout, world_size = sequence_parallel.layout, sequence_parallel.world_size
        transports = transports_per_branch(sequence_parallel.transport, len(pattern.branches))
    grouped = world_size > 1  # a group of one rank runs as one device
    if document_ids is not None and grouped and layout != "contiguous":
        raise ValueError(
            "dilated_attention: document_ids with sequence_parallel run on contiguous shards "
            f"only (not layout={layout!r} yet); pass SequenceParallel(group, "
            "layout='contiguous')."
        )
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    process_group = sequence_parallel.process_group if grouped else None
    if grouped:  # before any exchange: every rank made this call
        budget = agree_on_call(
            f"shape={tuple(q.shape)} dtype={q.dtype} pattern={pattern.branches} causal={causal} "
            f"scale={scale} transport={transports} kernel={kernel} layout={layout} "
            f"documents={document_ids is not None} retrieval={retrieval} "
            f"retrieval_qk={retrieval_qk is not None}",
            default_block_elements(q.device) if block_elements is None else int(block_elements),
            process_group,
            q.device,
        )
    documents = None
    if document_ids is not None:
        if not isinstance(document_ids, PackedDocuments):
            document_ids = resolve_documents(document_ids, q.shape[0], q.shape[1], q.device,
                                             process_group)
        documents = document_ids.lengths_for(q.shape, world_size)
    if not grouped:
        op_args = (list(pattern.segment_lengths), list(pattern.dilation_rates), causal, scale,
                   kernel, None if block_elements is None else int(block_elements),
                   *flat_documents(documents))
        if retrieval is None:
            out, lse = dilated_attention_op(q, _expand_kv(q, k), _expand_kv(q, v), *op_args)
        else:
            out, lse = dilated_with_retrieval(q, k, v, op_args, pattern, retrieval,
                                              causal=causal, scale=scale, documents=documents,
                                              far_qk=retrieval_qk)
        return (out, lse) if return_lse else out
    plan = plan_attention(
        pattern, tuple(q.shape), q.dtype, q.device, causal=causal, scale=scale,
        world_size=world_size, rank=sequence_parallel.rank, layout=layout,
        transports=transports, kernel=kernel, block_elements=budget, documents=documents,
    )
    out, lse = _DilatedAttention.apply(q, _expand_kv(q, k), _expand_kv(q, v), plan,
                                      process_group)
    if retrieval is not None:
        far = ring_retrieval(q, k, v, pattern, retrieval, causal=causal, scale=scale,
                             documents=documents, group=process_group, layout=layout,
                             far_qk=retrieval_qk)
        out, lse = merge_attention(((out, lse), far), q.dtype)
    return (out, lse) if return_lse else out


def transports_per_branch(transport: str | Sequence[str], num_branches: int) -> tuple[str, ...]:
    """One transport name per branch (``transport`` is one name for all or one per branch)."""
    transports = (transport,) * num_branches if isinstance(transport, str) else tuple(transport)
    if len(transports) != num_branches or any(t not in TRANSPORTS for t in transports):
        raise ValueError(
            f"dilated_attention: transport must be one of {TRANSPORTS} or a list of them, one "
            f"per branch ({num_branches}), got {transport!r}."
        )
    return transports


_AGREED: WeakKeyDictionary[dist.ProcessGroup, dict[tuple[str, int], int]] = WeakKeyDictionary()
"""The calls each process group agreed on: ``(signature, block budget) -> agreed budget``."""


def agree_on_call(
    signature: str, block_elements: int, process_group: dist.ProcessGroup, device: torch.device
) -> int:
    """Raise on every rank if any rank called with a different ``signature``; return the
    group's smallest ``block_elements`` (one all-reduce per group and signature, cached: a
    later mismatch is caught by the exchange itself)."""
    agreed = _AGREED.setdefault(process_group, {})
    key = (signature, block_elements)
    if key not in agreed:
        agreed[key] = _all_agree(signature, block_elements, process_group, device)
    return agreed[key]


def _all_agree(
    signature: str, block_elements: int, process_group: dist.ProcessGroup, device: torch.device
) -> int:
    """The all-reduce of :func:`agree_on_call`."""
    code = zlib.crc32(signature.encode())
    values = torch.tensor([code, -code, -block_elements], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=process_group)
    if values[0].item() != code or -values[1].item() != code:
        raise ValueError(
            f"dilated_attention: rank {dist.get_rank(process_group)} of the sequence-parallel "
            f"group was called with ({signature}) but another rank passed different shapes, "
            "dtype, pattern or options; every rank must pass equal-length shards and the same "
            "arguments."
        )
    return int(-values[2].item())


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> None:
    """Refuse inputs the call cannot take (:func:`~longnet.compiled.refuse`)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            refuse(TypeError, f"dilated_attention: {name} must be a torch.Tensor, got "
                   f"{type(t).__name__}.")
        if not t.is_floating_point():
            refuse(TypeError, f"dilated_attention: {name} has dtype {t.dtype}; use a floating "
                   "dtype (float64, float32, bfloat16 or float16).")
        if t.dim() != 4:
            refuse(ValueError, f"dilated_attention: {name} must be 4-D (batch, seq, heads, "
                   f"head_dim), got shape {tuple(t.shape)}.")
    if not (k.shape == v.shape and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
            and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0):
        refuse(ValueError, "dilated_attention: q must be (batch, seq, heads, head_dim) and k, "
               "v (batch, seq, kv_heads, head_dim) with kv_heads dividing heads, got q "
               f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if not (q.dtype == k.dtype == v.dtype):
        refuse(TypeError, f"dilated_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, "
               f"{v.dtype}); cast them to one dtype.")
    if not (q.device == k.device == v.device):
        refuse(ValueError, f"dilated_attention: q, k, v are on different devices ({q.device}, "
               f"{k.device}, {v.device}); move them to one device.")
    if 0 in q.shape:
        refuse(ValueError, f"dilated_attention: q has an empty dimension, shape "
               f"{tuple(q.shape)}; every dimension (batch, seq, heads, head_dim) must be at "
               "least 1.")
    if scale is not None:
        check_positive_float("dilated_attention: scale", scale)


def _check_retrieval_qk(q: Tensor, k: Tensor, retrieval: Retrieval | None,
                        retrieval_qk: object) -> None:
    """``retrieval_qk``: two tensors like ``q`` and ``k``, given with active ``retrieval``."""
    if retrieval is None:
        raise ValueError("dilated_attention: retrieval_qk is given without retrieval "
                         "branches; pass retrieval=Retrieval(...) or drop retrieval_qk.")
    if not (isinstance(retrieval_qk, tuple) and len(retrieval_qk) == 2
            and all(isinstance(t, Tensor) for t in retrieval_qk)):
        raise TypeError("dilated_attention: retrieval_qk must be a pair (far_q, far_k) of "
                        f"tensors, got {type(retrieval_qk).__name__}.")
    for name, mine, like in (("far_q", retrieval_qk[0], q), ("far_k", retrieval_qk[1], k)):
        if mine.shape != like.shape or mine.dtype != like.dtype or mine.device != like.device:
            raise ValueError(
                f"dilated_attention: retrieval_qk's {name} must have the shape, dtype and "
                f"device of {name[-1]} ({tuple(like.shape)}, {like.dtype}, {like.device}), got "
                f"({tuple(mine.shape)}, {mine.dtype}, {mine.device})."
            )


def _expand_kv(q: Tensor, t: Tensor) -> Tensor:
    """Grouped K/V heads ``(batch, seq, kv_heads, dim)`` repeated to ``q``'s heads."""
    groups = q.shape[2] // t.shape[2]
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


def _check_finite(q: Tensor, k: Tensor, v: Tensor) -> None:
    """``check_finite``'s ``ValueError`` (under ``torch.compile``: ``_assert_async``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if torch.compiler.is_compiling():
            torch._assert_async(torch.isfinite(t).all(), f"dilated_attention: {name} holds NaN "
                                "or infinite values; find where they come from before attention.")
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(
                f"dilated_attention: {name} holds {bad} NaN or infinite value(s) (shape "
                f"{tuple(t.shape)}, {t.dtype}); find where they come from (a diverged "
                "training step, an unmasked padding value) before attention."
            )
