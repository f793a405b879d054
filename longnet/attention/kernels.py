"""Block attention kernels (``KERNELS``: ``(forward, backward)`` pairs, most preferred first),
the accumulators of a call and the log-sum-exp merge of block results.

Kernels take ``(batch, heads, length, head_dim)`` and return ``(out, lse)``, ``lse`` ``(batch,
heads, length)`` in the accumulation dtype; ``causal`` only on square diagonal blocks. The
backward gets the *global* merged ``out``/``lse``, so one block's flash backward is exactly its
share of the mixture's gradient (docs/architecture.md §3); a gradient into ``lse`` enters via
``delta = rowsum(d_out * out) - d_lse``, which only the math kernel takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from longnet.attention.blocks import Blocks, gather, scatter_


class BlockBackward(NamedTuple):
    """One block's backward inputs (kernel layout); ``out``/``lse`` are the GLOBAL merged ones."""

    d_out: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


Forward = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
Backward = Callable[[BlockBackward, bool, float], tuple[Tensor, Tensor, Tensor]]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of lse and accumulators: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- math: any device and dtype; the reference the fused kernels are tested against -----------
def math_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Plain-torch attention for any device and dtype; computes in float32/float64."""
    acc = accumulation_dtype(q.dtype)
    scores = torch.einsum("bhid,bhjd->bhij", q.to(acc), k.to(acc)) * scale
    if causal:
        scores = scores.masked_fill(_future(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhij,bhjd->bhid", probs, v.to(acc))
    return out.to(q.dtype), lse


def math_backward(
    block: BlockBackward, causal: bool, scale: float, delta: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the global ``out``/``lse``; ``delta`` ``(batch, heads,
    length)`` replaces ``rowsum(d_out * out)`` (see the module docstring)."""
    d_out, q, k, v, out, lse = block
    acc = accumulation_dtype(q.dtype)
    q, k, v, d_out = (t.to(acc) for t in (q, k, v, d_out))
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        scores = scores.masked_fill(_future(scores), float("-inf"))
    probs = torch.exp(scores - lse.to(acc)[..., None])
    if delta is None:
        delta = (d_out * out.to(acc)).sum(-1)
    d_v = torch.einsum("bhij,bhid->bhjd", probs, d_out)
    d_probs = torch.einsum("bhid,bhjd->bhij", d_out, v)
    d_scores = probs * (d_probs - delta.to(acc)[..., None]) * scale
    d_q = torch.einsum("bhij,bhjd->bhid", d_scores, k)
    d_k = torch.einsum("bhij,bhid->bhjd", d_scores, q)
    return d_q, d_k, d_v


def _future(scores: Tensor) -> Tensor:
    """``(queries, keys)`` True where a key lies after its query (masked: even a NaN there)."""
    length_q, length_k = scores.shape[-2:]
    return torch.ones(length_q, length_k, dtype=torch.bool, device=scores.device).triu(1)


# -- what the fused kernels assume without checking ---------------------------------------------
def _fused_ready(*tensors: Tensor) -> list[Tensor]:
    """Copies of the tensors the fused ops (called without SDPA's checks) would misread: rows
    must be contiguous, and on CUDA the pointer and strides 16-byte aligned."""
    ready = []
    for t in tensors:
        size = t.element_size()
        aligned = t.data_ptr() % 16 == 0 and all(
            (stride * size) % 16 == 0 for stride in t.stride()[:-1]
        )
        ready.append(t if t.stride(-1) == 1 and (aligned or t.device.type == "cpu") else
                     t.contiguous())
    return ready


def _sequence_major(t: Tensor) -> Tensor:
    """``t`` ``(batch, heads, length, dim)`` in memory ``(batch, length, heads, dim)``: the
    memory-efficient CUDA backward assumes that row stride for ``out`` (its ``o_strideM``)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


# -- CPU: ATen's flash attention ----------------------------------------------------------------
def cpu_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype, needs keys)."""
    q, k, v = _fused_ready(q, k, v)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def cpu_flash_backward(
    block: BlockBackward, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    d_out, q, k, v, out = _fused_ready(*block[:5])
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, block.lse, 0.0, causal, scale=scale
    )


