"""Training: the causal-LM LightningModule, its metrics, learning rate, data order and
callbacks, driven by the ``longnet`` command from YAML configs (docs/training.md).
The sequence-parallel strategies live in ``parallel/``."""

from longnet.training.callbacks import ExportPretrained, LastCheckpoint, ValidateLastStep
from longnet.training.checkpoint import (
    build_lm,
    checkpoint_config,
    load_lightning_checkpoint,
    read_checkpoint,
)
from longnet.training.curriculum import (
    EpochIndexSampler,
    EpochLoader,
    LengthCurriculum,
    ResumableDataOrder,
)
from longnet.training.lora import LoraSettings, merge_delta
from longnet.training.metrics import TokenAccuracy, TokenCrossEntropy, lm_summary
from longnet.training.module import CausalLMModule, TrainingDiverged
from longnet.training.parallel import (
    SequenceParallelLayout,
    SequenceParallelModule,
    SequenceParallelStrategy,
    ShardedModule,
    ShardedSequenceParallelStrategy,
    pad_sequences,
    shard_batch,
)
from longnet.training.reports import (
    LineProgressBar,
    MetricsSummary,
    PeakMemory,
    PredictionsWriter,
    StepProgressBar,
    TrainingCurves,
    plot_training_curves,
    read_curves,
)
from longnet.training.run_folder import RunId, RunLock, RunLogger
from longnet.training.schedule import (
    Rewarmup,
    TimeBudget,
    TrainingDeadline,
    parameter_groups,
)
from longnet.training.trainer import AutoPrecisionTrainer, StopOnSignal

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
    "PeakMemory",
    "PredictionsWriter",
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
]
