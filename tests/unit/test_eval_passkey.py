"""Passkey grid: deterministic examples, exact answer checks, grid bookkeeping."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from longnet.data import ByteTokenizer, passkey_examples, passkey_match
from longnet.data.subword import from_backend
from longnet.data.synthetic import NEEDLE_JITTER, min_passkey_length, needle_window
from longnet.data.tokenizer import train_bpe
from longnet.eval import (
    accuracy_by_visibility,
    check_passkey_grid,
    copy_distance,
    evaluate_passkey,
)
from longnet.modeling import LongNetConfig, LongNetLM
from tests.reference import copy_visibility

SHORTEST = min_passkey_length(5)


class OracleLM(nn.Module):
    """Stands in for a LongNetLM: reads the key out of the prompt and 'generates'
    ``transform(key)``, padded with ``!`` to the requested number of bytes."""

    def __init__(self, transform=lambda key, prompt: key, **config) -> None:
        super().__init__()
        self.config = LongNetConfig(**{"hidden_size": 8, "num_layers": 1, "num_heads": 1,
                                       **config})
        self.weight = nn.Parameter(torch.zeros(1))
        self.transform = transform
        self.calls: list[tuple[int, ...]] = []

    def generate(self, input_ids, max_new_tokens, temperature=1.0, **_):
        assert temperature == 0  # greedy
        self.calls.append(tuple(input_ids.shape))
        tokenizer = ByteTokenizer()
        rows = []
        for row in input_ids.tolist():
            prompt = tokenizer.decode(row)
            key = re.search(r"The pass key is (\d+)\. Remember", prompt).group(1)
            text = (self.transform(key, prompt) + "!" * max_new_tokens)[:max_new_tokens]
            rows.append(row + tokenizer.encode(text))
        return torch.tensor(rows)


def test_examples_are_deterministic_per_seed():
    first = passkey_examples(4, 600, 0.5, seed=3)
    assert first == passkey_examples(4, 600, 0.5, seed=3)
    assert [e.answer for e in first] != [e.answer for e in passkey_examples(4, 600, 0.5, seed=4)]
    for example in first:
        assert len(example.prompt) + len(example.answer) == 600


def test_answer_check_is_exact():
    assert passkey_match("71432!", "71432")
    assert passkey_match("71432", "71432")
    assert not passkey_match("714325", "71432")  # a longer number is wrong
    assert not passkey_match("7143", "71432")
    assert not passkey_match(" 71432", "71432")


def test_grid_cells_accuracy_and_order():
    lengths, depths = [SHORTEST + 50, 700], [0.0, 0.5, 1.0]
    model = OracleLM()
    cells = evaluate_passkey(model, lengths, depths, num_examples=3, seed=1, batch_size=2)
    assert [(c.length, c.depth) for c in cells] == [(n, d) for n in lengths for d in depths]
    assert all(c.accuracy == 1.0 and c.num_examples == 3 for c in cells)
    # 3 examples with batch_size 2: batches of 2 and 1, prompts of length - 5 bytes
    assert model.calls[:2] == [(2, lengths[0] - 5), (1, lengths[0] - 5)]
    assert cells[0].outcomes[0].generated == cells[0].outcomes[0].answer + "!"
    first_cell = passkey_examples(3, lengths[0], depths[0], seed=1)
    assert [o.needle_distance for o in cells[0].outcomes] == [
        len(e.prompt) - e.prompt.index("The pass key is") for e in first_cell
    ]
    budgets = {n: n - SHORTEST for n in lengths}  # the needle lies within a filler period
    assert all(abs(c.mean_depth - c.depth) * budgets[c.length] <= 2 * NEEDLE_JITTER for c in cells)
    again = evaluate_passkey(OracleLM(), lengths, depths, num_examples=3, seed=1)
    assert [c.outcomes for c in again] == [c.outcomes for c in cells]


def test_grid_counts_only_exact_answers():
    longer = OracleLM(lambda key, prompt: key + "7")
    cells = evaluate_passkey(longer, [600], [0.0, 1.0], num_examples=2)
    assert [c.accuracy for c in cells] == [0.0, 0.0]

    def early_only(key: str, prompt: str) -> str:  # right only when the needle comes early
        return key if prompt.index("The pass key is") < 300 else "00000"

    cells = evaluate_passkey(OracleLM(early_only), [1000], [0.0, 1.0], num_examples=4)
    assert [c.accuracy for c in cells] == [1.0, 0.0]
    assert [c.num_correct for c in cells] == [4, 0]


def test_accuracy_by_visibility_splits_copies_by_what_the_heads_see():
    """A model that answers exactly the copies some head of its pattern sees (by the rules,
    not by ``key_multiplicity``) scores 1 on ``dense`` and ``sparse`` and 0 on ``unseen``;
    every outcome's visibility and each row's count are those of the rules. Two heads and a
    rate of 4: queries at offsets 2 and 3 have no head in that branch."""
    branches, heads = [(128, 1), (256, 2), (1024, 4)], 2

    def copy(prompt: str) -> tuple[int, int]:
        return len(prompt) - 1, prompt.index("The pass key is ") + len("The pass key is ")

    def seen_only(key: str, prompt: str) -> str:
        return key if copy_visibility(*copy(prompt), branches, heads) != "unseen" else "00000"

    model = OracleLM(seen_only, num_heads=heads, max_positions=1024,
                     segment_lengths=[w for w, _ in branches],
                     dilation_rates=[r for _, r in branches])
    lengths, depths = [300, 1000], [0.0, 0.5, 1.0]
    cells = evaluate_passkey(model, lengths, depths, num_examples=8, seed=2)
    expected: dict[tuple[int, str], list[int]] = {}
    for cell in cells:
        examples = passkey_examples(8, cell.length, cell.depth, seed=2)
        for example, outcome in zip(examples, cell.outcomes):
            kind = copy_visibility(*copy(example.prompt), branches, heads)
            assert outcome.visibility == kind and outcome.correct == (kind != "unseen")
            tally = expected.setdefault((cell.length, kind), [0, 0])
            tally[0] += 1
            tally[1] += kind != "unseen"
    assert {kind for _, kind in expected} == {"dense", "sparse", "unseen"}
    rows = accuracy_by_visibility(cells)
    order = ["dense", "sparse", "unseen"]
    assert [(r["context_length"], r["visibility"], r["examples"], r["correct"]) for r in rows] == [
        (length, kind, *expected[length, kind]) for length in lengths for kind in order
        if (length, kind) in expected]
    assert {r["visibility"]: r["accuracy"] for r in rows} == {
        "dense": 1.0, "sparse": 1.0, "unseen": 0.0}


def test_copy_distance_counts_the_tokens_from_the_needles_key_to_the_answers_query():
    """In a subword tokenizer's tokens of ``prompt + answer``, from the token holding the key's
    first digit in the needle to the token before the one holding the answer's first digit
    (the query that predicts it): found here by decoding prefixes, not from the tokenizer's
    offsets."""
    examples = [e for depth in (0.0, 0.5) for e in passkey_examples(4, 700, depth, seed=5)]
    texts = [e.prompt + e.answer + "." for e in examples]
    numbers = " ".join(str(n) for n in range(10_000, 99_999, 7))  # merges " 5" and the like
    tokenizer = from_backend(train_bpe([*texts, numbers], 400), "bpe:400")

    def token_holding(ids: list[int], char: int) -> int:
        return next(t for t in range(len(ids)) if len(tokenizer.decode(ids[:t + 1])) > char)

    distances = []
    for example in examples:
        ids = tokenizer.encode(example.prompt + example.answer)
        key = example.prompt.index("The pass key is ") + len("The pass key is ")
        expected = token_holding(ids, len(example.prompt)) - 1 - token_holding(ids, key)
        assert copy_distance(example, tokenizer) == expected
        assert copy_distance(example) == len(example.prompt) - 1 - key  # bytes
        assert tokenizer.decode(ids[token_holding(ids, key):]).lstrip().startswith(
            example.answer)
        distances.append(expected)
    assert len(set(distances)) > 2  # the needles' places differ in tokens too


def test_bad_grids_are_refused():
    with pytest.raises(ValueError, match="too short"):
        check_passkey_grid([SHORTEST - 1], [0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_passkey_grid([600], [1.5])
    with pytest.raises(ValueError, match="repeat"):
        check_passkey_grid([600, 600], [0.5])
    with pytest.raises(ValueError, match="context length must be a positive integer, got 0"):
        check_passkey_grid([0], [0.5])
    with pytest.raises(ValueError, match="at least one"):
        check_passkey_grid([], [0.5])
    with pytest.raises(ValueError, match="num_examples"):
        evaluate_passkey(OracleLM(), [600], [0.5], num_examples=0)
    torch.manual_seed(0)
    learned = LongNetLM(LongNetConfig(hidden_size=16, num_layers=1, num_heads=2,
                                      max_positions=256, position_encoding="learned"))
    with pytest.raises(ValueError, match="longer than possible"):
        evaluate_passkey(learned, [600], [0.5], num_examples=1)


def test_real_model_runs_greedy_and_deterministically():
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(
        hidden_size=32, num_layers=2, num_heads=2, max_positions=64,
        segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4), eos_token_id=255,
    )).eval()
    first = evaluate_passkey(model, [260], [0.5], num_examples=2, batch_size=2)
    second = evaluate_passkey(model, [260], [0.5], num_examples=2, batch_size=1)
    assert [c.outcomes for c in first] == [c.outcomes for c in second]
    for cell in first:
        assert 0.0 <= cell.accuracy <= 1.0
        for outcome in cell.outcomes:
            assert outcome.correct == passkey_match(outcome.generated, outcome.answer)
    assert np.isfinite([c.mean_depth for c in first]).all()


def test_the_needle_is_at_the_requested_depth_at_short_lengths():
    """At 256 bytes (19 filler bytes) every depth drew its needle from the whole filler, so
    depths 0, 0.5 and 1 were one cell three times (mean depth 0.053 each)."""
    budget = 256 - SHORTEST
    means = []
    for depth in (0.0, 0.5, 1.0):
        examples = passkey_examples(10, 256, depth, seed=0)
        assert all(abs(e.depth - depth) <= 1 / 3 for e in examples), (depth, examples)
        low, high = needle_window(budget, depth)
        assert all(low <= round(e.depth * budget) <= high for e in examples)
        means.append(sum(e.depth for e in examples) / len(examples))
    assert means[0] < 0.25 < means[1] < 0.75 < means[2]


@pytest.mark.parametrize("budget", [6 * NEEDLE_JITTER, 2049 - SHORTEST, 16384])
def test_long_fillers_keep_a_needle_window_of_one_filler_period(budget):
    """Lengths from 507 bytes on (512 in the published results) place their needles as
    before: anywhere in one filler period, so a cell covers every alignment."""
    for depth in (0.0, 0.3, 1.0):
        low, high = needle_window(budget, depth)
        assert high - low == 2 * NEEDLE_JITTER and low >= 0 and high <= budget
        assert low == min(max(0, round(depth * budget) - NEEDLE_JITTER), budget - high + low)


class SubwordOracleLM(OracleLM):
    """The oracle in a subword tokenizer's tokens: it continues the prompt as the text goes on
    (" <key>." after "The pass key is"), one token of it per step."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.config = LongNetConfig(hidden_size=8, num_layers=1, num_heads=1,
                                    vocab_size=tokenizer.vocab_size)

    def generate(self, input_ids, max_new_tokens, temperature=1.0, **_):
        assert temperature == 0
        rows = []
        for row in input_ids.tolist():
            prompt = self.tokenizer.decode(row)
            assert prompt.endswith("The pass key is")  # read without its final space
            key = re.search(r"The pass key is (\d+)\. Remember", prompt).group(1)
            full = self.tokenizer.encode(prompt + f" {key}. The end")
            rows.append(full[:len(row) + max_new_tokens])
        return torch.tensor(rows)


def test_passkey_with_a_subword_tokenizer_reads_prompts_on_a_token_boundary():
    from longnet.eval.passkey import prompt_text

    examples = passkey_examples(6, 400, 0.5, seed=2)
    texts = [e.prompt + e.answer + "." for e in examples]
    numbers = " ".join(str(n) for n in range(10_000, 99_999, 7))  # merges " 5" and the like
    tokenizer = from_backend(train_bpe([*texts, numbers], 400), "bpe:400")
    for example in examples:  # the held-back space belongs to the key's first token
        text, held = prompt_text(example.prompt, tokenizer)
        assert held == " " and text + held == example.prompt
        whole = tokenizer.encode(example.prompt + example.answer)
        assert whole[:len(tokenizer.encode(text))] == tokenizer.encode(text)
        assert whole[:len(tokenizer.encode(example.prompt))] != tokenizer.encode(example.prompt)
    (cell,) = evaluate_passkey(SubwordOracleLM(tokenizer), [400], [0.5], num_examples=6,
                               seed=2, tokenizer=tokenizer)
    assert cell.accuracy == 1.0
    assert all(o.generated.startswith(o.answer + ".") for o in cell.outcomes)
    assert all(o.prompt_tokens < 400 - 5 for o in cell.outcomes)
