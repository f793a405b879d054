"""LoRA fine-tuning (Hu et al. 2021) of a pretrained :class:`~longnet.modeling.LongNetLM` with
``peft``: only the *delta* (adapters, optionally norms and key/value convolutions) is trained,
checkpointed and exported (:func:`save_delta`: ``lora.json`` and ``lora.safetensors``), bound to
its base's :func:`weights_fingerprint`; :func:`merge_delta` makes a plain model folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import Tensor, nn

from longnet.constants import DELTA_CONFIG
from longnet.files import check_target, model_entries, replace_folder
from longnet.modeling import LongNetLM, list_models, models_dir
from longnet.modeling.hub import materialized_dir
from longnet.modeling.pretrained import SAVED_FILES
from longnet.modeling.serialization import read_safetensors, unique_state_dict
from longnet.nn.norm import RMSNorm
from longnet.nn.short_conv import CausalShortConv
from longnet.validation import UsageError, check_positive_float, check_positive_int

ADAPTER = "default"
"""The ``peft`` adapter name (it appears in the delta's tensor names)."""
DELTA_WEIGHTS = "lora.safetensors"
DELTA_FORMAT = "longnet-lora"
LORA_BASE_KEY = "longnet_lora_base"
"""Checkpoint key of a LoRA run's base: ``{"source", "fingerprint"}`` (:func:`base_record`)."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """What :func:`apply_lora` adds: rank-``r`` adapters scaled by ``alpha / r`` (``dropout``
    on their input) on ``target_modules``; trainable norm scales (``train_norms``) and
    key/value convolutions (``train_kv_conv``)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = PROJECTIONS
    train_norms: bool = True
    train_kv_conv: bool = False

    @classmethod
    def from_mapping(cls, value: Any) -> LoraSettings:
        """Settings from a mapping such as ``{r: 16, alpha: 32}`` (missing keys: defaults).

        Raises:
            ValueError: not a mapping, an unknown key, or a value out of range (named).
        """
        fields = [field.name for field in dataclasses.fields(cls)]
        if not isinstance(value, Mapping) or set(value) - set(fields):
            raise ValueError(f"lora must be a mapping with keys among {fields}, got {value!r}; "
                             "e.g. {r: 16, alpha: 32, target_modules: [q_proj, v_proj]}.")
        settings = cls(**{key: value[key] for key in value})
        check_positive_int("lora.r", settings.r)
        check_positive_float("lora.alpha", settings.alpha)
        if not 0.0 <= settings.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {settings.dropout!r}.")
        targets = settings.target_modules
        if isinstance(targets, str) or not targets or not all(
                isinstance(name, str) and name for name in targets):
            raise ValueError(f"lora.target_modules must be a non-empty list of module names, "
                             f"got {targets!r}; e.g. {list(PROJECTIONS)}.")
        for flag in ("train_norms", "train_kv_conv"):
            if not isinstance(getattr(settings, flag), bool):
                raise ValueError(f"lora.{flag} must be true or false, got "
                                 f"{getattr(settings, flag)!r}.")
        return dataclasses.replace(settings, target_modules=tuple(targets))

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain values (``from_mapping`` reads them back)."""
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}


def require_peft() -> Any:
    """The ``peft`` module, or an ``ImportError`` saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA fine-tuning (lora: ...) needs the peft package: pip install "
                          "peft (or pip install 'longnet[pretrained]').") from None
    return peft


def lora_config(settings: LoraSettings) -> Any:
    """The ``peft.LoraConfig`` of ``settings``."""
    peft = require_peft()
    return peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha,
                           lora_dropout=settings.dropout,
                           target_modules=list(settings.target_modules), bias="none")


