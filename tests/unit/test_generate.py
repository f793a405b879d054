"""Generation with the dilated KV cache equals recomputing the full sequence at every step."""

from __future__ import annotations

import math

import pytest
import torch

from longnet.modeling import LongNetConfig, LongNetLM

F64 = torch.float64
PATTERN = dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4))


def make_lm(seed=0, **overrides) -> LongNetLM:
    config = dict(
        vocab_size=48,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_positions=64,
        position_encoding="xpos",
        xpos_scale_base=16.0,
        sub_ln=True,
        initializer_range=0.3,  # larger than the 0.02 default: context-dependent, diverse output
        **PATTERN,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return LongNetLM(LongNetConfig(**config)).double().eval()


def greedy_by_recomputation(model: LongNetLM, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Reference: the whole sequence through the model, no cache, at every step."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(steps):
            next_ids = model(tokens).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat((tokens, next_ids), dim=1)
    return tokens


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"position_encoding": "rope"},
        {"position_encoding": "learned", "sub_ln": False, "norm": "rmsnorm", "ffn_kind": "glu"},
    ],
    ids=["xpos", "rope", "learned"],
)
def test_greedy_with_cache_equals_recomputation_across_segments(overrides):
    model = make_lm(**overrides)
    prompt = torch.randint(0, 48, (2, 5))
    steps = 45  # positions 5..49: crosses many 4/8/16 segment boundaries
    expected = greedy_by_recomputation(model, prompt, steps)
    generated = model.generate(prompt, steps, temperature=0)
    assert generated.shape == (2, 5 + steps)
    assert torch.equal(generated, expected)
    assert (
        min(len(set(row[5:].tolist())) for row in generated) > 5
    )  # not a degenerate constant continuation


def test_cache_holds_at_most_about_one_largest_segment():
    model = make_lm()
    cache = model.new_cache()
    tokens = torch.randint(0, 48, (1, 3))
    sizes = []
    with torch.no_grad():
        model(tokens, cache=cache)
        for _ in range(60):
            model(torch.randint(0, 48, (1, 1)), cache=cache)
            sizes.append(len(cache[0]))
    assert cache.next_position == 63
    assert max(sizes) <= 16 and cache[0].start == 48


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
    model = make_lm()
    prompt = torch.randint(0, 48, (2, 4))
    a = model.generate(
        prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1)
    )
    b = model.generate(
        prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(a, b) and int(a.max()) < 48 and int(a.min()) >= 0
    greedy = model.generate(prompt, 12, temperature=0)
    assert torch.equal(model.generate(prompt, 12, temperature=1.0, top_k=1), greedy)
    assert torch.equal(model.generate(prompt, 12, temperature=0, use_cache=False), greedy)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_stops_at_eos_and_restores_training_mode():
    model = make_lm()
    prompt = torch.randint(0, 48, (1, 4))
    greedy = model.generate(prompt, 30, temperature=0)
    eos = int(greedy[0, 6])  # the third generated token
    first = 4 + greedy[0, 4:].tolist().index(eos)
    out = model.generate(prompt, 30, temperature=0, eos_token_id=eos)
    assert out.shape[1] == first + 1 and int(out[0, -1]) == eos
    model.train()
    model.generate(prompt, 3)
    assert model.training


def test_generation_argument_errors():
    model = make_lm()
    prompt = torch.randint(0, 48, (1, 4))
    for temperature in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=f"temperature must be a finite number >= 0 .*, "
                                             f"got {temperature!r}"):
            model.generate(prompt, 3, temperature=temperature)
    for temperature, kind in ((True, "bool"), ("1", "str")):
        with pytest.raises(ValueError, match=f"temperature must be a number .*, not a {kind}: "
                                             f"got {temperature!r}"):
            model.generate(prompt, 3, temperature=temperature)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 3, top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, -1)
    learned = make_lm(position_encoding="learned")
    with pytest.raises(ValueError, match="learned positions"):
        learned.generate(prompt, 61)
