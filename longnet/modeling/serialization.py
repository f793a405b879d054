"""Weights on disk: safetensors only (never pickle), with errors that name the tensor."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

WEIGHTS_NAME = "model.safetensors"


class WeightsMismatchError(ValueError):
    """A checkpoint's tensors do not match the model: missing, unexpected or mis-shaped."""


def unique_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` without aliases: a tensor shared by several names (tied
    embeddings) is kept once, under the first name."""
    state: dict[str, Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.device.type != "meta" and key in seen:
            continue
        seen.add(key)
        state[name] = tensor
    return state


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Write the model's tensors (tied ones once) to a safetensors file."""
    state = {k: v.detach().contiguous() for k, v in unique_state_dict(model).items()}
    save_file(state, str(path), metadata={"format": "pt", "library": "longnet"})


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a safetensors file on CPU; a damaged file raises a clear ``ValueError``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}.")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}); it is corrupt or truncated. "
            "Re-save or re-copy it."
        ) from None


def load_state_checked(
    model: nn.Module, tensors: Mapping[str, Tensor], source: str = "checkpoint"
) -> None:
    """Copy ``tensors`` into ``model``, requiring exactly its (unaliased) tensors and shapes.

    Raises :class:`WeightsMismatchError` naming every missing, unexpected and mis-shaped
    tensor.  Values are cast to the model's dtypes.
    """
    expected = unique_state_dict(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{name} (checkpoint {tuple(tensors[name].shape)}, model {tuple(expected[name].shape)})"
        for name in expected
        if name in tensors and tuple(tensors[name].shape) != tuple(expected[name].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {', '.join(wrong)}")
    if problems:
        raise WeightsMismatchError(
            f"{source} does not match the model ({'; '.join(problems)}). Check that the "
            "config belongs to these weights (and that no override changes a shape)."
        )
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])
