"""Positional encodings applied with GLOBAL positions: RoPE, xPos and learned absolute.

Every encoding here is a function of the global position of each token (``position_ids``),
never of its index in the local tensor, so a shard of a sequence (sequence parallelism, or
new tokens appended to a KV cache) is encoded exactly as the same tokens of the whole
sequence.

``position_ids`` is ``(seq,)`` (shared by the batch) or ``(batch, seq)``, integer dtype.
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
    """``head_dim`` of rotary positions (RoPE, xPos): a positive even integer, else
    ``ValueError``."""
    head_dim = check_positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim ({head_dim}) must be even for rotary positions (RoPE, xPos); "
                         "change hidden_size/num_heads or head_dim.")
    return head_dim


def check_xpos_pattern(pattern: DilatedPattern, block_size: int) -> None:
    """Refuse, with a ``ValueError``, a pattern whose segment lengths do not all divide the xPos
    ``block_size``: it would compare positions of different centres (:class:`XPos`)."""
    bad = [w for w in pattern.segment_lengths if block_size % w]
    if bad:
        raise ValueError(
            f"xPos: segment_lengths {bad} do not divide the xPos block size {block_size}; use "
            "segment lengths that all divide the largest one (e.g. powers of two) so every "
            "attended pair shares its xPos centre, or position_encoding='rope'."
        )


def _angle_dtype(device: torch.device) -> torch.dtype:
    # Angles position * frequency are computed in float64: float32 angles are off by up to
    # position * 2**-24 radians, which is 0.06 rad at position 1e6.  MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def rotary_inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """``1 / theta ** (2i / head_dim)`` for ``i < head_dim / 2``, rounded to float32.

    The float32 rounding is the GPT-NeoX / Llama convention, kept so imported checkpoints
    use exactly the frequencies they were trained with.
    """
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
    """Rotary position embedding (Su et al. 2021), split-half layout (as Llama / GPT-NeoX).

    Dimension ``i`` and ``i + head_dim / 2`` of each head form a pair rotated by angle
    ``position * inv_freq[i]``.  (The interleaved layout of other codebases is the same map
    up to a fixed permutation of the q/k projection rows.)

    ``extension``: RoPE context extension, linear position interpolation or YaRN
    (:mod:`longnet.nn.rope_extension`; None: plain RoPE).

    Shapes: ``q`` ``(batch, seq, heads, head_dim)``, ``k`` ``(batch, seq, kv_heads, head_dim)``,
    ``position_ids`` ``(seq,)`` or ``(batch, seq)``; returns rotated ``q, k`` of the same shapes.
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
        """The inverse frequencies ``(head_dim / 2,)`` (float32) and the factor cos and sin
        are multiplied by (YaRN's attention factor; 1 otherwise). Kept per device and
        setting: every layer and step would otherwise build them again (a few dozen small
        kernels under YaRN), and a length curriculum may change ``theta`` between stages."""
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

    RoPE plus an exponential decay: pair ``i`` of a query at position ``n`` is scaled by
    ``zeta_i ** ((n - c) / scale_base)`` and of a key at ``m`` by
    ``zeta_i ** -((m - c) / scale_base)`` with ``zeta_i = (2i / head_dim + 0.4) / 1.4``, so
    the score of ``(n, m)`` is multiplied by
    ``zeta_i ** ((n - m) / scale_base)``, a decay with distance.

    The centre ``c`` only keeps the scales in floating-point range and cancels in every score
    whose query and key share it.  The reference implementation centres on the current
    sequence, which would make a shard's encoding depend on the shard; here
    ``c = (p // block_size) * block_size + block_size // 2`` depends only on the global position
    ``p``.  With ``block_size`` the largest segment length of a pattern whose segment lengths all
    divide it, every pair of positions the dilated attention compares shares its centre, so
    the result is exact (see :meth:`check_pattern`).  Scales reach
    ``zeta_0 ** -(block_size / 2 / scale_base)``: about 3e17 for block 32768 and base 512,
    fine in float32/bfloat16, not in float16 (refused with an error).
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
    """Learned absolute position embeddings (GPT-2), looked up by global position.

    Shapes: ``position_ids`` ``(seq,)`` or ``(batch, seq)`` -> ``(..., seq, dim)``.
    Positions at or beyond ``max_positions`` raise a ``ValueError`` (a ``RuntimeError`` with
    the same advice under ``torch.compile``, where the check runs as an op in the graph).
    """

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
    """The position of every token in its document (packed documents, ``document_ids``
    ``(batch, seq)`` non-decreasing along the sequence): 0 at each run of equal ids' first
    token. Returns ``(batch, seq)`` int64 on the ids' device."""
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
    """Global positions ``(seq_len,)`` of a local input when none are given.

    Without a group: ``offset .. offset + seq_len - 1``.  With a sequence-parallel group the
    input is taken to be this rank's shard of a sequence sharded over the group by ``layout``
    (``longnet.distributed.layouts``: the contiguous shard starts at ``offset + rank *
    seq_len``); pass ``position_ids`` explicitly for anything else.
    """
    check_process_group("group", group)
    if group is None or torch.distributed.get_world_size(group) == 1:
        return torch.arange(offset, offset + seq_len, device=device)
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    return offset + shard_positions(seq_len * world, rank, world, layout, device)
