"""The length curriculum (``longnet.training.LengthCurriculum``): a long window cut into short
ones is the short windows of the same stream; the stage, the RoPE base and the passkey
examples follow the optimizer step, switch at the configured step and resume bit-exactly
across a switch; bad stages and settings are refused naming the value."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from longnet.data.encoding import packed_document_windows, packed_windows
from longnet.data.synthetic import PasskeyDataset
from longnet.modeling import LongNetConfig, LongNetLM
from longnet.training import LengthCurriculum
from longnet.training.checkpoint import checkpoint_config
from longnet.training.curriculum import split_windows
from longnet.validation import UsageError
from tests.chunked import callback, chunk_config, fit, load, probed

SWITCH, CRASH_AT = 3, 3  # last.ckpt at step 2, before the switch; the resumed run crosses it
STAGES = [{"step": 0, "seq_len": 16}, {"step": SWITCH, "seq_len": 32, "rope_theta": 20000.0}]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def as_batch(*arrays: np.ndarray) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "labels", "document_ids")
    return {key: torch.from_numpy(array.astype(np.int64)) for key, array in zip(keys, arrays)}


@pytest.mark.parametrize("pack", [False, True], ids=["stream", "packed documents"])
def test_short_windows_cut_from_long_ones_are_the_short_windows_of_the_stream(pack):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 250, size=n, dtype=np.uint8) for n in (300, 50, 700, 20, 999)]
    windows = packed_document_windows if pack else packed_windows
    long, short = as_batch(*windows(documents, 256)), as_batch(*windows(documents, 64))
    rows = 4 * len(long["input_ids"])
    split = split_windows(long, 64)
    assert split.keys() == short.keys()
    for key, value in short.items():
        assert torch.equal(split[key], value[:rows]), key


def curriculum_config(path: Path, cache: Path, *callbacks: dict) -> Path:
    """The chunked smoke run (``test_handoff``) on windows of 64 tokens cut by ``STAGES``."""
    chunk_config(path, cache, *callbacks)
    config = yaml.safe_load(path.read_text())
    config["trainer"]["callbacks"].insert(1, {"class_path": "longnet.training.LengthCurriculum",
                                              "init_args": {"stages": STAGES}})
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_stage_switches_at_its_step_and_resumes_across_the_switch(tmp_path):
    cache = tmp_path / "cache"
    full = curriculum_config(tmp_path / "full.yaml", cache,
                             callback("Probe", path=str(tmp_path / "full.jsonl")))
    assert fit(full, tmp_path, "full") == 0
    records = probed(tmp_path / "full.jsonl")
    # 4 windows of 64 per step: 16 of 16 tokens, then 8 of 32 with the stage's RoPE base
    assert [records[step]["shape"] for step in range(6)] == [[16, 16]] * 3 + [[8, 32]] * 3
    assert [records[step]["rope_theta"] for step in range(6)] == [1e4] * 3 + [2e4] * 3
    last = load(tmp_path / "full" / "checkpoints" / "last.ckpt")
    assert last["hyper_parameters"]["overrides"]["rope_theta"] == 2e4
    assert checkpoint_config(last).rope_theta == 2e4

    crashing = curriculum_config(tmp_path / "crash.yaml", cache,
                                 callback("CrashAtStep", step=CRASH_AT),
                                 callback("Probe", path=str(tmp_path / "resumed.jsonl")))
    with pytest.raises(RuntimeError, match="crash at step"):
        fit(crashing, tmp_path, "resumed")
    assert load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["global_step"] == 2
    plain = curriculum_config(tmp_path / "plain.yaml", cache,
                              callback("Probe", path=str(tmp_path / "resumed.jsonl")))
    assert fit(plain, tmp_path, "resumed", "--ckpt_path=last") == 0
    resumed = probed(tmp_path / "resumed.jsonl")
    for step in range(2, 6):  # the same windows, shapes, rates and RoPE base
        assert resumed[step] == records[step], step
    final = load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    for name, value in last["state_dict"].items():
        assert torch.equal(final["state_dict"][name], value), name


def step_trainer(step: int, rank: int = 0, world_size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, global_rank=rank, world_size=world_size)


def test_passkey_windows_are_of_the_stage_length_and_follow_the_step():
    curriculum = LengthCurriculum([{"step": 0, "seq_len": 512}], passkey_fraction=0.5, seed=3)
    module = SimpleNamespace(log=lambda *args, **kwargs: None)

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        batch = {"input_ids": torch.full((2, 2048), 7), "labels": torch.full((2, 2048), 8),
                 "document_ids": torch.ones(2, 2048, dtype=torch.long)}
        curriculum.on_train_batch_start(step_trainer(step), module, batch, 0)
        return batch

    examples = PasskeyDataset(512, 1 << 62, seed=3, label_mode="recall")
    replaced = 0
    for step in range(4):
        batch = batch_at(step)
        assert batch["input_ids"].shape == (8, 512)
        for row in range(8):
            text = bool((batch["input_ids"][row] == 7).all())
            if not text:
                sample = examples[step * 8 + row]
                assert torch.equal(batch["input_ids"][row], sample["input_ids"])
                assert torch.equal(batch["labels"][row], sample["labels"])
                assert not batch["document_ids"][row].any()
            replaced += not text
        assert all(torch.equal(a, b) for a, b in zip(batch.values(), batch_at(step).values()))
    assert 8 <= replaced <= 24  # about half of 32 windows


def test_data_parallel_ranks_train_the_passkeys_of_one_device_training_their_windows():
    curriculum = LengthCurriculum([{"step": 0, "seq_len": 512}], passkey_fraction=0.5, seed=3)
    module = SimpleNamespace(log=lambda *args, **kwargs: None)

    def batch_at(step: int, rows: int, rank: int, world_size: int) -> torch.Tensor:
        batch = {"input_ids": torch.full((rows, 2048), 7), "labels": torch.full((rows, 2048), 8)}
        curriculum.on_train_batch_start(step_trainer(step, rank, world_size), module, batch, 0)
        return batch["input_ids"]

    for step in range(3):
        one_device = batch_at(step, 2, 0, 1)  # 8 windows of 512
        ranks = [batch_at(step, 1, rank, 2) for rank in range(2)]  # 4 each
        assert torch.equal(torch.cat(ranks), one_device), step
        assert not torch.equal(ranks[0], ranks[1])
    drawn = [index for rank in range(2) for _, index in curriculum.passkey_draws(5, 4, rank, 2)]
    assert len(drawn) == len(set(drawn)) > 0
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        curriculum.passkey_draws(5, 4, 2, 2)


BAD_STAGES = {
    "empty": ([], "non-empty list"),
    "not at step 0": ([{"step": 5, "seq_len": 16}], r"stages\[0\] must start at step 0"),
    "steps not increasing": ([{"step": 0, "seq_len": 16}, {"step": 0, "seq_len": 32}],
                             r"stages\[1\].step 0 must be larger"),
    "a float length": ([{"step": 0, "seq_len": 16.5}],
                       r"stages\[0\].seq_len must be a positive integer, got 16.5"),
    "a bad RoPE base": ([{"step": 0, "seq_len": 16, "rope_theta": -1.0}],
                        r"stages\[0\].rope_theta must be a finite positive number, got -1.0"),
    "an unknown key": ([{"step": 0, "seq_len": 16, "batch_size": 4}],
                       r"stages\[0\] must be a mapping with step, seq_len"),
}


@pytest.mark.parametrize("case", list(BAD_STAGES))
def test_bad_stages_are_refused_naming_the_entry(case):
    stages, message = BAD_STAGES[case]
    with pytest.raises(ValueError, match=message):
        LengthCurriculum(stages)


@pytest.mark.parametrize("step", [-1, 2.5, "3"])
def test_a_step_before_the_first_or_not_an_integer_is_refused(step):
    curriculum = LengthCurriculum([{"step": 0, "seq_len": 16}, {"step": 4, "seq_len": 32}])
    assert curriculum.stage_at(5).seq_len == 32
    for method in (curriculum.stage_at, curriculum.rope_theta_at):
        with pytest.raises(ValueError, match=rf"step must be a non-negative integer, got "
                           rf"{step!r}"):
            method(step)


def test_a_passkey_window_too_short_for_the_task_is_refused():
    with pytest.raises(UsageError, match="the stage at step 0 has passkey_fraction 0.1: "
                                         "passkey length 16 is too short.* need 237 bytes"):
        setup_with({"seq_len": 64}, stages=[{"step": 0, "seq_len": 16}], passkey_fraction=0.1)
    with pytest.raises(ValueError, match="label_mode must be"):
        LengthCurriculum([{"step": 0, "seq_len": 16}], passkey_fraction=0.1,
                         passkey_label_mode="answers")


@pytest.mark.parametrize(("options", "message"), [
    ({"passkey_label_mode": "everything"}, r"label_mode must be 'answer', 'recall' or 'all', "
     r"got 'everything'"),
    ({"seed": -1}, r"seed must be a non-negative integer, got -1"),
    ({"passkey_fraction": "0.1"}, r"passkey_fraction must be a number in \[0, 1\), got '0.1'"),
    ({"passkey_fraction": True}, r"passkey_fraction must be a number in \[0, 1\), got True"),
])
def test_passkey_options_are_checked_when_given_even_with_passkeys_off(options, message):
    with pytest.raises(ValueError, match=message):
        LengthCurriculum([{"step": 0, "seq_len": 16}], **options)


def setup_with(data: dict, position_encoding: str = "xpos",
               stages: list | None = None, passkey_fraction: float = 0.0) -> LengthCurriculum:
    config = LongNetConfig(vocab_size=256, hidden_size=16, num_layers=1, num_heads=2,
                           max_positions=64, segment_lengths=(64,), dilation_rates=(1,),
                           position_encoding=position_encoding)
    curriculum = LengthCurriculum(stages or STAGES, passkey_fraction=passkey_fraction)
    trainer = SimpleNamespace(datamodule=SimpleNamespace(**data), strategy=None)
    curriculum.setup(trainer, SimpleNamespace(model=LongNetLM(config)), "fit")
    return curriculum


def test_settings_the_curriculum_cannot_use_are_refused_at_setup():
    assert setup_with({"seq_len": 64}).rope_theta_at(0) == 1e4  # the configured base
    with pytest.raises(UsageError, match="seq_len 32, which does not divide the data's "
                                         "seq_len 48"):
        setup_with({"seq_len": 48})
    with pytest.raises(UsageError, match="passkey examples .* set the data's passkey_fraction"):
        setup_with({"seq_len": 64, "passkey_fraction": 0.5})
    subword = {"seq_len": 512, "tokenizer_choice": SimpleNamespace(kind="bpe"),
               "tokenizer": None}  # a BPE not trained yet: its tokens cannot be counted
    with pytest.raises(UsageError, match=r"the data's tokenizer \(bpe\) is not loaded"):
        setup_with(subword, stages=[{"step": 0, "seq_len": 256}], passkey_fraction=0.1)
    setup_with({**subword, "tokenizer_choice": SimpleNamespace(kind="bytes")},
               stages=[{"step": 0, "seq_len": 256}], passkey_fraction=0.1)
    with pytest.raises(UsageError, match="position_encoding is 'learned'"):
        setup_with({"seq_len": 64}, position_encoding="learned")
    with pytest.raises(UsageError, match="needs a datamodule with a seq_len"):
        setup_with({})
