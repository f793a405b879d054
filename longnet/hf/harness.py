"""lm-eval on LongNet models, offline: :func:`harness_lm` (``HFLM`` over the loaded model),
:func:`write_bpb_task` (a local bits-per-byte task) and :func:`evaluate` (those and RULER's
``niah_*`` tasks).

The bits-per-byte task's rolling windows are the sliding windows of ``longnet eval perplexity
--stride 1.0 --score-from 0`` (``sliding_bits_per_byte``); the small remaining difference at
each document's last chunk, and why batch size does not change the result, are in
docs/evaluation.md ("lm-eval").
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer

from longnet.data.subword import SubwordTokenizer
from longnet.data.tokenizer import ByteTokenizer
from longnet.eval import (
    EvalDocument,
    LoadedModel,
    bits_from_position,
    score_documents,
    tokenize_documents,
)
from longnet.hf.modeling import LongNetForCausalLM
from longnet.modeling import LongNetLM, write_tokenizer_files

BPB_TASK = "longnet_bpb"
NIAH_TASKS = ("niah_single_1", "niah_multikey_2")
"""RULER's needle-in-a-haystack tasks with generated haystacks; the others read essays from
the Hugging Face Hub and cannot run offline."""


def tokenizer_folder(model: LongNetLM, directory: str | Path,
                     tokenizer: SubwordTokenizer | None = None) -> Path:
    """Write the tokenizer of ``model`` into ``directory`` (RULER loads it by path): the byte
    tokenizer's files for a byte-level model, else ``tokenizer``'s.

    Raises:
        ValueError: a model that is not byte-level and no subword ``tokenizer``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if write_tokenizer_files(directory, model.config):
        return directory
    if not isinstance(tokenizer, SubwordTokenizer):
        raise ValueError(
            f"lm-eval needs a tokenizer: the byte tokenizer serves vocab_size 256, this model "
            f"has {model.config.vocab_size} and no tokenizer was given."
        )
    tokenizer.save(directory)
    return directory


def harness_lm(
    model: LongNetLM, tokenizer_dir: str | Path, *, max_length: int, batch_size: int = 1
) -> HFLM:
    """lm-eval's ``HFLM`` over ``model`` (wrapped, not copied) and the tokenizer in
    ``tokenizer_dir``; ``max_length``: lm-eval's context in tokens."""
    return HFLM(
        pretrained=LongNetForCausalLM.from_longnet(model.eval()),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        backend="causal",
        max_length=max_length,
        batch_size=batch_size,
    )


def write_bpb_task(
    directory: str | Path, documents: Sequence[EvalDocument], task: str = BPB_TASK
) -> Path:
    """Write ``<task>.jsonl`` (the UTF-8 documents) and ``<task>.yaml`` (a
    ``loglikelihood_rolling`` task with ``bits_per_byte``, ``byte_perplexity`` and
    ``word_perplexity``) into ``directory``; returns the YAML's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{task}.jsonl"
    with data.open("w", encoding="utf-8") as out:
        for doc in documents:
            text = doc.utf8.tobytes().decode("utf-8")
            out.write(json.dumps({"doc_id": doc.doc_id, "text": text}) + "\n")
    metrics = "".join(
        f"  - metric: {name}\n    aggregation: {aggregation}\n    higher_is_better: false\n"
        for name, aggregation in (("bits_per_byte", "bits_per_byte"),
                                  ("byte_perplexity", "weighted_perplexity"),
                                  ("word_perplexity", "weighted_perplexity"))
    )
    config = directory / f"{task}.yaml"
    config.write_text("\n".join([
        f"task: {task}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data.resolve()))}",
        "test_split: test",
        "output_type: loglikelihood_rolling",
        'doc_to_text: ""',
        "doc_to_target: text",
        "metric_list:",
        metrics.rstrip("\n"),
        "metadata:",
        "  version: 1.0",
    ]) + "\n")
    return config


def evaluate(
    lm: HFLM,
    tasks: Sequence[str],
    *,
    include_path: str | Path | None = None,
    metadata: dict[str, Any] | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """``lm_eval.simple_evaluate`` of ``tasks`` (local ones from ``include_path``), with
    ``metadata`` for the tasks and at most ``limit`` examples each. Returns lm-eval's
    ``results``: per task, metric name (``"bits_per_byte,none"``, ...) to value."""
    forbid_nltk_downloads()
    manager = TaskManager(
        include_path=None if include_path is None else str(include_path), metadata=metadata
    )
    output = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=False,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return output["results"]


def forbid_nltk_downloads() -> None:
    """Keep lm-eval's RULER module offline: ``nltk.download`` (which it calls on import)
    downloads nothing and returns False, as a failed download does."""
    import nltk

    nltk.download = _no_download


def _no_download(*args: Any, **kwargs: Any) -> bool:
    return False


def sliding_bits_per_byte(
    model: LongNetLM, documents: Sequence[EvalDocument], context_length: int,
    batch_size: int = 1, tokenizer: ByteTokenizer | SubwordTokenizer | None = None,
) -> float:
    """Bits per byte of the documents' bytes (closing EOS left out), sliding windows of
    ``context_length`` tokens of ``tokenizer`` (None: bytes) at stride ``context_length``:
    ``longnet eval perplexity``'s ``scored_bits_per_byte`` (module docstring)."""
    tokenized = tokenize_documents(documents, tokenizer or ByteTokenizer())
    result = score_documents(model, tokenized, context_length, 1.0, batch_size=batch_size,
                             return_token_nll=True)
    return bits_from_position(result.token_nll, 0, result.token_bytes).bits_per_byte


