"""``LongNetHFConfig``: the ``transformers`` config of model type ``longnet``.

It reads the ``config.json`` that ``LongNetLM.save_pretrained`` and the zoo write, unchanged:
the LongNet fields (:class:`longnet.modeling.LongNetConfig`, validated by it, defaults
included) become attributes, everything else (``transformers``' own keys) goes to
``PreTrainedConfig``. ``num_hidden_layers``, ``num_attention_heads`` and
``max_position_embeddings`` are aliases of ``num_layers``, ``num_heads`` and
``max_positions``; ``use_cache`` (default true) is ``transformers``' switch for the KV cache.
``dtype`` defaults to float32, so ``from_pretrained(..., dtype="auto")`` (the default of
``transformers`` 5 and of lm-eval) gives float32 like ``LongNetLM.from_pretrained``, not the
bfloat16 the zoo stores its weights in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import PreTrainedConfig

from longnet.modeling import LongNetConfig
from longnet.modeling.config import MODEL_TYPE

LONGNET_FIELDS = tuple(f.name for f in dataclasses.fields(LongNetConfig))


class LongNetHFConfig(PreTrainedConfig):
    """A :class:`LongNetConfig` as a ``transformers`` config (module docstring).

    ``to_longnet()`` returns the validated :class:`LongNetConfig`; ``from_longnet(config)``
    builds this class from one.
    """

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
        for name in LONGNET_FIELDS:
            if name != "num_labels":
                setattr(self, name, getattr(longnet, name))

    def to_longnet(self) -> LongNetConfig:
        """The LongNet config these attributes describe (validated)."""
        return LongNetConfig.from_dict({name: getattr(self, name) for name in LONGNET_FIELDS})

    @classmethod
    def from_longnet(cls, config: LongNetConfig, **kwargs: Any) -> LongNetHFConfig:
        """This class for a LongNet ``config``; ``kwargs`` are ``transformers`` options."""
        return cls(**config.to_dict(), **kwargs)
