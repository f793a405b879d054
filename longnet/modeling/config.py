"""``LongNetConfig``: every hyper-parameter of a LongNet model, validated, JSON round-trip."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longnet.attention import DilatedPattern, Retrieval
from longnet.attention.selection import check_retrieval
from longnet.files import write_atomic
from longnet.modeling.hub import CONFIG_NAME, resolve_model_dir
from longnet.nn.attention import check_heads, check_retrieval_positions
from longnet.nn.feedforward import ACTIVATIONS, FFN_KINDS
from longnet.nn.norm import check_norm
from longnet.nn.positional import POSITION_ENCODINGS, check_rotary_head_dim, check_xpos_pattern
from longnet.nn.rope_extension import check_rope_extension
from longnet.nn.short_conv import check_kv_conv_size
from longnet.validation import (
    UsageError,
    check_bool,
    check_choice,
    check_dropout,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
    is_int,
    is_real,
)

MODEL_TYPE = "longnet"
POOLINGS = ("mean", "first", "last")
COMPUTATION_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "ffn_kind", "ffn_hidden_size", "activation", "norm", "norm_eps", "sub_ln",
    "attention_bias", "mlp_bias", "tie_word_embeddings", "max_positions", "segment_lengths",
    "dilation_rates", "position_encoding", "rope_theta", "xpos_scale_base", "num_labels",
    "pooling",
)
"""Fields a saved ``config.json`` must spell out: a default would silently be another model
(``kv_conv_size`` and the retrieval fields are optional: older configs lack them)."""


@dataclass
class LongNetConfig:
    """Hyper-parameters of :class:`LongNetLM` / :class:`LongNetEncoder`.

    Architecture:
        vocab_size: token ids are ``0 .. vocab_size - 1``.
        hidden_size, num_layers, num_heads: width, depth, query heads.
        num_kv_heads: K/V heads (grouped-query attention), dividing ``num_heads``; None: same.
        head_dim: per-head width; None: ``hidden_size // num_heads``.
        ffn_kind: ``"mlp"`` or ``"glu"`` (SwiGLU with ``activation="silu"``).
        ffn_hidden_size: FFN inner width; None: ``4 * hidden_size`` (mlp), ``8/3 * hidden_size``
            rounded up to a multiple of 64 (glu).
        activation: ``"gelu"`` (erf), ``"gelu_tanh"`` (GPT-2's gelu_new), ``"relu"``, ``"silu"``.
        norm: ``"layernorm"`` or ``"rmsnorm"``; ``norm_eps`` its epsilon.
        sub_ln: MAGNETO sub-LN (norms before the attention output and FFN down projections).
        attention_bias, mlp_bias: biases on the attention projections / FFN linears.
        tie_word_embeddings: the LM head shares the token embedding matrix.
    Positions and attention pattern:
        max_positions: context length (learned position table, default dense segment).
        segment_lengths, dilation_rates: the dilated pattern (docs/architecture.md §2); both
            None: dense attention ``(max_positions, 1)``.
        kv_conv_size: width of a causal convolution over keys and values (0: none, else >= 2).
        attention_sinks: first tokens of each document every query also sees (0: none).
        select_block, select_top_k: each query attends to the ``select_top_k`` blocks of
            ``select_block`` tokens whose keys bound its scores highest (0: no selection).
        neighbor_segments: local segments before the query's own (both sides when
            bidirectional) that it also sees densely, at their own positions (0: none).
        retrieval_positions: where retrieval keys sit: ``"own"`` (their positions) or
            ``"before_segment"`` (RoPE only: just before the query's local segment).
        position_encoding: ``"xpos"`` (the paper's), ``"rope"``, ``"learned"`` or ``"none"``.
        rope_theta: base of the rotary frequencies (RoPE and xPos).
        rope_extension: RoPE extension (:mod:`longnet.nn.rope_extension`); None: plain.
        xpos_scale_base: xPos decay length (gamma in the paper, 512).
    Training:
        dropout: residual dropout (embeddings, attention and FFN outputs).
        initializer_range: std of the normal initialisation.
        gradient_checkpointing: recompute each block's activations in backward.
    Encoder head:
        num_labels, pooling (``"mean"``, ``"first"``, ``"last"``).
    Tokens:
        bos_token_id, eos_token_id, pad_token_id: optional special ids.
    """

    vocab_size: int = 256
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_kind: str = "mlp"
    ffn_hidden_size: int | None = None
    activation: str = "gelu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    sub_ln: bool = False
    attention_bias: bool = True
    mlp_bias: bool = True
    tie_word_embeddings: bool = True
    max_positions: int = 1024
    segment_lengths: tuple[int, ...] | None = None
    dilation_rates: tuple[int, ...] | None = None
    kv_conv_size: int = 0
    attention_sinks: int = 0
    select_block: int = 64
    select_top_k: int = 0
    neighbor_segments: int = 0
    retrieval_positions: str = "own"
    position_encoding: str = "xpos"
    rope_theta: float = 10000.0
    rope_extension: dict[str, Any] | None = None
    xpos_scale_base: float = 512.0
    dropout: float = 0.0
    initializer_range: float = 0.02
    gradient_checkpointing: bool = False
    num_labels: int = 2
    pooling: str = "mean"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.segment_lengths is not None:
            self.segment_lengths = _int_tuple("segment_lengths", self.segment_lengths)
        if self.dilation_rates is not None:
            self.dilation_rates = _int_tuple("dilation_rates", self.dilation_rates)
        self.rope_extension = check_rope_extension(self.rope_extension)
        self.validate()
        for f in dataclasses.fields(self):  # NumPy numbers as int/float: config.json holds them
            value = getattr(self, f.name)
            if is_int(value):
                setattr(self, f.name, int(value))
            elif is_real(value):
                setattr(self, f.name, float(value))

    @property
    def pattern(self) -> DilatedPattern:
        """The dilated pattern; dense ``(max_positions, 1)`` when none is set."""
        if self.segment_lengths is None:
            return DilatedPattern.dense(self.max_positions)
        return DilatedPattern(self.segment_lengths, self.dilation_rates)

    @property
    def retrieval(self) -> Retrieval | None:
        """The retrieval branches (sinks, block selection), or None when there are none."""
        retrieval = Retrieval(self.attention_sinks, self.select_block, self.select_top_k,
                              self.neighbor_segments)
        return retrieval if retrieval.active else None

    @property
    def resolved_num_kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.ffn_kind == "glu":
            return 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        return 4 * self.hidden_size

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (``TypeError`` for a non-bool flag)."""
        for name in ("vocab_size", "num_layers", "max_positions"):
            check_positive_int(name, getattr(self, name))
        check_heads(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                    "hidden_size")
        if self.ffn_hidden_size is not None:
            check_positive_int("ffn_hidden_size", self.ffn_hidden_size)
        check_positive_int("num_labels", self.num_labels)
        check_kv_conv_size(self.kv_conv_size)
        check_non_negative_int("attention_sinks", self.attention_sinks)
        check_positive_int("select_block", self.select_block)
        check_non_negative_int("select_top_k", self.select_top_k)
        check_non_negative_int("neighbor_segments", self.neighbor_segments)
        check_retrieval_positions(self.retrieval_positions, self.retrieval is not None,
                                  self.position_encoding == "rope")
        check_choice("ffn_kind", self.ffn_kind, FFN_KINDS)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_norm(self.norm, self.norm_eps)
        check_choice("position_encoding", self.position_encoding, POSITION_ENCODINGS)
        check_choice("pooling", self.pooling, POOLINGS)
        for name in ("sub_ln", "attention_bias", "mlp_bias", "tie_word_embeddings",
                     "gradient_checkpointing"):
            check_bool(name, getattr(self, name))
        for name in ("rope_theta", "xpos_scale_base", "initializer_range"):
            check_positive_float(name, getattr(self, name))
        check_dropout("dropout", self.dropout)
        check_rope_extension(self.rope_extension)
        if self.rope_extension is not None and self.position_encoding != "rope":
            raise ValueError(
                f"rope_extension is set ({self.rope_extension['rope_type']}) but "
                f"position_encoding is {self.position_encoding!r}; it extends RoPE only: set "
                "position_encoding='rope' or rope_extension=None."
            )
        if self.position_encoding in ("rope", "xpos"):
            check_rotary_head_dim(self.resolved_head_dim)
        if (self.segment_lengths is None) != (self.dilation_rates is None):
            raise ValueError(
                "segment_lengths and dilation_rates must be given together (or both None for "
                f"dense attention); got segment_lengths={self.segment_lengths}, "
                f"dilation_rates={self.dilation_rates}."
            )
        if self.segment_lengths is not None:
            try:
                pattern = DilatedPattern(self.segment_lengths, self.dilation_rates)
            except ValueError as err:
                raise ValueError(f"segment_lengths/dilation_rates: {err}") from None
            if self.position_encoding == "xpos":
                check_xpos_pattern(pattern, pattern.segment_lengths[-1])
        check_retrieval("LongNetConfig", self.retrieval, self.pattern)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value < self.vocab_size):
                raise ValueError(
                    f"{name} must be None or a token id in 0..{self.vocab_size - 1}, got {value!r}."
                )
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict of JSON values, got {self.extra!r}.")

    def replace(self, **overrides: Any) -> LongNetConfig:
        """A validated copy with fields replaced (``pattern=``: any ``DilatedPattern.coerce``)."""
        overrides = dict(overrides)
        if "pattern" in overrides:
            pattern = overrides.pop("pattern")
            if pattern is None or pattern == "dense":
                overrides["segment_lengths"] = overrides["dilation_rates"] = None
            else:
                pattern = DilatedPattern.coerce(pattern)
                overrides["segment_lengths"] = pattern.segment_lengths
                overrides["dilation_rates"] = pattern.dilation_rates
        _check_names(overrides)
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with ``"model_type": "longnet"``)."""
        data: dict[str, Any] = {"model_type": MODEL_TYPE}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            data[f.name] = list(value) if isinstance(value, tuple) else value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> LongNetConfig:
        """Build from :meth:`to_dict` output; unknown keys raise with the known field names."""
        data = dict(data)
        model_type = data.pop("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(
                f"config has model_type {model_type!r}, not {MODEL_TYPE!r}; import foreign "
                "checkpoints with LongNetLM.from_pretrained(folder)."
            )
        data.pop("architecture", None)  # written by save_pretrained; not a hyper-parameter
        _check_names(data)
        config = cls(**data)
        return config.replace(**overrides) if overrides else config

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def save(self, path: str | Path) -> None:
        """Write JSON to ``path`` (a file, or a folder that gets ``config.json``), atomically."""
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_NAME
        write_atomic(path, self.to_json_string())

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> LongNetConfig:
        """Read JSON from ``path`` (a file, or a folder holding ``config.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no LongNet config at {path}.") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}.") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
        check_saved_fields(data, path)
        return cls.from_dict(data, **overrides)

    @classmethod
    def from_pretrained(cls, name_or_dir: str | Path, **overrides: Any) -> LongNetConfig:
        """The config of a zoo model (``"longnet-tiny"``) or of a saved model folder."""
        return cls.load(resolve_model_dir(name_or_dir), **overrides)


