"""Positional encodings of global positions: RoPE, xPos and learned absolute.

Each is a function of ``position_ids`` (integer, ``(seq,)`` or ``(batch, seq)``), never of the
local index, so a sequence shard or tokens appended to a KV cache are encoded as in the whole.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from longnet.attention import DilatedPattern
from longnet.compiled import refuse
from longnet.distributed.layouts import shard_positions
from longnet.distributed.sequence_parallel import check_process_group
from longnet.nn.rope_extension import check_rope_extension, extended_frequencies
from longnet.validation import check_positive_float, check_positive_int

POSITION_ENCODINGS = ("learned", "rope", "xpos", "none")


def check_position_ids(position_ids: Tensor, batch: int, seq: int) -> Tensor:
    """Validate ``position_ids`` against ``(batch, seq)``; returns them unchanged."""
    if not isinstance(position_ids, Tensor):
        refuse(TypeError, "position_ids must be an integer torch.Tensor, got "
               f"{type(position_ids).__name__}.")
    if position_ids.is_floating_point() or position_ids.is_complex():
        refuse(TypeError, f"position_ids must have an integer dtype, got {position_ids.dtype}; "
               "use torch.long.")
    shape = tuple(position_ids.shape)
    if shape not in ((seq,), (batch, seq), (1, seq)):
        refuse(ValueError, f"position_ids has shape {shape}, expected ({seq},) or ({batch}, "
               f"{seq}) for an input of batch {batch} and length {seq}.")
    return position_ids


def check_rotary_head_dim(head_dim: int) -> int:
    """``head_dim`` of rotary positions: a positive even integer, else ``ValueError``."""
    head_dim = check_positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim ({head_dim}) must be even for rotary positions (RoPE, xPos); "
                         "change hidden_size/num_heads or head_dim.")
    return head_dim


def check_xpos_pattern(pattern: DilatedPattern, block_size: int) -> None:
    """``ValueError`` for segment lengths not dividing the xPos ``block_size`` (:class:`XPos`)."""
    bad = [w for w in pattern.segment_lengths if block_size % w]
    if bad:
        raise ValueError(
            f"xPos: segment_lengths {bad} do not divide the xPos block size {block_size}; use "
            "segment lengths that all divide the largest one (e.g. powers of two) so every "
            "attended pair shares its xPos centre, or position_encoding='rope'."
        )


def _angle_dtype(device: torch.device) -> torch.dtype:
    # float64 angles: in float32 they are off by 0.06 rad at position 1e6. MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def rotary_inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """``1 / theta ** (2i / head_dim)``, ``i < head_dim / 2``, in float32 as Llama's."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (float(theta) ** exponent)


