"""The one-device core as a custom op (``longnet::dilated_attention``): ``opcheck`` passes, it
equals the autograd function the sequence-parallel path runs (outputs and every gradient, bit
for bit), ``dilated_attention`` routes one-device calls through it, and attention layers
compile with ``fullgraph=True``; packed documents resolved once per model forward."""

from __future__ import annotations

import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import longnet.attention.documents as documents_module
from longnet.attention import DilatedPattern, dilated_attention
from longnet.attention.dilated import _DilatedAttention
from longnet.attention.documents import PackedDocuments, resolve_documents
from longnet.attention.op import dilated_attention_op, flat_documents
from longnet.attention.plan import plan_attention
from longnet.modeling import LongNetConfig, LongNetLM
from longnet.nn import (
    LearnedPositionalEmbedding,
    MultiheadDilatedAttention,
    RotaryEmbedding,
    TransformerBlock,
    XPos,
    build_feed_forward,
    build_norm,
    document_position_ids,
)
from tests.reference import document_ids_of

BRANCHES = [(4, 1), (8, 2), (16, 4)]
DOCUMENTS = ((5, 11, 8), (24,))  # two batch elements of 24 tokens


def _inputs(dtype=torch.float64, seq=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, seq, 3, 8, generator=gen, dtype=dtype) for _ in range(3)]


def _op_args(q, k, v, causal, branches=BRANCHES, documents=None, kernel="auto",
             block_elements=None):
    pattern = DilatedPattern(branches)
    return (q, k, v, list(pattern.segment_lengths), list(pattern.dilation_rates), causal,
            q.shape[-1] ** -0.5, kernel, block_elements, *flat_documents(documents))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["one-document", "packed"])
def test_opcheck(causal, documents):
    """Fake (meta) shapes, strides and dtypes, schema, autograd registration and AOT dispatch,
    rates > 1, both outputs (``lse`` included) in float64."""
    q, k, v = (t.requires_grad_() for t in _inputs())
    torch.library.opcheck(dilated_attention_op, _op_args(q, k, v, causal, documents=documents))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fake_outputs(dtype):
    """``out`` like ``q``; ``lse`` ``(batch, heads, seq)`` in float32, float64 for float64."""
    with FakeTensorMode():
        q = torch.empty(2, 24, 3, 8, dtype=dtype)
        out, lse = dilated_attention_op(*_op_args(q, q, q, True))
    assert (out.shape, out.dtype) == (q.shape, dtype)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert (tuple(lse.shape), lse.dtype) == ((2, 3, 24), lse_dtype)


def _grads(fn, tensors, d_out, d_lse):
    """``fn(q, k, v) -> (out, lse)`` and the gradients of ``<out, d_out> + <lse, d_lse>``
    (``d_lse`` None: no gradient into ``lse``)."""
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = fn(*tensors)
    outputs, upstream = [out], [d_out]
    if d_lse is not None:
        outputs.append(lse)
        upstream.append(d_lse)
    return [out, lse, *torch.autograd.grad(outputs, tensors, upstream)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["one-document", "packed"])
@pytest.mark.parametrize("lse_grad", [True, False])
@pytest.mark.parametrize("block_elements", [None, 40])
def test_op_equals_autograd_function(causal, documents, lse_grad, block_elements):
    """Outputs and ``dq, dk, dv`` (random upstream gradients, into ``lse`` too or not) are
    bit for bit those of the autograd function the sequence-parallel path runs."""
    tensors = _inputs()
    gen = torch.Generator().manual_seed(1)
    d_out = torch.randn(tensors[0].shape, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(2, 3, 24, generator=gen, dtype=torch.float64) if lse_grad else None
    plan = plan_attention(DilatedPattern(BRANCHES), tuple(tensors[0].shape), torch.float64,
                          tensors[0].device, causal=causal, scale=8**-0.5,
                          block_elements=block_elements, documents=documents)
    function = _grads(lambda q, k, v: _DilatedAttention.apply(q, k, v, plan, None), tensors,
                      d_out, d_lse)
    op = _grads(lambda q, k, v: dilated_attention_op(*_op_args(
        q, k, v, causal, documents=documents, block_elements=block_elements)), tensors, d_out,
        d_lse)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), op, function):
        assert torch.equal(got, want), name


def test_one_device_calls_run_the_op():
    """``dilated_attention`` on one device (with ids or resolved documents) is the op."""
    q, k, v = (t.requires_grad_() for t in _inputs())
    ids = document_ids_of(DOCUMENTS)
    for document_ids in (None, ids, resolve_documents(ids, 2, 24, q.device)):
        out = dilated_attention(q, k, v, BRANCHES, causal=True, document_ids=document_ids)
        assert "longnet_dilated_attention" in out.grad_fn.name()


