"""Nothing the user did not name is replaced: every writer of a model folder, checkpoint or
state (import, export, merge, save, the chunk handovers) refuses a target that holds a model or
checkpoint unless asked to replace it (``--overwrite``, ``overwrite=True``), never writes onto
its own source or a LoRA run's base, and leaves the target byte for byte as it was when it
refuses; a LoRA run is bound to its base by the base's weights fingerprint.

The six destructive cases of issue 62 are ``test_case_1`` ... ``test_case_6``."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from lab.handoff import (
    handoff_checkpoint,
    restore_newest,
    unpack_state,
    write_handoff,
)
from longnet.cli import main
from longnet.files import check_target, held_model
from longnet.modeling import LongNetConfig, LongNetLM
from longnet.training.run_folder import RUN_ID_KEY
from longnet.validation import UsageError
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
TINY = {"vocab_size": 64, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
        "max_positions": 32, "segment_lengths": [32], "dilation_rates": [1],
        "eos_token_id": 63, "pad_token_id": 62}
LORA = {"r": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"]}


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) by relative name, with its SHA-256."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def refused(script: str, argv: list[str], capsys) -> str:
    """Run ``longnet import|export argv`` or ``lab/scripts/<script>.py argv`` as the command
    line does; it must end with exit status 2 and no traceback. Returns what it printed on
    stderr."""
    if script in ("import", "export"):
        assert main([script, *argv]) == 2
    else:
        module = load_script(script)
        assert module.run_cli(lambda: module.main(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def tiny_model(seed: int = 0) -> LongNetLM:
    torch.manual_seed(seed)
    return LongNetLM(LongNetConfig(**TINY))


def tiny_checkpoint(path: Path, model: LongNetLM, run_id: str = "run-a", step: int = 3,
                    **extra) -> Path:
    """A Lightning checkpoint of ``CausalLMModule(config=TINY)`` holding ``model``."""
    checkpoint = {
        "epoch": 0, "global_step": step, RUN_ID_KEY: run_id,
        "hyper_parameters": {"config": dict(TINY), "overrides": None},
        "state_dict": {f"model.{name}": t.clone() for name, t in model.state_dict().items()},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]}],
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def hf_source(tmp_path) -> Path:
    """A tiny random Llama with its tokenizer, as ``transformers`` saves them."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.unit.test_import_hf import _llama
    from tests.unit.test_import_pretrained import VOCAB, _tokenizer

    folder = tmp_path / "hf"
    _llama(folder, vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=None,
           eos_token_id=None)
    _tokenizer(folder)
    return folder


@pytest.fixture
def trained(tmp_path) -> Path:
    """A model folder the user trained: what an import or export must not replace unasked."""
    return tiny_model(seed=1).save_pretrained(tmp_path / "trained")


# ---------------------------------------------------------------------- the one check
def test_check_target_refuses_a_model_unless_overwrite_and_a_source_always(tmp_path, trained):
    assert held_model(tmp_path / "absent") is None
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("kept")
    assert held_model(tmp_path / "notes") is None
    assert check_target(tmp_path / "notes") == tmp_path / "notes"
    with pytest.raises(UsageError, match=r"already holds a model or checkpoint "
                       r"\(config.json, model.safetensors\)") as info:
        check_target(trained, what="OUTPUT")
    assert str(trained) in str(info.value) and "--overwrite" in str(info.value)
    assert check_target(trained, overwrite=True) == trained
    for target, source, where in ((trained, trained, "is"), (trained / "sub", trained,
                                                              "is inside"),
                                  (tmp_path, trained, "holds")):
        with pytest.raises(UsageError, match=f"{where} the source") as info:
            check_target(target, sources={"the source": source}, overwrite=True)
        assert "even with --overwrite" in str(info.value)
    link = tmp_path / "link"
    link.symlink_to(trained)
    with pytest.raises(UsageError, match="is the source"):
        check_target(link, sources={"the source": trained}, overwrite=True)
    (tmp_path / "last.ckpt").write_bytes(b"x" * 10)
    with pytest.raises(UsageError, match="already holds a file of 10 bytes"):
        check_target(tmp_path / "last.ckpt", kind="file")
    with pytest.raises(UsageError, match="is a folder, not a checkpoint file"):
        check_target(trained, kind="file", overwrite=True)
    with pytest.raises(UsageError, match="last.ckpt is a file, not a folder"):  # not overwrite
        check_target(tmp_path / "last.ckpt")


