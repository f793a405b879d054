"""Build the :class:`~longnet.modeling.LongNetLM` of a run (:func:`build_lm`), and read it out
of a Lightning checkpoint (a file, or a folder of shards read on one process) with
``torch.load(weights_only=True)``; a folder's ``.metadata`` is a pickle: load folders you trust.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import (
    _EmptyStateDictLoadPlanner,
    _load_state_dict,
)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from longnet.files import check_path_given, check_target, model_entries, replace_folder
from longnet.modeling import LongNetConfig, LongNetLM, WeightsMismatchError
from longnet.modeling.pretrained import SAVED_FILES, pretrained_config
from longnet.modeling.serialization import load_state_checked, unique_state_dict
from longnet.training.lora import (
    LORA_BASE_KEY,
    LoraSettings,
    base_folder,
    base_record,
    check_same_base,
    merged_model,
)
from longnet.training.vocabulary import TOKENIZER_KEY
from longnet.validation import UsageError

LM_HEAD = "lm_head.weight"
EMBEDDINGS = "model.embed_tokens.weight"
SHARDED_INDEX = ".metadata"  # torch.distributed.checkpoint's index of a folder's shards
SHARDED_META = "meta.pt"  # Lightning's non-tensor state (loops, callbacks, hyper-parameters)
STATE_DICT = "state_dict"
MODEL_PREFIX = "model."  # CausalLMModule's attribute that holds the LM


MODEL_SOURCES = ("model", "pretrained", "config")
"""The arguments that name where a model comes from; exactly one is given."""


def build_lm(
    model: str | None = None,
    *,
    pretrained: str | None = None,
    config: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> LongNetLM:
    """A causal LM from exactly one source, with config fields replaced by ``overrides``.

    Args:
        model: a zoo name or model folder; fresh weights.
        pretrained: a zoo name or ``save_pretrained`` folder (or local Hugging Face one).
        config: the fields of a :class:`~longnet.modeling.LongNetConfig` (fresh weights).
        overrides: config fields to replace (with ``pretrained``: only shape-preserving ones).

    Raises:
        ValueError: none or several sources are given, or a field is invalid.
        FileNotFoundError: an unknown model name or folder (the message lists the zoo).
    """
    _check_one_source(model, pretrained, config)
    if pretrained is not None:
        return LongNetLM.from_pretrained(pretrained, **dict(overrides or {})).train()
    return LongNetLM(lm_config(model, config=config, overrides=overrides))


def lm_config(
    model: str | None = None,
    *,
    pretrained: str | None = None,
    config: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> LongNetConfig:
    """The config :func:`build_lm` would build from the same arguments; raises as it does."""
    _check_one_source(model, pretrained, config)
    overrides = dict(overrides or {})
    if pretrained is not None:
        return pretrained_config(pretrained, **overrides)
    if config is not None:
        if not isinstance(config, dict):
            raise ValueError(f"config must be a mapping of LongNetConfig fields, got {config!r}.")
        return LongNetConfig.from_dict(dict(config), **overrides)
    return LongNetConfig.from_pretrained(model, **overrides)


def _check_one_source(model: Any, pretrained: Any, config: Any) -> None:
    given = [name for name, value in zip(MODEL_SOURCES, (model, pretrained, config))
             if value is not None]
    if len(given) != 1:
        raise ValueError(
            "give exactly one of model (a zoo name or folder, fresh weights), pretrained (a "
            "name or folder with weights) or config (LongNetConfig fields); got "
            f"{given or 'none'}. Example: model: longnet-tiny."
        )


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder of shards (``torch.distributed.checkpoint``)."""
    return (Path(path) / SHARDED_INDEX).is_file()


def _torch_load(path: Path) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)`` on the CPU, or a ``UsageError``."""
    if not zipfile.is_zipfile(path):
        raise UsageError(
            f"{path} is not a checkpoint: torch.save writes a zip archive and this file "
            f"({path.stat().st_size:,} bytes) is not one (truncated, corrupt, or another kind "
            "of file). Use a .ckpt written by Lightning, e.g. <run folder>/checkpoints/last.ckpt."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - re-raised with the path and the cause
        raise UsageError(
            f"cannot read {path} as a checkpoint with torch.load(weights_only=True): "
            f"{_load_error(err)}. The file is corrupt or holds objects other than tensors "
            "and plain containers."
        ) from None


def sharded_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Full shapes of a sharded checkpoint's module tensors by name, from its index alone."""
    metadata = FileSystemReader(str(path)).read_metadata()
    prefix = f"{STATE_DICT}."
    return {
        key[len(prefix) :]: tuple(value.size)
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)
    }


