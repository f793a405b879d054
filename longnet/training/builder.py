"""Build the :class:`~longnet.modeling.LongNetLM` a training run starts from."""

from __future__ import annotations

from typing import Any

from longnet.modeling import LongNetConfig, LongNetLM


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
    given = [name for name, value in
             (("model", model), ("pretrained", pretrained), ("config", config))
             if value is not None]
    if len(given) != 1:
        raise ValueError(
            "give exactly one of model (a zoo name or folder, fresh weights), pretrained (a "
            "name or folder with weights) or config (LongNetConfig fields); got "
            f"{given or 'none'}. Example: model: longnet-tiny."
        )
    overrides = dict(overrides or {})
    if pretrained is not None:
        return LongNetLM.from_pretrained(pretrained, **overrides).train()
    if config is not None:
        if not isinstance(config, dict):
            raise ValueError(f"config must be a mapping of LongNetConfig fields, got {config!r}.")
        lm_config = LongNetConfig.from_dict(dict(config), **overrides)
    else:
        lm_config = LongNetConfig.from_pretrained(model, **overrides)
    return LongNetLM(lm_config)