# ---------------------------------------------------------------------- the six cases
def test_case_1_an_import_onto_its_own_source_is_refused_even_with_overwrite(hf_source, capsys):
    before = tree(hf_source)
    for extra in ([], ["--overwrite"]):
        err = refused("import", [str(hf_source), str(hf_source), *extra], capsys)
        assert f"OUTPUT {hf_source} is the source {hf_source}" in err
    assert tree(hf_source) == before
    with pytest.raises(UsageError, match="is inside the source"):
        from longnet.hf.pretrained import import_pretrained

        import_pretrained(hf_source, hf_source / "longnet", overwrite=True)
    assert tree(hf_source) == before


def test_case_2_an_import_onto_a_trained_model_needs_overwrite(hf_source, trained, capsys):
    before = tree(trained)
    err = refused("import", [str(hf_source), str(trained)], capsys)
    assert f"OUTPUT {trained} already holds a model or checkpoint" in err
    assert "pass --overwrite" in err
    assert tree(trained) == before
    assert main(["import", str(hf_source), str(trained), "--overwrite"]) == 0
    assert tree(trained) != before
    assert LongNetLM.from_pretrained(trained).config.vocab_size != TINY["vocab_size"]


def test_case_3_an_export_onto_a_trained_model_needs_overwrite(tmp_path, trained, capsys):
    checkpoint = tiny_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", tiny_model())
    before = tree(trained)
    err = refused("export", [str(checkpoint), str(trained)], capsys)
    assert f"OUTPUT {trained} already holds a model or checkpoint" in err
    assert tree(trained) == before
    assert main(["export", str(checkpoint), str(trained), "--overwrite"]) == 0
    exported = LongNetLM.from_pretrained(trained)
    assert torch.equal(exported.state_dict()["lm_head.weight"],
                       tiny_model().state_dict()["lm_head.weight"])


@pytest.fixture
def delta(tmp_path) -> tuple[Path, Path]:
    """A LoRA base (a model folder) and the delta folder of a fine-tune of it."""
    pytest.importorskip("peft")
    from longnet.training import CausalLMModule
    from longnet.training.lora import save_delta

    base = tiny_model(seed=2).save_pretrained(tmp_path / "base")
    module = CausalLMModule(pretrained=str(base), lora=LORA)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    folder = save_delta(tmp_path / "run" / "model",
                        {n.removeprefix("model."): t for n, t in module.state_dict().items()},
                        base=str(base), settings=module.lora,
                        base_fingerprint=module.lora_base["fingerprint"])
    (folder / "tokenizer.json").write_text("{}")
    return base, folder


def test_case_4_an_export_onto_the_runs_lora_base_is_refused_even_with_overwrite(delta, capsys):
    base, folder = delta
    before = tree(base)
    for extra in ([], ["--overwrite"]):
        err = refused("export", [str(folder), str(base), *extra], capsys)
        assert f"OUTPUT {base} is the LoRA base {base}" in err
    assert tree(base) == before


def test_case_5_an_export_onto_its_own_delta_is_refused(delta, capsys):
    _, folder = delta
    before = tree(folder)
    for extra in ([], ["--overwrite"]):
        err = refused("export", [str(folder), str(folder), *extra], capsys)
        assert f"OUTPUT {folder} is the source {folder}" in err
    assert tree(folder) == before


