"""Autoregressive generation with a KV cache that follows the dilated pattern."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from longnet.nn.kv_cache import KVCache
from longnet.validation import check_bool, check_number, check_positive_int, describe, is_int


def sample_next(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids ``(batch,)`` from last-position logits ``(batch, vocab)``."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check(
    model: nn.Module, input_ids: Tensor, max_new_tokens, temperature, top_k, eos_token_id,
    generator, use_cache,
) -> None:
    if not is_int(max_new_tokens):
        raise TypeError(f"max_new_tokens must be an int, got {describe(max_new_tokens)}.")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if not math.isfinite(check_number("temperature", temperature)) or temperature < 0:
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}."
        )
    if top_k is not None:
        check_positive_int("top_k", top_k)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__} "
            f"{generator!r}; seed one with torch.Generator().manual_seed(seed)."
        )
    check_bool("use_cache", use_cache)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            "input_ids must be a (batch, seq) tensor with seq >= 1, got "
            f"{getattr(input_ids, 'shape', input_ids)!r}."
        )
    config = model.config
    if eos_token_id is not None and (
        not is_int(eos_token_id) or not 0 <= eos_token_id < config.vocab_size
    ):
        raise ValueError(
            f"eos_token_id must be None or a token id in 0..{config.vocab_size - 1}, got "
            f"{eos_token_id!r}; with another id generation could never stop on it."
        )
    total = input_ids.shape[1] + max_new_tokens
    if config.position_encoding == "learned" and total > config.max_positions:
        raise ValueError(
            f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds the {config.max_positions} learned positions of this model; generate "
            "fewer tokens or shorten the prompt."
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Tensor:
    """See :meth:`longnet.modeling.LongNetLM.generate` (``model``: a ``LongNetLM``)."""
    _check(model, input_ids, max_new_tokens, temperature, top_k, eos_token_id, generator,
           use_cache)
    was_training = model.training
    model.eval()
    try:
        tokens = input_ids
        if max_new_tokens == 0:
            return tokens
        cache = model.new_cache() if use_cache else None
        logits = _last_logits(model, tokens, cache)
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for step in range(max_new_tokens):
            next_ids = sample_next(logits, temperature, top_k, generator)
            if eos_token_id is not None:
                next_ids = next_ids.masked_fill(finished, eos_token_id)
                finished = finished | (next_ids == eos_token_id)
            tokens = torch.cat((tokens, next_ids[:, None].to(tokens.dtype)), dim=1)
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            logits = (_last_logits(model, tokens[:, -1:], cache) if use_cache
                      else _last_logits(model, tokens, None))
        return tokens
    finally:
        model.train(was_training)


def _last_logits(model: nn.Module, tokens: Tensor, cache: KVCache | None) -> Tensor:
    """``(batch, vocab)`` logits of the last position only (a whole prompt's would be GBs)."""
    return model.lm_head(model.model(tokens, cache=cache)[:, -1])
