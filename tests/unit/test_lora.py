"""LoRA fine-tuning (``CausalLMModule(lora=...)``, ``longnet.training.lora``) over a tiny
random Llama imported with its byte-level BPE tokenizer: only the adapters and norms train
and travel (checkpoint, compact handoff, export); a chunk resumes over the base weights (from
``last.ckpt``: bit-exactly; from the bfloat16 compact handoff: its first loss within 1e-3);
the delta merges into a model folder ``LongNetLM.from_pretrained`` loads."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lab.handoff import handoff_checkpoint, write_handoff
from longnet.attention import Retrieval
from longnet.cli import main
from longnet.cli.run_checks import describe_run
from longnet.modeling import LongNetLM
from longnet.modeling.zoo import ZOO
from longnet.training import CausalLMModule
from longnet.training.checkpoint import export_pretrained, load_lightning_checkpoint
from longnet.training.lora import (
    DELTA_CONFIG,
    DELTA_WEIGHTS,
    LoraSettings,
    merge_delta,
    read_delta,
    save_delta,
)
from longnet.training.schedule import parameter_groups
from longnet.validation import UsageError
from tests.chunked import CrashAtStep, Probe, fit, load, probed  # noqa: F401
from tests.gpu_configs import REPO, tiny_pretrained_config

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from longnet.hf.pretrained import import_pretrained  # noqa: E402
from tests.unit.test_import_hf import _llama  # noqa: E402
from tests.unit.test_import_pretrained import VOCAB, _tokenizer  # noqa: E402

HERE = "tests.unit.test_lora"
STEPS, CRASH_AT = 4, 3  # last.ckpt every 2 steps: the crashed run's is of step 2
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "train_norms": True, "train_kv_conv": False,
        "target_modules": ["q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj",
                           "down_proj"]}
PATTERN = {"segment_lengths": [16, 32, 64], "dilation_rates": [1, 2, 4]}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, width 32, 4 heads, 2 KV heads) and a BPE tokenizer of
    ``VOCAB`` ids, imported as a LongNet folder."""
    root = tmp_path_factory.mktemp("base")
    _llama(root / "hf", vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=None,
           eos_token_id=None)
    _tokenizer(root / "hf")
    return import_pretrained(root / "hf", root / "longnet")


def module(base: Path, **lora) -> CausalLMModule:
    return CausalLMModule(pretrained=str(base), overrides=PATTERN, lora={**LORA, **lora})


def test_only_the_adapters_and_norms_train_and_the_function_starts_unchanged(base):
    torch.manual_seed(0)
    tuned, plain = module(base), LongNetLM.from_pretrained(base, **PATTERN)
    trainable = {n for n, p in tuned.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or "norm" in n for n in trainable)
    assert sum("norm" in n for n in trainable) == 2 * 2 + 1  # two per block, the final one
    config = plain.config
    head, kv = config.hidden_size // config.num_heads, config.num_kv_heads
    shapes = {"q_proj": (32, 32), "k_proj": (32, head * kv), "v_proj": (32, head * kv),
              "out_proj": (32, 32), "gate_proj": (32, 40), "up_proj": (32, 40),
              "down_proj": (40, 32)}
    adapters = sum(p.numel() for n, p in tuned.named_parameters() if ".lora_" in n)
    assert adapters == 2 * sum(4 * (i + o) for i, o in shapes.values())  # r (in + out)
    assert set(tuned.state_dict()) == trainable  # the delta alone
    optimized = [p for group in parameter_groups(tuned.model, 0.1) for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in tuned.parameters() if p.requires_grad}
    frozen = dict(tuned.model.named_parameters())
    for name, value in plain.named_parameters():
        adapted = name.replace(".weight", ".base_layer.weight")
        assert torch.equal(frozen.get(name, frozen.get(adapted)), value), name
    x = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # lora_B starts at zero
        assert torch.equal(tuned.model(x).logits, plain(x).logits)
    without_norms = module(base, train_norms=False)
    assert not any("norm" in n for n, p in without_norms.named_parameters() if p.requires_grad)


