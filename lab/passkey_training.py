"""Which passkey copies a run learns while it trains: its labelled passkey loss by whether
the model's heads see the copy.

A :class:`~longnet.training.LengthCurriculum` draws its passkey examples from its seed and the
optimizer step alone (:meth:`~longnet.training.LengthCurriculum.passkey_draws`), so a run's
resolved ``config.yaml`` and its ``metrics.csv`` say, for every logged step that trained on
one passkey example, which example it was, where in the window its answer copies the key
from (:func:`longnet.eval.copy_positions`, in the run's tokens) and its labelled loss
(``train/passkey_loss``, which ``CausalLMModule`` logs: the answer and, with
``passkey_label_mode: recall``, the needle's second copy of the key, a short-range copy).
The query that predicts the answer's first digit is given the key's first digit by a head
only where the model's dilated pattern puts both in one segment of a branch at the head's
offset (``DilatedPattern.key_multiplicity``; docs/architecture.md): by a rate-1 branch
(``dense``), by heads of sparse branches only (``sparse``) or by no head (``unseen``: the
key can only be found through another row that carries it). Split so, the loss shows which
copies a dilated model is learning long before a passkey evaluation would.

Steps with several passkey examples over all data-parallel ranks are left out (their loss
mixes them), and so are, in a log written before ``train/passkey_loss`` existed, steps of
several windows or devices (``train/loss`` is then the example's only on a step of one
window). ``log_every_n_steps: 1`` shows every step.
"""

from __future__ import annotations

import inspect
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from longnet.attention import DilatedPattern
from longnet.data.datamodules import LongDocumentDataModule
from longnet.data.subword import SubwordTokenizer, load_tokenizer_folder
from longnet.data.tokenizer import parse_tokenizer
from longnet.eval.passkey import VISIBILITIES, copy_positions, visibility
from longnet.files import write_atomic
from longnet.training.checkpoint import checkpoint_config
from longnet.training.curriculum import LengthCurriculum
from longnet.training.reports import read_curves
from longnet.validation import UsageError, check_positive_int

PASSKEY_LOSS_KEY = "train/passkey_loss"
LOSS_KEY = "train/loss"
DATA_BATCH_SIZE = inspect.signature(LongDocumentDataModule).parameters["batch_size"].default
"""The data's ``batch_size`` when a config does not set it."""
LOSS_FLOOR = 1e-4
"""Losses are drawn at least this high on the plot's logarithmic axis."""


@dataclass(frozen=True)
class PasskeyStep:
    """A logged optimizer step that trained on one passkey example of ``seq_len`` tokens,
    whose answer's first digit is predicted at window position ``query_position`` from the
    key ``copy_distance`` tokens before it; ``visibility``: :func:`visibility` of that copy;
    ``loss``: the example's labelled loss."""

    step: int
    seq_len: int
    query_position: int
    copy_distance: int
    visibility: str
    loss: float


@dataclass(frozen=True)
class RunPasskeySteps:
    """A run's :class:`PasskeyStep` s, its logged steps in all, and its model's pattern."""

    steps: list[PasskeyStep]
    logged_steps: int
    pattern: DilatedPattern


def passkey_steps(
    losses: Sequence[tuple[int, float]],
    curriculum: LengthCurriculum,
    *,
    data_seq_len: int,
    batch_size: int,
    pattern: DilatedPattern,
    num_heads: int,
    tokenizer: SubwordTokenizer | None = None,
    passkey_loss: bool = True,
    world_size: int = 1,
) -> list[PasskeyStep]:
    """Of the logged ``(step, loss)`` pairs of a run with ``curriculum``, those whose step
    trained on one passkey example (over all ``world_size`` ranks), with that example's copy
    and its :func:`visibility` to a model of ``pattern`` and ``num_heads`` query heads.

    ``data_seq_len``, ``batch_size``: the datamodule's (each step trains ``batch_size *
    data_seq_len / L`` windows of its stage's length ``L`` on each rank); ``tokenizer``: the
    data's (None: bytes); ``passkey_loss``: the losses are ``train/passkey_loss`` (the passkey
    windows' own); False: ``train/loss``, the example's own only on a step of one window.
    """
    check_positive_int("data_seq_len", data_seq_len)
    check_positive_int("batch_size", batch_size)
    check_positive_int("world_size", world_size)
    examples = {}
    found = []
    for step, loss in losses:
        seq_len = curriculum.stage_at(step).seq_len
        windows = batch_size * data_seq_len // seq_len
        if windows * world_size > 1 and not passkey_loss:
            continue  # train/loss mixes the windows
        draws = [draw for rank in range(world_size)
                 for draw in curriculum.passkey_draws(step, windows, rank, world_size)]
        if len(draws) != 1:
            continue  # no passkey example, or several mixed in one loss
        if seq_len not in examples:
            examples[seq_len] = curriculum.passkey_examples(seq_len, tokenizer)
        ((_, index),) = draws
        key, query = copy_positions(examples[seq_len].example(index), tokenizer)
        found.append(PasskeyStep(step, seq_len, query, query - key,
                                 visibility(pattern, num_heads, query, key), loss))
    return found


