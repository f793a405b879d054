"""Passkey retrieval over a grid of context lengths x needle depths.

A cell ``(length, depth)`` holds ``num_examples`` prompts from
``longnet.data.passkey_examples(num_examples, length, depth, seed)``: ``length`` bytes in all
(prompt + key), the needle within half a filler period of ``depth`` at a byte drawn per example,
so that a cell's examples place it at every alignment modulo a dilation rate. The prompt is
encoded with the model's tokenizer (bytes by default; a subword tokenizer gives fewer tokens,
counted in ``PasskeyOutcome.prompt_tokens``, and reads the prompt without its final space,
which it would join to the key: :func:`prompt_text`), the model greedily generates
``num_digits + 1`` tokens after it (one more for a subword tokenizer), and the decoded text is
compared as text: an example is correct when ``longnet.data.passkey_match`` accepts it (it
starts with the key and the character after it is not a digit, so a longer number is wrong).
Accuracy is the share of correct examples.

Each outcome records the copy its answer makes, in the model's tokens: the distance from
the needle key's first digit to the query that predicts the answer's first digit
(:func:`copy_distance`), and whether the model's dilated pattern gives that query that key
(:func:`visibility`): a dilated branch of rate ``r`` gives a query only the keys of its segment
at its own offset modulo ``r``, and only to the heads at that offset, so a far needle may lie
where no head of the query sees it. :func:`accuracy_by_visibility` splits accuracy by it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from longnet.attention import DilatedPattern
from longnet.data import ByteTokenizer, passkey_examples, passkey_match
from longnet.data.subword import SubwordTokenizer
from longnet.data.synthetic import PasskeyExample, min_passkey_length
from longnet.eval.sliding import check_context_length
from longnet.modeling import LongNetLM
from longnet.validation import check_non_negative_int, check_positive_int, is_int

DENSE, SPARSE, UNSEEN = "dense", "sparse", "unseen"
VISIBILITIES = (DENSE, SPARSE, UNSEEN)
"""The ways a copy can be seen, from the best: :func:`visibility`."""


@dataclass(frozen=True)
class PasskeyOutcome:
    """One example: the key, the decoded generated text, the needle's actual depth and its
    distance in bytes from the end of the prompt, whether ``passkey_match(generated,
    answer)`` holds, the prompt's length in tokens, the distance in tokens over which the
    answer copies the key (:func:`copy_distance`) and whether the model's heads see that
    copy (:func:`visibility`)."""

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
        """Mean actual depth (each needle lies within half a filler period of the request)."""
        return sum(o.depth for o in self.outcomes) / self.num_examples


def check_passkey_grid(
    lengths: Sequence[int], depths: Sequence[float], num_digits: int = 5
) -> tuple[list[int], list[float]]:
    """Validated ``(lengths, depths)``: lengths are ints of at least
    ``min_passkey_length(num_digits)`` bytes, depths floats in ``[0, 1]``, both non-empty;
    ``num_digits`` an int in ``[1, 18]``."""
    if not is_int(num_digits) or not 1 <= num_digits <= 18:
        raise ValueError(f"num_digits must be an integer in [1, 18], got {num_digits!r}.")
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
    """Greedy answers: ``len(answer) + 1`` generated tokens per example (one more for a
    subword tokenizer), decoded to text.

    Prompts are encoded with ``tokenizer`` (None: bytes; a subword tokenizer reads them
    without their trailing spaces, :func:`prompt_text`, and the spaces the model generates
    first are dropped from its answer); those of equal token length (all of one grid cell for
    bytes) run ``batch_size`` at a time, in example order within a length. ``on_answered``
    is called with the number of examples of each batch once it is answered (a progress
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
    """``(text to encode, held back)``: the prompt itself for bytes; for a subword tokenizer
    the prompt without its trailing spaces, held back because such a tokenizer joins a space
    to the word after it (GPT-2's pre-tokenization: "is 71432" is "is" + " 71432"), so the
    prompt ends on a token boundary of the text the model was trained on."""
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
    """Accuracy for every ``(length, depth)`` cell, lengths (in bytes) outer, depths inner;
    prompts in ``tokenizer``'s tokens (None: bytes; ``LoadedModel.tokenizer``).

    The examples of a cell depend only on ``(seed, length, depth, num_digits)``, so a grid
    evaluated one length at a time gives the same cells. Each outcome's :func:`visibility`
    is that of the model's pattern and query heads. ``progress`` shows a tqdm bar per length
    (on stderr; a string is its description, followed by ``@ <length>``) counting the
    examples answered.

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
    """``(key, query)``: in ``tokenizer``'s tokens (None: bytes) of the text ``prompt +
    answer``, the position of the token holding the needle key's first digit and of the query
    that predicts the answer's first digit (the token before the one holding it). A head
    copies the key into the answer over ``query - key`` (:func:`copy_distance`); a passkey
    training sample starts with its prompt, so these are also its positions in the window."""
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
    """The distance a head attends over to copy the key into the answer, in ``tokenizer``'s
    tokens (None: bytes) of the text ``prompt + answer``: from the token holding the needle
    key's first digit to the query that predicts the answer's first digit
    (:func:`copy_positions`); the same at every digit. In a branch of rate ``r`` that query
    sees that key only when the distance is a multiple of ``r`` (:func:`visibility` says
    whether a head does). For bytes it is ``len(prompt) - 1 - key_start``."""
    key, query = copy_positions(example, tokenizer)
    return query - key


def visibility(pattern: DilatedPattern, num_heads: int, query: int, key: int) -> str:
    """How the query at position ``query`` is given the key at ``key`` by a causal model of
    ``pattern`` with ``num_heads`` query heads (``DilatedPattern.key_multiplicity``):
    ``"dense"`` by a rate-1 branch, ``"sparse"`` by heads of sparse branches only (the two in
    one segment of a branch, at the offset of a head), ``"unseen"`` by no head (the key can
    only reach the query through another row that carries it)."""
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
    """The rows of ``passkey.csv`` (one per cell; ``context_tokens``: the mean prompt tokens
    plus the key's digits) and of ``passkey_generations.csv`` (one per example) of the model
    ``label``'s ``cells``."""
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

    A dilated model can only find a needle where its pattern lets some head see the copy, or
    through a row that carries the key; a grid's accuracy then mixes copies it can and cannot
    see, and this table separates them.

    Returns:
        rows ``{"context_length", "visibility", "examples", "correct", "accuracy"}``, lengths
        in the cells' order, visibilities in ``VISIBILITIES``' order; a pair with no example
        has no row.
    """
    return _accuracy_by(cells, "visibility", lambda outcome: outcome.visibility,
                        VISIBILITIES.index)


def accuracy_by_alignment(
    cells: Sequence[PasskeyCell], rate: int, beyond: int = 0
) -> list[dict[str, int | float]]:
    """Deprecated (a ``FutureWarning``): :func:`accuracy_by_visibility` says which copies the
    model's heads see, for any pattern. Accuracy per context length and needle alignment,
    ``copy_distance % rate``.

    In a branch of dilation rate ``r`` a query sees only the keys at its own offset modulo ``r``
    (docs/architecture.md), so a dilated model can retrieve a far needle at some alignments and
    miss it at all others; a grid's accuracy then looks merely low. Alignment 0 is a copy that
    a branch of rate ``rate`` sees. Only copies over more than ``beyond`` tokens count
    (pass the longest segment of the model's rate-1 branches, which see every alignment).

    Returns:
        rows ``{"context_length", "alignment", "examples", "correct", "accuracy"}``, lengths in
        the cells' order, alignments ascending; a pair with no such needle has no row.
    """
    warnings.warn(
        "accuracy_by_alignment is deprecated: accuracy_by_visibility(cells) splits accuracy by "
        "whether the model's heads see each copy (PasskeyOutcome.visibility), for any pattern.",
        FutureWarning, stacklevel=2)
    check_positive_int("rate", rate)
    return _accuracy_by(
        cells, "alignment",
        lambda outcome: outcome.copy_distance % rate if outcome.copy_distance > beyond else None,
        lambda alignment: alignment)


def _accuracy_by(
    cells: Sequence[PasskeyCell], column: str, group: Callable[[PasskeyOutcome], Any],
    order: Callable[[Any], int],
) -> list[dict[str, Any]]:
    """Rows ``{"context_length", column, "examples", "correct", "accuracy"}`` of the outcomes
    by length and ``group(outcome)`` (None: left out), lengths in the cells' order, groups by
    ``order``; a pair with no outcome has no row."""
    counts: dict[tuple[int, Any], list[int]] = {}
    for cell in cells:
        for outcome in cell.outcomes:
            key = group(outcome)
            if key is not None:
                tally = counts.setdefault((cell.length, key), [0, 0])
                tally[0] += 1
                tally[1] += outcome.correct
    lengths = list(dict.fromkeys(cell.length for cell in cells))
    return [
        {"context_length": length, column: key, "examples": examples, "correct": correct,
         "accuracy": correct / examples}
        for (length, key), (examples, correct) in sorted(
            counts.items(), key=lambda item: (lengths.index(item[0][0]), order(item[0][1])))
    ]
