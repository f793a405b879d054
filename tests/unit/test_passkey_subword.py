"""Passkey examples in a subword tokenizer's tokens (``PasskeyDataset(tokenizer=...)``): exactly
``seq_len`` tokens of the evaluation's text, the needle at its depth, labels on the answer as the
evaluation reads it, deterministic per ``(seed, index)``, a ``seq_len`` too short named in
tokens; and ``LengthCurriculum`` mixing them into the windows of a ``bpe:N`` datamodule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longnet.constants import IGNORE_INDEX
from longnet.data import LongDocumentDataModule
from longnet.data.subword import SubwordTokenizer, from_backend
from longnet.data.synthetic import (
    ANSWER_END,
    NEEDLE,
    NEEDLE_JITTER,
    QUESTION,
    TASK,
    PasskeyDataset,
    min_passkey_length,
    min_passkey_tokens,
)
from longnet.data.tokenizer import train_bpe
from longnet.training import LengthCurriculum
from longnet.validation import UsageError

WORDS = ["the", "grass", "is", "green", "sky", "blue", "sun", "yellow", "here", "we", "go",
         "there", "and", "back", "again", "pass", "key", "what", "remember", "it", "text",
         "piece", "of", "information", "find", "quiz", "you", "about", "2024", "17", "365"]


def english(seed: int, words: int) -> str:
    """``words`` words of a small English-like vocabulary in sentences."""
    rng = np.random.default_rng(seed)
    sentences = [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 12)))).capitalize() + "."
                 for _ in range(words // 7)]
    return " ".join(sentences) + "\n"


@pytest.fixture(scope="module")
def tokenizer() -> SubwordTokenizer:
    """A byte-level BPE of 400 ids trained here on a tiny English-like corpus."""
    return from_backend(train_bpe([english(seed, 2000) for seed in range(4)], 400), "bpe:400")


def whole_ids(sample: dict[str, torch.Tensor], tokenizer: SubwordTokenizer) -> list[int]:
    """The ids of a sample's ``seq_len + 1`` tokens, padding left out (the last of them is the
    last label unless it is padding: every label mode scores the end mark)."""
    ids = sample["input_ids"][sample["input_ids"] != tokenizer.pad_id].tolist()
    if len(ids) == len(sample["input_ids"]) and int(sample["labels"][-1]) != IGNORE_INDEX:
        ids.append(int(sample["labels"][-1]))
    return ids


def whole_text(sample: dict[str, torch.Tensor], tokenizer: SubwordTokenizer) -> str:
    return tokenizer.decode(whole_ids(sample, tokenizer))


def labelled_runs(sample: dict[str, torch.Tensor]) -> list[list[int]]:
    """The labelled token ids, in runs of consecutive positions."""
    runs: list[list[int]] = []
    previous = -2
    for position in torch.nonzero(sample["labels"] != IGNORE_INDEX).flatten().tolist():
        if position != previous + 1:
            runs.append([])
        runs[-1].append(int(sample["labels"][position]))
        previous = position
    return runs


@pytest.mark.parametrize("seq_len", ["shortest", 200, 1000])
def test_a_sample_is_seq_len_tokens_of_the_evaluation_text(tokenizer, seq_len):
    seq_len = min_passkey_tokens(tokenizer) if seq_len == "shortest" else seq_len
    data = PasskeyDataset(seq_len, 6, seed=2, tokenizer=tokenizer, label_mode="all")
    for index in range(6):
        sample = data[index]
        assert {key: tuple(value.shape) for key, value in sample.items()} == {
            "input_ids": (seq_len,), "labels": (seq_len,), "label_bytes": (seq_len,)}
        ids = whole_ids(sample, tokenizer)
        assert seq_len + 1 - 16 < len(ids) <= seq_len + 1  # the longest of the draw that fits
        assert (sample["input_ids"][len(ids):] == tokenizer.pad_id).all()
        assert (sample["labels"][len(ids) - 1:] == IGNORE_INDEX).all()  # padding not scored
        text = tokenizer.decode(ids)
        assert tokenizer.encode(text) == ids
        example = data.example(index)  # the example of the draw whose tokens fill the sample
        assert text == example.prompt + example.answer + ANSWER_END  # the evaluation's text
        assert example == data.example(index, len(text) - len(ANSWER_END))  # that many bytes
        assert example.prompt.startswith(TASK) and example.prompt.endswith(QUESTION)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_key_is_in_the_text_at_the_depth_asked(tokenizer, depth):
    data = PasskeyDataset(1000, 4, seed=7, depth=depth, tokenizer=tokenizer)
    for index in range(4):
        text = whole_text(data[index], tokenizer)
        key = text[len(text) - len(ANSWER_END) - 5:len(text) - len(ANSWER_END)]
        assert key.isdigit() and text.count(key) == 3  # two in the needle, the answer
        needle = text.index(NEEDLE.format(key=key))
        budget = len(text) - len(ANSWER_END) - min_passkey_length()  # bytes of filler
        assert budget > 2000  # 1,000 tokens of this BPE: several filler periods
        assert abs((needle - len(TASK)) / budget - depth) <= 2 * NEEDLE_JITTER / budget


@pytest.mark.parametrize("label_mode", ["answer", "recall"])
def test_only_the_answer_is_labelled_and_it_decodes_to_the_key(tokenizer, label_mode):
    data = PasskeyDataset(300, 8, seed=4, label_mode=label_mode, tokenizer=tokenizer)
    for index in range(8):
        sample = data[index]
        key = data.example(index).answer
        runs = [tokenizer.decode(run) for run in labelled_runs(sample)]
        # the answer as the evaluation reads it: the prompt's final space, the key, the end mark
        answer = " " + key + ANSWER_END
        assert runs[-1] == answer
        if label_mode == "recall":  # and the needle's second copy of the key
            assert len(runs) == 2 and runs[0].strip() == key
        else:
            assert len(runs) == 1
        labelled = sample["labels"] != IGNORE_INDEX
        assert int(labelled.sum()) <= 2 * (len(key) + 2)  # everything else is -100
        assert int(sample["label_bytes"].sum()) == len("".join(runs).encode())
        assert not sample["label_bytes"][~labelled].any()


def test_samples_are_deterministic_per_seed_and_index(tokenizer):
    data = PasskeyDataset(300, 6, seed=9, tokenizer=tokenizer)
    again = PasskeyDataset(300, 6, seed=9, tokenizer=tokenizer)
    for index in range(6):
        assert torch.equal(data[index]["input_ids"], again[index]["input_ids"])
        assert torch.equal(data[index]["labels"], again[index]["labels"])
    keys = [data.example(index).answer for index in range(6)]
    assert len(set(keys)) == 6  # another index, another key
    texts = [whole_text(data[index], tokenizer) for index in range(6)]
    assert all(key in text for key, text in zip(keys, texts))
    other = PasskeyDataset(300, 6, seed=10, tokenizer=tokenizer)
    assert other.example(0).answer != keys[0]


def test_the_shortest_seq_len_is_counted_in_tokens(tokenizer):
    shortest = min_passkey_tokens(tokenizer)
    assert shortest < min_passkey_length()  # fewer tokens than bytes: not the byte bound
    PasskeyDataset(shortest, 1, tokenizer=tokenizer)[0]
    with pytest.raises(ValueError, match=rf"passkey seq_len {shortest - 1} is too short for the "
                                         rf"tokens of bpe:400: .* at least {shortest} tokens"):
        PasskeyDataset(shortest - 1, 1, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="passkey length 200 is too short"):
        PasskeyDataset(200, 1)  # bytes: unchanged


# ---------------------------------------------------------------------- the curriculum
SEQ_LEN, SHORT, SWITCH = 1024, 512, 20


@pytest.fixture(scope="module")
def bpe_root(tmp_path_factory) -> Path:
    """12 long English-like documents in ``docs/``, a cache in ``cache/``."""
    root = tmp_path_factory.mktemp("bpe_data")
    (root / "docs").mkdir()
    for index in range(12):
        (root / "docs" / f"doc{index:02d}.txt").write_text(english(100 + index, 2500))
    return root


def bpe_module(root: Path, **options) -> LongDocumentDataModule:
    """A ``bpe:300`` datamodule of the documents of ``root``."""
    options = {"seq_len": SEQ_LEN, "batch_size": 2, **options}
    return LongDocumentDataModule(
        data_files=str(root / "docs" / "*.txt"), cache_dir=str(root / "cache"),
        tokenizer="bpe:300", val_fraction=0.2, test_fraction=0.2, **options)


@pytest.fixture(scope="module")
def bpe_data(bpe_root) -> LongDocumentDataModule:
    """A ``bpe:300`` datamodule of 1,024-token windows, set up."""
    module = bpe_module(bpe_root)
    module.setup()
    return module


def test_the_datamodule_counts_its_passkeys_in_bpe_tokens(bpe_root, bpe_data):
    shortest = min_passkey_tokens(bpe_data.tokenizer)  # the same BPE: the same documents
    assert shortest < 200 < min_passkey_length()  # 200 tokens hold what 200 bytes cannot
    module = bpe_module(bpe_root, seq_len=200, passkey_fraction=0.2, passkey_label_mode="answer")
    module.setup()
    passkeys = module.train_dataset.datasets[1]
    assert len(passkeys) > 0 and passkeys.tokenizer is module.tokenizer
    for index in range(len(passkeys)):
        sample = passkeys[index]
        assert sample["input_ids"].shape == (200,)
        (run,) = labelled_runs(sample)
        assert module.tokenizer.decode(run) == " " + passkeys.example(index).answer + ANSWER_END
    short = bpe_module(bpe_root, seq_len=shortest - 1, passkey_fraction=0.2)
    with pytest.raises(ValueError, match=rf"at least {shortest} tokens"):
        short.setup()  # the BPE is trained in setup: its tokens are counted there


MODULE = SimpleNamespace(  # what the curriculum reads of a LightningModule
    model=SimpleNamespace(config=SimpleNamespace(position_encoding="rope", rope_theta=1e4)),
    log=lambda *args, **kwargs: None)


def curriculum_on(data: LongDocumentDataModule, stages: list[dict],
                  fraction: float) -> LengthCurriculum:
    curriculum = LengthCurriculum(stages, passkey_fraction=fraction, seed=5)
    curriculum.setup(SimpleNamespace(datamodule=data, strategy=None), MODULE, "fit")
    return curriculum


def test_the_curriculum_mixes_passkeys_in_the_datas_bpe_tokens(bpe_data):
    tokenizer = bpe_data.tokenizer
    assert isinstance(tokenizer, SubwordTokenizer) and tokenizer.vocab_size == 300
    fraction = 0.5
    curriculum = curriculum_on(bpe_data, [{"step": 0, "seq_len": SHORT},
                                          {"step": SWITCH, "seq_len": SEQ_LEN}], fraction)
    window = next(iter(bpe_data.train_dataloader()))
    assert "label_bytes" in window
    examples = {length: PasskeyDataset(length, 1 << 62, seed=5, label_mode="recall",
                                       tokenizer=tokenizer) for length in (SHORT, SEQ_LEN)}
    replaced = total = 0
    for step in range(2 * SWITCH):
        batch = {key: value.clone() for key, value in window.items()}
        trainer = SimpleNamespace(global_step=step, global_rank=0, world_size=1)
        curriculum.on_train_batch_start(trainer, MODULE, batch, 0)
        length = SHORT if step < SWITCH else SEQ_LEN
        text = window["input_ids"].reshape(-1, length)
        rows = len(text)
        assert batch["input_ids"].shape == (rows, length)
        for row in range(rows):
            if torch.equal(batch["input_ids"][row], text[row]):
                continue
            sample = examples[length][step * rows + row]
            for key in ("input_ids", "labels", "label_bytes"):
                assert torch.equal(batch[key][row], sample[key]), (step, row, key)
            assert "What is the pass key?" in tokenizer.decode(batch["input_ids"][row].tolist())
            replaced += 1
        total += rows
    assert total == SWITCH * 4 + SWITCH * 2
    assert abs(replaced / total - fraction) < 0.15  # the share asked, of 120 windows


def test_a_stage_too_short_for_the_bpe_passkeys_is_named_in_tokens(bpe_data):
    shortest = min_passkey_tokens(bpe_data.tokenizer)
    assert 128 < shortest < SHORT
    message = rf"stage at step 0 has passkey_fraction 0.2: passkey seq_len 128 is too short " \
              rf".* at least {shortest} tokens"
    with pytest.raises(UsageError, match=message):
        curriculum_on(bpe_data, [{"step": 0, "seq_len": 128}, {"step": 5, "seq_len": SHORT}],
                      0.2)
    curriculum_on(bpe_data, [{"step": 0, "seq_len": 256}], 0.2)  # 256 tokens hold it

