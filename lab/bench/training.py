"""Harness of ``lab/scripts/bench_training.py``: the cost of one training step of a LongNet LM.

A step is what ``longnet fit`` runs per batch: forward, loss, backward and an AdamW update, on
random bytes of ``(batch, length)`` (the weights are freshly initialised; the script flushes
subnormal floats as the command does, without which a trained model's sharp attention makes
the CPU attention backward slower: ``longnet.denormals``). Each model is timed
twice at every length: with its own dilated pattern, and as its *dense twin*, the same model
with one branch ``(length, 1)`` (dense causal attention).
Timings of one length interleave the two systems (dilated, dense, dense, dilated, ...) and
report medians.

``profile_step`` splits one step's time by where it goes: the attention block kernels
(forward, backward), the rest of the attention (gathers, LSE merges, scatters), the matrix
products of the projections and the feed-forward, norms, element-wise work (activations,
positional encodings, residuals), the loss, and the optimizer; ``branch_seconds`` times each
branch of the pattern alone (forward + backward of the attention core at the model's shapes).
``forward_macs`` counts the multiply-accumulates of one forward pass, the arithmetic bound on
what the dilated pattern can save against the dense twin.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from longnet.attention import DilatedPattern, dilated_attention
from longnet.modeling import LongNetConfig, LongNetLM

SYSTEMS = ("dilated", "dense")
PRECISIONS = ("32", "bf16")

# aten op name -> category of profile_step (first matching rule wins; the rest is "other")
CATEGORIES = (
    ("attention kernels, forward", ("_scaled_dot_product_flash_attention_for_cpu",
                                    "_scaled_dot_product_efficient_attention",
                                    "_scaled_dot_product_flash_attention")),
    ("matrix products (projections, FFN, logits)", ("aten::mm", "aten::addmm", "aten::bmm",
                                                    "aten::linear")),
    ("norms", ("layer_norm", "rms_norm")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "_log_softmax")),
)
OTHER = "other (element-wise: activations, positions, residuals, copies)"
OPTIMIZER = "optimizer (AdamW)"


@dataclass(frozen=True)
class StepTiming:
    """Median seconds of one training step of ``system`` at ``length`` tokens per sample."""

    system: str
    length: int
    batch: int
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.length / self.median


def twin_config(config: LongNetConfig, system: str, length: int) -> LongNetConfig:
    """``config`` itself (``"dilated"``) or its dense twin at ``length`` (``"dense"``: one
    branch ``(length, 1)``), with room for ``length`` positions."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}.")
    changes = {"max_positions": max(config.max_positions, length)}
    if system == "dense":
        changes |= {"segment_lengths": (length,), "dilation_rates": (1,)}
    return dataclasses.replace(config, **changes)


class TrainingStep:
    """A model, its AdamW optimizer and random inputs on ``device``: ``run()`` is one timed
    training step (on CUDA, timed to the end of the device's work)."""

    def __init__(self, config: LongNetConfig, length: int, batch: int, precision: str,
                 seed: int = 0, device: torch.device | str = "cpu") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = LongNetLM(config).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = torch.randint(0, config.vocab_size, (batch, length), device=self.device)
        self.targets = self.tokens.roll(-1, dims=1)  # next-token targets (the last wraps)
        self.precision = precision

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self) -> float:
        self._synchronize()
        started = time.perf_counter()
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.precision == "bf16"):
            loss = self.model(self.tokens, targets=self.targets).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._synchronize()
        return time.perf_counter() - started


def time_length(config: LongNetConfig, length: int, *, batch: int, precision: str,
                steps: int, warmup: int, systems: Sequence[str] = SYSTEMS,
                device: torch.device | str = "cpu") -> list[StepTiming]:
    """Median step times of every system at one length, interleaved (the order flips every
    round)."""
    runners = {s: TrainingStep(twin_config(config, s, length), length, batch, precision,
                               device=device)
               for s in systems}
    for runner in runners.values():
        for _ in range(warmup):
            runner.run()
    seconds: dict[str, list[float]] = {s: [] for s in systems}
    for round_index in range(steps):
        order = list(systems) if round_index % 2 == 0 else list(reversed(systems))
        for system in order:
            seconds[system].append(runners[system].run())
    return [StepTiming(s, length, batch, seconds[s]) for s in systems]


