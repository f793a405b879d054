"""LongNet models: the shared backbone and base class, the causal LM and their input checks."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longnet.attention.documents import PackedDocuments, resolve_documents
from longnet.compiled import host_read, refuse
from longnet.constants import IGNORE_INDEX
from longnet.distributed.sequence_parallel import SequenceParallel
from longnet.modeling import generation, pretrained
from longnet.modeling.config import LongNetConfig
from longnet.nn import (
    KVCache,
    LearnedPositionalEmbedding,
    MultiheadDilatedAttention,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    XPos,
    build_feed_forward,
    build_norm,
    default_position_ids,
    document_position_ids,
)
from longnet.nn.kv_cache import check_cache
from longnet.validation import check_bool


def build_block(config: LongNetConfig, causal: bool) -> TransformerBlock:
    """One transformer block as ``config`` (validated) describes it, causal or bidirectional."""
    head_dim, width, norm, eps = (config.resolved_head_dim, config.hidden_size, config.norm,
                                  config.norm_eps)
    positional: nn.Module | None = None
    if config.position_encoding == "rope":
        positional = RotaryEmbedding(head_dim, theta=config.rope_theta,
                                     extension=config.rope_extension)
    elif config.position_encoding == "xpos":
        positional = XPos(head_dim, block_size=config.pattern.segment_lengths[-1],
                          theta=config.rope_theta, scale_base=config.xpos_scale_base)
    attn = MultiheadDilatedAttention(
        width, config.num_heads, config.pattern, causal=causal, output_dropout=config.dropout,
        bias=config.attention_bias, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        positional=positional, sub_ln=config.sub_ln, norm=norm, norm_eps=eps,
        kv_conv_size=config.kv_conv_size, retrieval=config.retrieval,
        retrieval_positions=config.retrieval_positions,
    )
    ffn = build_feed_forward(
        config.ffn_kind, width, config.resolved_ffn_hidden_size, activation=config.activation,
        bias=config.mlp_bias, dropout=config.dropout, sub_ln=config.sub_ln, norm=norm,
        norm_eps=eps,
    )
    return TransformerBlock(attn, ffn, build_norm(norm, width, eps), build_norm(norm, width, eps),
                            gradient_checkpointing=config.gradient_checkpointing)


def check_input_ids(input_ids: Tensor, vocab_size: int) -> None:
    """``input_ids`` must be a non-empty ``(batch, seq)`` integer tensor of valid token ids."""
    if not isinstance(input_ids, Tensor):
        refuse(TypeError, f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}.")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        refuse(TypeError, f"input_ids must have an integer dtype, got {input_ids.dtype}.")
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        refuse(ValueError, "input_ids must be a non-empty (batch, seq) tensor, got shape "
               f"{tuple(input_ids.shape)}; add a batch dimension with input_ids[None].")
    host_read("input_ids: the token-id check reads the ids on the host, which a "
              "torch.compile(fullgraph=True) region cannot hold; compile the model's blocks "
              "(for block in model.model.layers: block.compile(fullgraph=True)) rather than "
              "the whole model, or compile it without fullgraph.")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"input_ids holds ids in {low}..{high} but vocab_size is {vocab_size}; ids must be "
            f"in 0..{vocab_size - 1}."
        )


def check_label_ids(
    labels: Tensor, num_classes: int, name: str, ignore: bool, argument: str = "labels"
) -> None:
    """Raise ``TypeError`` unless ``labels`` (any shape) is an integer tensor, ``ValueError``
    unless its ids are in ``0..num_classes - 1`` (or ``IGNORE_INDEX`` where ``ignore``)."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(labels).__name__}.")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{argument} must have an integer dtype, got {labels.dtype}.")
    valid = (labels >= 0) & (labels < num_classes)
    if ignore:
        valid |= labels == IGNORE_INDEX
    if not bool(valid.all()):
        bad = labels[~valid]
        allowed = f"0..{num_classes - 1} ({name} {num_classes})"
        raise ValueError(
            f"{argument} hold {bad.numel()} out-of-range id(s) (the first: {int(bad[0])}); ids "
            f"must be in {allowed}{f' or {IGNORE_INDEX} where no loss is taken' if ignore else ''}."
        )


