"""Working memory of the block kernel the models cover: ATen's CPU flash attention.

Its per-thread buffers depend on the query and key tile sizes it picks for a call
(:func:`cpu_flash_splits`); the CUDA kernels' workspaces are not modelled (see
``lab.memory``).
"""

from __future__ import annotations

from lab.memory.setup import AttentionSetup


def cpu_flash_splits(q_len: int, k_len: int) -> tuple[int, int]:
    """The query and key tile sizes ATen's CPU flash attention picks for a ``q_len x k_len``
    block (they size its per-thread buffers)."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, k_len)


def kernel_workspace_forward(setup: AttentionSetup, q_len: int, k_len: int) -> int:
    """Bytes of the CPU flash forward's per-thread buffer (scores, max, sum, output row block)."""
    qs, ks = cpu_flash_splits(q_len, k_len)
    return setup.threads * (qs * ks + 2 * qs + qs * setup.head_dim) * setup.acc_size


def kernel_workspace_backward(setup: AttentionSetup, q_len: int, k_len: int) -> int:
    """Bytes of the CPU flash backward's per-thread buffers (probabilities and their gradient)."""
    qs, ks = cpu_flash_splits(q_len, k_len)
    return setup.threads * (2 * qs * ks + qs) * setup.acc_size