def apply_lora(model: LongNetLM, settings: LoraSettings) -> LongNetLM:
    """Add the adapters of ``settings`` to ``model`` in place (``lora_B`` starts at zero: the
    function is unchanged) and freeze all but the delta; returns ``model``.

    Raises:
        UsageError: a target that is no linear layer of the model, or ``train_kv_conv``
            without key/value convolutions.
        ImportError: ``peft`` is not installed.
    """
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, nn.Linear)} - {"lm_head"})
    unknown = [name for name in settings.target_modules if name not in linear]
    if unknown:
        raise UsageError(f"lora.target_modules names {unknown}, which are not linear layers "
                         f"of this model; its layers are {linear}.")
    if settings.train_kv_conv and not model.config.kv_conv_size:
        raise UsageError("lora.train_kv_conv needs a model with key/value convolutions; set "
                         "kv_conv_size (e.g. overrides: {kv_conv_size: 16}) or drop "
                         "train_kv_conv.")
    require_peft().inject_adapter_in_model(lora_config(settings), model, adapter_name=ADAPTER)
    apply_trainability(model, settings)
    return model


def trainable_names(module: nn.Module) -> set[str]:
    """The ``state_dict`` names of ``module``'s trainable parameters (tied ones once each)."""
    return {name for name, param in module.named_parameters() if param.requires_grad}


def merged_model(base: LongNetLM, settings: LoraSettings,
                 delta: Mapping[str, Tensor], *, source: str = "delta") -> LongNetLM:
    """``base`` (changed in place) with ``delta`` merged into its weights: a plain LM.

    Raises:
        UsageError: ``delta``'s names are not those the settings train.
    """
    peft = require_peft()
    adapted = peft.tuners.lora.LoraModel(base, lora_config(settings), ADAPTER)
    apply_trainability(base, settings)
    expected = trainable_names(base)
    check_delta_names(set(delta), expected, source)
    state = base.state_dict()
    with torch.no_grad():
        for name, tensor in delta.items():
            state[name].copy_(tensor.to(state[name].dtype))
    return adapted.merge_and_unload()


def apply_trainability(model: LongNetLM, settings: LoraSettings) -> None:
    """Set ``requires_grad`` on an adapted model as :func:`apply_lora` does."""
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    if settings.train_norms:
        for module in model.modules():
            if isinstance(module, RMSNorm | nn.LayerNorm):
                for param in module.parameters():
                    param.requires_grad_(True)
    if settings.train_kv_conv:
        for module in model.modules():
            if isinstance(module, CausalShortConv):
                module.weight.requires_grad_(True)


def weights_fingerprint(model: nn.Module) -> str:
    """SHA-256 (hex) of ``model``'s unique tensors' names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(unique_state_dict(model).items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def base_record(source: str, base: nn.Module) -> dict[str, str]:
    """A LoRA run's record of its base: ``pretrained`` ``source`` and its fingerprint."""
    return {"source": str(source), "fingerprint": weights_fingerprint(base)}


def check_same_base(recorded: Mapping[str, Any] | None, current: Mapping[str, str],
                    what: str) -> None:
    """Refuse ``what`` (a checkpoint, a delta folder) whose ``recorded`` base is not
    ``current`` (:func:`base_record`); a record without a fingerprint passes.

    Raises:
        UsageError: the fingerprints differ.
    """
    fingerprint = (recorded or {}).get("fingerprint")
    if not fingerprint or fingerprint == current["fingerprint"]:
        return
    raise UsageError(
        f"{what} was trained over another base: its base {recorded.get('source')} had the "
        f"weights fingerprint {recorded.get('fingerprint')}, the base {current['source']} "
        f"built now has {current['fingerprint']}. Its delta over these weights would be "
        "another model: give the base it was trained over (the same weights at "
        f"{recorded.get('source')}), or start a new LoRA run over this base."
    )


def base_folder(source: str | None) -> Path | None:
    """The folder a ``pretrained`` source names (no writer may write into it), or None."""
    if source is None:
        return None
    path = Path(source)
    if path.is_dir():
        return path
    if "/" in str(source) or str(source) not in list_models():
        return None
    cached = materialized_dir(str(source))
    return cached if cached.is_dir() else models_dir() / str(source)


def check_delta_names(given: set[str], expected: set[str], source: str) -> None:
    """Refuse a delta whose tensor names are not the trainable ones of the adapted model."""
    if given != expected:
        missing, unknown = sorted(expected - given), sorted(given - expected)
        raise UsageError(
            f"{source} does not fit the model's LoRA adapters: missing {missing[:3]} "
            f"({len(missing)} in all), unknown {unknown[:3]} ({len(unknown)} in all). It was "
            "written with other lora settings (r, target_modules, train_norms, train_kv_conv) "
            "or another base; use the same settings as the run that wrote it.")