def test_the_key_value_convolutions_train_with_train_kv_conv_and_merge(base, tmp_path):
    """``train_kv_conv`` adds each layer's K/V convolution to the delta (and nothing else); the
    retrofit starts as the base (identity convolution, ``lora_B`` zero); a trained delta
    merged into a model folder computes what the adapted model does."""
    torch.manual_seed(0)
    overrides = {**PATTERN, "kv_conv_size": 4}
    settings = {**LORA, "train_kv_conv": True}
    tuned = CausalLMModule(pretrained=str(base), overrides=overrides, lora=settings).model
    trainable = {n for n, p in tuned.named_parameters() if p.requires_grad}
    convs = {n for n in trainable if ".kv_conv." in n}
    assert convs == {f"model.layers.{i}.attn.kv_conv.weight" for i in range(2)}
    assert trainable - convs == {n for n, p in module(base).model.named_parameters()
                                 if p.requires_grad}
    x = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(3))
    plain = LongNetLM.from_pretrained(base, **PATTERN).eval()
    tuned.eval()
    with torch.no_grad():
        assert torch.equal(tuned(x).logits, plain(x).logits)
        for name, param in tuned.named_parameters():
            if ".lora_B" in name or ".kv_conv." in name:
                param.add_(0.05 * torch.randn_like(param))
        delta = {n: t for n, t in tuned.state_dict().items() if n in trainable}
        save_delta(tmp_path / "delta", delta, base=str(base), overrides=overrides,
                   settings=LoraSettings.from_mapping(settings), dtype=torch.float32)
        merged = LongNetLM.from_pretrained(merge_delta(tmp_path / "delta", tmp_path / "merged"))
        logits = tuned(x).logits
        assert (logits - plain(x).logits).abs().max() > 1e-2
        torch.testing.assert_close(merged.eval()(x).logits, logits, rtol=0, atol=1e-5)
    with pytest.raises(UsageError, match="lora.train_kv_conv needs a model with key/value "
                                         "convolutions; set kv_conv_size"):
        module(base, train_kv_conv=True)
    with pytest.raises(ValueError, match="lora.train_kv_conv must be true or false, got 'yes'"):
        LoraSettings.from_mapping({"train_kv_conv": "yes"})


def test_bad_lora_settings_and_a_missing_peft_are_refused(base, monkeypatch):
    with pytest.raises(UsageError, match="lora fine-tunes pretrained weights: give pretrained"):
        CausalLMModule(model="longnet-tiny", lora=LORA)
    with pytest.raises(UsageError, match=r"names \['o_proj'\], which are not linear layers.*"
                                         "'out_proj'"):
        module(base, target_modules=["q_proj", "o_proj"])
    with pytest.raises(ValueError, match="lora.r must be a positive integer, got 0"):
        LoraSettings.from_mapping({"r": 0})
    with pytest.raises(ValueError, match="lora must be a mapping with keys among.*'rank': 4"):
        LoraSettings.from_mapping({"rank": 4})
    with pytest.raises(ValueError, match="lora.dropout must be in \\[0, 1\\), got 1.0"):
        LoraSettings.from_mapping({"dropout": 1.0})
    with pytest.raises(UsageError, match=r"the checkpoint does not fit the model's LoRA "
                                         r"adapters: missing \['model.model.final_norm.weight'"):
        module(base).load_state_dict(module(base, train_norms=False).state_dict())
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match="needs the peft package: pip install peft"):
        module(base)


def config(base: Path, path: Path, cache: Path, *callbacks: dict) -> Path:
    """A LoRA fine-tune of ``base`` with its own tokenizer: ``STEPS`` steps of 4 x 64 tokens,
    ``last.ckpt`` every 2 steps, ``Rewarmup`` of 2, the export of the last weights, then
    ``callbacks``."""
    callback = [{"class_path": "longnet.training.LastCheckpoint",
                 "init_args": {"every_n_train_steps": 2}},
                {"class_path": "longnet.training.Rewarmup", "init_args": {"steps": 2}},
                {"class_path": "longnet.training.ExportPretrained",
                 "init_args": {"weights": "last"}}, *callbacks]
    data = {"seq_len": 64, "batch_size": 4, "max_documents": 40, "cache_dir": str(cache),
            "tokenizer": str(base)}
    model = {"pretrained": str(base), "overrides": PATTERN, "lora": LORA,
             "learning_rate": 1e-2, "warmup_steps": 1, "total_steps": STEPS}
    document = {
        "seed_everything": 7, "test_after_fit": False,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": STEPS,
                    "val_check_interval": 2, "check_val_every_n_epoch": None,
                    "limit_val_batches": 1, "num_sanity_val_steps": 0,
                    "log_every_n_steps": 1, "enable_progress_bar": False,
                    "logger": {"class_path": "longnet.training.RunLogger",
                               "init_args": {"save_dir": "runs", "name": "lora"}},
                    "callbacks": callback},
        "model": {"class_path": "longnet.training.CausalLMModule", "init_args": model},
        "data": {"class_path": "longnet.data.LongDocumentDataModule", "init_args": data},
    }
    path.write_text(yaml.safe_dump(document))
    return path