def evaluate_model(
    loaded: LoadedModel,
    work_dir: str | Path,
    *,
    documents: Sequence[EvalDocument] | None,
    niah_tasks: Sequence[str] = (),
    context_length: int | None = None,
    niah_lengths: Sequence[int] = (),
    niah_examples: int | None = None,
    batch_size: int = 1,
    compare: bool = False,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One model through lm-eval: the bits-per-byte task over ``documents`` (None: skipped)
    at context ``context_length`` (default ``max_positions``), and ``niah_tasks`` at each of
    ``niah_lengths`` (default: the context), ``niah_examples`` per task and length.

    Writes the tokenizer and task files into ``work_dir``. Returns one row per value:
    ``model``, ``task``, ``length``, ``examples``, ``metric``, ``value``, ``seconds``; with
    ``compare`` also task ``eval_perplexity`` (:func:`sliding_bits_per_byte`).
    """
    work_dir = Path(work_dir)
    model = loaded.model
    context = context_length or model.config.max_positions
    tokenizer_dir = tokenizer_folder(model, work_dir / "tokenizer", loaded.tokenizer)
    rows: list[dict[str, Any]] = []

    def row(task: str, length: int, examples: int, metric: str, value: float,
            started: float) -> None:
        rows.append({"model": loaded.label, "task": task, "length": length,
                     "examples": examples, "metric": metric, "value": value,
                     "seconds": round(time.perf_counter() - started, 1)})

    if documents is not None:
        task_dir = write_bpb_task(work_dir / "tasks", documents).parent
        started = time.perf_counter()
        lm = harness_lm(model, tokenizer_dir, max_length=context, batch_size=batch_size)
        result = evaluate(lm, [BPB_TASK], include_path=task_dir, seed=seed)[BPB_TASK]
        for metric in ("bits_per_byte", "byte_perplexity"):
            row(BPB_TASK, context, len(documents), metric, result[f"{metric},none"], started)
        if compare:
            started = time.perf_counter()
            value = sliding_bits_per_byte(model, documents, context, batch_size,
                                          loaded.tokenizer)
            row("eval_perplexity", context, len(documents), "scored_bits_per_byte", value,
                started)
    for task in niah_tasks:
        for length in niah_lengths or [context]:  # one run per length: `limit` counts the
            started = time.perf_counter()         # examples of all lengths together
            lm = harness_lm(model, tokenizer_dir, max_length=length, batch_size=batch_size)
            metadata = {"tokenizer": str(tokenizer_dir), "max_seq_lengths": [length]}
            result = evaluate(lm, [task], limit=niah_examples, metadata=metadata, seed=seed)
            row(task, length, result[task]["sample_len"], "string_match_all",
                result[task][f"{length},none"], started)
    return rows
