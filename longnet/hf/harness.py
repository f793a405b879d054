"""lm-eval on LongNet models, offline: the model, its tokenizer and the local tasks.

- :func:`harness_lm`: lm-eval's ``HFLM`` over :class:`LongNetForCausalLM` (the loaded
  ``LongNetLM``, shared) and the byte tokenizer.
- :func:`write_bpb_task`: a ``loglikelihood_rolling`` task with ``bits_per_byte`` over local
  documents (a jsonl file and a YAML config in one folder, for ``TaskManager(include_path=)``).
- :func:`evaluate`: ``lm_eval.simple_evaluate`` on such tasks and lm-eval's own (RULER's
  ``niah_*``), with the NIAH lengths and the tokenizer folder as task metadata.

**The bits-per-byte task computes what** ``longnet eval perplexity --stride 1.0
--score-from 0`` **reports as** ``scored_bits_per_byte`` (``sliding_bits_per_byte``). lm-eval's
rolling windows of ``max_length`` ``C`` (``utils.get_rolling_token_windows`` with
``context_len=1``): the first window is ``[EOS] + bytes[:C-1]`` and predicts ``bytes[:C]``;
each later window predicts the next ``C`` bytes from the ``C`` tokens that end just before
the last of them, so the last, shorter chunk still gets a full window. These are the sliding
windows of ``longnet.eval.sliding`` with stride ``C`` (each document framed ``[EOS] bytes
[EOS]``). Two differences remain: lm-eval scores the bytes only, while ``bits_per_byte`` of
``longnet eval perplexity`` also scores each document's closing EOS (hence ``--score-from 0``, the
bytes alone); and where a document's length is not a multiple of ``C``, the window of its last
chunk ends one token later in ``longnet eval perplexity`` (it also scores that EOS), so those bytes
see one token less context there. Both are documented with measured sizes in
docs/evaluation.md.

**Batch size and dtype.** lm-eval batches rolling windows right-padded with token 0 and
passes no attention mask. A causal model never looks at later positions and LongNet's dilated
segments are laid out from position 0, so the padding changes nothing: the bits per byte are
the same at every batch size (tested; measured in docs/evaluation.md). Batched generation
(``generate_until``, the NIAH tasks) pads on the left with a mask, which
:class:`LongNetForCausalLM` honours exactly (``longnet.hf.padding``). What does change the
numbers is the dtype: lm-eval's default ``dtype="auto"`` would run the zoo's bfloat16-stored
weights in bfloat16; ``LongNetHFConfig`` makes ``"auto"`` float32, and :func:`harness_lm`
wraps the model that ``longnet.eval.load_model`` loads (float32 unless asked otherwise).
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
"""RULER's needle-in-a-haystack tasks run here; their haystacks are generated (a repeated
filler paragraph; distractor needles). ``niah_single_2``/``_3``, ``niah_multikey_1``,
``niah_multivalue`` and ``niah_multiquery`` read Paul Graham's essays from the Hugging Face
Hub and cannot run offline."""


def tokenizer_folder(model: LongNetLM, directory: str | Path,
                     tokenizer: SubwordTokenizer | None = None) -> Path:
    """Write the tokenizer of ``model`` into ``directory``: the byte tokenizer's files for a
    byte-level model, else ``tokenizer``'s (``LoadedModel.tokenizer``: its folder's or its
    checkpoint's). lm-eval's RULER tasks load their tokenizer by path, so even a Lightning
    checkpoint's model needs one on disk.

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
    ``tokenizer_dir``. ``max_length``: lm-eval's context in tokens (rolling windows; prompt
    plus generated tokens)."""
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
    """Write ``<task>.jsonl`` (one ``{"doc_id", "text"}`` per document) and ``<task>.yaml``
    (``loglikelihood_rolling`` with ``bits_per_byte``, ``byte_perplexity`` and
    ``word_perplexity``) into ``directory``; returns the YAML's path.

    Documents must be UTF-8 (as ``load_eval_documents`` makes them): lm-eval reads text.
    """
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
    """``lm_eval.simple_evaluate`` of ``tasks`` (local ones from ``include_path``);
    ``metadata`` goes to the tasks (RULER reads ``tokenizer`` and ``max_seq_lengths``),
    ``limit`` caps the examples per task. Returns lm-eval's ``results``: per task, metric
    name (``"bits_per_byte,none"``, ``"1024,none"``, ...) to value."""
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
    """Keep lm-eval's RULER module offline: on import it calls ``nltk.download("punkt_tab")``
    when that data is missing (for the essay haystacks; the NIAH tasks here never use it).
    ``nltk.download`` is replaced by a function that downloads nothing and returns False, as
    a failed download does (lm-eval then goes on)."""
    import nltk

    nltk.download = _no_download


def _no_download(*args: Any, **kwargs: Any) -> bool:
    return False


def sliding_bits_per_byte(
    model: LongNetLM, documents: Sequence[EvalDocument], context_length: int,
    batch_size: int = 1, tokenizer: ByteTokenizer | SubwordTokenizer | None = None,
) -> float:
    """Bits per byte of the documents' bytes (closing EOS left out) with sliding windows of
    ``context_length`` tokens of ``tokenizer`` (None: bytes) and stride ``context_length``:
    what ``longnet eval perplexity --stride 1.0 --score-from 0`` reports as
    ``scored_bits_per_byte``, and what the bits-per-byte task measures (module docstring)."""
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
    """One model through lm-eval: the bits-per-byte task over ``documents`` (skipped when
    None) with context ``context_length`` (default ``max_positions``), and ``niah_tasks`` at
    each of ``niah_lengths`` (default: the context; lm-eval's ``max_length`` is the NIAH
    length, prompt plus the 128 generated tokens), ``niah_examples`` examples per task and
    length (RULER generates 500).

    Writes the tokenizer and the task files into ``work_dir``. Returns one row per measured value:
    ``model``, ``task``, ``length`` (context or NIAH length), ``examples``, ``metric``,
    ``value``, ``seconds``; with ``compare`` also the ``longnet eval perplexity`` value of the
    same documents (task ``eval_perplexity``, :func:`sliding_bits_per_byte`).
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