def callback(name: str, **init_args) -> dict:
    return {"class_path": f"{HERE}.{name}", "init_args": init_args}


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> Path:
    """``full``: the uninterrupted fine-tune; ``crashed``: killed in step ``CRASH_AT``."""
    root = tmp_path_factory.mktemp("runs")
    cache = root / "cache"
    full = config(base, root / "full.yaml", cache, callback("Probe", path=str(root / "full.jsonl")))
    assert fit(full, root, "full") == 0
    crashing = config(base, root / "crash.yaml", cache, callback("CrashAtStep", step=CRASH_AT))
    with pytest.raises(RuntimeError, match=f"crash at step {CRASH_AT}"):
        fit(crashing, root, "crashed")
    return root


def losses(path: Path) -> dict[int, float]:
    with open(path) as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle)
                if row.get("train/loss")}


def test_a_chunk_resumes_over_the_base_from_the_delta_alone(base, runs, tmp_path):
    last = runs / "crashed" / "checkpoints" / "last.ckpt"
    checkpoint = load(last)
    assert checkpoint["global_step"] == 2
    assert all(".lora_" in n or "norm" in n for n in checkpoint["state_dict"])
    target = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    target.parent.mkdir(parents=True)
    shutil.copyfile(last, target)
    resumed = config(base, tmp_path / "resumed.yaml", tmp_path / "cache",
                     callback("Probe", path=str(tmp_path / "resumed.jsonl")))
    assert fit(resumed, tmp_path, "resumed", "--ckpt_path=last") == 0

    expected = load(runs / "full" / "checkpoints" / "last.ckpt")["state_dict"]
    got = load(target)["state_dict"]
    assert got.keys() == expected.keys()
    for name, value in expected.items():  # the full state resumes bit-exactly
        assert torch.equal(got[name], value), name
    full, after = losses(runs / "full" / "metrics.csv"), losses(
        tmp_path / "resumed" / "metrics.csv")
    assert [after[s] for s in (2, 3)] == [full[s] for s in (2, 3)]


def test_the_compact_handoff_carries_the_delta_and_names_the_base(base, runs, tmp_path):
    last = runs / "crashed" / "checkpoints" / "last.ckpt"
    weights, record = write_handoff(last, tmp_path / "handoff")
    handoff = json.loads(record.read_text())
    hparams = handoff["checkpoint"]["hyper_parameters"]
    assert hparams["pretrained"] == str(base) and hparams["lora"] == LORA
    delta = load(last)["state_dict"]
    assert set(handoff["dtypes"]) == set(delta)
    assert weights.stat().st_size < 2 * sum(t.numel() for t in delta.values()) + 16_384
    base_size = (base / "model.safetensors").stat().st_size
    assert weights.stat().st_size < base_size / 3

    target = tmp_path / "started" / "checkpoints" / "last.ckpt"
    handoff_checkpoint(tmp_path / "handoff", target)
    started = config(base, tmp_path / "started.yaml", tmp_path / "cache",
                     callback("Probe", path=str(tmp_path / "started.jsonl")))
    assert fit(started, tmp_path, "started", "--ckpt_path=last") == 0
    assert load(target)["global_step"] == STEPS
    full, after = probed(runs / "full.jsonl"), probed(tmp_path / "started.jsonl")
    assert [after[s]["sha"] for s in (2, 3)] == [full[s]["sha"] for s in (2, 3)]
    # the weights rounded to bfloat16: the first loss after the handoff within 1e-3
    first = losses(tmp_path / "started" / "metrics.csv")[2]
    assert first == pytest.approx(losses(runs / "full" / "metrics.csv")[2], rel=1e-3)


