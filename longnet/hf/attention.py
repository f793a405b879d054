"""LongNet dilated attention in ``transformers``' models: ``attn_implementation="longnet_dilated"``.

Importing ``longnet.hf`` registers :data:`ATTENTION_NAME` in ``transformers``'
``AttentionInterface`` and ``AttentionMaskInterface``; a model whose layers call the interface
(Llama, Mistral, Qwen2, ...) then runs exact dilated attention in place of dense attention::

    model = AutoModelForCausalLM.from_pretrained(folder)
    use_dilated_attention(model, [(2048, 1), (4096, 2), (8192, 4)])

The pattern is the config attribute :data:`PATTERN_ATTRIBUTE` (``[[segment_length,
dilation_rate], ...]``, saved with the model), the retrieval branches
:data:`RETRIEVAL_ATTRIBUTE` (``{"sinks": n, "block": b, "top_k": k}``, placed at the keys' own
positions: ``q, k`` arrive rotated, so ``LongNetConfig.retrieval_positions`` needs
``LongNetLM``). Keys are laid out from position 0: as many queries as keys is one
``dilated_attention``, fewer (decoding against ``transformers``' cache) is
``decode_attention``, O(largest segment) per token. Padding, packed sequences, other
positions, dropout and sliding windows are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from longnet.attention import DilatedPattern, Retrieval, dilated_attention
from longnet.attention.selection import check_retrieval
from longnet.nn.kv_cache import decode_attention

ATTENTION_NAME = "longnet_dilated"
PATTERN_ATTRIBUTE = "longnet_pattern"
RETRIEVAL_ATTRIBUTE = "longnet_retrieval"


def longnet_dilated_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``transformers``' attention function: ``query`` ``(batch, heads, q, head_dim)``,
    ``key``/``value`` ``(batch, kv_heads, k, head_dim)`` (all keys so far, ``q <= k``);
    returns ``(batch, q, heads, head_dim)`` and no weights.

    Raises:
        ValueError: no pattern in the config, padding, unusual positions, dropout or a
            sliding window (the message says what to change).
    """
    pattern = _pattern(module.config)
    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} runs unpadded rows only (its segments "
            "start at each row's first token); this batch is padded: run rows of different "
            "lengths as separate calls, or use a LongNetForCausalLM (longnet.hf), which "
            "groups left-padded rows."
        )
    if dropout:
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} has no attention-probability dropout "
            f"(got {dropout}); set the config's attention_dropout to 0."
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"attn_implementation={ATTENTION_NAME!r} replaces dense attention; "
                         "a sliding-window layer cannot use it.")
    retrieval = _retrieval(module.config)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    queries, keys = q.shape[1], k.shape[1]
    _check_positions(kwargs.get("position_ids"), keys - queries, queries)
    if queries == keys:
        out = dilated_attention(q, k, v, pattern, causal=True, scale=scale, retrieval=retrieval)
        return out, None
    return decode_attention(q, k, v, 0, pattern, scale=scale, retrieval=retrieval), None


def longnet_dilated_mask(*args: Any, attention_mask: Tensor | None = None,
                         **kwargs: Any) -> Tensor | None:
    """The mask for :func:`longnet_dilated_attention`: None unless a row is padded."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


def _pattern(config: Any) -> DilatedPattern:
    value = getattr(config, PATTERN_ATTRIBUTE, None)
    if value is None:
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} needs the dilated pattern in the model "
            "config: call longnet.hf.use_dilated_attention(model, [(2048, 1), (4096, 2), "
            f"...]), or set config.{PATTERN_ATTRIBUTE} = [[2048, 1], [4096, 2], ...] and pass "
            "that config to from_pretrained; [[n, 1]] is dense attention over segments of n "
            "tokens."
        )
    try:
        return DilatedPattern.coerce([tuple(branch) for branch in value])
    except (TypeError, ValueError) as err:
        raise ValueError(f"config.{PATTERN_ATTRIBUTE} = {value!r}: {err}") from None


def _retrieval(config: Any) -> Retrieval | None:
    """The retrieval branches of ``config.longnet_retrieval``, or None when absent."""
    value = getattr(config, RETRIEVAL_ATTRIBUTE, None)
    if value is None:
        return None
    try:
        return Retrieval(**value)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"config.{RETRIEVAL_ATTRIBUTE} = {value!r}: {err} It takes the keys sinks, block, "
            "top_k and neighbors, e.g. {'sinks': 4, 'block': 64, 'top_k': 16}."
        ) from None


def _check_positions(position_ids: Tensor | None, first: int, length: int) -> None:
    """Refuse ``position_ids`` other than ``first .. first + length - 1`` in every row."""
    if position_ids is None:
        return
    expected = torch.arange(first, first + length, device=position_ids.device)
    if not bool((position_ids == expected).all()):
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} lays the keys out from position 0 of each "
            f"row: the queries must have positions {first}..{first + length - 1} (an unpadded "
            "batch, one sequence per row); packed sequences and other positions are refused, "
            "and so are caches with empty slots (StaticCache: use the default DynamicCache)."
        )


def use_dilated_attention(
    model: nn.Module, pattern: Any, retrieval: Retrieval | None = None
) -> nn.Module:
    """Make the ``transformers`` model ``model`` run :data:`ATTENTION_NAME` with ``pattern``
    (``[(segment_length, dilation_rate), ...]`` or a ``DilatedPattern``) and optional
    ``retrieval`` branches, set in ``model.config`` (saved with it); returns ``model``.

    Raises:
        ValueError: an invalid pattern, or neighbours beside a pattern without a rate-1 branch.
        TypeError: ``retrieval`` is not a :class:`~longnet.attention.Retrieval` or None.
    """
    pattern = DilatedPattern.coerce(pattern)
    retrieval = check_retrieval("use_dilated_attention", retrieval, pattern)
    setattr(model.config, PATTERN_ATTRIBUTE, [list(branch) for branch in pattern.branches])
    setattr(model.config, RETRIEVAL_ATTRIBUTE,
            None if retrieval is None else dataclasses.asdict(retrieval))
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def register() -> None:
    """Register :data:`ATTENTION_NAME` with ``transformers`` (done on ``import longnet.hf``)."""
    AttentionInterface.register(ATTENTION_NAME, longnet_dilated_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, longnet_dilated_mask)
