"""Exact LongNet dilated attention on one device or across a sequence-parallel group."""

from longnet.attention.dilated import dilated_attention
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan.spanning import fits_shards, padded_length
from longnet.attention.selection import Retrieval

__all__ = ["DilatedPattern", "Retrieval", "dilated_attention", "fits_shards", "padded_length"]
