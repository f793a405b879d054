"""LoRA fine-tuning of a pretrained :class:`~longnet.modeling.LongNetLM` with ``peft``.

:func:`apply_lora` puts low-rank adapters (Hu et al. 2021) on the model's linear projections
named in the settings (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``gate_proj``,
``up_proj``, ``down_proj``), in place, and freezes every other weight; the norms' scales stay
trainable when asked (``train_norms``), and so do the key/value convolutions' weights
(``train_kv_conv``, for a model with ``kv_conv_size``). What training changes is then the
*delta*: the adapters, the norms and the convolutions. A
:class:`~longnet.training.CausalLMModule` with ``lora`` keeps only the delta in its
checkpoints (so ``last.ckpt``, the full-state pack and the compact handoff hold the delta,
the base weights being rebuilt from the ``pretrained`` source the hyper-parameters name),
and its export (:func:`save_delta`) is a delta folder:

- ``lora.json``: ``{"format": "longnet-lora", "base": <pretrained source>,
  "base_fingerprint": <sha256>, "overrides": {...}, "lora": {r, alpha, dropout,
  target_modules, train_norms, train_kv_conv}}``;
- ``lora.safetensors``: the delta in bfloat16, named as in the adapted ``LongNetLM``
  (``model.layers.0.attn.q_proj.lora_A.default.weight``, ``model.layers.0.attn_norm.weight``);
- the data's tokenizer files, as any export.

:func:`merge_delta` rebuilds the base, loads the delta and merges it (``peft``'s
``merge_and_unload``: ``W + (alpha / r) B A``) into a plain ``save_pretrained`` folder that
``LongNetLM.from_pretrained`` loads. ``peft`` is imported only here, when LoRA is used (the
``pretrained`` extra installs it).

A LoRA run is bound to its base: :func:`weights_fingerprint` of the base as it was built when
the run started is recorded in the run's checkpoints and handoffs (:data:`LORA_BASE_KEY`) and
in ``lora.json``; a resume, an export and a merge over a base whose fingerprint differs (the
folder was replaced, or another source given) are refused, naming both
(:func:`check_same_base`). Deltas and checkpoints written before the fingerprint was recorded
are accepted as they are. No writer writes into the base's folder (:func:`base_folder`),
``overwrite`` or not.
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
DELTA_CONFIG = "lora.json"
DELTA_WEIGHTS = "lora.safetensors"
DELTA_FORMAT = "longnet-lora"
LORA_BASE_KEY = "longnet_lora_base"
"""Top-level key of a LoRA run's checkpoints (kept by the compact handoff) that names its base:
``{"source": <pretrained source>, "fingerprint": <weights_fingerprint>}``."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj", "down_proj")
"""The linear projections of a ``LongNetLM`` block (attention, then gated MLP)."""