def loss_by_visibility(steps: Sequence[PasskeyStep], span: int) -> list[dict[str, Any]]:
    """The labelled loss per ``span`` optimizer steps and :func:`visibility`.

    Returns:
        rows ``{"from_step", "to_step", "visibility", "steps", "mean_loss",
        "median_loss"}``, spans ascending, visibilities in ``VISIBILITIES``' order; a span
        and visibility without a step has no row.
    """
    check_positive_int("span", span)
    groups: dict[tuple[int, str], list[float]] = {}
    for item in steps:
        groups.setdefault((item.step // span, item.visibility), []).append(item.loss)
    return [
        {"from_step": start * span, "to_step": (start + 1) * span - 1, "visibility": kind,
         "steps": len(values), "mean_loss": sum(values) / len(values),
         "median_loss": median(values)}
        for (start, kind), values in sorted(
            groups.items(), key=lambda item: (item[0][0], VISIBILITIES.index(item[0][1])))
    ]


def plot_loss_by_visibility(
    steps: Sequence[PasskeyStep], path: str | Path, *, title: str = "Passkey loss by copy"
) -> Path:
    """Each step's labelled loss against the optimizer step (logarithmic, at least
    ``LOSS_FLOOR``), one colour per :func:`visibility`, with each one's running median of its
    last 9 steps. The PNG replaces ``path`` whole. Returns ``path``."""
    fig = Figure(figsize=(7.5, 4.4), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for kind, colour in zip(VISIBILITIES, ("tab:gray", "tab:green", "tab:red")):
        points = [(item.step, max(item.loss, LOSS_FLOOR)) for item in steps
                  if item.visibility == kind]
        if not points:
            continue
        xs, ys = zip(*points)
        ax.scatter(xs, ys, s=10, alpha=0.45, color=colour, label=f"{kind} ({len(xs)} steps)")
        running = [median(ys[max(0, i - 8):i + 1]) for i in range(len(ys))]
        ax.plot(xs, running, color=colour, linewidth=1.6)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("labelled loss (nats per token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize="small", title="key given to the answer's query by")
    image = io.BytesIO()
    fig.savefig(image, format="png")
    return write_atomic(path, image.getvalue())


def read_passkey_steps(
    config: str | Path, metrics_csv: str | Path, tokenizer_folder: str | Path | None = None
) -> RunPasskeySteps:
    """The :class:`PasskeyStep` s of a run, with its model's pattern.

    Args:
        config: the run's ``longnet fit`` config: a run folder's ``config.yaml`` (resolved)
            or the file it was started with (e.g. ``lab/configs/gpu/smollm2_135m_32k.yaml``);
            the model is its ``model.init_args`` (as a checkpoint's hyper-parameters).
        metrics_csv: the run's ``metrics.csv`` (a chunked run's, every chunk's rows).
        tokenizer_folder: the run folder's ``tokenizer/``; None reads the data's
            ``tokenizer`` option (bytes, a file, a folder or a zoo name; a ``bpe:<size>``
            the run trained needs the folder).

    Raises:
        UsageError: a missing file, a run that trains no passkey examples through a
            ``LengthCurriculum``, a device count that is not a number (``auto``), a
            ``bpe:<size>`` tokenizer without its folder, a log of several devices without
            ``train/passkey_loss``.
    """
    config, metrics_csv = Path(config), Path(metrics_csv)
    missing = [str(path) for path in (config, metrics_csv) if not path.is_file()]
    if missing:
        raise UsageError(f"no file {' and '.join(missing)}: give a `longnet fit` run folder "
                         "(runs/<name>) or its config and metrics.csv.")
    settings = yaml.safe_load(config.read_text()) or {}
    world_size = _world_size(settings.get("trainer") or {}, config)
    curriculum = _run_curriculum(settings, config)
    data = (settings.get("data") or {}).get("init_args") or {}
    if "seq_len" not in data:
        raise UsageError(f"{config} sets no data.init_args.seq_len: give the run's config.")
    model = checkpoint_config({"hyper_parameters": (settings.get("model") or {}).get(
        "init_args") or {}}, source=str(config))
    curves = read_curves(metrics_csv, [PASSKEY_LOSS_KEY, LOSS_KEY])
    passkey_losses = [(step, loss) for step, loss in curves[PASSKEY_LOSS_KEY]
                      if not math.isnan(loss)]  # NaN: a step without passkey windows
    if world_size > 1 and not passkey_losses:
        raise UsageError(
            f"{metrics_csv} has no train/passkey_loss, and on {world_size} devices train/loss "
            "mixes the ranks' windows: only a log with train/passkey_loss (written by "
            "CausalLMModule since it logs it) can be split.")
    steps = passkey_steps(passkey_losses or curves[LOSS_KEY], curriculum,
                          data_seq_len=data["seq_len"],
                          batch_size=data.get("batch_size", DATA_BATCH_SIZE),
                          tokenizer=_run_tokenizer(data.get("tokenizer"), tokenizer_folder),
                          pattern=model.pattern, num_heads=model.num_heads,
                          passkey_loss=bool(passkey_losses), world_size=world_size)
    return RunPasskeySteps(steps=steps, logged_steps=len(curves[LOSS_KEY]),
                           pattern=model.pattern)


def _world_size(trainer: dict[str, Any], source: Path) -> int:
    """The ranks of a config's ``trainer`` (``devices`` x ``num_nodes``), refused when not
    numbers (``auto``, a device list)."""
    counts = [trainer.get(key) for key in ("devices", "num_nodes")]
    if not all(count is None or str(count).isdigit() and int(count) > 0 for count in counts):
        raise UsageError(
            f"{source} trains on devices={counts[0]!r}, num_nodes={counts[1]!r}: the split "
            "needs the run's device count as numbers; give a config that states them.")
    return math.prod(int(count or 1) for count in counts)


def _run_tokenizer(
    option: str | None, folder: str | Path | None
) -> SubwordTokenizer | None:
    """The run's subword tokenizer (None: bytes): ``folder``'s, else the data's option's."""
    if folder is not None:
        return load_tokenizer_folder(folder)
    choice = parse_tokenizer(option)
    if choice.kind == "bpe":
        raise UsageError(f"the run's tokenizer {option!r} is a BPE it trained: give the run "
                         "folder, whose tokenizer/ holds it.")
    return choice.loaded if isinstance(choice.loaded, SubwordTokenizer) else None


def _run_curriculum(config: dict[str, Any], source: Path) -> LengthCurriculum:
    """The ``LengthCurriculum`` of a ``longnet fit`` config, refused when it has no passkeys."""
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    found = [entry.get("init_args") or {} for entry in callbacks if isinstance(entry, dict)
             and str(entry.get("class_path", "")).endswith(".LengthCurriculum")]
    if not found or not found[0].get("passkey_fraction"):
        raise UsageError(
            f"{source} trains no passkey examples: no longnet.training.LengthCurriculum with "
            "a passkey_fraction above 0 among trainer.callbacks.")
    return LengthCurriculum(**found[0])


def span_for(steps: Sequence[PasskeyStep], rows: int = 8) -> int:
    """A round span of optimizer steps that cuts the steps' range into about ``rows``."""
    if not steps:
        return 1
    width = (steps[-1].step - steps[0].step + 1) / rows
    magnitude = 10 ** max(0, math.floor(math.log10(max(width, 1))))
    return max(1, round(width / magnitude) * magnitude)
