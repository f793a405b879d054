"""Generated tasks: passkey retrieval, MQAR, their DataModules and answer checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longnet.data import (
    IGNORE_INDEX,
    MQARDataModule,
    MQARDataset,
    PasskeyDataModule,
    PasskeyDataset,
    make_passkey_example,
    passkey_examples,
    passkey_match,
    sample_rng,
)
from longnet.data.synthetic import NEEDLE_JITTER, min_passkey_length
from longnet.data.tokenizer import ByteTokenizer


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[key], b[key]) for key in ("input_ids", "labels"))


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("length", [min_passkey_length(), 300, 2049])
def test_passkey_example_layout(length: int, depth: float) -> None:
    example = make_passkey_example(length, np.random.default_rng(0), depth=depth)
    text = example.prompt + example.answer
    assert len(text.encode("utf-8")) == length
    assert example.answer.isdigit() and len(example.answer) == 5 and example.answer[0] != "0"
    assert example.prompt.endswith("The pass key is ")
    assert text.count(example.answer) == 3  # twice in the needle, once as the answer
    budget = length - min_passkey_length()
    assert abs(example.depth - depth) * budget <= 2 * NEEDLE_JITTER


def test_passkey_cell_places_its_needles_at_every_alignment() -> None:
    """A cell's examples must not share the needle's offset from the question modulo a
    dilation rate: a dilated model sees a far key only from queries at the same offset."""
    examples = passkey_examples(16, 2048, depth=0.5, seed=0)
    distances = [e.needle_distance for e in examples]
    assert [len(e.prompt) - e.prompt.index("The pass key is") for e in examples] == distances
    assert {d % 4 for d in distances} == {0, 1, 2, 3}
    assert max(distances) - min(distances) <= 2 * NEEDLE_JITTER


def test_passkey_dataset_deterministic_per_seed_and_split() -> None:
    data = PasskeyDataset(seq_len=512, size=8, seed=3)
    again = PasskeyDataset(seq_len=512, size=8, seed=3)
    assert all(_same(data[i], again[i]) for i in range(8))
    other_seed = PasskeyDataset(seq_len=512, size=8, seed=4)
    other_split = PasskeyDataset(seq_len=512, size=8, seed=3, split="validation")
    assert not any(_same(data[i], other_seed[i]) for i in range(8))
    assert not any(_same(data[i], other_split[i]) for i in range(8))
    assert len({data.example(i).answer for i in range(8)}) == 8
    with pytest.raises(IndexError):
        data[8]


def test_passkey_labels() -> None:
    tokenizer = ByteTokenizer()
    answer_only = PasskeyDataset(seq_len=400, size=4, seed=1, label_mode="answer")
    everything = PasskeyDataset(seq_len=400, size=4, seed=1, label_mode="all")
    for index in range(4):
        sample, full = answer_only[index], everything[index]
        example = answer_only.example(index)
        assert sample["input_ids"].shape == sample["labels"].shape == (400,)
        assert torch.equal(sample["input_ids"], full["input_ids"])
        assert torch.equal(full["labels"][:-1], full["input_ids"][1:])
        scored = sample["labels"] != IGNORE_INDEX
        assert scored.sum() == 6 and scored[-6:].all()  # the key's 5 digits and the end mark
        assert tokenizer.decode(sample["labels"][scored]) == example.answer + "."
        assert tokenizer.decode(sample["input_ids"]) == example.prompt + example.answer


def test_passkey_recall_labels_add_the_needles_second_copy() -> None:
    tokenizer = ByteTokenizer()
    answer_only = PasskeyDataset(seq_len=400, size=4, seed=1, label_mode="answer")
    recall = PasskeyDataset(seq_len=400, size=4, seed=1, label_mode="recall")
    for index in range(4):
        sample, key = recall[index], recall.example(index).answer
        assert torch.equal(sample["input_ids"], answer_only[index]["input_ids"])
        scored = (sample["labels"] != IGNORE_INDEX).nonzero().flatten()
        assert len(scored) == 11 and scored[-6:].tolist() == list(range(394, 400))
        copy = scored[:5]
        assert copy.tolist() == list(range(int(copy[0]), int(copy[0]) + 5))
        assert tokenizer.decode(sample["labels"][copy]) == key
        assert tokenizer.decode(sample["input_ids"][copy[0] - 12:copy[0] + 1]) == "Remember it. "
        assert tokenizer.decode(sample["labels"][scored]) == key + key + "."


def test_passkey_evaluation_pairs_and_match() -> None:
    pairs = passkey_examples(6, 600, depth=0.25, seed=2)
    assert pairs == passkey_examples(6, 600, depth=0.25, seed=2)
    assert pairs != passkey_examples(6, 600, depth=0.25, seed=5)
    test_split = PasskeyDataset(seq_len=600, size=6, seed=2, split="test", depth=0.25)
    assert pairs == [test_split.example(i) for i in range(6)]
    answer = pairs[0].answer
    assert passkey_match(answer, answer)
    assert passkey_match(answer + ". Done", answer)
    assert not passkey_match(answer + "7", answer)
    assert not passkey_match(answer[:-1], answer)
    assert not passkey_match(" " + answer, answer)


def test_passkey_bad_arguments() -> None:
    with pytest.raises(ValueError, match="raise seq_len"):
        PasskeyDataset(seq_len=100, size=1)
    with pytest.raises(ValueError, match="depth"):
        PasskeyDataset(seq_len=400, size=1, depth=1.5)
    with pytest.raises(ValueError, match="label_mode"):
        PasskeyDataset(seq_len=400, size=1, label_mode="answers")
    with pytest.raises(ValueError, match="split"):
        sample_rng(0, "val", 0)


def _pairs(tokens: np.ndarray, num_kv_pairs: int) -> dict[int, int]:
    return dict(
        zip(tokens[0 : 2 * num_kv_pairs : 2].tolist(), tokens[1 : 2 * num_kv_pairs : 2].tolist())
    )


@pytest.mark.parametrize(("seq_len", "pairs", "queries"), [(64, 4, None), (64, 8, 3), (15, 4, 4)])
def test_mqar_layout_and_labels(seq_len: int, pairs: int, queries: int | None) -> None:
    data = MQARDataset(seq_len=seq_len, size=20, num_kv_pairs=pairs, num_queries=queries, seed=7)
    asked = pairs if queries is None else queries
    for index in range(20):
        example, sample = data.example(index), data[index]
        table = _pairs(example.tokens, pairs)
        assert len(table) == pairs and all(1 <= key < 128 for key in table)
        assert all(128 <= value < 256 for value in table.values())
        scored = (sample["labels"] != IGNORE_INDEX).nonzero().flatten()
        assert scored.tolist() == example.query_positions.tolist() and len(scored) == asked
        for position, answer in zip(example.query_positions, example.answers):
            key = int(sample["input_ids"][position])
            assert table[key] == answer == int(sample["labels"][position])
        assert len(set(sample["input_ids"][scored].tolist())) == asked  # distinct keys asked


def test_mqar_deterministic_per_seed() -> None:
    data, again = MQARDataset(size=10, seed=0), MQARDataset(size=10, seed=0)
    assert all(_same(data[i], again[i]) for i in range(10))
    assert not any(_same(data[i], MQARDataset(size=10, seed=1)[i]) for i in range(10))


def test_mqar_bad_arguments() -> None:
    with pytest.raises(ValueError, match="raise seq_len to at least 15"):
        MQARDataset(seq_len=14, num_kv_pairs=4)
    with pytest.raises(ValueError, match="vocab_size"):
        MQARDataset(num_kv_pairs=8, vocab_size=16)
    with pytest.raises(ValueError, match="num_queries"):
        MQARDataset(num_kv_pairs=4, num_queries=5)


@pytest.mark.parametrize("module_class", [PasskeyDataModule, MQARDataModule])
def test_synthetic_datamodules(module_class) -> None:
    seq_len = 256 if module_class is PasskeyDataModule else 64
    module = module_class(seq_len=seq_len, batch_size=4, train_size=12, val_size=8, test_size=8)
    module.setup("fit")
    assert module.vocab_size == 256
    assert [
        len(loader.dataset)
        for loader in (module.train_dataloader(), module.val_dataloader(), module.test_dataloader())
    ] == [12, 8, 8]
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, seq_len)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    val = module.datasets["validation"][0]
    assert not _same(module.datasets["train"][0], val)
    with pytest.raises(ValueError, match="batch_size"):
        module_class(batch_size=0)
