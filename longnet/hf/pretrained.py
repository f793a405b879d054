"""Pretrained models from elsewhere as LongNet folders, with their tokenizers.

:func:`import_pretrained` converts a Hugging Face checkpoint folder (GPT-2 or Llama family,
read by ``longnet.modeling.importers``) or a GGUF file (Llama family, dequantized to float32 by
``transformers``: the ``pretrained`` extra). :func:`materialize` does it once, into the user
cache, for a zoo entry whose weights come from an installed distribution (``smollm2-135m``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from longnet.files import (
    check_path_given,
    check_target,
    link_or_copy,
    replace_folder,
    write_atomic,
)
from longnet.modeling import LongNetConfig, LongNetLM, models_dir, resolve_model_dir
from longnet.modeling.gguf import check_gguf_file
from longnet.modeling.hub import (
    CACHE_ENV,
    DELTA_SHA256,
    VARIANT_OF,
    WEIGHTS_FROM,
    external_weights_hint,
    is_current,
    materialized_dir,
)
from longnet.modeling.importers import (
    convert_hf_checkpoint,
    import_hf_checkpoint,
)
from longnet.modeling.pretrained import CARD_NAME, SAVED_FILES, model_card
from longnet.modeling.serialization import WEIGHTS_NAME, load_state_checked, save_weights
from longnet.modeling.zoo import ZOO

GGUF_SUFFIX = ".gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "added_tokens.json", "vocab.json", "merges.txt",
                   "tokenizer.model")
"""Files ``tokenizer.save_pretrained`` may write: an imported folder owns them (a new import
never inherits an old one's)."""


def import_pretrained(
    source: str | Path,
    output: str | Path,
    *,
    pattern: Any = None,
    expected: LongNetConfig | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the model of ``source`` (a Hugging Face checkpoint folder or a ``.gguf`` file)
    and its tokenizer files as the LongNet folder ``output``, whole or not at all; returns it.
    A ``source`` without tokenizer files gives a folder without them (and a line on stderr).

    ``pattern``: the LongNet model's dilated pattern (default: dense, the original's
    function). ``expected``: the config the result must have (a zoo entry's); the folder
    gets it. ``overwrite``: replace an ``output`` that holds a model or checkpoint.

    Raises:
        UsageError: before any conversion, an ``output`` that is, holds or is inside
            ``source``, that holds a model (without ``overwrite``), or that cannot be
            written (:func:`longnet.files.check_target`).
        FileNotFoundError: ``source`` is neither a folder nor a ``.gguf`` file.
        ImportError: a GGUF file without the ``gguf`` / ``accelerate`` packages.
        ValueError: an architecture the importer refuses, or one other than ``expected``.
    """
    source = check_path_given(source, "source")
    check_target(output, sources={"the source": source}, overwrite=overwrite, what="OUTPUT")
    overrides = {} if pattern is None else {"pattern": pattern}
    if source.is_file() and source.suffix == GGUF_SUFFIX:
        config, tensors = _read_gguf(source, overrides)
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    elif source.is_dir():
        config, tensors = import_hf_checkpoint(source, **overrides)
        tokenizer = _folder_tokenizer(source)
    else:
        raise FileNotFoundError(
            f"{source} is neither a Hugging Face checkpoint folder nor a {GGUF_SUFFIX} file."
        )
    if expected is not None:
        config = _as_expected(config, expected, source)
    model = LongNetLM(config)
    load_state_checked(model, tensors, source=str(source))
    with replace_folder(output, (*SAVED_FILES, *TOKENIZER_FILES), "output") as folder:
        model.save_pretrained(folder, name=Path(output).name)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))
    if tokenizer is None:
        print(f"longnet: {source} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, "
              f"...), so {output} holds none: copy the original model's tokenizer files into "
              f"{output} (or into {source}, and import again) before loading it with "
              "AutoTokenizer or using it as a training's data tokenizer.", file=sys.stderr)
    return Path(output)


def materialize(name: str, *, force: bool = False) -> Path:
    """The folder of the zoo entry ``name`` whose weights come from an installed
    distribution, imported into the user cache on the first call (or with ``force``). A
    variant (:data:`VARIANT_OF` in ``extra.weights_from``) links its base entry's weights and
    tokenizer files under its own config.

    Raises:
        ValueError: ``name`` is no such zoo entry.
        FileNotFoundError: the distribution or its file is not installed (how to install).
        UsageError: the cache folder cannot be written (checked before the conversion).
    """
    folder = models_dir() / name
    config = LongNetConfig.load(folder) if (folder / "config.json").is_file() else None
    external = None if config is None else config.extra.get(WEIGHTS_FROM)
    if not external:
        raise ValueError(
            f"{name!r} is not a zoo entry whose weights come from another distribution (such "
            f"entries name one under extra.{WEIGHTS_FROM} in {folder / 'config.json'})."
        )
    target = materialized_dir(name)
    if ((target / "model.safetensors").is_file() and not force
            and is_current(target, folder, external)):
        return target
    check_target(target, overwrite=True,  # the cache's own entry, incomplete or forced
                 what=f"the user cache's folder of {name} (${CACHE_ENV} moves the cache)")
    if VARIANT_OF in external:
        _write_variant(materialize(external[VARIANT_OF], force=force), target, config,
                       folder if DELTA_SHA256 in external else None)
    else:
        import_pretrained(distribution_file(name, external), target, expected=config,
                          overwrite=True)
    card = model_card(config, name, has_weights=True, description=ZOO[name].description)
    write_atomic(target / CARD_NAME, card)
    return target


def _write_variant(base: Path, target: Path, config: LongNetConfig,
                   delta: Path | None = None) -> None:
    """``target``: ``base``'s tokenizer files, linked, ``config``, and ``base``'s weights:
    linked, or with the LoRA delta of the folder ``delta`` merged in (its ``lora.json``
    names the base and the overrides it was trained with)."""
    with replace_folder(target, (*SAVED_FILES, *TOKENIZER_FILES), "output") as folder:
        for path in sorted(base.iterdir()):
            if path.name in TOKENIZER_FILES or (path.name == WEIGHTS_NAME and delta is None):
                link_or_copy(path, folder / path.name)
        if delta is not None:
            from longnet.training.lora import delta_merged  # LoRA needs peft (pretrained extra)

            save_weights(delta_merged(delta, base), folder / WEIGHTS_NAME)
        config.save(folder)


def resolve_or_materialize(name_or_dir: str | Path) -> Path:
    """``longnet.modeling.resolve_model_dir``, materializing (:func:`materialize`) a zoo entry
    whose weights come from an installed distribution on first use."""
    folder = resolve_model_dir(name_or_dir)
    external = (folder.parent == models_dir()
                and not (folder / "model.safetensors").is_file()
                and LongNetConfig.load(folder).extra.get(WEIGHTS_FROM))
    return materialize(folder.name) if external else folder


def distribution_file(name: str, external: dict[str, str]) -> Path:
    """The file ``external["file"]`` of the installed distribution ``external["distribution"]``
    that the zoo entry ``name`` is imported from.

    Raises:
        FileNotFoundError: not installed, saying how to install it.
    """
    try:
        dist = importlib.metadata.distribution(external["distribution"])
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{external['distribution']} is not installed: {external_weights_hint(name, external)}"
        ) from None
    path = Path(dist.locate_file(external["file"]))
    if not path.is_file():
        raise FileNotFoundError(
            f"{external['distribution']} {dist.version} is installed but has no "
            f"{external['file']}; reinstall it: {external_weights_hint(name, external)}"
        )
    return path


def _read_gguf(path: Path, overrides: dict[str, Any]) -> tuple[LongNetConfig, dict]:
    """The LongNet config and state dict of a GGUF file (float32)."""
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ImportError(
            f"reading {path} needs the packages {', '.join(missing)}: pip install "
            "'longnet[pretrained]' (or pip install gguf accelerate)."
        )
    check_gguf_file(path)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    data = hf.config.to_dict()
    tensors = {name: t.detach() for name, t in hf.state_dict().items()}
    return convert_hf_checkpoint(data, tensors, f"GGUF file {path}", **overrides)


def _folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a Hugging Face checkpoint folder; None when it has no tokenizer files."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(folder))


def _as_expected(config: LongNetConfig, expected: LongNetConfig, source: Path) -> LongNetConfig:
    """``expected``, when ``config`` (imported from ``source``) equals it but for ``extra``."""
    differ = [f.name for f in dataclasses.fields(LongNetConfig)
              if f.name != "extra" and getattr(config, f.name) != getattr(expected, f.name)]
    if differ:
        raise ValueError(
            f"{source} holds another model than expected: "
            + ", ".join(f"{n}={getattr(config, n)!r} (expected {getattr(expected, n)!r})"
                        for n in differ) + "."
        )
    return expected

