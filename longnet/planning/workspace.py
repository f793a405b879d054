"""Working memory of the block kernel the plans model: ATen's CPU flash attention.

Its per-thread buffers depend on the query and key block sizes it picks for a call
(``_flash_splits``); the CUDA kernels' workspaces are not modelled (see ``longnet.planning``).
"""

from __future__ import annotations

from longnet.planning.setup import AttentionSetup

MERGE_TEMPORARIES = 3
"""lse-sized temporaries alive at once in ``merge.lse_merge_`` (the difference of the two lse,
its NaN-free copy, the sigmoid weight); ``lerp_`` and ``logaddexp`` then write in place."""

def _flash_splits(q_len: int, k_len: int) -> tuple[int, int]:
    """Query / key block sizes of ATen's CPU flash attention for these lengths."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, k_len)


def kernel_workspace_forward(setup: AttentionSetup, q_len: int, k_len: int) -> int:
    """Bytes of the CPU flash forward's per-thread buffer (scores, max, sum, output row block)."""
    qs, ks = _flash_splits(q_len, k_len)
    return setup.threads * (qs * ks + 2 * qs + qs * setup.head_dim) * setup.acc_size


def kernel_workspace_backward(setup: AttentionSetup, q_len: int, k_len: int) -> int:
    """Bytes of the CPU flash backward's per-thread buffers (probabilities and their gradient)."""
    qs, ks = _flash_splits(q_len, k_len)
    return setup.threads * (2 * qs * ks + qs) * setup.acc_size


