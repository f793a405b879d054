"""What ``LongNetLM.generate`` needs: its argument checks and next-token sampling."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

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


def check_generate(
    model: nn.Module, input_ids: Tensor, max_new_tokens: int, temperature: float,
    top_k: int | None, eos_token_id: int | None, generator: torch.Generator | None,
    use_cache: bool,
) -> None:
    """Raise ``TypeError``/``ValueError`` for arguments ``LongNetLM.generate`` cannot take."""
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