def checkpoint_shapes(
    path: str | Path, checkpoint: Mapping[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Module tensor shapes by name, without loading tensors (``checkpoint``: read's result)."""
    if is_sharded_checkpoint(path):
        return sharded_tensor_shapes(path)
    return {name: tuple(value.shape) for name, value in checkpoint[STATE_DICT].items()
            if isinstance(value, Tensor)}


def read_checkpoint(path: str | Path, *, tensors: bool = True) -> dict[str, Any]:
    """The Lightning checkpoint at ``path`` on the CPU (a folder's ``state_dict`` assembled
    into full tensors, no optimizer state; left empty with ``tensors=False``).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        UsageError: (a ``ValueError``) not a ``torch.save`` archive, unreadable with
            ``weights_only``, or no ``state_dict``; the message names the file.
    """
    path = Path(path)
    if path.is_dir() and is_sharded_checkpoint(path):
        meta_path = path / SHARDED_META
        if not meta_path.is_file():
            raise UsageError(f"{path} is a folder of shards without Lightning's {SHARDED_META}.")
        checkpoint = _torch_load(meta_path)
        if not isinstance(checkpoint, Mapping):
            raise UsageError(f"{meta_path} is not a Lightning checkpoint's {SHARDED_META}.")
        if not tensors:
            return {**checkpoint, STATE_DICT: {}}
        state: dict[str, Any] = {}
        # dcp_to_torch_save for the module's tensors only (dcp.load would fill a copy)
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(str(path)),
            planner=_EmptyStateDictLoadPlanner(keys={STATE_DICT}),
            no_dist=True,
        )
        return {**checkpoint, STATE_DICT: state.get(STATE_DICT, {})}
    if not path.is_file():
        raise FileNotFoundError(
            f"no checkpoint file at {path} (nor a folder of shards with {SHARDED_INDEX})."
        )
    checkpoint = _torch_load(path)
    if not isinstance(checkpoint, Mapping) or STATE_DICT not in checkpoint:
        raise UsageError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry).")
    return dict(checkpoint)


def _load_error(err: Exception) -> str:
    """The informative line of a ``torch.load`` error (not its advice to drop weights_only)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = next((line for line in lines if "Unpickler error" in line), None)
    return detail or (lines[0] if lines else type(err).__name__)


def checkpoint_config(
    checkpoint: Mapping[str, Any], *, source: str = "checkpoint"
) -> LongNetConfig:
    """The ``LongNetConfig`` of a checkpoint's model, from its hyper-parameters."""
    hparams = checkpoint.get("hyper_parameters") or {}
    sources = {key: hparams.get(key) for key in MODEL_SOURCES}
    if isinstance(sources["config"], Mapping):
        sources["config"] = dict(sources["config"])
    if all(value is None for value in sources.values()):
        raise ValueError(
            f"{source}: found no model config (no 'model', 'pretrained' or 'config' "
            f"hyper-parameter; hyper-parameters: {sorted(hparams)}). Export the model with "
            "save_pretrained (the ExportPretrained callback) and evaluate that folder instead."
        )
    return lm_config(**sources, overrides=hparams.get("overrides"))


def lm_state_dict(
    state_dict: Mapping[str, Tensor], *, source: str = "checkpoint", prefix: str | None = None
) -> dict[str, Tensor]:
    """The ``LongNetLM`` tensors of a module's ``state_dict``, ``prefix`` removed (None: the
    shortest prefix of a ``lm_head.weight`` next to ``model.embed_tokens.weight``)."""
    if prefix is None:
        candidates = sorted(
            (name[: -len(LM_HEAD)] for name in state_dict if name.endswith(LM_HEAD)), key=len
        )
        prefix = next((p for p in candidates if f"{p}{EMBEDDINGS}" in state_dict), None)
    if prefix is None or f"{prefix}{LM_HEAD}" not in state_dict:
        raise ValueError(
            f"{source}: the state_dict holds no LongNetLM (no '{prefix or '<prefix>'}{LM_HEAD}' "
            f"next to '{prefix or '<prefix>'}{EMBEDDINGS}'; {len(state_dict)} entries, e.g. "
            f"{sorted(state_dict)[:5]})."
        )
    return {
        name[len(prefix) :]: tensor
        for name, tensor in state_dict.items()
        if name.startswith(prefix)
    }


def load_lightning_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    config: LongNetConfig | None = None,
    prefix: str | None = None,
) -> LongNetLM:
    """The :class:`LongNetLM` inside a Lightning checkpoint, in eval mode on the CPU (a LoRA
    fine-tune's: its base with the delta merged).

    Args:
        path: the ``.ckpt`` file or folder of shards (read by :func:`read_checkpoint`).
        dtype: parameter dtype (default float32).
        config: the model's config; None: :func:`checkpoint_config`.
        prefix: see :func:`lm_state_dict`.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_checkpoint`, :func:`checkpoint_config`
            and :func:`lm_state_dict`.
        WeightsMismatchError: the weights do not fit the config.
        UsageError: a LoRA checkpoint over another base than its recorded one.
    """
    path = Path(path)
    checkpoint = read_checkpoint(path)
    hparams = checkpoint.get("hyper_parameters") or {}
    if hparams.get("lora") is not None:
        model = merged_lora_model(hparams, checkpoint[STATE_DICT], source=str(path),
                                  prefix=MODEL_PREFIX if prefix is None else prefix,
                                  base=checkpoint.get(LORA_BASE_KEY))
        return (model if dtype is None else model.to(dtype)).eval()
    origin = "config given by the caller"
    if config is None:
        config = checkpoint_config(checkpoint, source=str(path))
        origin = "config read from the checkpoint's hyper-parameters"
    tensors = lm_state_dict(checkpoint["state_dict"], source=str(path), prefix=prefix)
    model = LongNetLM(config)
    if dtype is not None:
        model = model.to(dtype)
    aliases = set(model.state_dict()) - set(unique_state_dict(model))  # tied: stored twice
    tensors = {name: value for name, value in tensors.items() if name not in aliases}
    try:
        load_state_checked(model, tensors, source=str(path))
    except WeightsMismatchError as err:
        raise WeightsMismatchError(f"{err} ({origin})") from None
    return model.eval()


