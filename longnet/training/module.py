"""``CausalLMModule``: the LightningModule that trains and evaluates a LongNet causal LM, and
its metrics.

The metrics are exact across ranks and batches: cross-entropy is accumulated as a *sum* over
scored tokens together with the number of scored tokens, both torchmetrics states reduced by
summation, so the epoch value is ``sum(CE) / sum(tokens)`` over every token of every rank, what
one device computes on the whole split. Perplexity is derived from that mean (never from a
materialised softmax: see docs/training.md, "Pitfalls found here"), per token. Bits per byte
divide the summed cross-entropy by the UTF-8 bytes of the text the scored tokens cover, counted
per token by the data (``label_bytes``; for byte text one per scored byte, none for an EOS), so
a byte model and a subword model are compared on the same bytes.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import DoublePrecision
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from longnet.attention import DilatedPattern
from longnet.constants import IGNORE_INDEX, NATS_PER_BIT
from longnet.distributed.sequence_parallel import parallelize
from longnet.modeling import LMOutput
from longnet.modeling.model import document_labels
from longnet.training.checkpoint import build_lm
from longnet.training.lora import (
    LORA_BASE_KEY,
    LoraSettings,
    apply_lora,
    base_record,
    check_delta_names,
    check_same_base,
    trainable_names,
)
from longnet.training.order import ResumableDataOrder
from longnet.training.parallel.batches import check_window_shards
from longnet.training.parallel.strategy import SequenceParallelLayout
from longnet.training.schedule import (
    build_optimizer,
    follow_configured_length,
    parameter_groups,
)
from longnet.training.vocabulary import (
    TOKENIZER_KEY,
    check_pretrained_tokenizer,
    check_tokenizer_record,
    data_token_ids,
    datamodule_seq_len,
    fitted_overrides,
    scored_bytes,
    tokenizer_record,
)
from longnet.validation import (
    UsageError,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
)

Batch = dict[str, Tensor]
RNG_KEY = "longnet_rng_state"
PASSKEY_ROWS = "passkey_rows"
"""Batch key of a ``(batch,)`` bool mask of the windows that are passkey examples (set by
:class:`~longnet.training.LengthCurriculum`): their scored tokens' mean loss is logged as
``train/passkey_loss`` (NaN on a step without one)."""


def lm_summary(loss_sum: Tensor, num_tokens: Tensor, num_bytes: Tensor | None = None,
               bytes_per_token: float = 1.0) -> dict:
    """``loss`` (nats per token), ``bpb`` (bits per byte) and ``ppl`` (per token) from summed
    CE.

    Args:
        loss_sum: summed cross-entropy in nats (scalar or ``(batch,)``).
        num_tokens: number of scored tokens (same shape).
        num_bytes: UTF-8 bytes of text the scored tokens cover (same shape); None:
            ``bytes_per_token`` per token.
        bytes_per_token: bytes per token when ``num_bytes`` is None.
    """
    loss = loss_sum.double() / num_tokens.double().clamp(min=1)
    covered = num_tokens * bytes_per_token if num_bytes is None else num_bytes
    return {
        "loss": loss,
        "bpb": loss_sum.double() / NATS_PER_BIT / covered.double().clamp(min=1),
        "ppl": torch.exp(loss.clamp(max=80.0)),
    }


class TokenCrossEntropy(Metric):
    """Summed cross-entropy, scored tokens and the bytes they cover; ``compute()`` gives loss
    (nats per token), bpb (bits per byte), perplexity (per token), tokens and bytes.

    ``update(loss_sum, num_tokens, num_bytes)`` takes the scalar outputs of
    :class:`longnet.modeling.LongNetLM` (``LMOutput.loss_sum`` / ``LMOutput.num_tokens``) for
    one batch (or one sequence shard) and the UTF-8 bytes its scored tokens cover (None:
    ``bytes_per_token`` per token). States are float64 and reduced with ``sum`` across
    processes, so sequence shards and data-parallel replicas add up to the exact global value.

    Args:
        bytes_per_token: bytes per token for updates without ``num_bytes``.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, bytes_per_token: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if not bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token!r}.")
        self.bytes_per_token = float(bytes_per_token)
        for name in ("loss_sum", "num_tokens", "num_bytes"):
            self.add_state(name, torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor, num_tokens: Tensor, num_bytes: Tensor | None = None) -> None:
        self.loss_sum += loss_sum.detach().to(torch.float64)
        self.num_tokens += num_tokens.detach().to(torch.float64)
        covered = num_tokens * self.bytes_per_token if num_bytes is None else num_bytes
        self.num_bytes += covered.detach().to(torch.float64)

    def compute(self) -> dict:
        return {
            **lm_summary(self.loss_sum, self.num_tokens, self.num_bytes),
            "tokens": self.num_tokens,
            "bytes": self.num_bytes,
        }