def test_resolved_documents_equal_ids():
    q, k, v = _inputs()
    ids = document_ids_of(DOCUMENTS)
    by_ids = dilated_attention(q, k, v, BRANCHES, causal=True, document_ids=ids,
                               return_lse=True)
    resolved = dilated_attention(q, k, v, BRANCHES, causal=True, return_lse=True,
                                 document_ids=resolve_documents(ids, 2, 24, q.device))
    assert all(torch.equal(a, b) for a, b in zip(by_ids, resolved))


def test_resolved_documents_of_another_input_are_refused():
    q, k, v = _inputs()
    documents = resolve_documents(document_ids_of(DOCUMENTS), 2, 24, q.device)
    with pytest.raises(ValueError, match=r"resolved for ids of shape \(2, 24\).*\(2, 12\)"):
        dilated_attention(q[:, :12], k[:, :12], v[:, :12], BRANCHES, document_ids=documents)
    wrong = PackedDocuments(documents.ids, ((5, 11), (24,)))
    with pytest.raises(ValueError, match=r"\[16, 24\] tokens per batch element"):
        dilated_attention(q, k, v, BRANCHES, document_ids=wrong)


def _block(positional, kv_conv_size):
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(24, 3, BRANCHES, positional=positional,
                                     kv_conv_size=kv_conv_size)
    ffn = build_feed_forward("glu", 24, 48)
    return TransformerBlock(attn, ffn, build_norm("layernorm", 24, 1e-5),
                            build_norm("layernorm", 24, 1e-5)).double()


COMPILED = {
    "attention-rope": (lambda: _block(RotaryEmbedding(8), 0).attn, None),
    "block-xpos-conv-documents": (lambda: _block(XPos(8, 16), 3), DOCUMENTS),
}


