"""Training: the causal-LM LightningModule, sequence parallelism, data order, callbacks.

The ``longnet`` command (``longnet.cli``) drives these from YAML configs in ``configs/``;
see ``docs/training.md``.
"""

from longnet.training.budget import TimeBudget, TrainingDeadline
from longnet.training.builder import build_lm
from longnet.training.callbacks import (
    ExportPretrained,
    LastCheckpoint,
    MetricsSummary,
    PredictionsWriter,
    ValidateLastStep,
)
from longnet.training.checkpoint import (
    checkpoint_config,
    load_lightning_checkpoint,
    read_checkpoint,
)
from longnet.training.curriculum import LengthCurriculum
from longnet.training.curves import TrainingCurves, plot_training_curves, read_curves
from longnet.training.loaders import EpochIndexSampler, EpochLoader, ResumableDataOrder
from longnet.training.logger import RunLogger
from longnet.training.lora import LoraSettings, merge_delta
from longnet.training.metrics import TokenAccuracy, TokenCrossEntropy, lm_summary
from longnet.training.module import CausalLMModule, TrainingDiverged
from longnet.training.optim import Rewarmup, parameter_groups, warmup_cosine
from longnet.training.precision import AutoPrecisionTrainer
from longnet.training.progress import LineProgressBar, StepProgressBar
from longnet.training.rank_memory import RankMemory
from longnet.training.runs import RunId, RunLock
from longnet.training.sharded import ShardedModule, ShardedSequenceParallelStrategy
from longnet.training.sharding import pad_sequences, shard_batch
from longnet.training.signals import StopOnSignal
from longnet.training.strategy import (
    SequenceParallelLayout,
    SequenceParallelModule,
    SequenceParallelStrategy,
)

__all__ = [
    "AutoPrecisionTrainer",
    "CausalLMModule",
    "EpochIndexSampler",
    "EpochLoader",
    "ExportPretrained",
    "LastCheckpoint",
    "LengthCurriculum",
    "LineProgressBar",
    "LoraSettings",
    "MetricsSummary",
    "PredictionsWriter",
    "RankMemory",
    "ResumableDataOrder",
    "Rewarmup",
    "RunId",
    "RunLock",
    "RunLogger",
    "SequenceParallelLayout",
    "SequenceParallelModule",
    "SequenceParallelStrategy",
    "ShardedModule",
    "ShardedSequenceParallelStrategy",
    "StepProgressBar",
    "StopOnSignal",
    "TimeBudget",
    "TokenAccuracy",
    "TokenCrossEntropy",
    "TrainingCurves",
    "TrainingDeadline",
    "TrainingDiverged",
    "ValidateLastStep",
    "build_lm",
    "checkpoint_config",
    "lm_summary",
    "load_lightning_checkpoint",
    "merge_delta",
    "pad_sequences",
    "parameter_groups",
    "plot_training_curves",
    "read_checkpoint",
    "read_curves",
    "shard_batch",
    "warmup_cosine",
]
