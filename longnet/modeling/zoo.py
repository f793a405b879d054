"""Definitions of the zoo models; ``python -m longnet.modeling.zoo`` (re)writes ``models/``.

Each entry becomes ``models/<name>/config.json`` plus a ``README.md`` card whose parameter
count is computed from the config.  All zoo models read the byte-level vocabulary of
``longnet.data`` (256 ids; 255 = end of document, 254 = padding).
"""

from __future__ import annotations

from pathlib import Path

from longnet.modeling.config import LongNetConfig
from longnet.modeling.hub import models_dir
from longnet.modeling.pretrained import write_model_folder

_BYTE_LEVEL = dict(
    vocab_size=256,
    eos_token_id=255,
    pad_token_id=254,
    position_encoding="xpos",
    sub_ln=True,
    norm="layernorm",
    ffn_kind="mlp",
    activation="gelu",
    tie_word_embeddings=True,
)

ZOO: dict[str, tuple[LongNetConfig, str]] = {
    "longnet-tiny": (
        LongNetConfig(
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            max_positions=1024,
            segment_lengths=(256, 512, 1024),
            dilation_rates=(1, 2, 4),
            **_BYTE_LEVEL,
        ),
        "Byte-level LongNet small enough to train on a laptop CPU: 4 layers, width 256, dilated "
        "attention over segments of 256/512/1024 bytes, xPos and sub-LN as in the LongNet paper.",
    ),
    "longnet-small": (
        LongNetConfig(
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            max_positions=8192,
            segment_lengths=(1024, 2048, 4096, 8192),
            dilation_rates=(1, 2, 4, 8),
            **_BYTE_LEVEL,
        ),
        "Byte-level LongNet for a single GPU: 8 layers, width 512, 8K-byte context with a "
        "geometric dilated pattern, xPos and sub-LN.",
    ),
    "longnet-base": (
        LongNetConfig(
            hidden_size=768,
            num_layers=12,
            num_heads=12,
            max_positions=32768,
            segment_lengths=(2048, 4096, 8192, 16384, 32768),
            dilation_rates=(1, 2, 4, 6, 12),
            **_BYTE_LEVEL,
        ),
        "The LongNet paper's base shape (Ding et al. 2023): 12 layers, hidden 768, 12 heads, "
        "segments 2048..32768 with dilation rates 1, 2, 4, 6, 12, xPos and sub-LN (MAGNETO), "
        "here with a byte-level vocabulary.",
    ),
}


def write_zoo(root: str | Path | None = None) -> list[Path]:
    """Write every zoo folder under ``root`` (default :func:`models_dir`)."""
    root = Path(root) if root is not None else models_dir()
    return [
        write_model_folder(root / name, config, description=description)
        for name, (config, description) in ZOO.items()
    ]


if __name__ == "__main__":
    for folder in write_zoo():
        print(folder)
