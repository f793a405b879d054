"""Load a causal LM to evaluate from a zoo name, a ``save_pretrained`` folder or a Lightning
checkpoint (``.ckpt``).

Lightning checkpoints are read with ``torch.load(weights_only=True)`` (never arbitrary pickle):
the model's config comes from the checkpoint's stored hyper-parameters and its weights from
the ``state_dict`` entries under the attribute that holds the :class:`LongNetLM` (found by
looking for ``<prefix>lm_head.weight``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from longnet.modeling import LongNetConfig, LongNetLM, WeightsMismatchError, resolve_model_dir
from longnet.modeling.serialization import load_state_checked, unique_state_dict

CHECKPOINT_SUFFIXES = (".ckpt",)
STORED_CONFIG_KEY = "longnet_config"


@dataclass
class LoadedModel:
    """A model ready for evaluation.

    Attributes:
        label: short name used in tables, CSV files and plot legends.
        model: the LM in eval mode on the requested device and dtype.
        source: what was loaded (zoo folder, model folder or checkpoint path).
        kind: ``"zoo"``, ``"folder"`` or ``"checkpoint"``.
    """

    label: str
    model: LongNetLM
    source: str
    kind: str

    @property
    def training_length(self) -> int:
        """The context length the model is built for (``config.max_positions``)."""
        return self.model.config.max_positions


def load_model(
    spec: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    label: str | None = None,
) -> LoadedModel:
    """Load ``spec``: a ``.ckpt`` file, a model folder, or a zoo name.

    Args:
        spec: path of a Lightning checkpoint (``*.ckpt``), a folder written by
            ``save_pretrained`` (or a local Hugging Face checkpoint), or a zoo model name
            (``longnet.modeling.list_models()``).
        device: where to put the model.
        dtype: parameter dtype (default float32).
        label: name in reports; default the zoo name, the folder name or the checkpoint stem.

    Raises:
        FileNotFoundError: an unknown name (the message lists the known ones), a missing file,
            or a zoo entry without weights.
        ValueError: a checkpoint without a recognisable model config or LM weights.
    """
    path = Path(spec)
    if path.suffix in CHECKPOINT_SUFFIXES or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint file at {path}.")
        model = load_lightning_checkpoint(path, dtype=dtype)
        kind, source, default_label = "checkpoint", str(path), path.stem
    else:
        folder = resolve_model_dir(spec)  # raises listing the known zoo names
        kind = "folder" if path.is_dir() else "zoo"
        model = LongNetLM.from_pretrained(folder, dtype=dtype)
        source, default_label = str(folder), (_folder_label(path) if path.is_dir() else str(spec))
    model = model.to(device).eval()
    return LoadedModel(label=label or default_label, model=model, source=source, kind=kind)


def load_models(
    specs: Sequence[str | Path],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    labels: Sequence[str] | None = None,
) -> list[LoadedModel]:
    """:func:`load_model` for each spec; labels default to unique names (``name``,
    ``name-2``, ...) so that models with the same folder name stay distinguishable."""
    if not specs:
        raise ValueError("no model given; pass at least one zoo name, folder or .ckpt file.")
    if labels is not None and len(labels) != len(specs):
        raise ValueError(
            f"got {len(labels)} labels for {len(specs)} models; give one label per model."
        )
    loaded = [
        load_model(spec, device=device, dtype=dtype, label=None if labels is None else labels[i])
        for i, spec in enumerate(specs)
    ]
    seen: dict[str, int] = {}
    for item in loaded:
        count = seen.get(item.label, 0) + 1
        seen[item.label] = count
        if count > 1:
            item.label = f"{item.label}-{count}"
    return loaded


def _folder_label(path: Path) -> str:
    """The folder's name; ``<parent>/model`` for the generic ``model`` folder that training
    exports write (``<run>/model``)."""
    path = path.resolve()
    return f"{path.parent.name}/{path.name}" if path.name == "model" else path.name


# ---------------------------------------------------------------------- Lightning checkpoints
def load_lightning_checkpoint(path: str | Path, *, dtype: torch.dtype | None = None) -> LongNetLM:
    """The :class:`LongNetLM` inside a Lightning checkpoint, in eval mode on the CPU.

    The checkpoint is read with ``torch.load(weights_only=True)``; the config comes from
    :func:`checkpoint_config`, the weights are the ``state_dict`` entries under the prefix
    that holds ``lm_head.weight`` (``model.`` for ``CausalLMModule``).
    """
    path = Path(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - re-raised with the path and the cause
        raise ValueError(
            f"cannot read {path} as a checkpoint with torch.load(weights_only=True): {err}"
        ) from None
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry).")
    config = checkpoint_config(checkpoint, source=str(path))
    tensors = _lm_tensors(checkpoint["state_dict"], source=str(path))
    model = LongNetLM(config)
    if dtype is not None:
        model = model.to(dtype)
    expected = unique_state_dict(model)
    aliases = set(model.state_dict()) - set(expected)  # tied weights stored under both names
    tensors = {name: value for name, value in tensors.items() if name not in aliases}
    try:
        load_state_checked(model, tensors, source=str(path))
    except WeightsMismatchError as err:
        raise WeightsMismatchError(
            f"{err} (config read from the checkpoint's hyper-parameters)"
        ) from None
    return model.eval()


def checkpoint_config(
    checkpoint: Mapping[str, Any], *, source: str = "checkpoint"
) -> LongNetConfig:
    """The ``LongNetConfig`` of a Lightning checkpoint's model.

    Preferred: a resolved config dict stored in the checkpoint under ``longnet_config``.
    Otherwise the ``hyper_parameters`` of :class:`longnet.training.CausalLMModule`, resolved
    as its ``build_lm`` does: ``config`` (a dict of fields), else ``pretrained`` or ``model``
    (a zoo name or folder, read now), with ``overrides`` applied.
    """
    stored = checkpoint.get(STORED_CONFIG_KEY)
    if isinstance(stored, Mapping):
        return LongNetConfig.from_dict(dict(stored))
    hparams = checkpoint.get("hyper_parameters") or {}
    overrides = dict(hparams.get("overrides") or {})
    if isinstance(hparams.get("config"), Mapping):
        return LongNetConfig.from_dict(dict(hparams["config"]), **overrides)
    for key in ("pretrained", "model"):
        if isinstance(hparams.get(key), (str, Path)):
            return LongNetConfig.from_pretrained(hparams[key], **overrides)
    raise ValueError(
        f"{source}: found no model config (no '{STORED_CONFIG_KEY}' entry and no 'config', "
        f"'pretrained' or 'model' hyper-parameter; hyper-parameters: {sorted(hparams)}). "
        "Export the model with save_pretrained (the ExportPretrained callback) and evaluate "
        "that folder instead."
    )


def _lm_tensors(state_dict: Mapping[str, Tensor], *, source: str) -> dict[str, Tensor]:
    """The entries of the LongNetLM, with the attribute prefix removed."""
    prefixes = sorted(
        (name[: -len("lm_head.weight")] for name in state_dict if name.endswith("lm_head.weight")),
        key=len,
    )
    for prefix in prefixes:
        if f"{prefix}model.embed_tokens.weight" in state_dict:
            return {
                name[len(prefix):]: tensor
                for name, tensor in state_dict.items()
                if name.startswith(prefix)
            }
    raise ValueError(
        f"{source}: the state_dict holds no LongNetLM (no '<prefix>lm_head.weight' next to "
        f"'<prefix>model.embed_tokens.weight'; {len(state_dict)} entries, e.g. "
        f"{sorted(state_dict)[:5]})."
    )
