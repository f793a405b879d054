"""LongNet models: the shared backbone, the causal LM and the bidirectional encoder."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longnet.attention.documents import check_document_ids
from longnet.constants import IGNORE_INDEX
from longnet.modeling import generation, pretrained
from longnet.modeling.config import LongNetConfig
from longnet.modeling.outputs import EncoderOutput, LMOutput
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
from longnet.validation import check_bool


def build_block(config: LongNetConfig, causal: bool) -> TransformerBlock:
    """One transformer block as ``config`` describes it."""
    head_dim = config.resolved_head_dim
    pattern = config.pattern
    positional: nn.Module | None = None
    if config.position_encoding == "rope":
        positional = RotaryEmbedding(head_dim, theta=config.rope_theta)
    elif config.position_encoding == "xpos":
        positional = XPos(
            head_dim,
            block_size=pattern.segment_lengths[-1],
            theta=config.rope_theta,
            scale_base=config.xpos_scale_base,
        )
    attn = MultiheadDilatedAttention(
        config.hidden_size,
        config.num_heads,
        pattern,
        causal=causal,
        dropout=config.dropout,
        bias=config.attention_bias,
        num_kv_heads=config.resolved_num_kv_heads,
        head_dim=head_dim,
        positional=positional,
        sub_ln=config.sub_ln,
        norm=config.norm,
        norm_eps=config.norm_eps,
        kv_conv_size=config.kv_conv_size,
    )
    ffn = build_feed_forward(
        config.ffn_kind,
        config.hidden_size,
        config.resolved_ffn_hidden_size,
        activation=config.activation,
        bias=config.mlp_bias,
        dropout=config.dropout,
        sub_ln=config.sub_ln,
        norm=config.norm,
        norm_eps=config.norm_eps,
    )
    return TransformerBlock(
        attn,
        ffn,
        build_norm(config.norm, config.hidden_size, config.norm_eps),
        build_norm(config.norm, config.hidden_size, config.norm_eps),
        gradient_checkpointing=config.gradient_checkpointing,
    )


def check_input_ids(input_ids: Tensor, vocab_size: int) -> None:
    """``input_ids`` must be a non-empty ``(batch, seq)`` integer tensor of valid token ids."""
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}.")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"input_ids must have an integer dtype, got {input_ids.dtype}.")
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(
            f"input_ids must be a non-empty (batch, seq) tensor, got shape "
            f"{tuple(input_ids.shape)}; add a batch dimension with input_ids[None]."
        )
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"input_ids holds ids in {low}..{high} but vocab_size is {vocab_size}; ids must be "
            f"in 0..{vocab_size - 1}."
        )


def check_label_ids(labels: Tensor, num_classes: int, name: str, ignore: bool) -> None:
    """``labels`` (any shape) must hold integer ids in ``0..num_classes - 1`` (``name``: what
    ``num_classes`` is, for the message), and ``IGNORE_INDEX`` (-100) where ``ignore``.

    Raises:
        TypeError: ``labels`` is not an integer tensor.
        ValueError: an id is out of range (the message gives the first and the range).
    """
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}.")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must have an integer dtype, got {labels.dtype}.")
    valid = (labels >= 0) & (labels < num_classes)
    if ignore:
        valid |= labels == IGNORE_INDEX
    if not bool(valid.all()):
        bad = labels[~valid]
        allowed = f"0..{num_classes - 1} ({name} {num_classes})"
        raise ValueError(
            f"labels hold {bad.numel()} out-of-range id(s) (the first: {int(bad[0])}); ids must "
            f"be in {allowed}{f' or {IGNORE_INDEX} where no loss is taken' if ignore else ''}."
        )


def document_labels(labels: Tensor, document_ids: Tensor | None) -> Tensor:
    """``labels`` ``(batch, seq)`` (aligned: ``labels[:, t]`` is the target of position ``t``)
    with ``IGNORE_INDEX`` where the target is the first token of the next packed document
    (``document_ids[:, t + 1] != document_ids[:, t]``): no document is scored as predicted
    from the one before it. Unchanged when ``document_ids`` is None."""
    if document_ids is None:
        return labels
    boundary = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    boundary[:, :-1] = document_ids[:, 1:] != document_ids[:, :-1]
    return labels.masked_fill(boundary, IGNORE_INDEX)


class LongNetModel(nn.Module):
    """Token (+ learned position) embeddings, ``num_layers`` blocks, final norm.

    ``document_ids`` ``(batch, seq)``: non-decreasing ids of packed documents; each document
    is computed as if it were alone (positions restart at 0, no attention or K/V convolution
    across a boundary). Not with ``cache``; with a ``group``: this rank's shard of the ids
    (contiguous layout) and ``position_ids`` given (each token's place in its document).

    Shapes: ``input_ids`` ``(batch, seq)`` -> hidden states ``(batch, seq, hidden_size)``.
    """

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

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        group: torch.distributed.ProcessGroup | None = None,
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
        layout: str = "contiguous",
    ) -> Tensor:
        check_input_ids(input_ids, self.config.vocab_size)
        if document_ids is not None:
            check_document_ids(document_ids, *input_ids.shape, input_ids.device,
                               caller="LongNetModel", of="input_ids")
            if position_ids is None and group is not None:
                raise ValueError(
                    "LongNetModel: with document_ids and a sequence-parallel group, pass "
                    "position_ids: each token's position in its document over the whole "
                    "sequence (longnet.training.shard_batch computes them)."
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
                input_ids.shape[1], input_ids.device, offset=offset, group=group, layout=layout
            )
        h = self.embed_tokens(input_ids.long())
        if self.embed_positions is not None:
            h = h + self.embed_positions(position_ids)
        h = self.embed_dropout(h)
        for index, layer in enumerate(self.layers):
            layer_cache = cache[index] if cache is not None else None
            h = layer(h, position_ids, group, layer_cache, document_ids, layout)
        return self.final_norm(h)


class LongNetPreTrained(nn.Module):
    """Shared by the LM and the encoder: init, checkpointing switch, save/from_pretrained."""

    config: LongNetConfig
    model: LongNetModel

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Register the class by name for :func:`longnet.modeling.count_parameters` and model
        cards (``longnet.modeling.pretrained.ARCHITECTURES``)."""
        super().__init_subclass__(**kwargs)
        pretrained.ARCHITECTURES.setdefault(cls.__name__, cls)

    def _init_weights(self) -> None:
        """Normal(0, initializer_range) weights, zero biases, unit norms; depth-scaled residual
        projections: MAGNETO's ``sqrt(log(2 * num_layers))`` gain on v/out/FFN weights with
        sub-LN, GPT-2's ``1 / sqrt(2 * num_layers)`` on the output projections otherwise."""
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

    # ------------------------------------------------------------------ pretrained I/O
    def save_pretrained(self, directory: str | Path, *, name: str | None = None) -> Path:
        """Write ``config.json``, ``model.safetensors`` and a ``README.md`` card (and, for a
        byte-level model, the tokenizer files) into ``directory``, atomically: a concurrent
        :meth:`from_pretrained` sees the old model or the new one, and a failed or killed save
        leaves the old folder (:func:`longnet.modeling.pretrained.save_pretrained`)."""
        return pretrained.save_pretrained(self, directory, name=name)

    @classmethod
    def from_pretrained(
        cls, name_or_dir: str | Path, *, dtype: torch.dtype | str | None = None,
        **overrides: Any,
    ) -> LongNetPreTrained:
        """Load a saved LongNet model or import a Hugging Face GPT-2 / Llama checkpoint.

        ``name_or_dir``: a folder (LongNet ``config.json`` + ``model.safetensors``, or a local
        Hugging Face checkpoint) or the name of a zoo model (a folder of ``models/``, see
        :func:`longnet.modeling.list_models`).  ``overrides`` replace config fields, e.g.
        ``pattern=[(2048, 1), (4096, 2)]`` (the dilated pattern used from then on),
        ``gradient_checkpointing=True`` or ``dropout=0.1``.  ``dtype``: parameter dtype of
        the returned model (default float32), a ``torch.dtype`` or its name (``"bfloat16"``);
        weights are cast from the file's dtype.
        Returns the model in eval mode.

        Raises:
            FileNotFoundError: no such folder or zoo name, or a folder without weights.
            ValueError: an unreadable ``config.json`` or ``model.safetensors`` (named), or a
                ``dtype`` that is not a floating dtype.
            WeightsMismatchError: missing, unexpected or mis-shaped tensors (all named).
            NonFiniteWeightsError: tensors holding NaN or infinite values (all named).
        """
        return pretrained.from_pretrained(cls, name_or_dir, dtype=dtype, **overrides)


class LongNetLM(LongNetPreTrained):
    """Causal language model: ``LongNetModel`` + LM head (optionally tied to the embeddings).

    Labels are ALIGNED with positions: ``labels[:, t]`` is the target of position ``t`` (the
    data pipeline shifts, e.g. ``labels[:, t] = tokens[t + 1]``); ``-100`` is ignored.
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

    def new_cache(self) -> KVCache:
        """An empty KV cache for incremental decoding with :meth:`forward` / :meth:`generate`."""
        return KVCache(self.config.num_layers)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        group: torch.distributed.ProcessGroup | None = None,
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
        layout: str = "contiguous",
    ) -> LMOutput:
        """Logits ``(batch, seq, vocab)`` and, with ``labels`` ``(batch, seq)``, the loss.

        ``position_ids``: global positions ``(seq,)`` or ``(batch, seq)``; default ``0..seq-1``
        (after the cache's positions with ``cache``; with ``group``, this rank's shard).
        ``group``: sequence-parallel process group; ``input_ids`` and ``labels`` are then this
        rank's shard and ``loss`` is the mean over this rank's tokens (aggregate ``loss_sum`` /
        ``num_tokens`` across the group for the global mean). ``layout``: how the sequence is
        sharded over ``group`` (``"contiguous"`` or ``"zigzag"``,
        ``longnet.distributed.shards``).
        ``cache``: from :meth:`new_cache`, for inference.
        ``document_ids``: ``(batch, seq)`` ids of packed documents (``LongNetModel``); positions
        then default to each token's place in its document, and the loss leaves out the
        labels whose target begins the next document (``document_labels``).
        """
        hidden = self.model(input_ids, position_ids=position_ids, group=group, cache=cache,
                            document_ids=document_ids, layout=layout)
        logits = self.lm_head(hidden)
        if labels is None:
            return LMOutput(logits=logits)
        check_label_ids(labels, self.config.vocab_size, "vocab_size", ignore=True)
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels has shape {tuple(labels.shape)}, expected {tuple(input_ids.shape)} "
                "(aligned with input_ids: labels[:, t] is the target of position t)."
            )
        labels = document_labels(labels, document_ids)
        compute = torch.promote_types(logits.dtype, torch.float32)
        loss_sum = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).to(compute),
            labels.reshape(-1).long(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        num_tokens = (labels != IGNORE_INDEX).sum()
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

        ``temperature == 0`` is greedy; otherwise sample from ``softmax(logits / temperature)``
        restricted to the ``top_k`` most likely tokens (all when ``None``).  Stops early when
        every row has produced ``eos_token_id`` (default ``config.eos_token_id``); finished
        rows are padded with it.  The KV cache follows the dilated pattern (see
        :class:`longnet.nn.LayerKVCache`); ``use_cache=False`` recomputes the whole sequence
        at every step.  Rows must not be padded (all prompts the same length).  Runs in eval
        mode (dropout off) and restores the previous mode.  Returns ``(batch, seq + new)``.
        """
        return generation.generate(
            self,
            input_ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            eos_token_id=eos_token_id if eos_token_id is not None else self.config.eos_token_id,
            generator=generator,
            use_cache=use_cache,
        )


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group; the gradient is the summed gradient (every rank's loss
    depends on the sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: torch.distributed.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class LongNetEncoder(LongNetPreTrained):
    """Bidirectional encoder with a pooled classification head.

    ``pooling`` (config): ``"mean"`` over all positions, or the ``"first"`` / ``"last"`` token.
    There is no padding mask (the attention core has none): every token of every row is
    attended to and pooled, so batch sequences of equal length without padding.
    """

    def __init__(self, config: LongNetConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.model = LongNetModel(config, causal=False)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._init_weights()

    def pool(self, hidden: Tensor, group: torch.distributed.ProcessGroup | None = None) -> Tensor:
        """``(batch, seq, hidden)`` -> ``(batch, hidden)``; across the group's shards with
        ``group`` (equal contiguous shards in rank order)."""
        pooling = self.config.pooling
        if group is None or torch.distributed.get_world_size(group) == 1:
            if pooling == "mean":
                return hidden.mean(dim=1)
            return hidden[:, 0] if pooling == "first" else hidden[:, -1]
        rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        if pooling == "mean":
            local = hidden.sum(dim=1) / (hidden.shape[1] * world)
        else:
            # Multiply by 0 on the other ranks instead of using zeros: every rank's autograd
            # graph must still reach its blocks, whose backward communicates with the others.
            owner = 0 if pooling == "first" else world - 1
            local = hidden[:, 0 if pooling == "first" else -1] * float(rank == owner)
        return _AllReduceSum.apply(local, group)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        group: torch.distributed.ProcessGroup | None = None,
    ) -> EncoderOutput:
        """Class logits ``(batch, num_labels)``; with ``labels`` ``(batch,)`` the mean loss."""
        hidden = self.model(input_ids, position_ids=position_ids, group=group)
        pooled = self.pool(hidden, group)
        logits = self.classifier(pooled)
        loss = None
        if labels is not None:
            check_label_ids(labels, self.config.num_labels, "num_labels", ignore=False)
            if labels.shape != (input_ids.shape[0],):
                raise ValueError(
                    f"labels must have shape ({input_ids.shape[0]},) (one class per row), got "
                    f"{tuple(labels.shape)}."
                )
            compute = torch.promote_types(logits.dtype, torch.float32)
            loss = F.cross_entropy(logits.to(compute), labels.long())
        return EncoderOutput(logits=logits, pooled=pooled, hidden_states=hidden, loss=loss)
