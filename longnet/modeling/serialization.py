"""Weights on disk: safetensors only (never pickle), with errors that name the tensor."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save_file
from torch import Tensor, nn

WEIGHTS_NAME = "model.safetensors"
_SAFETENSORS_ERRORS = (SafetensorError, OSError, RuntimeError, ValueError)
"""What the ``safetensors`` readers raise on a damaged file."""


class WeightsMismatchError(ValueError):
    """A checkpoint's tensors do not match the model: missing, unexpected or mis-shaped."""


class NonFiniteWeightsError(ValueError):
    """A checkpoint holds NaN or infinite values."""


def unique_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with each shared tensor (tied embeddings) once, first name."""
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
    """Write the model's tensors (tied ones once) to a safetensors file, with a new file's
    usual permission bits (``safetensors`` alone gives ``0o600``)."""
    path = Path(path)
    state = {k: v.detach().contiguous() for k, v in unique_state_dict(model).items()}
    path.touch()
    mode = stat.S_IMODE(path.stat().st_mode)
    save_file(state, str(path), metadata={"format": "pt", "library": "longnet"})
    os.chmod(path, mode)


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a safetensors file on CPU; a damaged file raises a clear ``ValueError``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}.")
    try:
        return load_file(str(path), device="cpu")
    except _SAFETENSORS_ERRORS as err:
        raise unreadable_weights(path, err) from None


REWRITE_FIX = "Re-save or re-copy it."
"""What to do about a damaged weights file, by default (:func:`unreadable_weights`)."""


def parse_safetensors(data: bytes, path: str | Path, fix: str = REWRITE_FIX
                      ) -> dict[str, Tensor]:
    """All tensors of ``path``'s bytes ``data`` on CPU; a damaged file raises ``ValueError``."""
    try:
        return load(data)
    except _SAFETENSORS_ERRORS as err:
        raise unreadable_weights(path, err, fix) from None


def unreadable_weights(path: str | Path, error: Exception, fix: str = REWRITE_FIX) -> ValueError:
    """The error for an unreadable weights file ``path``, ending with ``fix``."""
    return ValueError(
        f"{path} is not a readable safetensors file ({error}); it is corrupt or truncated. {fix}"
    )


def check_finite(tensors: Mapping[str, Tensor], source: str) -> None:
    """Raise :class:`NonFiniteWeightsError` naming every tensor holding a NaN or infinity."""
    bad = []
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.device.type != "meta":
            count = int((~torch.isfinite(tensor)).sum())
            if count:
                bad.append(f"{name} ({count} of {tensor.numel()} values)")
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteWeightsError(
            f"{source} holds NaN or infinite weights: {shown}. The training that wrote it "
            "diverged or the file is damaged; load an earlier checkpoint or re-copy the file."
        )


def load_state_checked(
    model: nn.Module, tensors: Mapping[str, Tensor], source: str = "checkpoint"
) -> None:
    """Copy ``tensors`` into ``model`` (cast to its dtypes), requiring exactly its tensors,
    shapes and finite values, else :class:`WeightsMismatchError` or
    :class:`NonFiniteWeightsError` naming every bad tensor."""
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
    check_finite(tensors, source)
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])
