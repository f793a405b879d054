"""Load a causal LM to evaluate from a zoo name, a ``save_pretrained`` folder or a Lightning
checkpoint (``.ckpt``, read by :func:`longnet.training.checkpoint.load_lightning_checkpoint`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from longnet.data.subword import SubwordTokenizer, load_tokenizer_folder, tokenizer_from_files
from longnet.data.tokenizer import VOCAB_SIZE, ByteTokenizer
from longnet.modeling import LongNetLM, resolve_model_dir
from longnet.training.checkpoint import load_lightning_checkpoint, read_checkpoint
from longnet.training.vocabulary import TOKENIZER_KEY
from longnet.validation import UsageError

CHECKPOINT_SUFFIXES = (".ckpt",)


@dataclass
class LoadedModel:
    """A model ready for evaluation.

    Attributes:
        label: name in tables, CSV files and plot legends.
        model: the LM in eval mode on the requested device and dtype.
        source: what was loaded (zoo folder, model folder or checkpoint path).
        kind: ``"zoo"``, ``"folder"`` or ``"checkpoint"``.
        tokenizer: the model's tokenizer (:func:`model_tokenizer`).
    """

    label: str
    model: LongNetLM
    source: str
    kind: str
    tokenizer: ByteTokenizer | SubwordTokenizer = field(default_factory=ByteTokenizer)

    @property
    def training_length(self) -> int:
        """``config.max_positions``."""
        return self.model.config.max_positions


def load_model(
    spec: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    label: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load ``spec``: a ``.ckpt`` file, a model folder, or a zoo name.

    Args:
        spec: a ``*.ckpt`` path, a ``save_pretrained`` (or Hugging Face) folder, or a zoo name.
        device: where to put the model.
        dtype: parameter dtype (default float32).
        label: name in reports; default the zoo name, the folder name or the checkpoint stem.
        overrides: ``LongNetLM.from_pretrained`` config overrides (folder or zoo name only).

    Raises:
        FileNotFoundError: an unknown name, a missing file, or a zoo entry without weights.
        ValueError: a checkpoint without a recognisable model config or LM weights.
        UsageError: ``overrides`` for a checkpoint.
    """
    path = Path(spec)
    if path.suffix in CHECKPOINT_SUFFIXES or path.is_file():
        if overrides:
            raise UsageError(
                f"{spec}: config overrides apply to model folders and zoo names, not to a "
                "Lightning checkpoint; export it (longnet export) and evaluate "
                "the folder with the overrides."
            )
        model = load_lightning_checkpoint(path, dtype=dtype)  # raises naming a missing file
        kind, source, default_label = "checkpoint", str(path), path.stem
    else:
        folder = resolve_model_dir(spec)  # raises listing the known zoo names
        kind = "folder" if path.is_dir() else "zoo"
        model = LongNetLM.from_pretrained(folder, dtype=dtype, **(overrides or {}))
        source, default_label = str(folder), (_folder_label(path) if path.is_dir() else str(spec))
    model = model.to(device).eval()
    return LoadedModel(label=label or default_label, model=model, source=source, kind=kind,
                       tokenizer=model_tokenizer(model, source, kind))


def model_tokenizer(model: LongNetLM, source: str,
                    kind: str) -> ByteTokenizer | SubwordTokenizer:
    """The tokenizer of a model loaded from ``source``: bytes for ``vocab_size`` 256, else its
    folder's tokenizer files or the tokenizer its checkpoint recorded.

    Raises:
        UsageError: a folder without tokenizer files, or a checkpoint without a record.
    """
    if model.config.vocab_size == VOCAB_SIZE:
        return ByteTokenizer()
    if kind != "checkpoint":
        return load_tokenizer_folder(source)
    record = read_checkpoint(source, tensors=False).get(TOKENIZER_KEY) or {}
    if "files" not in record:
        raise UsageError(
            f"{source}: the checkpoint of a model of vocab_size {model.config.vocab_size} "
            "records no tokenizer; export it (longnet export), write its tokenizer "
            "files into the export (tokenizer.save_pretrained) and evaluate that folder."
        )
    return tokenizer_from_files(record["files"], f"{source} ({record.get('name')})")


def load_models(
    specs: Sequence[str | Path],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    labels: Sequence[str] | None = None,
    overrides: Sequence[dict[str, Any]] | None = None,
) -> list[LoadedModel]:
    """:func:`load_model` for each spec (``overrides``: one dict per spec, or one for all);
    default labels are made unique (``name``, ``name-2``, ...)."""
    if not specs:
        raise ValueError("no model given; pass at least one zoo name, folder or .ckpt file.")
    if labels is not None and len(labels) != len(specs):
        raise ValueError(
            f"got {len(labels)} labels for {len(specs)} models; give one label per model."
        )
    if overrides is not None and len(overrides) not in (1, len(specs)):
        raise ValueError(
            f"got {len(overrides)} overrides for {len(specs)} models; give one JSON object for "
            "all models or one per model ({} for none)."
        )
    loaded = [
        load_model(spec, device=device, dtype=dtype, label=None if labels is None else labels[i],
                   overrides=None if overrides is None else overrides[i % len(overrides)])
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
    """The folder's name; ``<run>/model`` for a training export's ``model`` folder."""
    path = path.resolve()
    return f"{path.parent.name}/{path.name}" if path.name == "model" else path.name
