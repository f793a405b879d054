"""Training with the data's tokenizer: the model takes its vocabulary, the checkpoint records
it (a resume with another is refused), the run's export carries it, and a model trained on a
user's tokenizer.json reloads through AutoTokenizer + AutoModelForCausalLM and generates."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from longnet.data import LongDocumentDataModule
from longnet.data.tokenizer import train_bpe
from longnet.eval import load_model
from longnet.modeling import LongNetLM
from longnet.training import CausalLMModule, ExportPretrained
from longnet.training.checkpoint import export_pretrained
from longnet.training.curriculum import split_windows
from longnet.training.parallel.batches import shard_batch
from longnet.training.vocabulary import TOKENIZER_KEY, check_tokenizer_record, tokenizer_record
from longnet.validation import UsageError

CONFIG = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "segment_lengths": [8, 16],
          "dilation_rates": [1, 2]}
WORDS = ["alpha", "beta", "délta", "ε", "zeta\n", "東京", "def f():\n    return 1\n"]


def write_words(folder: Path, words: list[str]) -> Path:
    """24 documents ``doc00.txt`` ... of 10-59 of ``words`` each, drawn with seeds 0-23, in
    ``folder``; returns ``folder``."""
    for index in range(24):
        rng = np.random.default_rng(index)
        (folder / f"doc{index:02d}.txt").write_text(
            " ".join(rng.choice(words, size=int(rng.integers(10, 60)))))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_words(tmp_path_factory.mktemp("docs"), WORDS)


def _data(corpus: Path, cache: Path, tokenizer: str) -> LongDocumentDataModule:
    return LongDocumentDataModule(
        seq_len=16, batch_size=2, data_files=str(corpus / "*.txt"), val_fraction=0.25,
        test_fraction=0.25, cache_dir=str(cache), tokenizer=tokenizer)


def _fit(module: CausalLMModule, data: LongDocumentDataModule, root: Path, steps: int = 2,
         ckpt_path: str | None = None, **options) -> L.Trainer:
    trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", limit_val_batches=1,
                        default_root_dir=str(root), **options)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_a_fresh_model_takes_the_tokenizers_vocabulary(corpus, tmp_path):
    data = _data(corpus, tmp_path, "bpe:300")
    module = CausalLMModule(model="longnet-tiny", overrides={"num_layers": 1})
    module.fit_tokenizer(data)
    config = module.model.config
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id) == (300, 0, 1)
    assert module.hparams.overrides == {"num_layers": 1, "vocab_size": 300, "eos_token_id": 0,
                                        "pad_token_id": 1}
    assert module.model.lm_head.weight.shape[0] == 300
    byte_module = CausalLMModule(model="longnet-tiny")
    before = {k: v.clone() for k, v in byte_module.model.state_dict().items()}
    byte_module.fit_tokenizer(_data(corpus, tmp_path, "bytes"))  # bytes: the model untouched
    after = byte_module.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_pretrained_model_of_another_vocabulary_is_refused(corpus, tmp_path):
    module = CausalLMModule(pretrained="longnet-tiny")
    with pytest.raises(UsageError, match="longnet-tiny has vocab_size 256.*tokenizer has 300"
                       ".*--data.init_args.tokenizer longnet-tiny"):
        module.fit_tokenizer(_data(corpus, tmp_path, "bpe:300"))


def test_a_config_vocabulary_below_the_tokenizers_is_refused(corpus, tmp_path):
    module = CausalLMModule(config={**CONFIG, "vocab_size": 256})
    with pytest.raises(UsageError, match="300 ids, above the vocab_size 256"):
        module.fit_tokenizer(_data(corpus, tmp_path, "bpe:300"))
    wider = CausalLMModule(config=dict(CONFIG), overrides={"vocab_size": 512})
    wider.fit_tokenizer(_data(corpus, tmp_path, "bpe:300"))
    assert wider.model.config.vocab_size == 512 and wider.model.config.eos_token_id == 0


def test_checkpoints_record_the_tokenizer_and_a_resume_cannot_switch(corpus, tmp_path):
    data = _data(corpus, tmp_path / "cache", "bpe:300")
    trainer = _fit(CausalLMModule(config=dict(CONFIG), warmup_steps=1), data, tmp_path / "run")
    path = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(path)
    record = torch.load(path, weights_only=True)[TOKENIZER_KEY]
    assert record == tokenizer_record(data.tokenizer) and "tokenizer.json" in record["files"]
    exported = export_pretrained(path, tmp_path / "exported")  # longnet export
    assert (exported / "tokenizer.json").read_text() == record["files"]["tokenizer.json"]
    loaded = load_model(path)  # the evaluation reads the checkpoint's model and tokenizer
    assert loaded.model.config.vocab_size == 300
    assert loaded.tokenizer.fingerprint == data.tokenizer.fingerprint
    mine = tmp_path / "mine.json"
    train_bpe(["another corpus, another tokenizer"] * 3, 300).save(str(mine))
    other = _data(corpus, tmp_path / "cache", str(mine))
    with pytest.raises(UsageError, match=f"trained with tokenizer bpe:300.*now uses {mine}"):
        _fit(CausalLMModule(config=dict(CONFIG), warmup_steps=1), other, tmp_path / "run2",
             steps=3, ckpt_path=str(path))
    check_tokenizer_record(record, data.tokenizer)  # the same tokenizer resumes


def test_a_model_trained_on_a_users_tokenizer_json_exports_reloads_and_generates(
        corpus, tmp_path, one_thread):
    transformers = pytest.importorskip("transformers")
    import longnet.hf  # noqa: F401  (registers the Auto classes)

    path = tmp_path / "mine.json"
    train_bpe([p.read_text() for p in sorted(corpus.glob("*.txt"))], 320).save(str(path))
    data = _data(corpus, tmp_path / "cache", str(path))
    export = tmp_path / "export"
    torch.manual_seed(0)
    _fit(CausalLMModule(config=dict(CONFIG), warmup_steps=1), data, tmp_path / "run",
         callbacks=[ExportPretrained(dirpath=str(export), weights="last")],
         enable_checkpointing=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    text = "def f():\n    return délta 東京"
    assert tokenizer(text)["input_ids"] == data.tokenizer.encode(text)
    assert tokenizer.eos_token_id == data.eos_id == model.config.eos_token_id
    inputs = tokenizer(text, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 6 or out[0, -1] == tokenizer.eos_token_id
    generated = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    assert isinstance(generated, str) and generated
    native = LongNetLM.from_pretrained(export).eval()
    with torch.no_grad():
        assert torch.equal(native(inputs["input_ids"]).logits, model(**inputs).logits)
    # the export as a tokenizer folder: its pretrained weights fit it, nothing is rebuilt
    again = CausalLMModule(pretrained=str(export))
    weights = again.model.lm_head.weight
    again.fit_tokenizer(_data(corpus, tmp_path / "cache", str(export)))
    assert again.model.lm_head.weight is weights


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sequence_parallel_shards_cut_label_bytes_with_the_labels(layout):
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 300, (2, 20), generator=generator),
             "labels": torch.randint(0, 300, (2, 20), generator=generator),
             "label_bytes": torch.randint(1, 6, (2, 20), generator=generator)}
    pattern = CausalLMModule(config=dict(CONFIG)).pattern  # pads 20 up to what fits 4 ranks
    shards = [shard_batch(batch, rank, 4, pattern=pattern, layout=layout) for rank in range(4)]
    assert sum(int(s["label_bytes"].sum()) for s in shards) == int(batch["label_bytes"].sum())
    for shard in shards:
        assert shard["label_bytes"].shape == shard["labels"].shape
        assert (shard["label_bytes"][shard["labels"] == -100] == 0).all()


def test_a_length_curriculum_cuts_label_bytes_with_the_windows():
    tokens = torch.arange(32).reshape(2, 16)
    batch = {"input_ids": tokens, "labels": tokens + 1, "label_bytes": tokens % 5}
    cut = split_windows(dict(batch), 8)
    assert cut["label_bytes"].shape == cut["labels"].shape == (4, 8)
    assert torch.equal(cut["label_bytes"].flatten(), batch["label_bytes"].flatten())
