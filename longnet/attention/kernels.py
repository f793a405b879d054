"""Block attention kernels that return ``(out, lse)`` and a backward that takes a GIVEN ``lse``.

All tensors use the kernel layout ``(batch, heads, length, head_dim)``; ``lse`` is
``(batch, heads, length)`` in float32 (float64 for float64 inputs). ``causal`` is only used on
square diagonal blocks (query i sees keys 0..i).

The backward receives the *global* ``out`` and ``lse`` of the merged attention (all blocks, all
branches) instead of the block's own: with those, the flash-attention backward of one block is
exactly that block's share of the gradient of the whole mixture. ``delta`` (optional,
``(batch, heads, length)``) replaces ``rowsum(d_out * out)``; this is how a gradient flowing into
``lse`` enters (``delta - d_lse``). Only the math kernel accepts it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of lse and accumulators: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def math_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Plain-torch attention for any device and dtype; computes in float32/float64."""
    acc = accumulation_dtype(q.dtype)
    scores = torch.einsum("bhid,bhjd->bhij", q.to(acc), k.to(acc)) * scale
    if causal:
        scores = scores + _causal_bias(scores)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhij,bhjd->bhid", probs, v.to(acc))
    return out.to(q.dtype), lse


def math_backward(
    d_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    delta: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the global ``out``/``lse`` (see the module docstring)."""
    acc = accumulation_dtype(q.dtype)
    q, k, v, d_out = (t.to(acc) for t in (q, k, v, d_out))
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        scores = scores + _causal_bias(scores)
    probs = torch.exp(scores - lse.to(acc)[..., None])
    if delta is None:
        delta = (d_out * out.to(acc)).sum(-1)
    d_v = torch.einsum("bhij,bhid->bhjd", probs, d_out)
    d_probs = torch.einsum("bhid,bhjd->bhij", d_out, v)
    d_scores = probs * (d_probs - delta.to(acc)[..., None]) * scale
    d_q = torch.einsum("bhij,bhjd->bhid", d_scores, k)
    d_k = torch.einsum("bhij,bhid->bhjd", d_scores, q)
    return d_q, d_k, d_v


def _causal_bias(scores: Tensor) -> Tensor:
    length_q, length_k = scores.shape[-2:]
    future = torch.ones(length_q, length_k, dtype=torch.bool, device=scores.device).triu(1)
    return torch.zeros_like(future, dtype=scores.dtype).masked_fill(future, float("-inf"))


def _unit_stride(*tensors: Tensor) -> list[Tensor]:
    """The fused kernels read each row's ``head_dim`` elements as consecutive memory, without
    checking (``scaled_dot_product_attention`` checks before it calls them): a tensor whose
    last dimension has another stride (a transposed or channel-major layout, e.g. a
    convolution's output) is copied first, or the kernels silently read the wrong elements."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def cpu_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype, needs keys)."""
    q, k, v = _unit_stride(q, k, v)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def cpu_flash_backward(
    d_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    d_out, q, k, v, out = _unit_stride(d_out, q, k, v, out)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def cuda_efficient_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_efficient_attention`` (CUDA, fp16/bf16/fp32)."""
    q, k, v = _unit_stride(q, k, v)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[-2]]  # the op pads lse's length to a multiple of 32


def cuda_efficient_backward(
    d_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    d_out, q, k, v, out = _unit_stride(d_out, q, k, v, out)
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
    # Pass lse in the op's own padded layout (length a multiple of 32), as its forward returns it.
    lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))
    d_q, d_k, d_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        d_out,
        q,
        k,
        v,
        None,
        out,
        lse.contiguous(),
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return d_q, d_k, d_v


def select_kernels(device: torch.device, dtype: torch.dtype):
    """The ``(forward, backward)`` block kernels for a device and dtype."""
    if device.type == "cpu":
        return cpu_flash_forward, cpu_flash_backward
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32):
        return cuda_efficient_forward, cuda_efficient_backward
    return math_forward, math_backward
