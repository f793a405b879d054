"""Exact LongNet dilated attention: the pattern, the block kernels and the public function."""

from longnet.attention.dilated import dilated_attention
from longnet.attention.pattern import DilatedPattern

__all__ = ["DilatedPattern", "dilated_attention"]
