"""``LongNetHFConfig``: the ``transformers`` config of model type ``longnet``.

It reads LongNet's ``config.json`` unchanged: the :class:`longnet.modeling.LongNetConfig`
fields (validated) become attributes, the rest goes to ``PreTrainedConfig``. ``dtype`` defaults
to float32, so ``dtype="auto"`` (``transformers`` 5's and lm-eval's default) does not run the
zoo's bfloat16-stored weights in bfloat16.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig

from longnet.hf.pretrained import resolve_or_materialize
from longnet.modeling import LongNetConfig, list_models, resolve_model_dir
from longnet.modeling.config import MODEL_TYPE
from longnet.validation import check_bool

LONGNET_FIELDS = tuple(f.name for f in dataclasses.fields(LongNetConfig))


class LongNetHFConfig(PreTrainedConfig):
    """A :class:`LongNetConfig` as a ``transformers`` config (module docstring); it remembers
    the fields it was built with (not saved) for :meth:`rebased`."""

    model_type = MODEL_TYPE
    attribute_map = {
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "max_position_embeddings": "max_positions",
    }

    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        model_type = kwargs.pop("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(
                f"this config.json describes a {model_type!r} model, not a LongNet model "
                f"(model_type {MODEL_TYPE!r}). Load it with transformers' own classes, or "
                "import a GPT-2 / Llama checkpoint into LongNet with "
                "longnet.modeling.LongNetLM.from_pretrained(folder)."
            )
        kwargs.pop("architecture", None)  # LongNet's own marker; transformers uses architectures
        fields = {name: kwargs.pop(name) for name in LONGNET_FIELDS if name in kwargs}
        longnet = LongNetConfig.from_dict(fields)
        kwargs["num_labels"] = longnet.num_labels  # a property of PreTrainedConfig
        if self.dtype is None and kwargs.get("torch_dtype") is None:
            self.dtype = torch.float32
        super().__post_init__(**kwargs)
        check_bool("use_cache", self.use_cache)
        for name in LONGNET_FIELDS:
            if name != "num_labels":
                setattr(self, name, getattr(longnet, name))
        self._built_as = longnet

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any
    ) -> LongNetHFConfig | tuple[LongNetHFConfig, dict[str, Any]]:
        """``transformers``' ``from_pretrained``, local paths and zoo names resolved by
        :func:`local_model_dir` (``FileNotFoundError`` for a path that is no model folder)."""
        folder = local_model_dir(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
        if folder is None:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        kwargs.pop("subfolder", None)
        return super().from_pretrained(folder, *args, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """``PreTrainedConfig.to_dict`` without the LongNet fields it was built with."""
        data = super().to_dict()
        data.pop("_built_as", None)
        return data

    def rebased(self, data: dict[str, Any]) -> LongNetHFConfig:
        """A copy of this config with the LongNet fields of the ``config.json`` ``data``
        (a newer version of its folder), except those changed since it was built."""
        newer = type(self)(**data)
        config = copy.deepcopy(self)
        for name in LONGNET_FIELDS:
            if name != "num_labels" and getattr(self, name) == getattr(self._built_as, name):
                setattr(config, name, getattr(newer, name))
        config._built_as = newer._built_as
        return config

    def to_longnet(self) -> LongNetConfig:
        """The LongNet config these attributes describe (validated)."""
        return LongNetConfig.from_dict({name: getattr(self, name) for name in LONGNET_FIELDS})

    @classmethod
    def from_longnet(cls, config: LongNetConfig, **kwargs: Any) -> LongNetHFConfig:
        """This class for a LongNet ``config``; ``kwargs`` are ``transformers`` options."""
        return cls(**config.to_dict(), **kwargs)


def local_model_dir(source: str | os.PathLike, subfolder: str = "") -> Path | None:
    """The local model folder ``source`` (and ``subfolder``) names: an existing path, checked
    by :func:`longnet.modeling.resolve_model_dir` (``FileNotFoundError``), or a zoo name's
    folder (materialized on first use); None for a Hub id or a ``.json`` file, left to
    ``transformers``."""
    path = Path(source, subfolder)
    if path.is_file() and path.suffix == ".json":
        return None
    if path.exists():
        return resolve_model_dir(path)
    if not subfolder and str(source) in list_models():
        return resolve_or_materialize(source)
    return None