# -- CUDA: FlashAttention-2 (sm80+, fp16/bf16) --------------------------------------------------
def cuda_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention`` (CUDA sm80+, fp16/bf16, head_dim % 8 == 0
    and <= 256); lse ``(batch, heads, length)`` float32."""
    q, k, v = _fused_ready(q, k, v)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse


def cuda_flash_backward(
    block: BlockBackward, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    d_out, q, k, v, out = _fused_ready(*block[:5])
    # a dense batch without dropout: no cumulative sequence lengths, an unused random state
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        d_out, q, k, v, out, block.lse.contiguous(), None, None,
        q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale,
    )


# -- CUDA: memory-efficient attention (fp32, and fp16/bf16 below sm80) --------------------------
def cuda_efficient_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_efficient_attention`` (CUDA, fp16/bf16/fp32)."""
    q, k, v = _fused_ready(q, k, v)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[-2]]  # the op pads lse's length to a multiple of 32


def cuda_efficient_backward(
    block: BlockBackward, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    d_out, q, k, v = _fused_ready(*block[:4])
    out = _sequence_major(block.out)
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
    # lse in the op's own padded layout (length a multiple of 32), as its forward returns it
    lse = torch.nn.functional.pad(block.lse, (0, -block.lse.shape[-1] % 32)).contiguous()
    d_q, d_k, d_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        d_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return d_q, d_k, d_v


# -- the registry ------------------------------------------------------------------------------
def _sm80_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


@dataclass(frozen=True)
class Kernel:
    """A ``(forward, backward)`` pair and what it runs on (``device``/``dtypes`` None: any;
    ``row_bytes``: a head's size in bytes must be a multiple of it; ``needs``: a hardware
    condition; ``fused``: it never holds a block's score matrix, as the math kernel does)."""

    name: str
    forward: Forward
    backward: Backward
    device: str | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    max_head_dim: int | None = None
    row_bytes: int = 1
    needs: Callable[[torch.device], bool] | None = None
    fused: bool = True

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this kernel cannot run the call, or None when it can."""
        if self.device is not None and device.type != self.device:
            return f"it runs on {self.device}, not {device.type}"
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"it takes {', '.join(str(d) for d in self.dtypes)}, not {dtype}"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"it takes head_dim <= {self.max_head_dim}, not {head_dim}"
        size = torch.empty((), dtype=dtype).element_size()
        if (head_dim * size) % self.row_bytes:
            multiple = self.row_bytes // math.gcd(self.row_bytes, size)
            return f"it takes head_dim a multiple of {multiple} for {dtype}, not {head_dim}"
        if self.needs is not None and not self.needs(device):
            return f"{device} lacks what it needs ({self.needs.__name__.strip('_')})"
        return None

    def block_backward(
        self, block: BlockBackward, d_lse: Tensor | None, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One block's share of the mixture gradient (with ``d_lse``: math kernel, ``delta``)."""
        if d_lse is None:
            return self.backward(block, causal, scale)
        lse = block.lse
        delta = (block.d_out.to(lse.dtype) * block.out.to(lse.dtype)).sum(-1) - d_lse
        return math_backward(block, causal, scale, delta=delta)


HALF = (torch.float16, torch.bfloat16)

KERNELS: tuple[Kernel, ...] = (
    Kernel("cuda-flash", cuda_flash_forward, cuda_flash_backward, "cuda", HALF, 256, 16,
           _sm80_or_newer),
    Kernel("cuda-efficient", cuda_efficient_forward, cuda_efficient_backward, "cuda",
           (*HALF, torch.float32), row_bytes=16),
    Kernel("cpu-flash", cpu_flash_forward, cpu_flash_backward, "cpu"),
    Kernel("math", math_forward, math_backward, fused=False),
)
"""Every kernel, most preferred first; ``select_kernel`` takes the first that supports a call."""


def kernel_names() -> tuple[str, ...]:
    """The names ``dilated_attention(kernel=...)`` accepts (besides ``"auto"``)."""
    return tuple(kernel.name for kernel in KERNELS)


def select_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, name: str = "auto"
) -> Kernel:
    """The first of ``KERNELS`` that supports the call, or the one named (``ValueError`` if not)."""
    if name == "auto":
        return next(k for k in KERNELS if k.unsupported(device, dtype, head_dim) is None)
    kernel = next((k for k in KERNELS if k.name == name), None)
    if kernel is None:
        raise ValueError(
            f"dilated_attention: kernel must be 'auto' or one of {kernel_names()}, got {name!r}."
        )
    reason = kernel.unsupported(device, dtype, head_dim)
    if reason is not None:
        raise ValueError(
            f"dilated_attention: kernel {name!r} cannot run this call: {reason}. Use "
            "kernel='auto' to let the library choose."
        )
    return kernel