class TokenAccuracy(Metric):
    """Share of scored tokens whose argmax prediction equals the label (exact across ranks).

    ``update(correct, num_tokens)`` takes counts of one batch or shard.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, correct: Tensor, total: Tensor) -> None:
        self.correct += correct.detach().to(torch.float64)
        self.total += total.detach().to(torch.float64)

    def compute(self) -> Tensor:
        return self.correct / self.total.clamp(min=1)


class TrainingDiverged(UsageError):
    """The loss or the gradients of a training step are not finite (NaN or infinite): the run
    stops before the optimizer applies them, so the weights and checkpoints stay finite.

    Attributes:
        step: the optimizer step that diverged (1-based: the ``global_step`` it would have
            reached).
        every_rank: every rank raises it at the same step (the loss is the global batch's and
            the gradient norm the whole gradient's), so the strategies name no lost rank.
    """

    every_rank = True

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class CausalLMModule(L.LightningModule):
    """Next-token training of a :class:`~longnet.modeling.LongNetLM`.

    Batches are ``{"input_ids": (batch, seq), "labels": (batch, seq)}`` with shifted labels
    (-100 ignored), as every ``longnet.data`` datamodule yields; the labels are aligned, the
    model's ``targets`` (with packed documents also ``"document_ids": (batch, seq)``, passed to
    the model; labels whose target begins the next document are not scored); under
    :class:`~longnet.training.SequenceParallelStrategy` they arrive as this rank's
    shard with global ``position_ids`` ``(shard,)``, and :meth:`setup` applies the strategy's
    ``sequence_parallel`` to the model (:func:`longnet.distributed.parallelize`; released in
    :meth:`teardown`).

    Loss (``loss_reduction="token"``): ``sum(CE) * world_size / N`` with ``N`` the number of
    scored tokens of the whole global batch (all ranks). Data-parallel training averages
    gradients over all ``world_size`` ranks, so the update is that of ``sum(CE) / N`` on one
    device: the token-weighted mean over the global batch, whatever the data-parallel and
    sequence-parallel layout. ``loss_reduction="sample"`` takes each sample's mean CE over its
    scored tokens, then the mean over the samples with any scored token (global batch): every
    sample weighs the same, so a task that labels only its answers (e.g. passkey examples with
    ``passkey_label_mode="answer"`` mixed into a corpus) is not drowned by fully labelled text.
    Under sequence parallelism a sample's scored tokens are counted over its whole group. The
    logged ``train/loss`` is token-weighted in both modes.

    Logged: ``train/loss`` (nats/token, global batch), ``train/bpb``, ``train/tokens_per_s``
    (input tokens of the global batch per second of training step, scored or not),
    ``train/passkey_loss`` (nats/token over the scored tokens of the global batch's passkey
    windows, :data:`PASSKEY_ROWS`; NaN on a step without one);
    ``val/loss``, ``val/bpb``, ``val/ppl`` (per token), ``val/accuracy`` (and ``test/...``)
    over the whole split, exact across ranks (summed cross-entropy, token and byte counts).
    Bits per byte divide by the UTF-8 bytes the scored tokens cover (the batch's
    ``"label_bytes"`` ``(batch, seq)``, else one per scored label other than EOS).

    The tokenizer: a datamodule that chooses one (``LongDocumentDataModule(tokenizer=...)``)
    gives a fresh model its ``vocab_size`` and EOS/padding ids (:meth:`fit_tokenizer`, in
    :meth:`setup`); every checkpoint records it and a resume with another is refused.

    Args:
        model: zoo name or model folder to build a freshly initialised model from.
        pretrained: zoo name or folder with weights to start from.
        config: :class:`~longnet.modeling.LongNetConfig` fields (fresh weights).
            Exactly one of ``model``, ``pretrained``, ``config``.
        overrides: config fields to replace (e.g. ``{hidden_size: 32}`` or ``{dropout: 0.1}``).
        learning_rate: peak AdamW learning rate.
        weight_decay: decoupled weight decay of matrices and embeddings (not biases/norms).
        betas, eps: AdamW moments and epsilon.
        warmup_steps: linear warmup steps.
        total_steps: length of the cosine schedule; None uses the trainer's
            ``estimated_stepping_batches`` (``max_steps`` when set).
        min_lr_ratio: the cosine ends at ``learning_rate * min_lr_ratio``.
        gradient_checkpointing: recompute each block in backward (saves activation memory).
        bytes_per_token: bytes per scored token other than EOS for batches without
            ``"label_bytes"`` (1: byte text; synthetic tasks).
        resumable_data: attach :class:`~longnet.training.ResumableDataOrder` (deterministic,
            resumable, exact-evaluation data order); turn off to keep Lightning's loaders.
        loss_reduction: ``"token"`` (mean over scored tokens) or ``"sample"`` (mean over
            samples of their mean over scored tokens); see above.
        lora: fine-tune ``pretrained`` weights with LoRA adapters (``peft``), e.g. ``{r: 16,
            alpha: 32, train_norms: true}`` (:class:`~longnet.training.lora.LoraSettings`):
            only the delta (adapters, norms, key/value convolutions) is trained and kept in
            checkpoints and exports, bound to its base (:mod:`longnet.training.lora`).
        kv_conv_learning_rate: the peak learning rate of the key/value convolutions' taps
            (``kv_conv_size``), scheduled as ``learning_rate`` is; None: ``learning_rate``
            (AdamW moves a parameter by about its rate a step: a tap that must grow from 0 in
            a few hundred steps needs a rate far above the adapters').
    """

    def __init__(
        self,
        model: str | None = None,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        overrides: dict[str, Any] | None = None,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        gradient_checkpointing: bool = False,
        bytes_per_token: float = 1.0,
        resumable_data: bool = True,
        loss_reduction: Literal["token", "sample"] = "token",
        lora: dict[str, Any] | None = None,
        kv_conv_learning_rate: float | None = None,
    ) -> None:
        super().__init__()
        _check_hparams(learning_rate, weight_decay, betas, eps, warmup_steps, total_steps,
                       min_lr_ratio, bytes_per_token)
        if loss_reduction not in ("token", "sample"):
            raise ValueError(
                f"loss_reduction must be 'token' or 'sample', got {loss_reduction!r}."
            )
        self.lora = None if lora is None else LoraSettings.from_mapping(lora)
        if kv_conv_learning_rate is not None:
            check_positive_float("kv_conv_learning_rate", kv_conv_learning_rate)
        if self.lora is not None and pretrained is None:
            raise UsageError("lora fine-tunes pretrained weights: give pretrained (a zoo name "
                             "or model folder) with it, not model or config.")
        self.save_hyperparameters()
        self.model = build_lm(model, pretrained=pretrained, config=config, overrides=overrides)
        if gradient_checkpointing:
            self.model.set_gradient_checkpointing(True)
        # a LoRA run's base: its source and weights fingerprint, before the adapters go in
        self.lora_base = None if self.lora is None else base_record(pretrained, self.model)
        if self.lora is not None:
            apply_lora(self.model, self.lora)
        self.bytes_per_token = bytes_per_token
        self.val_ce = TokenCrossEntropy()
        self.val_acc = TokenAccuracy()
        self.test_ce = TokenCrossEntropy()
        self.test_acc = TokenAccuracy()
        self._step_started: float | None = None
        self._step_ended: float | None = None
        self._step_tokens: Tensor | None = None
        self._step_loss: Tensor | None = None
        self._tokenizer_record: dict[str, Any] | None = None
        self._eos_id: int | None = self.model.config.eos_token_id  # the data's, from setup

    # ------------------------------------------------------------------ model facts
    # ``pattern`` and ``pad_token_id`` make this a ``SequenceParallelModule``: what both
    # sequence-parallel strategies read to cut batches into shards; ``network`` and ``blocks``
    # make it a ``ShardedModule``: what ``ShardedSequenceParallelStrategy`` fully_shards.
    @property
    def pattern(self) -> DilatedPattern:
        """The model's dilated pattern (the strategy pads sequences to fit it)."""
        return self.model.config.pattern

    @property
    def pad_token_id(self) -> int:
        """Input id used for padding (the config's ``pad_token_id``, else 0)."""
        pad = self.model.config.pad_token_id
        return 0 if pad is None else pad

    @property
    def network(self) -> torch.nn.Module:
        """The :class:`~longnet.modeling.LongNetLM` every step calls (the FSDP root)."""
        return self.model

    @property
    def blocks(self) -> torch.nn.ModuleList:
        """The model's transformer blocks (one FSDP unit each)."""
        return self.model.model.layers

    def sequence_parallel_group(self) -> dist.ProcessGroup | None:
        """The sequence-parallel group of the trainer's strategy: that of a
        :class:`~longnet.training.SequenceParallelStrategy` or
        :class:`~longnet.training.ShardedSequenceParallelStrategy` (None when its size
        is 1), None under any other strategy or without a trainer."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, SequenceParallelLayout):
            return strategy.sequence_parallel_group
        return None

    # ------------------------------------------------------------------ Lightning hooks
    def configure_callbacks(self) -> list[L.Callback]:
        if not self.hparams.resumable_data:
            return []
        present = self._trainer is not None and any(
            isinstance(callback, ResumableDataOrder) for callback in self._trainer.callbacks
        )
        return [] if present else [ResumableDataOrder()]

    def fit_tokenizer(self, datamodule: Any) -> None:
        """Give a fresh model the vocabulary and EOS/padding ids of ``datamodule``'s tokenizer
        (rebuilt with them as ``overrides``, also in the saved hyper-parameters); nothing for a
        datamodule without a tokenizer choice or a model that has them already. Pretrained
        weights keep their own and must read the data's tokenizer.

        Raises:
            UsageError: pretrained weights of another vocabulary or tokenizer, or a config
                ``vocab_size`` below the tokenizer's (``vocabulary.fitted_overrides``,
                ``vocabulary.check_pretrained_tokenizer``).
        """
        ids = data_token_ids(datamodule)
        overrides = None if ids is None else fitted_overrides(ids, self.model.config,
                                                              self.hparams)
        check_pretrained_tokenizer(self.hparams.get("pretrained"), self.model.config,
                                   getattr(datamodule, "tokenizer", None))
        if overrides is None:
            return
        hp = self.hparams
        self.model = build_lm(hp.model, config=hp.config, overrides=overrides)
        if hp.gradient_checkpointing:
            self.model.set_gradient_checkpointing(True)
        self.hparams["overrides"] = overrides

    def setup(self, stage: str) -> None:
        """Fit the model to the data's tokenizer (:meth:`fit_tokenizer`), then refuse a
        datamodule the model cannot read, before any work."""
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        self.fit_tokenizer(datamodule)
        tokenizer = getattr(datamodule, "tokenizer", None)
        self._tokenizer_record = None if tokenizer is None else tokenizer_record(tokenizer)
        config = self.model.config
        self._eos_id = getattr(datamodule, "eos_id", config.eos_token_id)
        vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(vocab, int) and vocab > config.vocab_size:
            raise UsageError(
                f"the data has vocab_size {vocab} but the model only {config.vocab_size}; set "
                f"model overrides {{vocab_size: {vocab}}} or use matching data."
            )
        seq_len = datamodule_seq_len(datamodule)
        if seq_len is not None and config.position_encoding == "learned" \
                and seq_len > config.max_positions:
            raise UsageError(
                f"data seq_len {seq_len} exceeds the model's max_positions "
                f"{config.max_positions} (learned position embeddings); lower seq_len or "
                "raise max_positions."
            )
        strategy = self._trainer.strategy if self._trainer is not None else None
        sequence_parallel = isinstance(strategy, SequenceParallelLayout)
        if stage == "fit" and seq_len is not None and sequence_parallel:
            check_window_shards(seq_len, self.pattern, strategy.sequence_parallel_size,
                                strategy.sequence_layout)
        parallelize(self.model, strategy.sequence_parallel if sequence_parallel else None)

    def teardown(self, stage: str) -> None:
        """Run the model on one device again, which also lets its process group go."""
        parallelize(self.model, None)

    def state_dict(self, *, destination: dict[str, Any] | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The module's tensors; with ``lora`` its trainable ones alone (the delta), which is
        what checkpoints and handoffs keep: the frozen base comes from ``pretrained``."""
        state = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.lora is not None:
            kept = {prefix + name for name in trainable_names(self)}
            for name in [name for name in state if name.startswith(prefix)
                         and name not in kept]:
                del state[name]
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load tensors; with ``lora`` a delta (:meth:`state_dict`) over the base weights the
        module holds, every trainable tensor required under ``strict``."""
        if self.lora is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if strict:
            check_delta_names(set(state_dict), trainable_names(self), "the checkpoint")
        full = super().state_dict()
        full.update(state_dict)
        return super().load_state_dict(full, strict=strict, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the RNG state (dropout) so a resumed run draws what the uninterrupted one
        would have drawn."""
        checkpoint[RNG_KEY] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            checkpoint[RNG_KEY]["cuda"] = torch.cuda.get_rng_state()
        if self._tokenizer_record is not None:
            checkpoint[TOKENIZER_KEY] = self._tokenizer_record
        if self.lora_base is not None:
            checkpoint[LORA_BASE_KEY] = self.lora_base

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another tokenizer than the data's, or a LoRA run's of another
        base (``lora.check_same_base``); under ``64-true``, make the
        module float64 first (Lightning loads the weights before it converts the module, and
        the float32 module it loads them into would round them); restore the RNG state."""
        tokenizer = getattr(self._trainer.datamodule, "tokenizer", None) \
            if self._trainer is not None else None
        if tokenizer is not None:
            check_tokenizer_record(checkpoint.get(TOKENIZER_KEY), tokenizer)
        if self.lora_base is not None:
            where = getattr(self._trainer, "ckpt_path", None) or "the checkpoint"
            check_same_base(checkpoint.get(LORA_BASE_KEY), self.lora_base, str(where))
        if self._trainer is not None and isinstance(self._trainer.precision_plugin,
                                                    DoublePrecision):
            self.double()
        state = checkpoint.get(RNG_KEY)
        if state is None:
            return
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])

    def forward(self, batch: Batch) -> LMOutput:
        """Run the LM on a (possibly sharded) batch."""
        return self.model(
            batch["input_ids"],
            targets=batch.get("labels"),
            position_ids=batch.get("position_ids"),
            document_ids=batch.get("document_ids"),
        )

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        out = self(batch)
        world = self.trainer.world_size
        # one all-reduce gives the global summed CE (for logging), scored tokens and bytes,
        # and the input tokens the step ran (the throughput's: a passkey example with recall
        # labels scores a few tokens of the thousands it runs; a fill, not a copy from the
        # host, which would wait for the forward to finish before the backward is queued)
        input_tokens = out.loss_sum.new_full((), batch["input_ids"].numel(),
                                             dtype=torch.float64)
        stats = torch.stack((out.loss_sum.detach().double(), out.num_tokens.double(),
                             self._scored_bytes(batch).sum().double(), input_tokens,
                             *_passkey_ce(out.logits, batch)))
        if world > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats)
        if self.hparams.loss_reduction == "sample":
            loss = self._sample_mean_loss(out.logits, _labels(batch), world)
        else:
            loss = out.loss_sum * (world / stats[1].clamp(min=1)).to(out.loss_sum.dtype)
        summary = lm_summary(stats[0], stats[1], stats[2])
        self.log("train/loss", summary["loss"].float(), prog_bar=True)
        self.log("train/bpb", summary["bpb"].float())
        if PASSKEY_ROWS in batch:  # NaN on a step without one (a key left out of a step
            # would be logged with its last value again)
            self.log("train/passkey_loss", (stats[4] / stats[5]).float())
        self._step_tokens = stats[3]
        self._step_loss = summary["loss"]  # of the global batch: the same on every rank
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse to apply a step whose loss or gradients are not finite
        (:class:`TrainingDiverged`, on every rank at once). Under a gradient scaler
        (``16-mixed``), whose steps skip infinite gradients by design, only the loss is
        checked."""
        checks = {"loss": self._step_loss}
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if grads:
                norm = torch.nn.utils.get_total_norm(grads)
                # FSDP's gradients are shards: the norm of the whole gradient (a collective)
                checks["gradient norm"] = norm.full_tensor() if isinstance(norm, DTensor) \
                    else norm
        bad = {name: float(value) for name, value in checks.items()
               if value is not None and not torch.isfinite(value)}
        if bad:
            raise self._diverged(bad)

    def _diverged(self, bad: dict[str, float]) -> TrainingDiverged:
        step = self.trainer.global_step + 1
        what = " and ".join(f"the {name} is {value}" for name, value in bad.items())
        return TrainingDiverged(
            f"training diverged at step {step}: {what}. The step was not applied, the run "
            "stops and nothing is exported. Lower model.init_args.learning_rate (now "
            f"{self.hparams.learning_rate:g}) or lengthen warmup_steps (now "
            f"{self.hparams.warmup_steps}), and train again.",
            step,
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started = self._step_ended = time.perf_counter()

    def on_after_backward(self) -> None:
        self._step_ended = time.perf_counter()  # a batch that accumulates gradients ends here

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self._step_ended = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log ``train/tokens_per_s`` over the step itself: from the batch's start to the end
        of its backward and optimizer step, leaving out what callbacks do at the batch's end
        (a checkpoint saved, a profile written), which runs before this hook."""
        if self._step_started is None or self._step_tokens is None:
            return
        elapsed = self._step_ended - self._step_started
        self.log("train/tokens_per_s", float(self._step_tokens) / max(elapsed, 1e-9))

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._eval_update(batch, self.val_ce, self.val_acc)

    def on_validation_epoch_end(self) -> None:
        self._eval_log("val", self.val_ce, self.val_acc)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._eval_update(batch, self.test_ce, self.test_acc)

    def on_test_epoch_end(self) -> None:
        self._eval_log("test", self.test_ce, self.test_acc)

    def predict_step(self, batch: Batch, batch_idx: int) -> dict[str, Tensor]:
        """Per-sample summed CE, scored tokens, the bytes they cover and bits per byte (whole
        sequences, also under sequence parallelism): ``{"loss_sum", "num_tokens",
        "num_bytes", "bpb"}`` each ``(batch,)``."""
        out = self.model(
            batch["input_ids"], position_ids=batch.get("position_ids"),
            document_ids=batch.get("document_ids"),
        )
        ce_sums, counts = _per_sample_ce(out.logits, _labels(batch))
        stats = torch.stack((ce_sums.double(), counts.double(),
                             self._scored_bytes(batch).double()))
        group = self.sequence_parallel_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        summary = lm_summary(stats[0], stats[1], stats[2])
        return {"loss_sum": stats[0], "num_tokens": stats[1], "num_bytes": stats[2],
                "bpb": summary["bpb"]}

    def schedule_length(self) -> int:
        """The optimizer steps the learning-rate decay is laid over: ``total_steps``, else
        the trainer's length (``max_steps``)."""
        total = self.hparams.total_steps
        if total is None:
            total = self.trainer.estimated_stepping_batches
            if total == float("inf"):
                raise UsageError(
                    "total_steps is None and the trainer has no finite length; set "
                    "trainer.max_steps or model.init_args.total_steps."
                )
        return int(total)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        total = self.schedule_length()
        if hp.warmup_steps >= total:
            warnings.warn(
                f"warmup_steps {hp.warmup_steps} is not below the schedule's {total} steps "
                "(total_steps, else max_steps): the learning rate never reaches learning_rate "
                f"{hp.learning_rate} and never decays. Fine for a quick check; for a real run "
                "lower --model.init_args.warmup_steps.", stacklevel=2)
        optimizer, scheduler = build_optimizer(
            parameter_groups(self.model, hp.weight_decay, hp.kv_conv_learning_rate),
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            eps=hp.eps,
            total_steps=total,
            warmup_steps=hp.warmup_steps,
            min_lr_ratio=hp.min_lr_ratio,
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    def on_train_start(self) -> None:
        """A resumed fit with another schedule length than its checkpoint's restarts the
        schedule at that length (:func:`~longnet.training.schedule.follow_configured_length`)."""
        follow_configured_length(self.trainer, self.lr_schedulers(), self.schedule_length(),
                                 self.hparams.learning_rate)

    # ------------------------------------------------------------------ helpers
    def _scored_bytes(self, batch: Batch) -> Tensor:
        """``(batch,)`` UTF-8 bytes the scored labels of each sample cover."""
        return scored_bytes(batch, _labels(batch), self._eos_id, self.bytes_per_token)

    def _sample_mean_loss(self, logits: Tensor, labels: Tensor, world: int) -> Tensor:
        """``sum_b (sum_t CE[b, t] / n_b) * world / S``: ``n_b`` the scored tokens of sample
        ``b`` over all its shards, ``S`` the samples with a scored token in the global batch;
        logits ``(batch, shard, vocab)``, labels ``(batch, shard)``. Summed over the ranks
        (DDP averages gradients over ``world``) this is the mean over samples of each whole
        sample's token-mean CE."""
        ce_sums, counts = _per_sample_ce(logits, labels)
        group = self.sequence_parallel_group()
        replicas = 1  # ranks that hold a part of each sample
        if group is not None:
            dist.all_reduce(counts, group=group)
            replicas = dist.get_world_size(group)
        samples = (counts > 0).sum().double()
        if world > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(samples)
        per_sample = ce_sums / counts.clamp(min=1)
        return per_sample.sum() * (world * replicas / samples.clamp(min=1)).float()

    def _eval_update(self, batch: Batch, ce: TokenCrossEntropy, acc: TokenAccuracy) -> None:
        out = self(batch)
        labels = _labels(batch)
        correct = ((out.logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
        ce.update(out.loss_sum, out.num_tokens, self._scored_bytes(batch).sum())
        acc.update(correct, out.num_tokens)

    def _eval_log(self, prefix: str, ce: TokenCrossEntropy, acc: TokenAccuracy) -> None:
        result = ce.compute()  # synchronised over all ranks: exact global sums
        accuracy = acc.compute()
        ce.reset()
        acc.reset()
        values = {
            f"{prefix}/loss": result["loss"],
            f"{prefix}/bpb": result["bpb"],
            f"{prefix}/ppl": result["ppl"],
            f"{prefix}/accuracy": accuracy,
            f"{prefix}/tokens": result["tokens"],
            f"{prefix}/bytes": result["bytes"],
        }
        # identical on every rank already; "max" keeps them bit-exact (a mean could round)
        self.log_dict({k: v.float() for k, v in values.items()}, sync_dist=True, reduce_fx="max")


def _labels(batch: Batch) -> Tensor:
    """The batch's labels, less those whose target begins the next packed document
    (``document_labels``; unchanged without ``document_ids``)."""
    return document_labels(batch["labels"], batch.get("document_ids"))


def _passkey_ce(logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy and count (float64 scalars) of the scored tokens of the windows
    ``batch[PASSKEY_ROWS]`` marks; zeros when the batch marks none. Logits ``(batch, seq,
    vocab)``; only the scored tokens' rows are gathered (a few per passkey window)."""
    marked = batch.get(PASSKEY_ROWS)
    if marked is None:
        zero = logits.new_zeros((), dtype=torch.float64)
        return zero, zero
    labels = _labels(batch)
    scored = marked.to(labels.device)[:, None] & (labels != IGNORE_INDEX)
    with torch.no_grad():
        ce = F.cross_entropy(logits[scored].float(), labels[scored], reduction="sum")
    return ce.double(), scored.sum().double()


def _per_sample_ce(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy (float32) and scored-token count of each sample, both
    ``(batch,)``; logits ``(batch, seq, vocab)``, labels ``(batch, seq)`` (-100 not scored)."""
    ce = F.cross_entropy(
        logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return ce.sum(-1), (labels != IGNORE_INDEX).sum(-1)


def _check_hparams(lr, weight_decay, betas, eps, warmup_steps, total_steps, min_lr_ratio,
                   bytes_per_token) -> None:
    if not lr > 0:
        raise ValueError(f"learning_rate must be positive, got {lr!r}.")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}.")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}.")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}.")
    check_non_negative_int("warmup_steps", warmup_steps)
    if total_steps is not None:
        check_positive_int("total_steps", total_steps)
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}.")
    if not bytes_per_token > 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token!r}.")