@dataclass(frozen=True)
class LoraSettings:
    """What :func:`apply_lora` adds: adapters of rank ``r`` scaled by ``alpha / r`` on the
    linear layers whose name is in ``target_modules`` (with ``dropout`` on their input), the
    norms' scales trainable when ``train_norms``, the key/value convolutions' weights
    (``kv_conv_size``) when ``train_kv_conv``."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = PROJECTIONS
    train_norms: bool = True
    train_kv_conv: bool = False

    @classmethod
    def from_mapping(cls, value: Any) -> LoraSettings:
        """Settings from ``{r: 16, alpha: 32, dropout: 0.0, target_modules: [...],
        train_norms: true}`` (missing keys take the defaults).

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
    """Add the adapters of ``settings`` to ``model`` in place (``peft``'s
    ``inject_adapter_in_model``; ``lora_B`` starts at zero, so the function is unchanged) and
    freeze every weight but the adapters and, with ``train_norms``, the norms' scales (with
    ``train_kv_conv``, the key/value convolutions' weights); returns ``model``.

    Raises:
        UsageError: a target name that is no linear layer of the model (the message lists
            those it has).
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
    """``base`` with the adapters of ``settings`` loaded from ``delta`` (names as in the
    adapted ``LongNetLM``) merged into its weights (``peft``'s ``merge_and_unload``), and the
    delta's norms; a plain ``LongNetLM`` (``base`` itself, changed in place).

    Raises:
        UsageError: ``delta`` lacks a tensor the settings train, or holds one they do not
            (the delta was written with other settings).
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
    """The SHA-256 (hex) of ``model``'s weights: each tensor of its ``state_dict`` (a tied one
    once) in name order, as its name, dtype, shape and bytes. Taken of a LoRA base as
    :func:`~longnet.training.checkpoint.build_lm` builds it (``from_pretrained``: float32, the
    overrides applied), it does not depend on the files' format (a LongNet folder, a Hugging
    Face folder, a GGUF import) and costs one pass over the weights (about half a second for
    135 M parameters)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(unique_state_dict(model).items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def base_record(source: str, base: nn.Module) -> dict[str, str]:
    """What a LoRA run records of its base (:data:`LORA_BASE_KEY`): the ``pretrained`` source
    and the :func:`weights_fingerprint` of ``base``, built from it."""
    return {"source": str(source), "fingerprint": weights_fingerprint(base)}


def check_same_base(recorded: Mapping[str, Any] | None, current: Mapping[str, str],
                    what: str) -> None:
    """Refuse to resume, export or merge ``what`` (a checkpoint, a delta folder) over a base
    other than the one it was trained over: ``recorded`` (its :func:`base_record`) against
    ``current``, the base built now. No record, or one without a fingerprint (written before
    it was recorded), is accepted.

    Raises:
        UsageError: the fingerprints differ; the message names both, with both sources.
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
    """The folder a LoRA run's ``pretrained`` source names, which no writer may write into: a
    folder given, or a zoo name's (its import in the user cache when its weights come from
    another distribution); None when it names none here."""
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
    """Write the delta folder ``folder`` (replaced whole; module docstring): ``delta``'s
    floating-point tensors in ``dtype``, and ``lora.json`` naming ``base`` (the pretrained
    source), its ``base_fingerprint`` (:func:`weights_fingerprint`), ``overrides`` and
    ``settings``; returns ``folder``.

    Raises:
        UsageError: ``folder`` holds a model or checkpoint and not ``overwrite``, or is, holds
            or is inside the base's folder (:func:`base_folder`), before anything is written.
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


def merge_delta(folder: str | Path, output: str | Path, *, overwrite: bool = False) -> Path:
    """Write the model of the delta folder ``folder`` merged into its base as the
    ``save_pretrained`` folder ``output`` (loadable with ``LongNetLM.from_pretrained``), with
    the delta folder's other files (the tokenizer's), swapped in whole when complete; returns
    ``output``.

    Raises:
        UsageError: before the base is built, an ``output`` that holds a model or checkpoint
            (without ``overwrite``) or that is, holds or is inside ``folder`` or the base's
            folder (even with ``overwrite``); a base whose fingerprint is not the one
            ``lora.json`` records (:func:`check_same_base`).
        FileNotFoundError, UsageError: as :func:`read_delta` and :func:`merged_model`.
    """
    record, delta = read_delta(folder)
    check_target(output, sources={"the source": folder,
                                  "the LoRA base": base_folder(record["base"])},
                 overwrite=overwrite, what="OUTPUT")
    base = LongNetLM.from_pretrained(record["base"], **record["overrides"])
    recorded = {"source": record["base"], "fingerprint": record.get("base_fingerprint")}
    check_same_base(recorded, base_record(record["base"], base), f"the delta {folder}")
    model = merged_model(base, LoraSettings.from_mapping(record["lora"]), delta,
                         source=str(Path(folder) / DELTA_WEIGHTS))
    with replace_folder(output, owned=model_entries(output) | set(SAVED_FILES),
                        what="OUTPUT") as temp:
        model.save_pretrained(temp, name=Path(output).name)
        for path in sorted(Path(folder).iterdir()):
            if path.is_file() and path.name not in (DELTA_CONFIG, DELTA_WEIGHTS):
                shutil.copyfile(path, temp / path.name)
    return Path(output)
