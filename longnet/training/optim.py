"""AdamW with decoupled weight decay on matrices only, and a linear-warmup cosine schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from longnet.nn.short_conv import CausalShortConv


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay on parameters with >= 2 dims (linear weights, embeddings),
    none on vectors (biases, norm scales) and on the K/V convolutions' per-channel taps (they
    start as the identity; decay would pull them towards dropping the keys). Tied parameters
    appear once."""
    convolution_taps = {
        id(module.weight) for module in model.modules() if isinstance(module, CausalShortConv)
    }
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        matrix = param.dim() >= 2 and id(param) not in convolution_taps
        (decay if matrix else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based).

    Linear from ``1 / (warmup_steps + 1)`` up to 1 over ``warmup_steps`` steps, then a cosine
    from 1 down to ``min_lr_ratio`` at ``total_steps``; constant ``min_lr_ratio`` after that.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float,
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over ``params`` (groups from :func:`parameter_groups`) and its per-step schedule."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps)
    scheduler = LambdaLR(
        optimizer,
        lambda step: warmup_cosine(step, warmup_steps, total_steps, min_lr_ratio),
    )
    return optimizer, scheduler