def attention_pairs(pattern: DilatedPattern, length: int, num_heads: int) -> int:
    """Causal (query, key) pairs the branches of ``pattern`` score over ``length`` positions,
    summed over heads and branches (a pair two branches give counts twice).

    Per branch ``(w, r)``, a segment of ``L`` positions gives head ``h`` the ``m`` positions
    ``p < L`` with ``p % r == h % r``, and those ``m`` queries score ``m (m + 1) / 2`` pairs.
    """
    pairs = 0
    for w, r in pattern.branches:
        for start in range(0, length, w):
            size = min(w, length - start)
            for head in range(num_heads):
                m = max(0, -(-(size - head % r) // r))
                pairs += m * (m + 1) // 2
    return pairs


def forward_macs(config: LongNetConfig, length: int) -> dict[str, int]:
    """Multiply-accumulates of one forward pass over ``length`` tokens (one sample):
    ``"attention"`` (scores ``q k^T`` and the weighted sum of values, over every pair of
    :func:`attention_pairs` in every layer) and ``"matmuls"`` (every linear layer: projections,
    feed-forward and the logits). Element-wise work, norms, gathers and the K/V convolutions'
    ``kv_conv_size`` taps per channel are not counted; the backward pass costs about twice the
    forward in both parts."""
    with torch.device("meta"):
        model = LongNetLM(config)
    linear = sum(m.in_features * m.out_features for m in model.modules()
                 if isinstance(m, torch.nn.Linear))  # the logits' head is one, tied or not
    pairs = attention_pairs(config.pattern, length, config.num_heads)
    return {"attention": 2 * pairs * config.resolved_head_dim * config.num_layers,
            "matmuls": linear * length}


def _category(name: str) -> str:
    for category, needles in CATEGORIES:
        if any(needle in name for needle in needles):
            if category.startswith("attention kernels") and "backward" in name:
                return "attention kernels, backward"
            return category
    return OTHER


def profile_step(config: LongNetConfig, length: int, *, batch: int,
                 precision: str) -> list[tuple[str, float]]:
    """Seconds of one (warm) training step by category, largest first. Two categories are
    ranges rather than operators: the attention glue (the time inside the dilated-attention
    autograd function, forward and backward, that is not a block kernel) and the optimizer
    step; both are taken out of the element-wise rest, where their operators fall."""
    step = TrainingStep(config, length, batch, precision)
    step.run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step.run()
    totals: dict[str, float] = {}
    attention_total = optimizer_total = 0.0
    for event in prof.key_averages():
        if event.key in ("_DilatedAttention", "_DilatedAttentionBackward"):
            attention_total += event.cpu_time_total / 1e6
        if event.key.startswith("Optimizer.step#"):
            optimizer_total += event.cpu_time_total / 1e6
        if event.key.startswith("aten::") or "scaled_dot_product" in event.key:
            category = _category(event.key)
            totals[category] = totals.get(category, 0.0) + event.self_cpu_time_total / 1e6
    kernels = sum(v for k, v in totals.items() if k.startswith("attention kernels"))
    glue = max(0.0, attention_total - kernels)
    totals[OTHER] = max(0.0, totals.get(OTHER, 0.0) - glue - optimizer_total)
    totals["attention gathers, merges, scatters"] = glue
    totals[OPTIMIZER] = optimizer_total
    return sorted(totals.items(), key=lambda item: -item[1])


def branch_seconds(config: LongNetConfig, length: int, *, batch: int, precision: str,
                   repeats: int = 3) -> list[tuple[tuple[int, int], float]]:
    """Median seconds of forward + backward of the attention core for each branch of the
    pattern alone, at the model's head shapes, summed over its layers."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    heads, head_dim = config.num_heads, config.resolved_head_dim
    out = []
    for branch in config.pattern.branches:
        pattern = DilatedPattern((branch[0],), (branch[1],))
        q, k, v = (torch.randn(batch, length, heads, head_dim, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(batch, length, heads, head_dim, dtype=dtype)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            dilated_attention(q, k, v, pattern, causal=True).backward(grad)
            times.append(time.perf_counter() - started)
        out.append((branch, statistics.median(times[1:]) * config.num_layers))
    return out
