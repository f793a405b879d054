"""Build the :class:`~longnet.modeling.LongNetLM` a training run starts from.

The one place that turns the model arguments of :class:`~longnet.training.CausalLMModule`
(``model``, ``pretrained``, ``config``, ``overrides``) into a model or its config: training
builds with :func:`build_lm`, and :mod:`longnet.training.checkpoint` rebuilds a checkpoint's
model from the same arguments stored in its hyper-parameters.
"""

from __future__ import annotations

from typing import Any

from longnet.modeling import LongNetConfig, LongNetLM
from longnet.modeling.pretrained import pretrained_config

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
        model: a zoo name (``"longnet-tiny"``, see ``longnet.modeling.list_models()``) or a
            model folder; its config is used and the weights are freshly initialised.
        pretrained: a zoo name or folder written by ``save_pretrained`` (or a local Hugging
            Face GPT-2/Llama checkpoint); its weights are loaded.
        config: the fields of a :class:`~longnet.modeling.LongNetConfig` (fresh weights).
        overrides: config fields to replace, e.g. ``{"hidden_size": 32, "num_layers": 2}``
            (with ``pretrained``: only fields that keep the weights' shapes, such as
            ``dropout``, ``gradient_checkpointing`` or the dilated pattern).

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
    """The config of the model :func:`build_lm` builds from the same arguments, without
    building it (a ``pretrained`` source is read: its ``config.json``, and for a Hugging Face
    checkpoint its weights too). Raises as :func:`build_lm`."""
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
