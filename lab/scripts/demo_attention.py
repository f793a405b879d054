"""A short demonstration of exact dilated attention: run it, check it, time it.

    python -m lab.scripts.demo_attention [--seq-len 16384]

Runs causal LongNet dilated attention (forward + backward) on random float32 inputs, checks a
sample of output rows against a dense float64 computation of the same function, and compares
the time with dense ``scaled_dot_product_attention`` on the same inputs.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from lab.scripts.arguments import ScriptParser, run_cli
from longnet.attention import DilatedPattern, dilated_attention
from longnet.cli.arguments import length_argument, positive_int_argument
from longnet.nn import multiplicity_attention


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _dense_rows(q, k, v, pattern: DilatedPattern, rows: torch.Tensor) -> torch.Tensor:
    """Float64 dilated attention for the query positions ``rows`` only: ``(rows, heads, dim)``,
    by the library's explicit formula ``softmax(q k^T * scale + log C) v``
    (``longnet.nn.multiplicity_attention``, independent of the block kernels)."""
    positions = torch.arange(q.shape[1])
    with torch.no_grad():
        out = multiplicity_attention(
            q[:1, rows].double(), k[:1].double(), v[:1].double(), rows, positions, pattern,
            causal=True, scale=q.shape[-1] ** -0.5,
        )
    return out[0]


def main() -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=length_argument, default=16384,
                        help="tokens, e.g. 4096 or 16K")
    parser.add_argument("--heads", type=positive_int_argument, default=8)
    parser.add_argument("--head-dim", type=positive_int_argument, default=64)
    args = parser.parse_args()

    pattern = DilatedPattern((2048, 4096, 8192, 16384), (1, 2, 4, 8))
    shape = (1, args.seq_len, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    print(f"causal dilated attention, {shape} float32, pattern {pattern.branches}")

    out = dilated_attention(q, k, v, pattern, causal=True)
    rows = torch.randint(0, args.seq_len, (64,))
    error = (out[0, rows].double() - _dense_rows(q, k, v, pattern, rows)).abs().max().item()
    print(f"max |error| on 64 sampled rows vs dense float64: {error:.2e}")

    grad = torch.randn(shape)
    ours = _timed(lambda: dilated_attention(q, k, v, pattern, causal=True).backward(grad))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    dense = _timed(
        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(
            grad.transpose(1, 2)
        )
    )
    print(f"forward+backward: dilated {ours:.2f} s, dense SDPA {dense:.2f} s ({ours / dense:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