def save_delta(folder: str | Path, delta: Mapping[str, Tensor], *, base: str,
               settings: LoraSettings, overrides: Mapping[str, Any] | None = None,
               dtype: torch.dtype = torch.bfloat16, base_fingerprint: str | None = None,
               overwrite: bool = False) -> Path:
    """Write the delta folder ``folder`` (module docstring; replaced whole), floating-point
    tensors in ``dtype``; returns ``folder``.

    Raises:
        UsageError: ``folder`` holds a model (without ``overwrite``) or overlaps the base's.
    """
    folder = check_target(folder, sources={"the LoRA base": base_folder(base)},
                          overwrite=overwrite, what="delta folder")
    old = set(p.name for p in folder.iterdir()) if folder.is_dir() else set()
    tensors = {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach())
               .contiguous().clone() for name, t in delta.items()}
    record = {"format": DELTA_FORMAT, "version": 1, "base": str(base),
              "base_fingerprint": base_fingerprint, "overrides": dict(overrides or {}),
              "lora": settings.as_dict()}
    with replace_folder(folder, owned=old) as temp:
        (temp / DELTA_WEIGHTS).write_bytes(save(tensors, metadata={"format": "pt"}))
        (temp / DELTA_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
    return folder


def read_delta(folder: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``lora.json`` and the tensors of the delta folder ``folder``.

    Raises:
        FileNotFoundError: ``folder`` has no ``lora.json`` or ``lora.safetensors``.
        UsageError: ``lora.json`` is not a delta record.
    """
    folder = Path(folder)
    path = folder / DELTA_CONFIG
    if not path.is_file() or not (folder / DELTA_WEIGHTS).is_file():
        raise FileNotFoundError(f"{folder} is not a LoRA delta folder: it needs {DELTA_CONFIG} "
                                f"and {DELTA_WEIGHTS} (written by ExportPretrained for a run "
                                "with lora).")
    record = json.loads(path.read_text())
    if not isinstance(record, dict) or record.get("format") != DELTA_FORMAT:
        raise UsageError(f"{path} is not a {DELTA_FORMAT} record.")
    return record, read_safetensors(folder / DELTA_WEIGHTS)


def delta_merged(folder: str | Path, base: str | Path | None = None) -> LongNetLM:
    """The delta folder ``folder`` merged into its recorded base (or ``base``, a folder of
    the same weights) read with the recorded overrides: a plain LM.

    Raises:
        FileNotFoundError, UsageError: as :func:`read_delta` and :func:`merged_model`;
            a base of another fingerprint than recorded.
    """
    record, delta = read_delta(folder)
    model = LongNetLM.from_pretrained(record["base"] if base is None else base,
                                      **record["overrides"])
    recorded = {"source": record["base"], "fingerprint": record.get("base_fingerprint")}
    check_same_base(recorded, base_record(record["base"], model), f"the delta {folder}")
    return merged_model(model, LoraSettings.from_mapping(record["lora"]), delta,
                        source=str(Path(folder) / DELTA_WEIGHTS))


def merge_delta(folder: str | Path, output: str | Path, *, overwrite: bool = False) -> Path:
    """Write the delta folder ``folder`` merged into its base, with its other files (the
    tokenizer's), as the ``save_pretrained`` folder ``output`` (swapped in whole); returns it.

    Raises:
        UsageError: an ``output`` holding a model (without ``overwrite``) or overlapping
            ``folder`` or the base's; a base of another fingerprint than recorded.
        FileNotFoundError, UsageError: as :func:`read_delta` and :func:`merged_model`.
    """
    record, _ = read_delta(folder)
    check_target(output, sources={"the source": folder,
                                  "the LoRA base": base_folder(record["base"])},
                 overwrite=overwrite, what="OUTPUT")
    model = delta_merged(folder)
    with replace_folder(output, owned=model_entries(output) | set(SAVED_FILES),
                        what="OUTPUT") as temp:
        model.save_pretrained(temp, name=Path(output).name)
        for path in sorted(Path(folder).iterdir()):
            if path.is_file() and path.name not in (DELTA_CONFIG, DELTA_WEIGHTS):
                shutil.copyfile(path, temp / path.name)
    return Path(output)
