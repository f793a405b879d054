"""Exact LongNet dilated attention on one device or across a sequence-parallel group."""

from longnet.attention.dilated import dilated_attention
from longnet.attention.pattern import DilatedPattern
from longnet.attention.selection import Retrieval
from longnet.attention.shard_lengths import fits_shards, padded_length

__all__ = ["DilatedPattern", "Retrieval", "dilated_attention", "fits_shards", "padded_length"]
