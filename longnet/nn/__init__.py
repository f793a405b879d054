"""Building blocks of LongNet models: attention, positional encodings, FFNs, norms, blocks.

Activations are ``(batch, seq, embed_dim)``, ``position_ids`` global ``(seq,)`` or
``(batch, seq)``.
"""

from longnet.nn.attention import MultiheadDilatedAttention
from longnet.nn.block import TransformerBlock
from longnet.nn.feedforward import ACTIVATIONS, FFN_KINDS, MLP, GatedMLP, build_feed_forward
from longnet.nn.kv_cache import KVCache, LayerKVCache, multiplicity_attention
from longnet.nn.norm import NORM_KINDS, RMSNorm, build_norm
from longnet.nn.positional import (
    POSITION_ENCODINGS,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    XPos,
    apply_rotary,
    default_position_ids,
    document_position_ids,
    rotate_half,
)
from longnet.nn.short_conv import CausalShortConv

__all__ = [
    "ACTIVATIONS",
    "FFN_KINDS",
    "MLP",
    "NORM_KINDS",
    "POSITION_ENCODINGS",
    "CausalShortConv",
    "GatedMLP",
    "KVCache",
    "LayerKVCache",
    "LearnedPositionalEmbedding",
    "MultiheadDilatedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerBlock",
    "XPos",
    "apply_rotary",
    "build_feed_forward",
    "build_norm",
    "default_position_ids",
    "document_position_ids",
    "multiplicity_attention",
    "rotate_half",
]
