"""Passkey retrieval over a grid of context lengths x needle depths.

A cell ``(length, depth)`` holds ``num_examples`` prompts of ``length`` bytes
(``longnet.data.passkey_examples``), the needle near ``depth`` at a byte drawn per example so
that a cell covers every alignment modulo a dilation rate. The model reads the prompt in its own
tokenizer and greedily generates the answer; an example is correct when
``longnet.data.passkey_match`` accepts the decoded text. Each outcome also records the distance
the answer copies the key over (:func:`copy_distance`) and whether the dilated pattern lets a
head see that copy (:func:`visibility`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from longnet.attention import DilatedPattern
from longnet.data import ByteTokenizer, passkey_examples, passkey_match
from longnet.data.subword import SubwordTokenizer
from longnet.data.synthetic import PasskeyExample, check_passkey_options, min_passkey_length
from longnet.eval.sliding import check_context_length
from longnet.modeling import LongNetLM
from longnet.validation import check_non_negative_int, check_positive_int

DENSE, SPARSE, UNSEEN = "dense", "sparse", "unseen"
VISIBILITIES = (DENSE, SPARSE, UNSEEN)
"""The ways a copy can be seen, from the best: :func:`visibility`."""


@dataclass(frozen=True)
class PasskeyOutcome:
    """One example: key, decoded answer, actual depth, needle distance from the prompt's end
    (bytes), correctness, prompt length (tokens), :func:`copy_distance` and :func:`visibility`."""

    answer: str
    generated: str
    depth: float
    needle_distance: int
    correct: bool
    prompt_tokens: int
    copy_distance: int
    visibility: str


@dataclass(frozen=True)
class PasskeyCell:
    """Result of one ``(length, depth)`` cell.

    Attributes:
        length: bytes per example (prompt + key).
        depth: the requested needle depth in ``[0, 1]``.
        outcomes: one per example, in example order.
    """

    length: int
    depth: float
    outcomes: tuple[PasskeyOutcome, ...]

    @property
    def num_examples(self) -> int:
        return len(self.outcomes)

    @property
    def num_correct(self) -> int:
        return sum(o.correct for o in self.outcomes)

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.num_examples

    @property
    def mean_depth(self) -> float:
        """Mean actual needle depth."""
        return sum(o.depth for o in self.outcomes) / self.num_examples


def check_passkey_grid(
    lengths: Sequence[int], depths: Sequence[float], num_digits: int = 5
) -> tuple[list[int], list[float]]:
    """Validated ``(lengths, depths)``: distinct lengths of at least
    ``min_passkey_length(num_digits)`` bytes, distinct depths in ``[0, 1]``; ``ValueError``
    otherwise."""
    check_passkey_options(num_digits=num_digits)
    if not lengths or not depths:
        raise ValueError("give at least one context length and one depth.")
    shortest = min_passkey_length(num_digits)
    checked_lengths = []
    for length in lengths:
        check_context_length(length)
        if length < shortest:
            raise ValueError(
                f"passkey context length {length} is too short: the task, needle and question "
                f"alone take {shortest} bytes with {num_digits} digits; use lengths >= {shortest}."
            )
        checked_lengths.append(length)
    checked_depths = []
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
            raise ValueError(f"depths must be numbers in [0, 1], got {depth!r}.")
        checked_depths.append(float(depth))
    for name, values in (("lengths", checked_lengths), ("depths", checked_depths)):
        if len(set(values)) != len(values):
            raise ValueError(f"{name} must not repeat a value, got {values}.")
    return checked_lengths, checked_depths


@torch.inference_mode()
def answer_examples(
    model: LongNetLM, examples: Sequence[PasskeyExample], batch_size: int = 1,
    tokenizer: ByteTokenizer | SubwordTokenizer | None = None,
    on_answered: Callable[[int], object] | None = None,
) -> list[str]:
    """Greedy answers: ``len(answer) + 1`` tokens per example (one more for a subword
    tokenizer), decoded to text.

    Prompts (in ``tokenizer``'s tokens, None: bytes; see :func:`prompt_text`) of equal token
    length run ``batch_size`` at a time. ``on_answered(n)`` follows each batch (a progress
    bar's ``update``).
    """
    check_positive_int("batch_size", batch_size)
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    extra = 0 if isinstance(tokenizer, ByteTokenizer) else 1
    device = next(model.parameters()).device
    texts = [prompt_text(e.prompt, tokenizer) for e in examples]
    prompts = [tokenizer.encode(text) for text, _ in texts]
    answers: list[str] = [""] * len(examples)
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    for indices in by_length.values():
        for first in range(0, len(indices), batch_size):
            batch = indices[first:first + batch_size]
            inputs = torch.tensor([prompts[i] for i in batch], device=device)
            steps = max(len(examples[i].answer) for i in batch) + 1 + extra
            out = model.generate(inputs, steps, temperature=0)
            for i, row in zip(batch, out):
                text, held = tokenizer.decode(row[inputs.shape[1]:].tolist()), texts[i][1]
                answers[i] = text[len(held):] if held and text.startswith(held) else text
            if on_answered is not None:
                on_answered(len(batch))
    return answers


def prompt_text(prompt: str, tokenizer: ByteTokenizer | SubwordTokenizer) -> tuple[str, str]:
    """``(text to encode, held back)``: for a subword tokenizer the trailing spaces are held
    back, since it joins a space to the next word ("is 71432" is "is" + " 71432")."""
    if isinstance(tokenizer, ByteTokenizer):
        return prompt, ""
    text = prompt.rstrip(" ")
    return text, prompt[len(text):]


def evaluate_passkey(
    model: LongNetLM,
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    num_examples: int = 10,
    seed: int = 0,
    num_digits: int = 5,
    batch_size: int = 1,
    progress: bool | str = False,
    tokenizer: ByteTokenizer | SubwordTokenizer | None = None,
) -> list[PasskeyCell]:
    """Accuracy for every ``(length, depth)`` cell, lengths (bytes) outer, depths inner;
    prompts in ``tokenizer``'s tokens (None: bytes).

    A cell's examples depend only on ``(seed, length, depth, num_digits)``, so a grid run one
    length at a time gives the same cells. ``progress``: a tqdm bar per length (a string is
    its description).

    Raises:
        ValueError: a byte tokenizer for a model whose vocabulary is not 256 (give its own).
    """
    lengths, depths = check_passkey_grid(lengths, depths, num_digits)
    check_positive_int("num_examples", num_examples)
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if isinstance(tokenizer, ByteTokenizer) and model.config.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"passkey prompts are bytes (vocab 256) but the model has vocab_size "
            f"{model.config.vocab_size}; pass the model's own tokenizer (tokenizer=)."
        )
    for length in lengths:
        check_context_length(length, model)
    cells = []
    desc = progress if isinstance(progress, str) else "passkey"
    for length in lengths:
        with tqdm(total=len(depths) * num_examples, desc=f"{desc} @ {length}",
                  disable=not progress, unit="example", leave=False) as bar:
            for depth in depths:
                examples = passkey_examples(num_examples, length, depth, seed, num_digits)
                generated = answer_examples(model, examples, batch_size, tokenizer, bar.update)
                cells.append(PasskeyCell(length=length, depth=depth, outcomes=tuple(
                    _outcome(model, example, text, tokenizer)
                    for example, text in zip(examples, generated))))
    return cells


def _outcome(model: LongNetLM, example: PasskeyExample, generated: str,
             tokenizer: ByteTokenizer | SubwordTokenizer) -> PasskeyOutcome:
    """The outcome of ``example`` whose answer the model generated as ``generated``."""
    key, query = copy_positions(example, tokenizer)
    return PasskeyOutcome(
        example.answer, generated, example.depth, example.needle_distance,
        passkey_match(generated, example.answer),
        len(tokenizer.encode(prompt_text(example.prompt, tokenizer)[0])), query - key,
        visibility(model.config.pattern, model.config.num_heads, query, key))


def copy_positions(
    example: PasskeyExample, tokenizer: ByteTokenizer | SubwordTokenizer | None = None
) -> tuple[int, int]:
    """``(key, query)`` token positions in ``prompt + answer`` (None tokenizer: bytes): the
    token holding the key's first digit and the query predicting the answer's first digit."""
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return example.key_start, len(example.prompt) - 1
    ((_, token_bytes),) = tokenizer.encode_documents([example.prompt + example.answer])
    ends = np.cumsum(token_bytes)  # the prompt is ASCII: its bytes are its characters

    def token_at(byte: int) -> int:
        return int(np.searchsorted(ends, byte, side="right"))

    return token_at(example.key_start), token_at(len(example.prompt)) - 1


def copy_distance(
    example: PasskeyExample, tokenizer: ByteTokenizer | SubwordTokenizer | None = None
) -> int:
    """``query - key`` of :func:`copy_positions`: the distance, in tokens, a head attends over
    to copy the key into the answer."""
    key, query = copy_positions(example, tokenizer)
    return query - key


def visibility(pattern: DilatedPattern, num_heads: int, query: int, key: int) -> str:
    """How the query at ``query`` sees the key at ``key`` under ``pattern`` with ``num_heads``
    heads (``DilatedPattern.key_multiplicity``): ``"dense"`` through a rate-1 branch,
    ``"sparse"`` through sparse branches only, ``"unseen"`` through no head."""
    check_positive_int("num_heads", num_heads)
    check_non_negative_int("key", key)
    if not key <= query:
        raise ValueError(f"the key ({key}) must not come after the query ({query}).")
    positions = torch.tensor([query]), torch.tensor([key])
    rates = [rate for width, rate in pattern.branches
             if DilatedPattern.coerce([(width, rate)]).key_multiplicity(
                 *positions, num_heads, causal=True).any()]
    if 1 in rates:
        return DENSE
    return SPARSE if rates else UNSEEN


def passkey_rows(label: str, cells: Sequence[PasskeyCell], num_digits: int
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of ``passkey.csv`` (per cell) and ``passkey_generations.csv`` (per example)."""
    rows, example_rows = [], []
    for cell in cells:
        rows.append({
            "model": label, "context_length": cell.length,
            "context_tokens": round(sum(o.prompt_tokens for o in cell.outcomes)
                                    / cell.num_examples) + num_digits,
            "depth": cell.depth, "mean_depth": cell.mean_depth, "examples": cell.num_examples,
            "correct": cell.num_correct, "accuracy": cell.accuracy,
        })
        example_rows += [
            {"model": label, "context_length": cell.length, "depth": cell.depth,
             "index": index, "actual_depth": o.depth,
             "needle_distance": o.needle_distance, "copy_distance": o.copy_distance,
             "visibility": o.visibility, "answer": o.answer,
             "generated": o.generated, "correct": o.correct,
             "prompt_tokens": o.prompt_tokens}
            for index, o in enumerate(cell.outcomes)
        ]
    return rows, example_rows


def accuracy_by_visibility(cells: Sequence[PasskeyCell]) -> list[dict[str, int | float | str]]:
    """Accuracy per context length and :func:`visibility` of the examples' copies.

    Returns:
        rows ``{"context_length", "visibility", "examples", "correct", "accuracy"}``, lengths
        in the cells' order, visibilities in ``VISIBILITIES``' order; a pair with no example
        has no row.
    """
    counts: dict[tuple[int, str], list[int]] = {}
    for cell in cells:
        for outcome in cell.outcomes:
            tally = counts.setdefault((cell.length, outcome.visibility), [0, 0])
            tally[0] += 1
            tally[1] += outcome.correct
    lengths = list(dict.fromkeys(cell.length for cell in cells))
    return [
        {"context_length": length, "visibility": key, "examples": examples, "correct": correct,
         "accuracy": correct / examples}
        for (length, key), (examples, correct) in sorted(
            counts.items(),
            key=lambda item: (lengths.index(item[0][0]), VISIBILITIES.index(item[0][1])))
    ]