def test_the_export_is_the_delta_and_merges_into_a_loadable_model(base, runs, tmp_path):
    exported = runs / "full" / "model"
    names = {p.name for p in exported.iterdir()}
    assert {DELTA_CONFIG, DELTA_WEIGHTS, "tokenizer.json"} <= names
    assert "model.safetensors" not in names
    record, delta = read_delta(exported)
    assert record["base"] == str(base) and record["lora"] == LORA
    assert record["overrides"] == PATTERN
    assert {t.dtype for t in delta.values()} == {torch.bfloat16}
    with pytest.raises(FileNotFoundError, match=rf"LoRA delta \(lora.json\): merge it into its "
                       rf"base with longnet export {exported} OUTPUT"):
        LongNetLM.from_pretrained(exported)
    with pytest.raises(FileNotFoundError, match=rf"with a LoRA delta: merge it with longnet "
                       rf"export {exported} OUTPUT"):
        LongNetLM.from_pretrained(runs / "full")
    assert f"LoRA delta: longnet export {exported} OUTPUT" in describe_run(runs / "full")

    trained = load_lightning_checkpoint(runs / "full" / "checkpoints" / "last.ckpt")
    assert not any("lora" in name for name in trained.state_dict())  # merged
    x = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(2))
    assert main(["export", str(exported), str(tmp_path / "merged")]) == 0  # merge_delta
    merged = LongNetLM.from_pretrained(tmp_path / "merged").eval()
    assert (tmp_path / "merged" / "tokenizer.json").read_text() == (
        exported / "tokenizer.json").read_text()
    assert list(merged.config.segment_lengths) == PATTERN["segment_lengths"]
    original = LongNetLM.from_pretrained(base, **PATTERN).eval()
    with torch.no_grad():
        logits = trained(x).logits
        assert (logits - original(x).logits).abs().max() > 1e-2  # the fine-tune changed it
        # the export's delta is bfloat16: the merged model is the adapted one with that delta
        rounded = module(base)
        rounded.load_state_dict({f"model.{name}": t.float() for name, t in delta.items()})
        torch.testing.assert_close(merged(x).logits, rounded.model.eval()(x).logits,
                                   rtol=0, atol=1e-4)
    exact = LongNetLM.from_pretrained(export_pretrained(
        runs / "full" / "checkpoints" / "last.ckpt", tmp_path / "exact")).eval()
    with torch.no_grad():
        torch.testing.assert_close(exact(x).logits, logits, rtol=0, atol=0)


def test_the_smollm2_32k_recipe_runs_on_the_cpu_at_tiny_size(base, tmp_path):
    """``lab/configs/gpu/smollm2_135m_32k.yaml`` at 1/128 of its lengths
    (``tiny_pretrained_config``:
    the tiny imported Llama as the base, its BPE as the tokenizer, the standard library's
    packages): 3 LoRA steps, one per curriculum stage (the second profiled), then the test and
    the delta export."""
    recipe_file = REPO / "lab" / "configs" / "gpu" / "smollm2_135m_32k.yaml"
    recipe = yaml.safe_load(recipe_file.read_text())
    model, data = recipe["model"]["init_args"], recipe["data"]["init_args"]
    assert model["pretrained"] == data["tokenizer"] == "smollm2-135m"
    assert model["overrides"]["segment_lengths"][-1] == data["seq_len"] == 32768
    assert model["overrides"]["dilation_rates"][0] == 1  # the first branch sees every token
    config = tiny_pretrained_config("smollm2_135m_32k", tmp_path / "cache", base)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    assert fit(path, tmp_path, "run") == 0

    checkpoint = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 3
    assert all(".lora_" in n or "norm" in n for n in checkpoint["state_dict"])
    record, _ = read_delta(tmp_path / "run" / "model")
    assert record["overrides"]["rope_extension"]["rope_type"] == "yarn"
    assert record["lora"]["target_modules"] == model["lora"]["target_modules"]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test"]["step"] == 3 and metrics["test"]["test/bpb"] > 0
    profile = (tmp_path / "run" / "profile.txt").read_text()
    assert profile.startswith("Profile of training step 1 on cpu")


def test_the_branches_overlay_of_the_32k_recipe_runs_on_the_cpu_at_tiny_size(base, tmp_path):
    """``lab/configs/gpu/smollm2_135m_32k_branches.yaml`` given after the recipe, at 1/128 of
    its lengths: the zoo entry's window, sinks, selection and neighbour segment over the
    base, 3 LoRA steps; the delta records the branches, the merged model runs them."""
    overlay = yaml.safe_load(
        (REPO / "lab" / "configs" / "gpu" / "smollm2_135m_32k_branches.yaml").read_text())
    overrides = overlay["model"]["init_args"]["overrides"]
    entry = ZOO["smollm2-135m-32k"].config  # the overlay spells out the zoo entry's attention
    assert overlay["model"]["init_args"]["pretrained"] == "smollm2-135m"
    assert {name: getattr(entry, name) for name in overrides} == {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in overrides.items()}
    assert overrides["neighbor_segments"] == 1 and entry.rope_extension is None
    config = tiny_pretrained_config("smollm2_135m_32k", tmp_path / "cache", base,
                                    overlay="smollm2_135m_32k_branches")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    assert fit(path, tmp_path, "run") == 0
    record, _ = read_delta(tmp_path / "run" / "model")
    assert record["overrides"]["select_top_k"] == 16
    assert record["overrides"]["retrieval_positions"] == "before_segment"
    merged = LongNetLM.from_pretrained(export_pretrained(
        tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "merged"))
    attention = merged.model.layers[0].attn
    assert attention.retrieval == Retrieval(sinks=4, block=4, top_k=16, neighbors=1)