def rotate_half(x: Tensor) -> Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(batch, seq, heads, head_dim)`` by ``cos, sin`` ``(..., seq, head_dim)``."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return (x * cos) + (rotate_half(x) * sin)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021), split-half layout as Llama / GPT-NeoX:
    dimensions ``i`` and ``i + head_dim / 2`` rotate by ``position * inv_freq[i]``.

    ``extension``: :mod:`longnet.nn.rope_extension`. Shapes: ``q`` ``(batch, seq, heads,
    head_dim)``, ``k`` ``(batch, seq, kv_heads, head_dim)`` -> the same.
    """

    def __init__(
        self, head_dim: int, theta: float = 10000.0, extension: dict | None = None
    ) -> None:
        super().__init__()
        self.head_dim = check_rotary_head_dim(head_dim)
        self.theta = check_positive_float("theta", theta)
        self.extension = check_rope_extension(extension)
        self._frequencies: dict[tuple, tuple[Tensor, float]] = {}

    def frequencies(self, device: torch.device) -> tuple[Tensor, float]:
        """Inverse frequencies ``(head_dim / 2,)`` and YaRN's factor, cached per setting."""
        extension = tuple(sorted(self.extension.items())) if self.extension else None
        key = (device, self.theta, extension)
        if key not in self._frequencies:
            plain = rotary_inverse_frequencies(self.head_dim, self.theta, device)
            self._frequencies[key] = extended_frequencies(plain, self.head_dim, self.theta,
                                                          self.extension)
        return self._frequencies[key]

    def cos_sin(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``cos, sin`` of shape ``(..., seq, head_dim)`` in float64 (float32 on MPS)."""
        dtype = _angle_dtype(position_ids.device)
        inv_freq, factor = self.frequencies(position_ids.device)
        angles = position_ids.to(dtype)[..., None] * inv_freq.to(dtype)
        angles = torch.cat((angles, angles), dim=-1)
        if factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * factor, angles.sin() * factor

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(position_ids)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        extension = f", extension={self.extension}" if self.extension else ""
        return f"head_dim={self.head_dim}, theta={self.theta}{extension}"


class XPos(RotaryEmbedding):
    """xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"), the LongNet paper's encoding.

    RoPE with a score decay ``zeta_i ** ((n - m) / scale_base)``. Scales are centred per
    ``block_size`` block (global positions), which cancels when the segment lengths divide it
    (:meth:`check_pattern`); they reach ~3e17 at block 32768, so float16 is refused.
    """

    def __init__(
        self, head_dim: int, block_size: int, theta: float = 10000.0, scale_base: float = 512.0
    ) -> None:
        super().__init__(head_dim, theta)
        self.block_size = check_positive_int("block_size", block_size)
        self.scale_base = check_positive_float("scale_base", scale_base)

    def check_pattern(self, pattern: DilatedPattern) -> None:
        """Refuse a pattern that compares positions across the centring blocks."""
        check_xpos_pattern(pattern, self.block_size)

    def zeta(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Per-pair decay base ``(head_dim / 2,)``."""
        i = torch.arange(0, self.head_dim, 2, device=device, dtype=dtype)
        return (i + 0.4 * self.head_dim) / (1.4 * self.head_dim)

    def max_scale(self) -> float:
        """The largest factor any q or k element is multiplied by."""
        zeta_min = 0.4 / 1.4
        return zeta_min ** (-(self.block_size / 2) / self.scale_base)

    def scales(self, position_ids: Tensor) -> Tensor:
        """Query scales ``(..., seq, head_dim)``; keys use the reciprocal."""
        dtype = _angle_dtype(position_ids.device)
        centre = (position_ids // self.block_size) * self.block_size + self.block_size // 2
        power = (position_ids - centre).to(dtype)[..., None] / self.scale_base
        scale = self.zeta(position_ids.device, dtype) ** power
        return torch.cat((scale, scale), dim=-1)

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        largest = self.max_scale()
        if largest * 1e3 > torch.finfo(q.dtype).max or math.isinf(largest):
            raise ValueError(
                f"xPos: block_size {self.block_size} with scale_base {self.scale_base} scales "
                f"q/k by up to {largest:.3g}, beyond the range of {q.dtype}; run attention in "
                "bfloat16, float32 or float64, or use a smaller largest segment."
            )
        cos, sin = self.cos_sin(position_ids)
        scale = self.scales(position_ids)
        q = apply_rotary(q, cos * scale, sin * scale)
        k = apply_rotary(k, cos / scale, sin / scale)
        return q, k

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, theta={self.theta}, scale_base={self.scale_base}, "
            f"block_size={self.block_size}"
        )


class LearnedPositionalEmbedding(nn.Embedding):
    """Learned absolute position embeddings (GPT-2): ``position_ids`` -> ``(..., seq, dim)``;
    positions beyond the table raise ``ValueError`` (``RuntimeError`` when compiled)."""

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__(check_positive_int("max_positions", max_positions),
                         check_positive_int("dim", dim))

    def forward(self, position_ids: Tensor) -> Tensor:  # type: ignore[override]
        if torch.compiler.is_compiling():  # the check as an op: no host read, no graph break
            if position_ids.numel():
                inside = (position_ids.min() >= 0) & (position_ids.max() < self.num_embeddings)
                torch._assert_async(
                    inside, f"learned position embeddings cover positions "
                    f"0..{self.num_embeddings - 1}; shorten the input or use "
                    "position_encoding='rope'/'xpos'."
                )
        elif position_ids.numel() and (
            int(position_ids.max()) >= self.num_embeddings or int(position_ids.min()) < 0
        ):
            raise ValueError(
                f"learned position embeddings cover positions 0..{self.num_embeddings - 1}, got "
                f"positions up to {int(position_ids.max())}; shorten the input (or the "
                "generation) or use position_encoding='rope'/'xpos', which have no limit."
            )
        return super().forward(position_ids)


def document_position_ids(document_ids: Tensor) -> Tensor:
    """Each token's position in its packed document, ``(batch, seq)`` int64."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand(
        document_ids.shape
    )
    starts = torch.ones(document_ids.shape, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def default_position_ids(
    seq_len: int,
    device: torch.device,
    *,
    offset: int = 0,
    group: torch.distributed.ProcessGroup | None = None,
    layout: str = "contiguous",
) -> Tensor:
    """Global positions ``(seq_len,)`` of a local input: ``offset .. offset + seq_len - 1``, or
    with a sequence-parallel ``group`` those of this rank's shard by ``layout``."""
    check_process_group("group", group)
    if group is None or torch.distributed.get_world_size(group) == 1:
        return torch.arange(offset, offset + seq_len, device=device)
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    return offset + shard_positions(seq_len * world, rank, world, layout, device)
