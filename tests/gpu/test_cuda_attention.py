"""The attention core and the model on a CUDA device (marker ``gpu``; skipped without one).

Exactness on the GPU is judged the way users judge a kernel: against float64, relative to what
``scaled_dot_product_attention`` itself gets wrong at the same dtype on the same inputs when it
computes the same function (its float mask ``log C``, the multiplicity of §2).
Every case runs ``DRAWS`` fresh random draws (the bf16 failures these tests guard against were
intermittent: memory read with the wrong layout). ``lab/scripts/gpu_check.py`` runs this file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longnet.attention import DilatedPattern, dilated_attention
from longnet.attention.kernels import KERNELS
from longnet.modeling import LongNetConfig, LongNetLM
from tests.reference import (
    branch_counts,
    dense_dilated_attention,
    document_ids_of,
    per_document_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DRAWS = 20
ALLOWED = 2.0
"""Our worst error over the draws may be at most this multiple of SDPA's worst error."""

CASES = {  # name: (batch, seq_len, heads, head_dim, branches, causal)
    "odd-77-causal": (1, 77, 4, 64, [(10, 1), (30, 3)], True),
    "rates-not-dividing-97": (2, 97, 12, 64, [(16, 1), (32, 2), (64, 4), (97, 6)], False),
    "rates-not-dividing-97-causal": (2, 97, 12, 64, [(16, 1), (32, 2), (64, 4), (97, 6)], True),
    "head-dim-128-3000": (1, 3000, 4, 128, [(1024, 1), (3000, 3)], True),
    "head-dim-36": (2, 77, 4, 36, [(10, 1), (30, 3)], False),
    "geometric-4096": (1, 4096, 8, 64, [(512, 1), (1024, 2), (2048, 4), (4096, 8)], True),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _errors(fn, inputs, upstream, reference) -> list[float]:
    """Max |difference| of out and dq, dk, dv against ``reference`` = ``(out, dq, dk, dv)``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype))
    return [(a.double() - b).abs().max().item() for a, b in zip((out, *grads), reference)]


def _sdpa(branches, causal: bool):
    """SDPA computing dilated attention: ``softmax(q k^T * scale + log C) v`` with ``C`` as a
    float mask (``-inf`` where a query does not see a key)."""
    def attend(q, k, v):
        counts = branch_counts(q.shape[1], q.shape[2], branches, causal).to(q.device)
        mask = counts.log().to(q.dtype)[None]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    return attend


def _worst_errors(case: str, dtype: torch.dtype, kernel: str = "auto") -> tuple[list, list]:
    """Worst errors over the draws of ours and of SDPA computing the same function: ``(ours,
    sdpa)``, each ``[out, dq, dk, dv]``."""
    batch, seq_len, heads, head_dim, branches, causal = CASES[case]
    ours_worst, sdpa_worst = [0.0] * 4, [0.0] * 4
    for draw in range(DRAWS):
        gen = torch.Generator(device="cuda").manual_seed(1000 * draw + seq_len)
        q, k, v, d_out = (torch.randn(batch, seq_len, heads, head_dim, generator=gen,
                                      device="cuda", dtype=torch.float64) for _ in range(4))
        exact = _errors_reference(q, k, v, d_out, branches, causal)
        low = [t.to(dtype) for t in (q, k, v)]
        ours = _errors(lambda a, b, c: dilated_attention(a, b, c, branches, causal=causal,
                                                         kernel=kernel), low, d_out, exact)
        sdpa = _errors(_sdpa(branches, causal), low, d_out, exact)
        ours_worst = [max(a, b) for a, b in zip(ours_worst, ours)]
        sdpa_worst = [max(a, b) for a, b in zip(sdpa_worst, sdpa)]
    return ours_worst, sdpa_worst


def _errors_reference(q, k, v, d_out, branches, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = dense_dilated_attention(*leaves, branches, causal)
    return [out.detach(), *torch.autograd.grad(out, leaves, d_out)]


def _report(label: str, ours: list, sdpa: list, against: str = "sdpa") -> None:
    ratios = ", ".join(f"{name} {a:.2e} ({a / max(b, 1e-30):.2f}x {against})"
                       for name, a, b in zip(("out", "dq", "dk", "dv"), ours, sdpa))
    print(f"\nERRORS {label}: {ratios}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_within_twice_sdpa_error_on_every_draw(case, dtype):
    ours, sdpa = _worst_errors(case, DTYPES[dtype])
    _report(f"{case} {dtype}", ours, sdpa)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, sdpa):
        assert a <= ALLOWED * b, f"{case} {dtype}: {name} error {a:.3e} > {ALLOWED} x {b:.3e}"


EFFICIENT_BF16 = pytest.mark.xfail(reason=(
    "H100, 2026-11-26: forcing cuda-efficient in bf16 gave dq 2.33x SDPA's error on "
    "rates-not-dividing-97-causal (4.99e-2 vs 2.14e-2; flash 1.08x, efficient fp16 1.47x); "
    "kernel='auto' never picks it for bf16 on sm80+. Cause not found yet."), strict=False)


@pytest.mark.parametrize("kernel", [k.name for k in KERNELS if k.device == "cuda"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_cuda_kernel_by_name(kernel, dtype, request):
    if (kernel, dtype) == ("cuda-efficient", "bfloat16"):
        request.applymarker(EFFICIENT_BF16)
    registered = next(k for k in KERNELS if k.name == kernel)
    if registered.unsupported(torch.device("cuda"), DTYPES[dtype], 64) is not None:
        pytest.skip(registered.unsupported(torch.device("cuda"), DTYPES[dtype], 64))
    ours, sdpa = _worst_errors("rates-not-dividing-97-causal", DTYPES[dtype], kernel)
    _report(f"kernel {kernel} {dtype}", ours, sdpa)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, sdpa):
        assert a <= ALLOWED * b, f"{kernel} {dtype}: {name} error {a:.3e} > {ALLOWED} x {b:.3e}"


PACKED = [(700, 1500, 1896), (4096,), (33, 4000, 63)]
"""Documents per batch element: tails of many lengths, one document a row, short
neighbours of a long document."""
PACKED_DRAWS = 2


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_causal_packed_documents_are_as_exact_as_each_document_alone(dtype):
    """Causal packed documents (their blocks stacked into shared kernel calls) err against
    float64 at most ``ALLOWED`` times as much as calling ``dilated_attention`` on every
    document alone in the same dtype (whose own error the cases above hold to SDPA's), out
    and every gradient, over ``PACKED_DRAWS`` draws (few: the kernels are those of the cases
    above, what this adds is the packed plan's gathers, the same on every draw)."""
    branches = [(512, 1), (1024, 2), (2048, 4), (4096, 8)]
    ids = document_ids_of(PACKED).cuda()
    packed_worst, alone_worst = [0.0] * 4, [0.0] * 4
    for draw in range(PACKED_DRAWS):
        gen = torch.Generator(device="cuda").manual_seed(draw)
        q, k, v, d_out = (torch.randn(3, 4096, 9, 64, generator=gen, device="cuda",
                                      dtype=torch.float64) for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        truth, _ = per_document_reference(*leaves, PACKED, branches, True)
        exact = [truth.detach(), *torch.autograd.grad(truth, leaves, d_out)]
        low = [t.to(DTYPES[dtype]) for t in (q, k, v)]
        packed = _errors(lambda a, b, c: dilated_attention(a, b, c, branches, causal=True,
                                                           document_ids=ids), low, d_out, exact)

        def ours(q, k, v, branches, causal):
            return dilated_attention(q, k, v, branches, causal=causal, return_lse=True)

        alone_errors = _errors(
            lambda a, b, c: per_document_reference(a, b, c, PACKED, branches, True, ours)[0],
            low, d_out, exact,
        )
        packed_worst = [max(a, b) for a, b in zip(packed_worst, packed)]
        alone_worst = [max(a, b) for a, b in zip(alone_worst, alone_errors)]
    _report(f"packed documents {dtype}", packed_worst, alone_worst, "each document alone")
    for name, a, b in zip(("out", "dq", "dk", "dv"), packed_worst, alone_worst):
        assert a <= ALLOWED * b, f"packed {dtype}: {name} error {a:.3e} > {ALLOWED} x {b:.3e}"


def test_misaligned_views_are_exact():
    """A view at an odd element offset (a slice of a wider tensor) breaks the 16-byte
    alignment the fused kernels load with; it must be copied, not read wrongly."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    wide = torch.randn(1, 77, 4, 65, generator=gen, device="cuda", dtype=torch.float64)
    q64 = wide[..., 1:]
    branches = [(10, 1), (30, 3)]
    truth, _ = dense_dilated_attention(q64, q64, q64, branches, True)
    low = wide.to(torch.bfloat16)[..., 1:]
    assert low.data_ptr() % 16 != 0
    out = dilated_attention(low, low, low, branches, causal=True)
    assert (out.double() - truth).abs().max().item() < 3e-2


def test_a_million_tokens_forward_and_backward_on_one_gpu():
    n = 2**20
    pattern = DilatedPattern.geometric(10)  # (2048, 1) ... (2**20, 512)
    q, k, v = (torch.randn(1, n, 16, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = dilated_attention(q, k, v, pattern, causal=True)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all() and torch.isfinite(v.grad).all()


def test_model_trains_and_generates_on_cuda():
    config = LongNetConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                           max_positions=256, segment_lengths=(32, 64, 128),
                           dilation_rates=(1, 2, 4))
    torch.manual_seed(0)
    model = LongNetLM(config).cuda()
    tokens = torch.randint(0, 256, (2, 128), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all()
                                        for p in model.parameters() if p.grad is not None)
    model.eval()
    prompt = tokens[:1, :40]
    generated = model.generate(prompt, max_new_tokens=24, temperature=0.0)
    with torch.no_grad():  # greedy by recomputing the whole sequence at every step
        recomputed = prompt
        for _ in range(24):
            logits = model(recomputed).logits[:, -1]
            recomputed = torch.cat([recomputed, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, recomputed)