def test_case_6_start_neither_replaces_a_checkpoint_unasked_nor_another_runs(tmp_path, capsys):
    run_a = tiny_checkpoint(tmp_path / "a" / "last.ckpt", tiny_model(), "run-a", step=5)
    run_b = tiny_checkpoint(tmp_path / "b" / "checkpoints" / "last.ckpt", tiny_model(3),
                            "run-b", step=2)
    write_handoff(run_a, tmp_path / "handoff-a")
    before = tree(run_b)
    err = refused("chunk_state", ["start", str(tmp_path / "handoff-a"), str(run_b)], capsys)
    assert f"CHECKPOINT {run_b} already holds a file of" in err and "--overwrite" in err
    err = refused("chunk_state", ["start", str(tmp_path / "handoff-a"), str(run_b),
                                  "--overwrite"], capsys)
    assert "holds another run than" in err and "run id run-a" in err
    assert tree(run_b) == before
    own = tiny_checkpoint(tmp_path / "a2" / "last.ckpt", tiny_model(), "run-a", step=1)
    script = load_script("chunk_state")
    assert script.main(["start", str(tmp_path / "handoff-a"), str(own), "--overwrite"]) == 0
    assert torch.load(own, weights_only=True)["global_step"] == 5


# ---------------------------------------------------------------------- the other writers
def test_pack_and_handoff_replace_an_earlier_one_only_when_asked(tmp_path, capsys):
    checkpoint = tiny_checkpoint(tmp_path / "last.ckpt", tiny_model())
    script = load_script("chunk_state")
    for command in ("pack", "handoff"):
        folder = tmp_path / command
        assert script.main([command, str(checkpoint), str(folder)]) == 0
        before = tree(folder)
        err = refused("chunk_state", [command, str(checkpoint), str(folder)], capsys)
        assert f"FOLDER {folder} already holds" in err and "--overwrite" in err
        assert tree(folder) == before
        assert script.main([command, str(checkpoint), str(folder), "--overwrite"]) == 0
    err = refused("chunk_state", ["pack", str(checkpoint), str(tmp_path)], capsys)
    assert f"{tmp_path} holds other files" in err
    (tmp_path / "pack" / "last.ckpt").write_bytes(checkpoint.read_bytes())
    err = refused("chunk_state", ["pack", str(tmp_path / "pack" / "last.ckpt"),
                                  str(tmp_path / "pack"), "--overwrite"], capsys)
    assert "holds the checkpoint" in err


def test_unpack_refuses_a_folder_and_an_existing_checkpoint(tmp_path, capsys):
    checkpoint = tiny_checkpoint(tmp_path / "last.ckpt", tiny_model())
    load_script("chunk_state").main(["pack", str(checkpoint), str(tmp_path / "state")])
    (tmp_path / "folder").mkdir()
    err = refused("chunk_state", ["unpack", str(tmp_path / "state"), str(tmp_path / "folder")],
                  capsys)
    assert f"CHECKPOINT {tmp_path / 'folder'} is a folder, not a checkpoint file" in err
    with pytest.raises(UsageError, match="is a folder, not a checkpoint file"):
        restore_newest(tmp_path / "folder", state=tmp_path / "state")
    other = tiny_checkpoint(tmp_path / "b" / "last.ckpt", tiny_model(3), "run-b")
    before = tree(other)
    with pytest.raises(UsageError, match="already holds a file"):
        unpack_state(tmp_path / "state", other)
    with pytest.raises(UsageError, match="holds another run than"):
        unpack_state(tmp_path / "state", other, overwrite=True)
    assert tree(other) == before
    with pytest.raises(UsageError, match="already holds a file"):
        handoff_checkpoint(tmp_path / "state", other)


def test_save_pretrained_refuses_a_model_folder_unless_overwrite(tmp_path, trained):
    before = tree(trained)
    with pytest.raises(UsageError, match="already holds a model or checkpoint"):
        tiny_model().save_pretrained(trained)
    assert tree(trained) == before
    tiny_model().save_pretrained(trained, overwrite=True)
    assert tree(trained) != before


def test_a_merge_onto_a_model_needs_overwrite_and_never_goes_onto_the_base(delta, trained):
    from longnet.training.lora import merge_delta

    base, folder = delta
    before = tree(trained), tree(base)
    with pytest.raises(UsageError, match="already holds a model"):
        merge_delta(folder, trained)
    with pytest.raises(UsageError, match="is inside the LoRA base"):
        merge_delta(folder, base / "merged", overwrite=True)
    assert (tree(trained), tree(base)) == before
    merge_delta(folder, trained, overwrite=True)
    assert (trained / "tokenizer.json").read_text() == "{}"
    assert not (trained / "lora.json").exists()