# -- the accumulators (sequence layout, accumulation dtype) and the log-sum-exp merge ------------
def lse_merge_(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold attention over key set B into that over key set A, in place in ``out_a, lse_a``.

    Args:
        out_a, out_b: ``(..., length, dim)`` normalised outputs of each part.
        lse_a, lse_b: ``(..., length)`` log-sum-exp of each part's scores (``-inf``: no keys;
            ``out_a`` must then be 0 there, as fresh accumulators are).
    ``out = out_a + w (out_b - out_a)``, ``w = sigmoid(lse_b - lse_a)``; ``w = 0`` where B has
    no keys (no NaN when neither side has any); a NaN on either side stays NaN.
    """
    weight = torch.sigmoid((lse_b - lse_a).masked_fill(torch.isneginf(lse_b), float("-inf")))
    out_a.lerp_(out_b.to(out_a.dtype), weight[..., None].to(out_a.dtype))
    torch.logaddexp(lse_a, lse_b, out=lse_a)


def accumulators(q: Tensor) -> tuple[Tensor, Tensor]:
    """Zeroed ``out`` and ``-inf`` ``lse`` accumulators for ``q`` ``(batch, seq, heads, dim)``."""
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros(q.shape, dtype=acc)
    lse = q.new_full((*q.shape[:3], 1), float("-inf"), dtype=acc)
    return out, lse


class QueryRows(NamedTuple):
    """The accumulator rows of one group's queries in the kernel layout (``out`` ``(batch *
    segments, heads, rows, dim)``, ``lse`` without ``dim``); views when ``gathers_view``, else
    copies: merge into them in place, then ``write_back_``."""

    group: Blocks
    out: Tensor
    lse: Tensor

    @classmethod
    def gather(cls, out: Tensor, lse: Tensor, group: Blocks) -> QueryRows:
        return cls(group, gather(out, group), gather(lse, group)[..., 0])

    def write_back_(self, out: Tensor, lse: Tensor) -> None:
        """Store the merged rows into the accumulators, unless they are views of them."""
        if self.out.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            scatter_(out, self.group, self.out)
            scatter_(lse, self.group, self.lse[..., None])


class BackwardQueries(NamedTuple):
    """A group's query rows' backward inputs; ``out``/``lse`` are the GLOBAL merged ones."""

    d_out: Tensor
    q: Tensor
    out: Tensor
    lse: Tensor
    d_lse: Tensor | None

    @classmethod
    def gather(
        cls, d_out: Tensor, q: Tensor, out: Tensor, lse: Tensor, d_lse: Tensor | None,
        group: Blocks,
    ) -> BackwardQueries:
        return cls(
            gather(d_out, group),
            gather(q, group),
            gather(out, group),
            gather(lse, group)[..., 0].contiguous(),
            None if d_lse is None else gather(d_lse, group)[..., 0],
        )

    def block(self, k: Tensor, v: Tensor) -> BlockBackward:
        """The kernel backward's inputs for these queries against the keys ``k``, ``v``."""
        return BlockBackward(self.d_out, self.q, k, v, self.out, self.lse)
