"""Packed documents through the model: ``LongNetLM(..., document_ids=...)`` computes each
document exactly as if it were run alone (positions, K/V convolution, attention), and its loss
never scores a document's first token as predicted from the document before it."""

from __future__ import annotations

import pytest
import torch

from longnet.constants import IGNORE_INDEX
from longnet.modeling import LongNetConfig, LongNetLM
from longnet.nn import CausalShortConv, document_position_ids

LENGTHS = [(5, 17, 1, 9), (32,), (12, 12, 8)]  # three batch elements of 32 tokens


def _packed_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 40, (len(LENGTHS), 32), generator=gen)
    document_ids = torch.tensor([
        [doc for doc, length in enumerate(lengths) for _ in range(length)] for lengths in LENGTHS
    ])
    return input_ids, document_ids


def _documents(row: int):
    """``(start, length)`` of each document of batch element ``row``."""
    starts = [sum(LENGTHS[row][:i]) for i in range(len(LENGTHS[row]))]
    return list(zip(starts, LENGTHS[row]))


def _lm(**overrides) -> LongNetLM:
    config = dict(
        vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, max_positions=64,
        segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), kv_conv_size=3,
        xpos_scale_base=16.0,
    )
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(**(config | overrides))).double().eval()
    with torch.no_grad():  # non-identity convolution taps, so that mixing rows would show
        for block in model.model.layers:
            block.attn.kv_conv.weight.normal_()
    return model


@pytest.mark.parametrize("position_encoding", ["xpos", "rope", "learned"])
def test_packed_logits_equal_each_document_alone(position_encoding):
    model = _lm(position_encoding=position_encoding)
    input_ids, document_ids = _packed_batch()
    packed = model(input_ids, document_ids=document_ids).logits
    for row in range(len(LENGTHS)):
        for start, length in _documents(row):
            alone = model(input_ids[row : row + 1, start : start + length]).logits
            torch.testing.assert_close(packed[row : row + 1, start : start + length], alone,
                                       atol=1e-12, rtol=0)


def test_packed_gradients_equal_the_sum_over_documents_alone():
    """With gradient checkpointing too: the packed loss's parameter gradients are those of
    the documents' losses run one by one."""
    model = _lm(position_encoding="rope", gradient_checkpointing=True).train()
    input_ids, document_ids = _packed_batch(1)
    weights = torch.randn(len(LENGTHS), 32, 40, dtype=torch.float64)
    packed = (model(input_ids, document_ids=document_ids).logits * weights).sum()
    packed_grads = torch.autograd.grad(packed, list(model.parameters()))
    alone = sum(
        (model(input_ids[row : row + 1, start : start + length]).logits
         * weights[row : row + 1, start : start + length]).sum()
        for row in range(len(LENGTHS)) for start, length in _documents(row)
    )
    alone_grads = torch.autograd.grad(alone, list(model.parameters()))
    for packed_grad, grad in zip(packed_grads, alone_grads):
        torch.testing.assert_close(packed_grad, grad, atol=1e-12, rtol=0)


def test_loss_ignores_the_first_token_of_every_later_document():
    model = _lm(position_encoding="rope")
    input_ids, document_ids = _packed_batch(2)
    labels = torch.cat((input_ids[:, 1:], torch.full((len(LENGTHS), 1), IGNORE_INDEX)), dim=1)
    packed = model(input_ids, targets=labels, document_ids=document_ids)
    loss_sum, tokens = 0.0, 0
    for row in range(len(LENGTHS)):
        for start, length in _documents(row):
            alone_labels = labels[row : row + 1, start : start + length].clone()
            alone_labels[:, -1] = IGNORE_INDEX  # a document alone has no next token to predict
            alone = model(input_ids[row : row + 1, start : start + length], targets=alone_labels)
            loss_sum, tokens = loss_sum + alone.loss_sum, tokens + int(alone.num_tokens)
    boundaries = sum(len(lengths) - 1 for lengths in LENGTHS)
    assert int(packed.num_tokens) == tokens == 3 * 31 - boundaries
    torch.testing.assert_close(packed.loss_sum, loss_sum, atol=1e-10, rtol=0)


def test_document_positions_and_convolution_stay_inside_documents():
    document_ids = torch.tensor([[0, 0, 0, 2, 2, 7], [1, 1, 1, 1, 1, 1]])
    assert document_position_ids(document_ids).tolist() == [[0, 1, 2, 0, 1, 0],
                                                            [0, 1, 2, 3, 4, 5]]
    conv = CausalShortConv(2, 3).double()
    with torch.no_grad():
        conv.weight.normal_()
    x = torch.randn(2, 6, 2, dtype=torch.float64)
    x[0, 2] = float("nan")  # the last row of a document reaches no later document
    y = conv(x, positions=document_position_ids(document_ids))
    for row, spans in ((0, [(0, 3), (3, 5), (5, 6)]), (1, [(0, 6)])):
        for start, end in spans:
            torch.testing.assert_close(y[row : row + 1, start:end],
                                       conv(x[row : row + 1, start:end]), atol=1e-14, rtol=0,
                                       equal_nan=True)
    assert torch.isfinite(y[0, 3:]).all()


def test_document_ids_are_checked_by_the_model():
    model = _lm()
    input_ids, document_ids = _packed_batch()
    with pytest.raises(ValueError, match=r"LongNetModel: document_ids has shape \(3, 31\), "
                                         r"expected \(batch, seq\) = \(3, 32\) of input_ids"):
        model(input_ids, document_ids=document_ids[:, 1:])
    with pytest.raises(ValueError, match="document_ids cannot be combined with a KV cache"):
        model(input_ids, document_ids=document_ids, cache=model.new_cache())
