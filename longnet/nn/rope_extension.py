"""RoPE context extension: linear position interpolation and YaRN, as ``transformers`` has them.

Linear: position interpolation (Chen et al. 2023); yarn: YaRN (Peng et al. 2023). Keys and
defaults are ``transformers``' ``rope_scaling``, and the float32 operations follow
``transformers.modeling_rope_utils`` in order, for bit-identical frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from longnet.validation import check_bool, check_positive_float, check_positive_int, describe

ROPE_EXTENSION_TYPES = ("linear", "yarn")
YARN_DEFAULTS: dict[str, Any] = {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": None,
    "mscale": None,
    "mscale_all_dim": None,
    "truncate": True,
}
"""YaRN's optional keys and ``transformers``' defaults for them."""
_KEYS = {
    "linear": {"rope_type", "factor"},
    "yarn": {"rope_type", "factor", "original_max_position_embeddings", *YARN_DEFAULTS},
}


def check_rope_extension(extension: Any) -> dict[str, Any] | None:
    """``extension`` validated and completed with the defaults (None: plain RoPE).

    Raises:
        ValueError: not a dict, an unknown ``rope_type`` or key, a missing or bad value.
    """
    if extension is None:
        return None
    name = "rope_extension"
    if not isinstance(extension, dict):
        raise ValueError(
            f"{name} must be None or a dict such as {{'rope_type': 'linear', 'factor': 4.0}}, "
            f"got {describe(extension)}."
        )
    kind = extension.get("rope_type")
    if kind not in ROPE_EXTENSION_TYPES:
        raise ValueError(
            f"{name}: rope_type {kind!r} is not supported; supported: "
            f"{', '.join(ROPE_EXTENSION_TYPES)} (e.g. {{'rope_type': 'yarn', 'factor': 4.0, "
            "'original_max_position_embeddings': 8192}})."
        )
    unknown = sorted(set(extension) - _KEYS[kind])
    if unknown:
        raise ValueError(
            f"{name}: {kind} takes the keys {sorted(_KEYS[kind])}; {unknown} are not among them."
        )
    out: dict[str, Any] = {"rope_type": kind}
    if "factor" not in extension:
        raise ValueError(f"{name}: {kind} needs 'factor' (the context extension ratio, e.g. 4.0).")
    out["factor"] = check_positive_float(f"{name}['factor']", extension["factor"])
    if kind == "linear":
        return out
    key = "original_max_position_embeddings"
    if key not in extension:
        raise ValueError(f"{name}: yarn needs {key!r} (the context length the model was "
                         "trained at, e.g. 8192).")
    out[key] = check_positive_int(f"{name}[{key!r}]", extension[key])
    for option, default in YARN_DEFAULTS.items():
        value = extension.get(option, default)
        if option == "truncate":
            value = check_bool(f"{name}['truncate']", value)
        elif value is not None:
            value = check_positive_float(f"{name}[{option!r}]", value)
        out[option] = value
    return out


def extended_frequencies(
    inverse_frequencies: Tensor, head_dim: int, theta: float, extension: dict[str, Any] | None
) -> tuple[Tensor, float]:
    """The inverse frequencies ``(head_dim / 2,)`` and cos/sin factor under ``extension``."""
    if extension is None:
        return inverse_frequencies, 1.0
    factor = extension["factor"]
    if extension["rope_type"] == "linear":
        return inverse_frequencies / factor, 1.0
    return _yarn(inverse_frequencies.device, head_dim, theta, extension)


def _yarn(
    device: torch.device, dim: int, base: float, extension: dict[str, Any]
) -> tuple[Tensor, float]:
    """``transformers.modeling_rope_utils._compute_yarn_parameters``, operation for operation."""
    factor = extension["factor"]
    original = extension["original_max_position_embeddings"]
    attention_factor = extension["attention_factor"]
    mscale, mscale_all_dim = extension["mscale"], extension["mscale_all_dim"]
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(extension["beta_fast"])
    high = correction_dim(extension["beta_slow"])
    if extension["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp.to(device)
    return interpolation * (1 - kept) + extrapolation * kept, float(attention_factor)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