# ---------------------------------------------------------------------- helpers
def check_saved_fields(data: dict[str, Any], source: str | Path) -> None:
    """Refuse unknown field names (``ValueError``), then omitted computation fields."""
    _check_names(name for name in data if name not in ("model_type", "architecture"))
    check_computation_fields(data, source)


def check_computation_fields(data: dict[str, Any], source: str | Path) -> None:
    """Raise :class:`UsageError` naming every :data:`COMPUTATION_FIELDS` entry ``data`` omits."""
    missing = [name for name in COMPUTATION_FIELDS if name not in data]
    if missing:
        raise UsageError(
            f"{source} omits {', '.join(missing)}: fields that change what the model computes, "
            "so a default would silently make another model (no segment_lengths/"
            "dilation_rates means dense attention). Add them (null where the default is "
            "meant, e.g. \"segment_lengths\": null for dense attention); "
            "LongNetLM.save_pretrained writes every field."
        )


def _check_names(data: Iterable[str]) -> None:
    known = [f.name for f in dataclasses.fields(LongNetConfig)]
    for name in data:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"LongNetConfig has no field {name!r}.{hint} Known fields: {', '.join(known)}."
            )


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of positive integers, got {value!r}.") from None
    for item in items:
        if not is_int(item):
            raise ValueError(f"{name} must be a list of positive integers, got {value!r}.")
    return tuple(int(item) for item in items)