def _compare_compiled(module, documents, backend):
    """Outputs, input and parameter gradients of ``module`` under ``torch.compile(fullgraph=
    True, backend=backend)`` against eager; returns the largest difference."""
    x = torch.randn(2, 24, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    upstream = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    packed = None
    if documents is not None:
        packed = resolve_documents(document_ids_of(documents), 2, 24, x.device)
    params = list(module.parameters())
    results = []
    for fn in (module, torch.compile(module, fullgraph=True, backend=backend)):
        inputs = x.clone().requires_grad_()
        out = fn(inputs, None, None, packed)
        results.append([out, *torch.autograd.grad(out, [inputs, *params], upstream)])
    torch._dynamo.reset()
    return max((a - b).abs().max().item() for a, b in zip(*results))


@pytest.mark.parametrize("name", list(COMPILED))
def test_layers_compile_fullgraph(name):
    """A layer (RoPE) and a block (xPos, K/V convolution, packed documents resolved once)
    compile without a graph break and give the eager outputs and gradients (float64)."""
    build, documents = COMPILED[name]
    assert _compare_compiled(build(), documents, "aot_eager") <= 1e-12


@pytest.mark.slow
def test_block_compiles_with_inductor():
    """The block with documents under inductor (CPU, C++ codegen), to 1e-12 in float64."""
    build, documents = COMPILED["block-xpos-conv-documents"]
    start = time.perf_counter()
    assert _compare_compiled(build(), documents, "inductor") <= 1e-12
    print(f"inductor compile and run: {time.perf_counter() - start:.1f} s")


def test_learned_positions_compile_and_keep_their_check():
    """The range check of learned positions runs inside the compiled graph (no graph break)
    and still refuses a position beyond the table."""
    embedding = LearnedPositionalEmbedding(16, 4)
    compiled = torch.compile(embedding, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(torch.arange(8)), embedding(torch.arange(8)))
    with pytest.raises(RuntimeError, match=r"cover positions 0\.\.15"):
        compiled(torch.arange(20))
    torch._dynamo.reset()


def test_check_finite_compiles_and_still_refuses():
    def attend(q):
        return dilated_attention(q, q, q, BRANCHES, causal=True, check_finite=True)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    q = _inputs()[0]
    assert torch.equal(compiled(q), attend(q))
    q[0, 3, 1, 2] = float("nan")
    with pytest.raises(RuntimeError, match="q holds NaN or infinite values"):
        compiled(q)
    torch._dynamo.reset()


def _refused_inputs():
    q = _inputs(torch.float32)[0]
    return {
        "no tokens": ((q[:, :0],) * 3, ValueError, "q has an empty dimension"),
        "no batch": ((q[:0],) * 3, ValueError, "q has an empty dimension"),
        "mixed dtypes": ((q, q.double(), q), TypeError, "q, k, v dtypes differ"),
        "kv of another length": ((q, q[:, :16], q[:, :16]), ValueError,
                                 "kv_heads dividing heads"),
        "kv heads not dividing heads": ((q, q[:, :, :2], q[:, :, :2]), ValueError,
                                        "kv_heads dividing heads"),
        "integers": ((q.long(),) * 3, TypeError, "q has dtype torch.int64; use a floating"),
    }


@pytest.mark.parametrize("case", list(_refused_inputs()))
def test_inputs_eager_mode_refuses_are_refused_in_the_projects_words_when_compiled(case):
    """Under ``fullgraph=True`` the project's message is Dynamo's reason (its first lines, not
    a debug line); a plain compile raises the eager exception itself."""
    args, error, message = _refused_inputs()[case]

    def attend(q, k, v):
        return dilated_attention(q, k, v, BRANCHES, causal=True)

    with pytest.raises(error, match=message):
        attend(*args)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(attend, fullgraph=True, backend="aot_eager")(*args)
    assert message in "\n".join(str(info.value).splitlines()[:2]), info.value
    with pytest.raises(error, match=message):
        torch.compile(attend, backend="aot_eager")(*args)
    torch._dynamo.reset()


def test_a_layer_refuses_its_input_in_the_projects_words_when_compiled():
    layer = MultiheadDilatedAttention(24, 3, BRANCHES, causal=True).double()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for x, message in ((torch.randn(1, 24, 16, dtype=torch.float64), "embed_dim 24, got"),
                       (torch.randn(1, 24, 24), "x has dtype torch.float32")):
        with pytest.raises(torch._dynamo.exc.Unsupported) as info:
            compiled(x)
        assert message in "\n".join(str(info.value).splitlines()[:2]), info.value
    x = torch.randn(1, 24, 24, dtype=torch.float64)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        compiled(x, torch.arange(23))
    assert "position_ids has shape (23,)" in "\n".join(str(info.value).splitlines()[:2])
    torch._dynamo.reset()


def test_the_documented_compile_limits_name_the_supported_way():
    """Raw ``document_ids`` in a fullgraph region and ``LongNetLM`` compiled whole say what to
    do: resolve the documents beforehand; compile the blocks."""
    q = _inputs()[0]
    ids = document_ids_of(DOCUMENTS)
    attend = torch.compile(lambda q, ids: dilated_attention(q, q, q, BRANCHES, document_ids=ids),
                           fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        attend(q, ids)
    assert "resolve them beforehand" in "\n".join(str(info.value).splitlines()[:2]), info.value
    resolved = resolve_documents(ids, 2, 24, q.device)
    assert torch.equal(attend(q, resolved), dilated_attention(q, q, q, BRANCHES,
                                                              document_ids=ids))
    model = LongNetLM(LongNetConfig(vocab_size=40, hidden_size=24, num_layers=1, num_heads=3,
                                    segment_lengths=(4, 8), dilation_rates=(1, 2))).eval()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for ids, message in ((torch.randint(0, 40, (1, 8)), "compile the model's blocks"),
                         (torch.rand(1, 8), "input_ids must have an integer dtype")):
        with pytest.raises(torch._dynamo.exc.Unsupported) as info:
            compiled(ids)
        assert message in "\n".join(str(info.value).splitlines()[:2]), info.value
    torch._dynamo.reset()


def test_model_resolves_documents_once(monkeypatch):
    """A forward of ``num_layers`` layers with ``document_ids`` copies the ids to the host
    once (the layers take the resolved documents), and gives what layers resolving the ids
    each call give."""
    config = LongNetConfig(vocab_size=40, hidden_size=24, num_layers=3, num_heads=3,
                           segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), kv_conv_size=3)
    torch.manual_seed(0)
    model = LongNetLM(config).double().eval()
    input_ids = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(4))
    ids = document_ids_of(DOCUMENTS)
    calls = []
    check = documents_module.check_document_ids

    def counted(*args, **kwargs):
        calls.append(args)
        return check(*args, **kwargs)

    monkeypatch.setattr(documents_module, "check_document_ids", counted)
    logits = model(input_ids, document_ids=ids).logits
    assert len(calls) == 1
    backbone = model.model
    h = backbone.embed_tokens(input_ids)
    for layer in backbone.layers:  # each layer resolving the ids itself
        h = layer(h, document_position_ids(ids), None, ids)
    assert len(calls) == 1 + config.num_layers
    assert torch.equal(logits, model.lm_head(backbone.final_norm(h)))
