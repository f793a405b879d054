"""Long-context evaluations behind ``longnet eval``: bits per byte versus context length with
sliding windows inside documents, compressor baselines (``longnet.data.compressors``), and
passkey retrieval grids. See ``docs/evaluation.md``.
"""

from longnet.data.compressors import COMPRESSORS, CompressorBaseline, compressor_baselines
from longnet.eval.documents import EvalDocument, load_eval_documents, tokenize_documents
from longnet.eval.loading import LoadedModel, load_model, load_models, model_tokenizer
from longnet.eval.passkey import (
    PasskeyCell,
    PasskeyOutcome,
    accuracy_by_visibility,
    answer_examples,
    check_passkey_grid,
    copy_distance,
    copy_positions,
    evaluate_passkey,
)
from longnet.eval.perplexity import (
    ContextScore,
    bits_per_byte_rows,
    default_context_lengths,
    position_rows,
    score_models,
)
from longnet.eval.plotting import plot_bits_by_position, plot_bits_per_byte, plot_passkey_heatmaps
from longnet.eval.positions import (
    PositionBucket,
    bits_by_position,
    bits_from_position,
    position_buckets,
)
from longnet.eval.reporting import format_table, parse_length, powers_of_two, write_csv
from longnet.eval.sliding import (
    SlidingWindowResult,
    Window,
    check_context_length,
    plan_windows,
    resolve_stride,
    score_documents,
)
from longnet.training.checkpoint import checkpoint_config, load_lightning_checkpoint

__all__ = [
    "COMPRESSORS",
    "CompressorBaseline",
    "ContextScore",
    "EvalDocument",
    "LoadedModel",
    "PasskeyCell",
    "PasskeyOutcome",
    "PositionBucket",
    "SlidingWindowResult",
    "Window",
    "accuracy_by_visibility",
    "answer_examples",
    "bits_by_position",
    "bits_from_position",
    "bits_per_byte_rows",
    "check_context_length",
    "check_passkey_grid",
    "checkpoint_config",
    "compressor_baselines",
    "copy_distance",
    "copy_positions",
    "default_context_lengths",
    "evaluate_passkey",
    "format_table",
    "load_eval_documents",
    "load_lightning_checkpoint",
    "load_model",
    "load_models",
    "model_tokenizer",
    "parse_length",
    "plan_windows",
    "position_buckets",
    "position_rows",
    "plot_bits_by_position",
    "plot_bits_per_byte",
    "plot_passkey_heatmaps",
    "powers_of_two",
    "resolve_stride",
    "score_documents",
    "score_models",
    "tokenize_documents",
    "write_csv",
]