def document_labels(labels: Tensor, document_ids: Tensor | None) -> Tensor:
    """``labels`` ``(batch, seq)`` with ``IGNORE_INDEX`` where a target begins a new document."""
    if document_ids is None:
        return labels
    boundary = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    boundary[:, :-1] = document_ids[:, 1:] != document_ids[:, :-1]
    return labels.masked_fill(boundary, IGNORE_INDEX)


@dataclass
class LMOutput:
    """Output of :class:`LongNetLM`: ``logits`` ``(batch, seq, vocab_size)``; ``loss``, the
    mean cross-entropy over labels that are not -100 (None without labels), from ``loss_sum``
    and ``num_tokens`` (int64), which aggregate exactly across ranks and batches."""

    logits: Tensor
    loss: Tensor | None = None
    loss_sum: Tensor | None = None
    num_tokens: Tensor | None = None


class LongNetModel(nn.Module):
    """Token (+ learned position) embeddings, ``num_layers`` blocks, final norm.

    Attributes:
        sequence_parallel: set by :func:`longnet.distributed.parallelize`; None on one device.
    """

    sequence_parallel: SequenceParallel | None

    def __init__(self, config: LongNetConfig, causal: bool) -> None:
        super().__init__()
        self.config = config
        self.causal = causal
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = (
            LearnedPositionalEmbedding(config.max_positions, config.hidden_size)
            if config.position_encoding == "learned"
            else None
        )
        self.embed_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(build_block(config, causal) for _ in range(config.num_layers))
        self.final_norm = build_norm(config.norm, config.hidden_size, config.norm_eps)
        self.sequence_parallel = None

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Hidden states ``(batch, seq, hidden_size)`` of ``input_ids`` ``(batch, seq)``
        (``seq``: this rank's shard under sequence parallelism).

        ``position_ids``: global positions ``(seq,)`` or ``(batch, seq)``; default ``0..seq-1``
        after the cache's positions (each token's place in its document with ``document_ids``).
        ``cache``: from :meth:`LongNetLM.new_cache`, for inference.
        ``document_ids``: ``(batch, seq)`` non-decreasing ids of packed documents, each computed
        as if alone; not with ``cache``.
        """
        sequence_parallel = self.sequence_parallel
        check_input_ids(input_ids, self.config.vocab_size)
        check_cache(cache, KVCache)
        documents: PackedDocuments | None = None
        if document_ids is not None:  # resolved once for all layers (one host transfer)
            if position_ids is None and sequence_parallel is not None:
                raise ValueError(
                    "LongNetModel: with document_ids under sequence parallelism, pass "
                    "position_ids: each token's position in its document over the whole "
                    "sequence (longnet.training.shard_batch computes them)."
                )
            across = sequence_parallel is not None and sequence_parallel.layout == "contiguous"
            documents = resolve_documents(  # zigzag shards: checked here, refused by the layers
                document_ids, *input_ids.shape, input_ids.device,
                sequence_parallel.process_group if across else None,
                caller="LongNetModel", of="input_ids",
            )
            if position_ids is None:
                position_ids = document_position_ids(document_ids)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(
                f"the KV cache has {len(cache)} layers, the model {len(self.layers)}; create it "
                "with model.new_cache()."
            )
        if position_ids is None:
            offset = cache.next_position if cache is not None else 0
            position_ids = default_position_ids(
                input_ids.shape[1], input_ids.device, offset=offset,
                group=None if sequence_parallel is None else sequence_parallel.process_group,
                layout="contiguous" if sequence_parallel is None else sequence_parallel.layout,
            )
        h = self.embed_tokens(input_ids.long())
        if self.embed_positions is not None:
            h = h + self.embed_positions(position_ids)
        h = self.embed_dropout(h)
        for index, layer in enumerate(self.layers):
            layer_cache = cache[index] if cache is not None else None
            h = layer(h, position_ids, layer_cache, documents)
        return self.final_norm(h)


class LongNetPreTrained(nn.Module):
    """Shared by the LM and the encoder: init, checkpointing switch, save/from_pretrained."""

    config: LongNetConfig
    model: LongNetModel

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Register the class by name in ``pretrained.ARCHITECTURES``."""
        super().__init_subclass__(**kwargs)
        pretrained.ARCHITECTURES.setdefault(cls.__name__, cls)

    def _init_weights(self) -> None:
        """Normal(0, initializer_range) weights, then MAGNETO's ``sqrt(log(2L))`` gain (sub-LN)
        or GPT-2's ``1 / sqrt(2L)`` on the residual projections."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        depth = 2 * self.config.num_layers
        with torch.no_grad():
            for block in self.model.layers:
                if self.config.sub_ln:
                    gain = math.sqrt(math.log(depth)) if depth > 1 else 1.0
                    for linear in (
                        block.attn.v_proj,
                        block.attn.out_proj,
                        block.ffn.up_proj,
                        block.ffn.down_proj,
                    ):
                        linear.weight.mul_(gain)
                else:
                    block.attn.out_proj.weight.mul_(depth**-0.5)
                    block.ffn.down_proj.weight.mul_(depth**-0.5)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Turn per-block activation recomputation on or off (also recorded in the config)."""
        self.config.gradient_checkpointing = check_bool("enabled", enabled)
        for block in self.model.layers:
            block.gradient_checkpointing = enabled

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied ones counted once)."""
        seen: dict[int, int] = {}
        for p in self.parameters():
            seen[id(p)] = p.numel()
        return sum(seen.values())

    def save_pretrained(self, directory: str | Path, *, name: str | None = None,
                        overwrite: bool = False) -> Path:
        """Write the model folder ``directory`` atomically (a held model needs ``overwrite``)."""
        return pretrained.save_pretrained(self, directory, name=name, overwrite=overwrite)

    @classmethod
    def from_pretrained(
        cls, name_or_dir: str | Path, *, dtype: torch.dtype | str | None = None,
        **overrides: Any,
    ) -> LongNetPreTrained:
        """Load a saved LongNet model or import a Hugging Face GPT-2 / Llama checkpoint.

        ``name_or_dir``: a LongNet or Hugging Face folder, or a zoo model's name
        (:func:`longnet.modeling.list_models`). ``overrides`` replace config fields, e.g.
        ``pattern=[(2048, 1), (4096, 2)]``. ``dtype``: parameter dtype (default float32), a
        ``torch.dtype`` or its name. Returns the model in eval mode.

        Raises:
            FileNotFoundError: no such folder or zoo name, or a folder without weights.
            ValueError: an unreadable config or weights file, or a non-floating ``dtype``.
            WeightsMismatchError: missing, unexpected or mis-shaped tensors (all named).
            NonFiniteWeightsError: tensors holding NaN or infinite values (all named).
        """
        return pretrained.from_pretrained(cls, name_or_dir, dtype=dtype, **overrides)


class LongNetLM(LongNetPreTrained):
    """Causal language model: ``LongNetModel`` + LM head (optionally tied to the embeddings).

    Targets are aligned with positions, as in nanoGPT: the caller shifts (``input_ids =
    tokens[:, :-1]``, ``targets = tokens[:, 1:]``); ``-100`` is ignored.
    """

    def __init__(self, config: LongNetConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.model = LongNetModel(config, causal=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._init_weights()
        # targets == input_ids is checked once: a device sync per step would cost too much
        self._targets_checked = False

    def new_cache(self) -> KVCache:
        """An empty KV cache for incremental decoding with :meth:`forward` / :meth:`generate`."""
        return KVCache(self.config.num_layers)

    def forward(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
    ) -> LMOutput:
        """Logits ``(batch, seq, vocab)`` and, with ``targets`` ``(batch, seq)``, the loss.

        ``targets``: ``targets[:, t]`` the token position ``t`` must predict (-100: no loss).
        ``position_ids``, ``cache``, ``document_ids``: as :meth:`LongNetModel.forward`; the
        loss leaves out targets that begin the next document (:func:`document_labels`).
        Under sequence parallelism ``loss`` is this rank's mean (see :class:`LMOutput`).
        """
        hidden = self.model(input_ids, position_ids=position_ids, cache=cache,
                            document_ids=document_ids)
        logits = self.lm_head(hidden)
        if targets is None:
            return LMOutput(logits=logits)
        check_label_ids(targets, self.config.vocab_size, "vocab_size", ignore=True,
                        argument="targets")
        if targets.shape != input_ids.shape:
            raise ValueError(
                f"targets has shape {tuple(targets.shape)}, expected {tuple(input_ids.shape)} "
                "(aligned with input_ids: targets[:, t] is the target of position t)."
            )
        if not self._targets_checked and torch.equal(targets, input_ids):
            warnings.warn(
                "LongNetLM: targets equal input_ids, so the model learns to copy its input. "
                "targets[:, t] is the token position t must predict: pass input_ids = "
                "tokens[:, :-1], targets = tokens[:, 1:] (or use "
                "longnet.hf.LongNetForCausalLM, whose labels are shifted inside).",
                UserWarning,
                stacklevel=4,
            )
        self._targets_checked = True
        targets = document_labels(targets, document_ids)
        compute = torch.promote_types(logits.dtype, torch.float32)
        loss_sum = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).to(compute),
            targets.reshape(-1).long(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        num_tokens = (targets != IGNORE_INDEX).sum()
        loss = loss_sum / num_tokens.clamp(min=1)
        return LMOutput(logits=logits, loss=loss, loss_sum=loss_sum, num_tokens=num_tokens)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Continue ``input_ids`` ``(batch, seq)`` by up to ``max_new_tokens`` tokens.

        ``temperature == 0`` is greedy, else sampling from the ``top_k`` most likely tokens.
        Stops when every row has produced ``eos_token_id`` (default ``config.eos_token_id``),
        padding finished rows with it. Prompts must not be padded. Returns ``(batch, seq + new)``.
        """
        if eos_token_id is None:
            eos_token_id = self.config.eos_token_id
        generation.check_generate(self, input_ids, max_new_tokens, temperature, top_k,
                                  eos_token_id, generator, use_cache)
        was_training = self.training
        self.eval()
        try:
            tokens = input_ids
            if max_new_tokens == 0:
                return tokens
            cache = self.new_cache() if use_cache else None
            logits = self._last_logits(tokens, cache)
            finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            for step in range(max_new_tokens):
                next_ids = generation.sample_next(logits, temperature, top_k, generator)
                if eos_token_id is not None:
                    next_ids = next_ids.masked_fill(finished, eos_token_id)
                    finished = finished | (next_ids == eos_token_id)
                tokens = torch.cat((tokens, next_ids[:, None].to(tokens.dtype)), dim=1)
                if step == max_new_tokens - 1 or bool(finished.all()):
                    break
                logits = (self._last_logits(tokens[:, -1:], cache) if use_cache
                          else self._last_logits(tokens, None))
            return tokens
        finally:
            self.train(was_training)

    def _last_logits(self, tokens: Tensor, cache: KVCache | None) -> Tensor:
        """``(batch, vocab)`` logits of the last position only (a whole prompt's would be GBs)."""
        return self.lm_head(self.model(tokens, cache=cache)[:, -1])