# ---------------------------------------------------------------------- LoRA bound to its base
def test_a_lora_delta_and_checkpoint_refuse_another_base(delta, tmp_path):
    from longnet.training.checkpoint import export_pretrained
    from longnet.training.lora import DELTA_CONFIG, merge_delta

    base, folder = delta
    record = json.loads((folder / DELTA_CONFIG).read_text())
    fingerprint = record["base_fingerprint"]
    assert len(fingerprint) == 64
    merge_delta(folder, tmp_path / "merged")  # the same base: merged
    tiny_model(seed=9).save_pretrained(base, overwrite=True)  # the base changed in place
    with pytest.raises(UsageError) as info:
        merge_delta(folder, tmp_path / "merged-2")
    message = str(info.value)
    assert fingerprint in message and str(base) in message and "another base" in message
    assert not (tmp_path / "merged-2").exists()

    from longnet.training import CausalLMModule

    module = CausalLMModule(pretrained=str(base), lora=LORA)
    assert module.lora_base["fingerprint"] != fingerprint
    checkpoint = {"hyper_parameters": {"pretrained": str(base), "lora": LORA,
                                       "overrides": None},
                  "state_dict": {f"model.{n}": t for n, t in module.state_dict().items()},
                  "global_step": 1, "optimizer_states": [{"state": {}, "param_groups": []}],
                  "longnet_lora_base": {**module.lora_base, "fingerprint": fingerprint}}
    torch.save(checkpoint, tmp_path / "last.ckpt")
    with pytest.raises(UsageError, match=fingerprint):
        export_pretrained(tmp_path / "last.ckpt", tmp_path / "exported")
    before = tree(base)
    with pytest.raises(UsageError, match=f"OUTPUT {base} is the LoRA base"):
        export_pretrained(tmp_path / "last.ckpt", base, overwrite=True)
    assert tree(base) == before
    with pytest.raises(UsageError, match=fingerprint):
        module.on_load_checkpoint(checkpoint)
    write_handoff(tmp_path / "last.ckpt", tmp_path / "handoff")
    data = handoff_checkpoint(tmp_path / "handoff", tmp_path / "started.ckpt")
    assert torch.load(data, weights_only=True)["longnet_lora_base"]["fingerprint"] == fingerprint


# ---------------------------------------------------------------------- clearer imports
def test_an_import_without_tokenizer_files_says_so(hf_source, tmp_path, capsys):
    for name in os.listdir(hf_source):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            os.remove(hf_source / name)
    main(["import", str(hf_source), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"{hf_source} has no tokenizer files" in err and "tokenizer.json" in err
    assert str(tmp_path / "out") in err


def test_an_unknown_zoo_name_lists_the_known_ones(tmp_path, capsys):
    for argv in (["smollm2-13b"], ["smollm2-13b", str(tmp_path / "out")]):
        err = refused("import", argv, capsys)
        assert "'smollm2-13b' is no folder, .gguf file or zoo name" in err
        assert "smollm2-135m" in err
    err = refused("import", ["smollm2-135m", str(tmp_path / "out")], capsys)
    assert "'smollm2-135m' is a zoo name: it imports into the user cache, without OUTPUT" in err
    assert not (tmp_path / "out").exists()


def test_an_unwritable_output_is_refused_before_the_conversion(hf_source, tmp_path,
                                                               monkeypatch):
    import longnet.hf.pretrained as pretrained

    def converted(*args, **kwargs):
        raise AssertionError("converted before the output was checked")

    monkeypatch.setattr(pretrained, "import_hf_checkpoint", converted)
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        pretrained.import_pretrained(hf_source, tmp_path / "file" / "out")


def test_a_truncated_cache_entry_names_the_real_fix(tmp_path, monkeypatch):
    from longnet.modeling.hub import materialized_dir

    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path / "cache"))
    folder = tiny_model().save_pretrained(materialized_dir("smollm2-135m"))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError) as info:
        LongNetLM.from_pretrained(folder)
    message = str(info.value)
    assert str(folder) in message and "Re-save" not in message
    assert f"delete {folder}" in message and "materialize" in message


