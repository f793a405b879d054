"""Loading models to evaluate: zoo names, folders, Lightning checkpoints."""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path

import pytest
import torch

from longnet.attention import Retrieval
from longnet.cli.arguments import json_object_argument
from longnet.eval import checkpoint_config, load_model, load_models
from longnet.modeling import (
    LongNetConfig,
    LongNetLM,
    NonFiniteWeightsError,
    WeightsMismatchError,
)
from longnet.validation import UsageError

CONFIG = dict(hidden_size=32, num_layers=2, num_heads=2, max_positions=64,
              segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4), eos_token_id=255)


def tiny(seed: int = 0) -> LongNetLM:
    torch.manual_seed(seed)
    return LongNetLM(LongNetConfig(**CONFIG)).eval()


def same_logits(a: LongNetLM, b: LongNetLM) -> bool:
    x = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.equal(a(x).logits, b(x).logits)


def lightning_like_checkpoint(model: LongNetLM, path: Path, hparams: dict) -> Path:
    """What Lightning writes for a module holding the LM as ``self.model``: the module's
    state_dict (tied weights under both names) and ``dict(hparams)``."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state["val_ce.total"] = torch.zeros(())  # other module state is ignored
    torch.save({"state_dict": state, "hyper_parameters": hparams, "epoch": 0,
                "optimizer_states": [], "pytorch-lightning_version": "2.x"}, path)
    return path


def test_folder_and_labels(tmp_path: Path):
    model = tiny()
    model.save_pretrained(tmp_path / "run-a")
    loaded = load_model(tmp_path / "run-a")
    assert loaded.label == "run-a" and loaded.kind == "folder" and not loaded.model.training
    assert loaded.training_length == 64
    assert same_logits(model, loaded.model)
    both = load_models([tmp_path / "run-a", tmp_path / "run-a"])
    assert [m.label for m in both] == ["run-a", "run-a-2"]
    assert load_models([tmp_path / "run-a"], labels=["mine"])[0].label == "mine"
    model.save_pretrained(tmp_path / "run-b" / "model")  # where ExportPretrained writes
    assert load_model(tmp_path / "run-b" / "model").label == "run-b/model"
    with pytest.raises(ValueError, match="one label per model"):
        load_models([tmp_path / "run-a"], labels=["a", "b"])
    assert load_model(tmp_path / "run-a", dtype=torch.float64).model.lm_head.weight.dtype == (
        torch.float64
    )


def test_overrides_per_model_or_for_all(tmp_path: Path):
    """One JSON object for all models or one per model; a checkpoint takes none; the
    command-line type refuses what is not a JSON object."""
    model = tiny()
    model.save_pretrained(tmp_path / "run")
    retrieval = {"attention_sinks": 2, "select_block": 4, "select_top_k": 2}
    plain, far = load_models([tmp_path / "run"] * 2, overrides=[{}, retrieval])
    assert plain.model.config.retrieval is None
    assert far.model.config.retrieval == Retrieval(sinks=2, block=4, top_k=2)
    assert far.model.model.layers[0].attn.retrieval == far.model.config.retrieval
    both = load_models([tmp_path / "run"] * 2, overrides=[retrieval])
    assert all(m.model.config.select_top_k == 2 for m in both)
    with pytest.raises(ValueError, match="one JSON object for all models or one per model"):
        load_models([tmp_path / "run"] * 3, overrides=[{}, {}])
    checkpoint = lightning_like_checkpoint(model, tmp_path / "last.ckpt",
                                           {"config": LongNetConfig(**CONFIG).to_dict()})
    with pytest.raises(UsageError, match="not to a Lightning checkpoint"):
        load_model(checkpoint, overrides=retrieval)
    with pytest.raises(argparse.ArgumentTypeError, match="not a JSON object"):
        json_object_argument("[1, 2]")
    with pytest.raises(argparse.ArgumentTypeError, match="is not JSON"):
        json_object_argument("{sinks: 4}")


def test_unknown_names_list_the_zoo_and_weightless_entries_say_so(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="Known models.*longnet-tiny"):
        load_model("longnet-huge")
    with pytest.raises(FileNotFoundError, match="no trained weights"):
        load_model("longnet-small")
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_model(tmp_path / "missing.ckpt")


@pytest.mark.parametrize("source", ["config", "model", "pretrained"])
def test_lightning_checkpoint(tmp_path: Path, source: str):
    model = tiny(seed=3)
    folder = model.save_pretrained(tmp_path / "base")
    fields = LongNetConfig(**CONFIG).to_dict()
    hparams = {"model": None, "pretrained": None, "config": None, "overrides": None,
               "learning_rate": 1e-3, "betas": (0.9, 0.95)}
    if source == "config":
        hparams["config"] = {k: v for k, v in fields.items() if k != "dropout"}
        hparams["overrides"] = {"dropout": 0.0}
    elif source == "model":
        hparams["model"] = str(folder)
    elif source == "pretrained":
        hparams["pretrained"] = str(folder)
    path = lightning_like_checkpoint(model, tmp_path / "epoch=1-step=10.ckpt", hparams)
    loaded = load_model(path)
    assert loaded.kind == "checkpoint" and loaded.label == "epoch=1-step=10"
    assert same_logits(model, loaded.model)


def test_real_training_module_checkpoint(tmp_path: Path):
    training = pytest.importorskip("longnet.training")
    module = training.CausalLMModule(config=dict(CONFIG), overrides={"num_layers": 1})
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)},
               tmp_path / "last.ckpt")
    loaded = load_model(tmp_path / "last.ckpt")
    assert loaded.model.config.num_layers == 1
    assert same_logits(module.model.eval(), loaded.model)


def test_bad_checkpoints_are_explained(tmp_path: Path):
    model = tiny()
    with pytest.raises(ValueError, match="found no model config"):
        checkpoint_config({"hyper_parameters": {"learning_rate": 1.0}}, source="x.ckpt")
    path = lightning_like_checkpoint(model, tmp_path / "a.ckpt", {"config": dict(
        CONFIG, hidden_size=64)})
    with pytest.raises(WeightsMismatchError, match="wrong shapes"):
        load_model(path)
    torch.save({"state_dict": {"encoder.weight": torch.zeros(2)},
                "hyper_parameters": {"config": CONFIG}}, tmp_path / "b.ckpt")
    with pytest.raises(ValueError, match="holds no LongNetLM"):
        load_model(tmp_path / "b.ckpt")
    torch.save({"weights": 1}, tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match="not a Lightning checkpoint"):
        load_model(tmp_path / "c.ckpt")
    (tmp_path / "d.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="d.ckpt is not a checkpoint: torch.save writes a zip"):
        load_model(tmp_path / "d.ckpt")
    with zipfile.ZipFile(tmp_path / "e.ckpt", "w") as archive:  # a zip, but not torch.save's
        archive.writestr("notes.txt", "hello")
    with pytest.raises(ValueError, match="cannot read .*e.ckpt .*weights_only=True"):
        load_model(tmp_path / "e.ckpt")
    with torch.no_grad():
        model.model.layers[1].ffn.up_proj.weight[2, 5] = float("inf")
    path = lightning_like_checkpoint(model, tmp_path / "f.ckpt", {"config": CONFIG})
    with pytest.raises(NonFiniteWeightsError,
                       match=r"f\.ckpt holds NaN or infinite weights: model\.layers\.1\.ffn"):
        load_model(path)


def test_checkpoint_errors_name_the_file(tmp_path: Path):
    """Training (ExportPretrained) and evaluation share one loader; its errors say which file."""
    from longnet.training import load_lightning_checkpoint, read_checkpoint

    missing = tmp_path / "gone.ckpt"
    with pytest.raises(FileNotFoundError, match="gone.ckpt"):
        read_checkpoint(missing)
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"\x80\x02 truncated")
    with pytest.raises(ValueError, match="corrupt.ckpt is not a checkpoint"):
        load_lightning_checkpoint(corrupt)
    model = tiny()
    path = lightning_like_checkpoint(model, tmp_path / "given.ckpt", {})
    with pytest.raises(ValueError, match="given.ckpt: found no model config"):
        load_lightning_checkpoint(path)
    loaded = load_lightning_checkpoint(path, config=model.config, prefix="model.")
    assert same_logits(model, loaded)
