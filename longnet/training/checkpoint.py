"""Read the :class:`~longnet.modeling.LongNetLM` out of a Lightning checkpoint, safely.

The one loader of Lightning checkpoints (``*.ckpt``) that training (``ExportPretrained``) and
evaluation (``longnet.eval.load_model``) share. Checkpoints are read with
``torch.load(weights_only=True)``: tensors and plain containers only, never an arbitrary
pickled object (so the module's hyper-parameters must be plain values, as ``longnet fit``
writes them). The model is rebuilt by :func:`longnet.training.builder.lm_config` from the
arguments :class:`~longnet.training.CausalLMModule` stores in its hyper-parameters
(``model``, ``pretrained`` or ``config``, and ``overrides``) and its weights are the
``state_dict`` entries under the attribute that holds it (``model.`` for ``CausalLMModule``).
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from longnet.modeling import LongNetConfig, LongNetLM, WeightsMismatchError
from longnet.modeling.serialization import load_state_checked, unique_state_dict
from longnet.training.builder import MODEL_SOURCES, lm_config
from longnet.validation import UsageError

LM_HEAD = "lm_head.weight"
EMBEDDINGS = "model.embed_tokens.weight"


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The contents of the Lightning checkpoint at ``path``, read on the CPU with
    ``torch.load(weights_only=True, mmap=True)`` (tensors stay on disk until used).

    Raises:
        FileNotFoundError: no file at ``path``.
        UsageError: (a ``ValueError``) the file is not a ``torch.save`` archive (truncated,
            random bytes, another kind of file), cannot be read that way (corrupt, or holding
            objects other than tensors and plain containers) or has no ``state_dict``; the
            message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}.")
    if not zipfile.is_zipfile(path):
        raise UsageError(
            f"{path} is not a checkpoint: torch.save writes a zip archive and this file "
            f"({path.stat().st_size:,} bytes) is not one (truncated, corrupt, or another kind "
            "of file). Use a .ckpt written by Lightning, e.g. <run folder>/checkpoints/last.ckpt."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - re-raised with the path and the cause
        raise UsageError(
            f"cannot read {path} as a checkpoint with torch.load(weights_only=True): "
            f"{_load_error(err)}. The file is corrupt or holds objects other than tensors "
            "and plain containers."
        ) from None
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
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
    """The ``LongNetConfig`` of a checkpoint's model: its ``hyper_parameters`` (those of
    :class:`~longnet.training.CausalLMModule`) resolved by
    :func:`~longnet.training.builder.lm_config`, as the module built it: ``model`` (a zoo
    name or folder) or ``pretrained`` (read now), or ``config`` (a dict of fields), with
    ``overrides`` applied."""
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
    """The tensors of the ``LongNetLM`` in a module's ``state_dict``, the prefix removed.

    ``prefix``: the attribute path of the LM (``"model."`` for ``CausalLMModule``); None
    finds it as the shortest prefix of a ``lm_head.weight`` next to
    ``model.embed_tokens.weight``.
    """
    if prefix is None:
        candidates = sorted((name[: -len(LM_HEAD)] for name in state_dict
                             if name.endswith(LM_HEAD)), key=len)
        prefix = next((p for p in candidates if f"{p}{EMBEDDINGS}" in state_dict), None)
    if prefix is None or f"{prefix}{LM_HEAD}" not in state_dict:
        raise ValueError(
            f"{source}: the state_dict holds no LongNetLM (no '{prefix or '<prefix>'}{LM_HEAD}' "
            f"next to '{prefix or '<prefix>'}{EMBEDDINGS}'; {len(state_dict)} entries, e.g. "
            f"{sorted(state_dict)[:5]})."
        )
    return {
        name[len(prefix):]: tensor
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
    """The :class:`LongNetLM` inside a Lightning checkpoint, in eval mode on the CPU.

    Args:
        path: the ``.ckpt`` file (read by :func:`read_checkpoint`).
        dtype: parameter dtype (default float32).
        config: the model's config; None reads it from the checkpoint
            (:func:`checkpoint_config`).
        prefix: see :func:`lm_state_dict`.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_checkpoint`, :func:`checkpoint_config`
            and :func:`lm_state_dict`.
        WeightsMismatchError: the weights do not fit the config (every missing, unexpected
            and mis-shaped tensor named).
    """
    path = Path(path)
    checkpoint = read_checkpoint(path)
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