# ---------------------------------------------------------------------- train_chunk.sh
def test_the_chunk_script_uses_the_run_name_given_on_the_command_line(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    config["trainer"]["logger"]["init_args"] = {"save_dir": str(tmp_path / "runs"),
                                                "name": "from-config"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        ["bash", str(REPO / "lab" / "gpu" / "train_chunk.sh"), str(tmp_path / "c.yaml"),
         "--trainer.logger.init_args.name", "given", "--trainer.max_steps=0"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OUT": str(tmp_path / "out")})
    assert f"run folder {tmp_path / 'runs' / 'given'}," in done.stdout, done.stdout[-3000:]
    assert "from-config" not in done.stdout
    assert "no checkpoint" in done.stdout and "nothing to keep" in done.stdout, done.stdout
    assert not (tmp_path / "out" / "handoff").exists()


def test_handoff_bytes_carry_the_lora_base_record(tmp_path):
    """The handoff keeps the checkpoint's LoRA base record (a plain value) as it is."""
    model = tiny_model()
    record = {"source": "base", "fingerprint": "0" * 64}
    checkpoint = tiny_checkpoint(tmp_path / "last.ckpt", model, longnet_lora_base=record)
    write_handoff(checkpoint, tmp_path / "handoff")
    handoff = json.loads((tmp_path / "handoff" / "handoff.json").read_text())
    assert handoff["checkpoint"]["longnet_lora_base"] == record
    started = handoff_checkpoint(tmp_path / "handoff", tmp_path / "started.ckpt")
    assert torch.load(io.BytesIO(started.read_bytes()),
                      weights_only=True)["longnet_lora_base"] == record


def test_a_lora_runs_export_never_goes_into_its_base(delta):
    """``ExportPretrained(dirpath=<the base>)`` stops the fit at ``setup``, before any step."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from longnet.training import CausalLMModule, ExportPretrained

    base, _ = delta
    before = tree(base)
    module = CausalLMModule(pretrained=str(base), lora=LORA)
    trainer = SimpleNamespace(is_global_zero=True,
                              strategy=SimpleNamespace(broadcast=lambda value: value))
    with pytest.raises(UsageError, match=f"ExportPretrained dirpath {base} is the LoRA base"):
        ExportPretrained(dirpath=str(base)).setup(trainer, module, TrainerFn.FITTING)
    assert tree(base) == before


def test_a_read_only_cache_is_refused_before_the_conversion(tmp_path, monkeypatch):
    """``materialize`` into a cache it cannot write stops at once, naming the cache and
    ``$LONGNET_CACHE``, before the minute the GGUF conversion takes."""
    pytest.importorskip("transformers")
    import longnet.hf.pretrained as pretrained

    def converted(*args, **kwargs):
        raise AssertionError("converted before the cache was checked")

    monkeypatch.setattr(pretrained, "_read_gguf", converted)
    monkeypatch.setattr(pretrained, "distribution_file", lambda *a: tmp_path / "x.gguf")
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UsageError, match=r"user cache's folder of smollm2-135m .*LONGNET_CACHE"):
        pretrained.materialize("smollm2-135m")


@pytest.mark.parametrize("resumed, overwrite", [(False, False), (True, False), (False, True)])
def test_an_export_folder_given_is_replaced_only_by_a_resume_or_when_asked(tmp_path, resumed,
                                                                            overwrite):
    """``ExportPretrained(dirpath=X)`` where X holds a model: a fresh fit stops when training
    starts, X unchanged; a resumed fit (its own earlier export) and ``overwrite`` go on."""
    from types import SimpleNamespace

    from longnet.training import ExportPretrained

    target = tmp_path / "export"
    tiny_model().save_pretrained(target)
    before = tree(target)
    trainer = SimpleNamespace(is_global_zero=True, ckpt_path="last.ckpt" if resumed else None,
                              strategy=SimpleNamespace(broadcast=lambda value: value))
    callback = ExportPretrained(dirpath=str(target), overwrite=overwrite)
    if resumed or overwrite:
        callback.on_train_start(trainer, None)
    else:
        with pytest.raises(UsageError, match=f"ExportPretrained dirpath {target} already holds "
                           "a model or checkpoint .*overwrite: true"):
            callback.on_train_start(trainer, None)
    assert tree(target) == before