def merged_lora_model(hparams: Mapping[str, Any], state_dict: Mapping[str, Tensor], *,
                      source: str, prefix: str = MODEL_PREFIX,
                      base: Mapping[str, Any] | None = None) -> LongNetLM:
    """A LoRA fine-tune's ``pretrained`` base with the delta under ``prefix`` merged in.

    Raises:
        UsageError: ``base`` (the checkpoint's record) has another weights fingerprint.
    """
    model = build_lm(pretrained=hparams["pretrained"], overrides=hparams.get("overrides"))
    check_same_base(base, base_record(hparams["pretrained"], model), source)
    delta = {name[len(prefix):]: tensor for name, tensor in state_dict.items()
             if name.startswith(prefix)}
    return merged_model(model, LoraSettings.from_mapping(hparams["lora"]), delta, source=source)


def last_checkpoint(folder: str | Path, name: str = "last.ckpt") -> Path | None:
    """The checkpoint ``--ckpt_path last`` resumes from: ``folder/name`` when complete (a file,
    or shards with both ``.metadata`` and ``meta.pt``, written last), else None.
    """
    path = Path(folder) / name
    if path.is_file():
        return path
    if path.is_dir() and is_sharded_checkpoint(path) and (path / SHARDED_META).is_file():
        return path
    return None


def export_pretrained(checkpoint: str | Path, target: str | Path, *,
                      overwrite: bool = False) -> Path:
    """Write a checkpoint's model and tokenizer files to ``target`` (swapped in whole);
    returns ``target``.

    Raises:
        UsageError: a ``target`` holding a model (without ``overwrite``) or overlapping
            ``checkpoint`` or a LoRA base; as :func:`load_lightning_checkpoint`.
    """
    checkpoint = check_path_given(checkpoint, "CHECKPOINT")
    sources = {"the checkpoint": checkpoint}
    check_target(target, sources=sources, overwrite=True, what="OUTPUT")  # before reading it
    entries = read_checkpoint(checkpoint, tensors=False)
    hparams = entries.get("hyper_parameters") or {}
    if hparams.get("lora") is not None:
        sources["the LoRA base"] = base_folder(hparams.get("pretrained"))
    check_target(target, sources=sources, overwrite=overwrite, what="OUTPUT")
    model = load_lightning_checkpoint(checkpoint)
    record = entries.get(TOKENIZER_KEY) or {}
    with replace_folder(target, owned=model_entries(target) | set(SAVED_FILES),
                        what="OUTPUT") as folder:
        model.save_pretrained(folder, name=Path(target).name)
        for name, text in sorted(record.get("files", {}).items()):
            (folder / name).write_text(text)
    return Path(target)
