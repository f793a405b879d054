"""``CausalLMModule``: the LightningModule that trains and evaluates a LongNet causal LM
(metrics: :mod:`longnet.training.metrics`)."""

from __future__ import annotations

import time
import warnings
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision
from torch import Tensor
from torch.distributed.tensor import DTensor

from longnet.attention import DilatedPattern
from longnet.constants import IGNORE_INDEX
from longnet.distributed.sequence_parallel import parallelize
from longnet.modeling import LMOutput
from longnet.training.checkpoint import build_lm
from longnet.training.curriculum import ResumableDataOrder
from longnet.training.lora import (
    LORA_BASE_KEY,
    LoraSettings,
    apply_lora,
    base_record,
    check_delta_names,
    check_same_base,
    trainable_names,
)
from longnet.training.metrics import (
    PASSKEY_ROWS,
    Batch,
    TokenAccuracy,
    TokenCrossEntropy,
    lm_summary,
    passkey_ce,
    per_sample_ce,
    sample_mean_loss,
    scored_labels,
)
from longnet.training.parallel.batches import check_window_shards
from longnet.training.parallel.strategy import SequenceParallelLayout
from longnet.training.schedule import (
    build_optimizer,
    check_optimizer_settings,
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
from longnet.validation import UsageError, check_positive_float

RNG_KEY = "longnet_rng_state"


class TrainingDiverged(UsageError):
    """A step's loss or gradients are not finite (raised before the optimizer applies them).

    Attributes:
        step: the 1-based optimizer step that diverged.
        every_rank: every rank raises it at the same step.
    """

    every_rank = True

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class CausalLMModule(L.LightningModule):
    """Next-token training of a :class:`~longnet.modeling.LongNetLM`.

    Batches: ``input_ids`` and ``labels`` ``(batch, seq)`` (-100 ignored), optionally
    ``document_ids`` and ``label_bytes``; under sequence parallelism this rank's shard with
    global ``position_ids`` ``(shard,)``. ``"token"`` loss: ``sum(CE) * world_size / N`` (``N``:
    the global batch's scored tokens), so DDP's average is the global token mean. Logs
    ``train/{loss,bpb,tokens_per_s,passkey_loss}`` and ``{val,test}/{loss,bpb,ppl,accuracy}``.

    Args:
        model: zoo name or model folder to build a freshly initialised model from.
        pretrained: zoo name or folder with weights to start from.
        config: :class:`~longnet.modeling.LongNetConfig` fields (fresh weights); exactly
            one of ``model``, ``pretrained``, ``config``.
        overrides: config fields to replace (e.g. ``{dropout: 0.1}``).
        learning_rate: peak AdamW learning rate.
        weight_decay: decoupled weight decay of matrices and embeddings (not biases/norms).
        betas, eps: AdamW moments and epsilon.
        warmup_steps: linear warmup steps.
        total_steps: length of the cosine schedule; None: the trainer's (``max_steps``).
        min_lr_ratio: the cosine ends at ``learning_rate * min_lr_ratio``.
        gradient_checkpointing: recompute each block in backward (saves activation memory).
        bytes_per_token: bytes per scored non-EOS token for batches without ``"label_bytes"``.
        resumable_data: attach :class:`~longnet.training.ResumableDataOrder`.
        loss_reduction: ``"token"`` (mean over scored tokens) or ``"sample"`` (mean over
            samples of their token mean: answer-only tasks are not drowned by full text).
        lora: :class:`~longnet.training.lora.LoraSettings` fields to fine-tune ``pretrained``.
        kv_conv_learning_rate: peak rate of the key/value convolution taps; None:
            ``learning_rate`` (taps growing from 0 need a far higher rate).
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
        check_optimizer_settings(learning_rate, weight_decay, betas, eps, warmup_steps,
                                 total_steps, min_lr_ratio)
        if not bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token!r}.")
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

    # ``pattern``/``pad_token_id`` make this a ``SequenceParallelModule`` (how strategies cut
    # shards); ``network``/``blocks`` a ``ShardedModule`` (what FSDP fully_shards).
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
        """The trainer's sequence-parallel group; None without one (or of size 1)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, SequenceParallelLayout):
            return strategy.sequence_parallel_group
        return None

    def configure_callbacks(self) -> list[L.Callback]:
        if not self.hparams.resumable_data:
            return []
        present = self._trainer is not None and any(
            isinstance(callback, ResumableDataOrder) for callback in self._trainer.callbacks
        )
        return [] if present else [ResumableDataOrder()]

    def fit_tokenizer(self, datamodule: Any) -> None:
        """Rebuild a fresh model with ``datamodule``'s tokenizer's vocabulary and special ids
        (saved as ``overrides``).

        Raises:
            UsageError: pretrained weights of another tokenizer or vocabulary size.
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
        """Fit the model to the data's tokenizer, then refuse data the model cannot read."""
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
        """The module's tensors; with ``lora`` only the trainable delta."""
        state = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.lora is not None:
            kept = {prefix + name for name in trainable_names(self)}
            for name in [name for name in state if name.startswith(prefix)
                         and name not in kept]:
                del state[name]
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load tensors; with ``lora`` a delta over the held base (all of it under ``strict``)."""
        if self.lora is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if strict:
            check_delta_names(set(state_dict), trainable_names(self), "the checkpoint")
        full = super().state_dict()
        full.update(state_dict)
        return super().load_state_dict(full, strict=strict, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the RNG state (dropout, for bit-exact resumes), tokenizer and LoRA base."""
        checkpoint[RNG_KEY] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            checkpoint[RNG_KEY]["cuda"] = torch.cuda.get_rng_state()
        if self._tokenizer_record is not None:
            checkpoint[TOKENIZER_KEY] = self._tokenizer_record
        if self.lora_base is not None:
            checkpoint[LORA_BASE_KEY] = self.lora_base

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse another tokenizer or LoRA base; restore the RNG state. Under ``64-true`` the
        module goes float64 first (Lightning loads weights before converting: they would round)."""
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
        # one all-reduce: global CE sum, scored tokens and bytes, input tokens (a device fill:
        # a host copy would wait for the forward before the backward is queued)
        input_tokens = out.loss_sum.new_full((), batch["input_ids"].numel(),
                                             dtype=torch.float64)
        stats = torch.stack((out.loss_sum.detach().double(), out.num_tokens.double(),
                             self._scored_bytes(batch).sum().double(), input_tokens,
                             *passkey_ce(out.logits, batch)))
        if world > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats)
        if self.hparams.loss_reduction == "sample":
            loss = sample_mean_loss(out.logits, scored_labels(batch), world,
                                    self.sequence_parallel_group())
        else:
            loss = out.loss_sum * (world / stats[1].clamp(min=1)).to(out.loss_sum.dtype)
        summary = lm_summary(stats[0], stats[1], stats[2])
        self.log("train/loss", summary["loss"].float(), prog_bar=True)
        self.log("train/bpb", summary["bpb"].float())
        if PASSKEY_ROWS in batch:  # NaN without one: an omitted key would repeat its last value
            self.log("train/passkey_loss", (stats[4] / stats[5]).float())
        self._step_tokens = stats[3]
        self._step_loss = summary["loss"]  # of the global batch: the same on every rank
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise :class:`TrainingDiverged` for a non-finite loss or gradient norm (the loss only
        under a gradient scaler, which skips infinite gradients by design)."""
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
        """Log ``train/tokens_per_s`` over the step itself, not callbacks' batch-end work."""
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
        """``{"loss_sum", "num_tokens", "num_bytes", "bpb"}`` of whole sequences, ``(batch,)``."""
        out = self.model(
            batch["input_ids"], position_ids=batch.get("position_ids"),
            document_ids=batch.get("document_ids"),
        )
        ce_sums, counts = per_sample_ce(out.logits, scored_labels(batch))
        stats = torch.stack((ce_sums.double(), counts.double(),
                             self._scored_bytes(batch).double()))
        group = self.sequence_parallel_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        summary = lm_summary(stats[0], stats[1], stats[2])
        return {"loss_sum": stats[0], "num_tokens": stats[1], "num_bytes": stats[2],
                "bpb": summary["bpb"]}

    def schedule_length(self) -> int:
        """Optimizer steps of the learning-rate schedule: ``total_steps``, else ``max_steps``."""
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
        """Follow a schedule length changed since the checkpoint (``follow_configured_length``)."""
        follow_configured_length(self.trainer, self.lr_schedulers(), self.schedule_length(),
                                 self.hparams.learning_rate)

    def _scored_bytes(self, batch: Batch) -> Tensor:
        """``(batch,)`` UTF-8 bytes the scored labels of each sample cover."""
        return scored_bytes(batch, scored_labels(batch), self._eos_id, self.bytes_per_token)

    def _eval_update(self, batch: Batch, ce: TokenCrossEntropy, acc: TokenAccuracy) -> None:
        out = self(batch)
        labels = scored_labels(batch)
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

