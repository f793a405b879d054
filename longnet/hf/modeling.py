"""``LongNetForCausalLM``: a ``transformers`` ``PreTrainedModel`` around a ``LongNetLM``.

The ``LongNetLM`` is the submodule ``longnet`` (``base_model_prefix``), so LongNet folders load
and save unchanged. This class adds ``transformers``' calling convention: unshifted
``labels``, left padding from ``attention_mask`` (exact, :mod:`longnet.hf.padding`; padded
positions get zero logits) and a :class:`longnet.hf.cache.LongNetCache` that replaces the empty
``DynamicCache`` ``generate`` starts with.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor, nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import GENERATION_CONFIG_NAME

from longnet.constants import IGNORE_INDEX
from longnet.files import open_files
from longnet.hf.cache import LongNetCache
from longnet.hf.configuration import LongNetHFConfig, local_model_dir
from longnet.hf.padding import left_padding, row_groups
from longnet.modeling import (
    LongNetLM,
    WeightsMismatchError,
    list_models,
    models_dir,
)
from longnet.modeling.config import CONFIG_NAME, MODEL_TYPE, check_computation_fields
from longnet.modeling.pretrained import read_config_json
from longnet.modeling.serialization import (
    WEIGHTS_NAME,
    check_finite,
    parse_safetensors,
    unique_state_dict,
    unreadable_weights,
)
from longnet.validation import check_bool

PREFIX = "longnet"
CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)
"""The output field of the cache: ``cache`` from ``transformers`` 5.24, else ``past_key_values``."""


class LongNetForCausalLM(PreTrainedModel, GenerationMixin):
    """``transformers`` causal LM over a :class:`LongNetLM`: ``LongNetForCausalLM(config)``
    builds a fresh one, :meth:`from_longnet` wraps an existing one."""

    config_class = LongNetHFConfig
    base_model_prefix = PREFIX
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerBlock"]
    _tied_weights_keys = {f"{PREFIX}.lm_head.weight": f"{PREFIX}.model.embed_tokens.weight"}

    def __init__(self, config: LongNetHFConfig, longnet: LongNetLM | None = None) -> None:
        super().__init__(config)
        if longnet is not None and longnet.config != config.to_longnet():
            raise ValueError("the LongNetLM's config differs from the given config.")
        self.longnet = longnet if longnet is not None else LongNetLM(config.to_longnet())
        self.post_init()

    @classmethod
    def from_longnet(cls, longnet: LongNetLM) -> LongNetForCausalLM:
        """Wrap ``longnet`` (shared, not copied: same parameters, device and dtype)."""
        dtype = next(longnet.parameters()).dtype
        return cls(LongNetHFConfig.from_longnet(longnet.config, dtype=dtype), longnet=longnet)

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing: ``LongNetLM`` initializes itself, and :meth:`from_pretrained` refuses a
        checkpoint that leaves any weight out."""

    def get_input_embeddings(self) -> nn.Embedding:
        return self.longnet.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.longnet.lm_head

    # ------------------------------------------------------------------ files
    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | Path, *model_args: Any, **kwargs: Any
    ) -> LongNetForCausalLM | tuple[LongNetForCausalLM, dict[str, Any]]:
        """``transformers``' ``from_pretrained``, with zoo names resolved and a local folder
        read from one version of it, as ``LongNetLM.from_pretrained`` reads it.

        Raises:
            FileNotFoundError: a path that is no model folder, a folder without weights, or
                a name nothing can load.
            WeightsMismatchError: missing, unexpected or mis-shaped tensors (where
                ``transformers`` would initialize them at random).
            NonFiniteWeightsError: NaN or infinite weights.
            ValueError: a damaged ``model.safetensors``.
            UsageError: a LongNet ``config.json`` missing a field that changes the computation.
        """
        source = pretrained_model_name_or_path
        wants_info = kwargs.pop("output_loading_info", False)
        kwargs["ignore_mismatched_sizes"] = True  # refused below, naming every tensor
        folder = local_model_dir(source, kwargs.get("subfolder") or "")
        if folder is not None:
            kwargs.pop("subfolder", None)
            if not Path(source).exists():  # a zoo name: its folder
                source = folder
            weights = folder / WEIGHTS_NAME
            model, info = cls._from_folder(folder, source, *model_args, **kwargs)
        else:
            weights = f"{source} weights"
            try:
                model, info = super().from_pretrained(
                    source, *model_args, output_loading_info=True, **kwargs
                )
            except SafetensorError as err:
                raise unreadable_weights(weights, err) from None
            except OSError as err:
                raise FileNotFoundError(
                    f"{str(source)!r} is neither a model folder nor a known model name (in "
                    f"{models_dir()}: {', '.join(list_models()) or 'none'}), and transformers "
                    f"could not load it from the Hugging Face Hub either: {err}"
                ) from None
        problems = [f"{kind.replace('_', ' ')}: {', '.join(sorted(map(_tensor_named, info[kind])))}"
                    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                    if info.get(kind)]
        if problems:
            raise WeightsMismatchError(
                f"{weights} does not match the model ({'; '.join(problems)}). Check that its "
                "config.json belongs to these weights."
            )
        check_finite(unique_state_dict(model.longnet), str(weights))
        return (model, info) if wants_info else model

    @classmethod
    def _from_folder(
        cls, folder: Path, source: str | Path, *model_args: Any, **kwargs: Any
    ) -> tuple[LongNetForCausalLM, dict[str, Any]]:
        """``transformers``' ``from_pretrained`` of the local ``folder`` and its loading info,
        from one version of it (:func:`longnet.files.open_files`): the weights go in as
        ``state_dict``, the config as that version's ``config.json`` or the given ``config``
        (:meth:`LongNetHFConfig.rebased` when read from the same folder)."""
        names = (CONFIG_NAME, WEIGHTS_NAME, GENERATION_CONFIG_NAME)
        with open_files(folder, names) as files:
            data = read_config_json(files, folder)
            if data.get("model_type") == MODEL_TYPE and "transformers_version" not in data:
                # LongNet spells out every field: a missing one would silently be its default
                check_computation_fields(data, folder / CONFIG_NAME)
            if WEIGHTS_NAME not in files:
                LongNetHFConfig(**data)  # a foreign config.json: its own error first
                raise FileNotFoundError(
                    f"{folder} has a config but no {WEIGHTS_NAME} (no trained weights yet). "
                    f"Build an untrained model with LongNetForCausalLM(AutoConfig."
                    f"from_pretrained({str(folder)!r}))."
                )
            tensors = parse_safetensors(files[WEIGHTS_NAME].read(), folder / WEIGHTS_NAME)
            if GENERATION_CONFIG_NAME in files and kwargs.get("generation_config") is None:
                kwargs["generation_config"] = GenerationConfig.from_dict(
                    json.loads(files[GENERATION_CONFIG_NAME].read()))
        config = kwargs.pop("config", None)
        if isinstance(config, LongNetHFConfig) and _same_path(config.name_or_path, source):
            config = config.rebased(data)
        with tempfile.TemporaryDirectory() as temp:
            if config is None:
                config = Path(temp, CONFIG_NAME)
                config.write_text(json.dumps(data))
            model, info = super().from_pretrained(
                None, *model_args, config=config, state_dict=tensors, output_loading_info=True,
                **kwargs,
            )
        model.name_or_path = model.config.name_or_path = str(source)
        return model, info

    def save_pretrained(
        self,
        save_directory: str | Path,
        *,
        is_main_process: bool = True,
        safe_serialization: bool = True,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> None:
        """Write the LongNet folder with ``LongNetLM.save_pretrained``; a folder holding a
        model is replaced only with ``overwrite=True``. ``transformers``' other saving
        options (sharding, custom state dicts, uploads) are refused."""
        unsupported = sorted(name for name, value in kwargs.items() if value)
        if unsupported or not safe_serialization:
            raise TypeError(
                f"LongNetForCausalLM.save_pretrained writes one safetensors file and takes no "
                f"{unsupported or ['safe_serialization=False']}; save with the defaults."
            )
        if is_main_process:
            self.longnet.save_pretrained(save_directory, overwrite=overwrite)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        past_key_values: Any = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits ``(batch, seq, vocab)`` of ``input_ids`` ``(batch, seq)``.

        ``attention_mask``: ``(batch, cached + seq)``, 1 for tokens, 0 for left padding.
        ``cache`` (or ``past_key_values``, its name before ``transformers`` 5.24): a
        :class:`LongNetCache` from an earlier call, or an empty one to replace.
        ``labels``: ``(batch, seq)`` tokens, ``-100`` for none; the loss is the mean
        cross-entropy of ``logits[:, t]`` against ``labels[:, t + 1]``. ``use_cache``
        (default ``config.use_cache``): return the cache (:data:`CACHE_FIELD`). Other
        ``transformers`` options are refused when set.
        """
        unsupported = sorted(name for name, value in kwargs.items() if value is not None
                             and value is not False)
        if unsupported:
            raise TypeError(
                f"LongNetForCausalLM.forward does not support {unsupported}; it takes "
                "input_ids, attention_mask (left padding), cache (or past_key_values), labels "
                "and use_cache."
            )
        if cache is not None and past_key_values is not None:
            raise ValueError(
                "pass the cache once: as cache or as past_key_values (its name before "
                "transformers 5.24), not both."
            )
        use_cache = check_bool("use_cache", self.config.use_cache if use_cache is None
                               else use_cache)
        if return_dict is not None:
            check_bool("return_dict", return_dict)
        given = cache if cache is not None else past_key_values
        cache = _longnet_cache(given, use_cache, self.config.num_layers)
        batch, length = input_ids.shape
        seen = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None:
            padding = left_padding(attention_mask, batch, seen + length)
        elif cache is not None and cache.padding is not None:
            padding = cache.padding
        else:
            padding = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
        groups = (cache.bind(padding, batch) if cache is not None
                  else [(group, None) for group in row_groups(padding)])
        logits = torch.zeros(batch, length, self.config.vocab_size, dtype=self.dtype,
                             device=input_ids.device)
        loss_sum, num_tokens = 0.0, 0
        for group, group_cache in groups:
            start = max(group.padding - seen, 0)  # the first new column holding a token
            if start >= length:  # only padding in this chunk (a prefill in pieces)
                continue
            out = self.longnet(
                input_ids[group.rows, start:],
                targets=None if labels is None else _aligned(labels[group.rows, start:]),
                cache=group_cache,
            )
            logits[group.rows, start:] = out.logits
            if labels is not None:
                loss_sum, num_tokens = loss_sum + out.loss_sum, num_tokens + out.num_tokens
        if cache is not None:
            cache.advance(length)
        loss = None if labels is None else loss_sum / max(int(num_tokens), 1)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
        return output if return_dict is not False else output.to_tuple()


def _tensor_named(entry: str | tuple) -> str:
    """An entry of ``transformers``' loading info (a name, or ``(name, saved, built)``)."""
    if isinstance(entry, str):
        return entry
    name, saved, built = entry
    return f"{name} (checkpoint {tuple(saved)}, model {tuple(built)})"


def _same_path(first: str, second: str | Path) -> bool:
    """Whether ``first`` (a ``name_or_path``, maybe empty) is the existing path ``second``."""
    return bool(first) and os.path.exists(first) and os.path.samefile(first, second)


def _aligned(labels: Tensor) -> Tensor:
    """``transformers`` labels as ``LongNetLM``'s aligned targets: shifted left, -100 last."""
    return torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)), dim=1)


def _longnet_cache(given: Any, use_cache: bool, num_layers: int) -> LongNetCache | None:
    """The cache a forward call reads and extends, or None to run without one."""
    if isinstance(given, LongNetCache):
        return given
    empty = given is None or (
        callable(getattr(given, "get_seq_length", None)) and given.get_seq_length() == 0
    )
    if not empty:
        raise ValueError(
            f"the cache is a {type(given).__name__} holding tokens; LongNet decodes only with "
            "its own dilated-pattern cache (LongNetCache). Start without a cache, or pass the "
            "one a previous call returned."
        )
    return LongNetCache(num_layers) if use_cache else None
