"""Load a causal LM to evaluate from a zoo name, a ``save_pretrained`` folder or a Lightning
checkpoint (``.ckpt``).

Lightning checkpoints are read by :func:`longnet.training.checkpoint.load_lightning_checkpoint`,
the loader training uses too (``torch.load(weights_only=True)``, never arbitrary pickle; the
config is rebuilt from the stored hyper-parameters by the training's model builder).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from longnet.modeling import LongNetLM, resolve_model_dir
from longnet.training.checkpoint import load_lightning_checkpoint

CHECKPOINT_SUFFIXES = (".ckpt",)


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
        model = load_lightning_checkpoint(path, dtype=dtype)  # raises naming a missing file
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
