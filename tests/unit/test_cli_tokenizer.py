"""The command with a subword tokenizer: ``--data.init_args.tokenizer bpe:N`` trains, the run
folder and the export carry the tokenizer, a resume keeps it and cannot switch it;
configs/quickstart_bpe.yaml gives longnet-tiny's shape the BPE's vocabulary."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from longnet.cli import main
from longnet.cli.command import LongNetCLI
from longnet.modeling import LongNetConfig, resolve_model_dir

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
QUICKSTART_BPE = REPO / "configs" / "quickstart_bpe.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(root: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(SMOKE), f"--trainer.logger.init_args.save_dir={root}",
            f"--trainer.default_root_dir={root / 'smoke'}",
            f"--data.init_args.cache_dir={root / 'cache'}", "--data.init_args.max_documents=40",
            "--trainer.val_check_interval=4", "--trainer.limit_val_batches=2",
            "--trainer.limit_test_batches=2", *extra]


def test_fit_with_a_bpe_carries_it_and_a_resume_cannot_switch(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    assert main(_args(tmp_path, "--trainer.max_steps=4", "--data.init_args.tokenizer=bpe:400")) \
        == 0
    assert "Trained a byte-level BPE of" in capsys.readouterr().err
    run = tmp_path / "smoke"
    saved = (run / "tokenizer" / "tokenizer.json").read_text()
    assert (run / "model" / "tokenizer.json").read_text() == saved
    config = json.loads((run / "model" / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["pad_token_id"]) == (400, 0, 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "model")
    assert tokenizer.eos_token_id == 0 and len(tokenizer.encode("def f():\n")) < 9

    test = json.loads((run / "metrics.json").read_text())["test"]
    assert test["test/bytes"] > 1.2 * test["test/tokens"]  # a small BPE: ~1.5 bytes a token
    assert test["test/bpb"] == pytest.approx(
        test["test/loss"] * test["test/tokens"] / test["test/bytes"] / math.log(2), rel=1e-5)

    resumed = _args(tmp_path, "--trainer.max_steps=6", "--data.init_args.tokenizer=bpe:400",
                    "--ckpt_path=last")
    assert main(resumed) == 0
    assert main(_args(tmp_path, "--trainer.max_steps=8", "--ckpt_path=last")) == 2
    err = capsys.readouterr().err
    assert "holds a model of another shape" in err and "400" in err and "256" in err, err


def test_quickstart_bpe_gives_the_model_the_bpe_vocabulary(tmp_path):
    cli = LongNetCLI(["--config", str(QUICKSTART_BPE), f"--data.init_args.cache_dir={tmp_path}"],
                     run=False)
    config = cli.model.model.config
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id) == (8192, 0, 1)
    tiny = LongNetConfig.from_pretrained(resolve_model_dir("longnet-tiny"))
    fitted = dataclasses.replace(config, vocab_size=256, eos_token_id=255, pad_token_id=254)
    assert fitted == tiny  # longnet-tiny's shape, the tokenizer's vocabulary
    assert cli.datamodule.tokenizer_choice.kind == "bpe"
