"""Plumbing shared by the benchmark harnesses: measuring, describing and reporting a run.

* glibc's allocator settings for child processes that measure their peak memory
  (``MALLOC_FIXED``, ``malloc_env``, ``fixed_malloc``; the readers live in
  ``longnet.training.reports``);
* what the error checks compare against: float64 ``reference_rows`` at ``sample_rows``, and
  dense SDPA in our ``(batch, seq, heads, head_dim)`` layout (``sdpa``);
* the run's description: ``machine``, ``commit_version`` / ``source_version`` (the code),
  ``command_line``, ``Run`` (date, wall time, load) and its ``run_lines``;
* formatting (``fmt``, ``ratio``, ``mib``) and tables (``markdown_table``, ``text_table``);
* where a script writes (``add_output_arguments``, ``check_outputs``: ``runs/<script>/`` by
  default, the repository's ``docs/`` only with ``--update-docs``) and ``write_blocks``: rewrite
  marked blocks of one section of a ``benchmarks.md``;
* plotting (``pyplot``, ``log2_axis``, ``save_figure``).

What the benchmarks measure, and the targets they are read against: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import shlex
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

import longnet.attention
from longnet.attention import DilatedPattern
from longnet.cli.arguments import path_argument
from longnet.files import check_output_folder
from longnet.training.reports import MIB, MMAP_THRESHOLD
from longnet.validation import UsageError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
ATTENTION_DIR = Path(longnet.attention.__file__).resolve().parent
"""The ``longnet/attention`` sources this process imported (and measures)."""
DOCS = Path(__file__).resolve().parents[2] / "docs"
"""The repository's ``docs/`` folder, which ``--update-docs`` writes (in a checkout)."""

# --------------------------------------------------------------------------- memory
MALLOC_FIXED = {MMAP_THRESHOLD: "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
"""glibc settings under which freed buffers above 128 KiB leave the RSS at once (the default
keeps up to 32 MiB), so peak RSS is the peak of live bytes. The benchmarks run under them."""


def malloc_env(fixed: bool, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child with ``MALLOC_FIXED`` (``fixed``) or
    glibc's default, adaptive settings (what users run with)."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in MALLOC_FIXED}
    return {**env, **MALLOC_FIXED} if fixed else env


@contextmanager
def fixed_malloc(fixed: bool) -> Iterator[None]:
    """``malloc_env(fixed)`` in ``os.environ`` for the block (for children that inherit it,
    such as ``multiprocessing``'s spawned ones); the old values afterwards."""
    saved = {k: os.environ.pop(k) for k in MALLOC_FIXED if k in os.environ}
    if fixed:
        os.environ.update(MALLOC_FIXED)
    try:
        yield
    finally:
        for key in MALLOC_FIXED:
            os.environ.pop(key, None)
        os.environ.update(saved)


# --------------------------------------------------------------------------- error checks


def sample_rows(n: int, count: int, seed: int) -> tuple[int, ...]:
    """Up to ``count`` query positions in ascending order: the first, the last and random ones."""
    generator = torch.Generator().manual_seed(seed)
    picked = torch.randperm(n, generator=generator)[: max(count - 2, 0)].tolist()
    return tuple(sorted({0, n - 1, *picked}))


def reference_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: DilatedPattern,
    rows: Sequence[int] | torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """Float64 ``softmax(q k^T * scale + log C) v`` of batch 0 at ``rows``: ``(rows, heads, dim)``,
    ``C`` from ``DilatedPattern.key_multiplicity`` (0 for a row without keys).

    Counts are built in row chunks (bounded memory) and stored as uint8; scores over all keys
    are computed one head at a time.
    """
    rows = torch.as_tensor(rows, dtype=torch.long)
    _, n, heads, dim = q.shape
    positions = torch.arange(n)
    chunk = max(1, 2**25 // (heads * n))
    counts = torch.cat(
        [
            pattern.key_multiplicity(part, positions, heads, causal).to(torch.uint8)
            for part in rows.split(chunk)
        ],
        dim=1,
    )  # (heads, rows, n)
    out = torch.zeros(len(rows), heads, dim, dtype=torch.float64)
    for h in range(heads):
        k_h, v_h = k[0, :, h].double(), v[0, :, h].double()
        scores = q[0, rows, h].double() @ k_h.T * dim**-0.5 + counts[h].double().log()
        has_key = (counts[h] > 0).any(dim=1)
        probs = torch.softmax(scores[has_key], dim=-1)
        out[has_key, h] = probs @ v_h
    return out


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Dense ``scaled_dot_product_attention`` on ``(batch, seq, heads, head_dim)`` tensors."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


# --------------------------------------------------------------------------- the run


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(*, threads: bool = False, python: bool = False, ram: bool = False) -> str:
    """Platform, CPUs and torch version; optionally torch's threads, python, physical RAM."""
    parts = [
        f"`{platform.platform()}`",
        f"{os.cpu_count()} CPUs ({cpu_model()})",
        f"torch {torch.__version__}"
        + (f" with {torch.get_num_threads()} threads" if threads else ""),
    ]
    if python:
        parts.append(f"python {platform.python_version()}")
    if ram:
        ram_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        parts.append(f"{ram_bytes / 2**30:.1f} GiB RAM")
    return ", ".join(parts)


def git(root: Path, *args: str) -> bytes:
    """stdout of ``git args`` in ``root``; raises ``OSError`` / ``CalledProcessError``."""
    return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout


def head_commit(root: Path) -> str:
    """Short ``HEAD`` of the checkout at ``root``, or ``unknown``."""
    try:
        return git(root, "rev-parse", "--short", "HEAD").decode().strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def commit_version(root: Path) -> str:
    """``commit <HEAD>``, noting uncommitted changes under ``longnet/attention``."""
    try:
        dirty = git(root, "status", "--porcelain", "longnet/attention").strip()
    except (OSError, subprocess.CalledProcessError):
        dirty = b""
    changes = ", longnet/attention with uncommitted changes" if dirty else ""
    return f"commit {head_commit(root)}{changes}"


def attention_digest() -> str:
    """sha256 (12 hex digits) of the ``longnet/attention`` sources (subpackages included) this
    process imported."""
    digest = hashlib.sha256()
    sources = {path.relative_to(ATTENTION_DIR).as_posix(): path
               for path in ATTENTION_DIR.rglob("*.py")}
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name].read_bytes())
    return digest.hexdigest()[:12]


def committed_attention_digest(root: Path) -> str:
    """The ``attention_digest`` of ``longnet/attention`` as committed at ``HEAD`` of ``root``."""
    try:
        names = git(root, "ls-tree", "-r", "--name-only", "HEAD", "longnet/attention/")
        digest = hashlib.sha256()
        for name in sorted(n for n in names.decode().split() if n.endswith(".py")):
            relative = Path(name).relative_to("longnet/attention").as_posix()
            digest.update(relative.encode() + b"\0" + git(root, "show", f"HEAD:{name}"))
    except (OSError, subprocess.CalledProcessError):
        return ""
    return digest.hexdigest()[:12]


def source_version(digest: str, root: Path) -> str:
    """Whether the imported attention sources (``digest``) are those committed at ``root``."""
    committed = committed_attention_digest(root)
    state = "identical to" if digest == committed else "NOT identical to (uncommitted changes)"
    imported_here = (root / "longnet" / "attention").resolve() == ATTENTION_DIR
    where = "" if imported_here else f", loaded from {ATTENTION_DIR}"
    return (
        f"longnet/attention sources sha256 {digest} {state} commit {head_commit(root)} "
        f"(HEAD when the run started){where}"
    )


def command_line(script: str, argv: Sequence[str], env_vars: Iterable[str] = ()) -> str:
    """How to repeat the run from the repository's root: the ``env_vars`` that are set, then
    ``python -m lab.scripts.<script> argv``."""
    env = [f"{name}={os.environ[name]}" for name in env_vars if name in os.environ]
    return " ".join([*env, "python", "-m", shlex.join([f"lab.scripts.{script}", *argv])])


class Run:
    """Command, start time and load average of a benchmark run; ``finish`` adds the rest."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.started = time.perf_counter()
        self.load_start = os.getloadavg()[0]

    def finish(self, **extra) -> dict:
        """``command``, ``date`` (UTC), ``wall_s``, ``load_start``, ``load_end`` and ``extra``."""
        now = datetime.datetime.now(datetime.timezone.utc)
        return dict(
            command=self.command,
            date=now.strftime("%Y-%m-%d %H:%M UTC"),
            wall_s=time.perf_counter() - self.started,
            load_start=self.load_start,
            load_end=os.getloadavg()[0],
            **extra,
        )


def run_lines(run: dict, machine: str, code: str) -> list[str]:
    """The markdown list lines that head a generated block: command, date, machine, code."""
    return [
        f"- command: `{run['command']}`",
        f"- date: {run['date']}; wall time of the run {run['wall_s']:.0f} s; load average "
        f"(1 min) at start {run['load_start']:.2f}, at end {run['load_end']:.2f}",
        f"- machine: {machine}",
        f"- code: {code}",
    ]


# --------------------------------------------------------------------------- formatting


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def mib(count: float | None, spec: str = ".1f") -> str:
    """Bytes as MiB, ``-`` for None."""
    return "-" if count is None else format(count / MIB, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Right-aligned columns for a terminal."""
    table = [list(header), *map(list, rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table)


# --------------------------------------------------------------------------- outputs


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out``, ``--update-docs``, ``--no-doc`` and ``--json`` of the benchmark script
    ``name`` (``bench_ring``): where its plots, its blocks of ``benchmarks.md`` and its samples
    go (:func:`check_outputs`)."""
    parser.add_argument(
        "--out", type=path_argument,
        help=f"folder of the plots and of a benchmarks.md with this run's blocks (default: "
        f"runs/{name})",
    )
    parser.add_argument(
        "--update-docs", action="store_true",
        help="write the plots and the blocks into the repository's docs/ (docs/benchmarks.md) "
        "instead of --out",
    )
    parser.add_argument("--no-doc", action="store_true", help="write no benchmarks.md")
    parser.add_argument("--json", type=path_argument, help="also write every sample here")


def name_argument(text: str) -> str:
    """argparse type for ``--tag`` and ``--block``: a name that becomes part of file names and
    doc markers (not empty, no ``/``)."""
    if not text.strip() or "/" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(
            f"expected a name without '/' (it becomes part of file names), got {text!r}."
        )
    return text


def check_outputs(args: argparse.Namespace, name: str, files: Sequence[str]) -> None:
    """Set ``args.out`` (:data:`DOCS` with ``--update-docs``, else ``--out`` or
    ``runs/<name>``) and refuse, before anything is measured, outputs that cannot be written:
    ``files`` and ``benchmarks.md`` (unless ``--no-doc``) in it, and ``--json``.

    Raises:
        UsageError: naming the option, the path and the fix.
    """
    if args.update_docs:
        if args.out is not None or args.no_doc:
            other = f"--out names another ({args.out})" if args.out else "--no-doc says not to"
            raise UsageError(
                f"--update-docs writes into the repository's docs/ folder; {other}: give one "
                "of them."
            )
        if not (DOCS / "benchmarks.md").is_file():
            raise UsageError(
                f"--update-docs rewrites the repository's docs/benchmarks.md, and there is none at "
                f"{DOCS} (an installed package, not a checkout); give --out instead."
            )
        args.out = DOCS
    elif args.out is None:
        args.out = Path("runs") / name
    what = "--update-docs" if args.update_docs else "--out"
    check_output_folder(args.out, [*files, *([] if args.no_doc else ["benchmarks.md"])], what)
    if args.json is not None:
        if args.json.is_dir():
            raise UsageError(
                f"--json {args.json} is a folder; give the path of a file (in it or elsewhere)."
            )
        check_output_folder(args.json.parent, [args.json.name], "--json")


# --------------------------------------------------------------------------- docs


def markers(prefix: str, name: str) -> tuple[str, str]:
    """The begin/end comments around the generated block ``name`` of script ``prefix``."""
    return f"<!-- {prefix}:{name}:begin -->", f"<!-- {prefix}:{name}:end -->"


def write_blocks(
    path: Path, section: str, prefix: str, blocks: dict[str, str], intro: str = ""
) -> None:
    """Put each of ``blocks`` between its ``markers`` in ``path``: an existing block is
    replaced where it stands; a new one goes to the end of ``section`` (a ``## `` heading,
    created with ``intro`` below it if missing). Text outside the markers is kept; the file is
    read right before writing."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if "\n" + section not in text:
        text = text.rstrip("\n") + "\n\n" + section + ("\n\n" + intro if intro else "") + "\n"
    for name, block in blocks.items():
        begin, end = markers(prefix, name)
        wrapped = f"{begin}\n{block}\n{end}"
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + wrapped + rest.split(end, 1)[1]
            continue
        start = text.index("\n" + section)
        following = text.find("\n## ", start + 1)
        cut = len(text) if following < 0 else following
        text = text[:cut].rstrip("\n") + "\n\n" + wrapped + "\n" + text[cut:]
    path.write_text(text.rstrip("\n") + "\n")


# --------------------------------------------------------------------------- plotting


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log2_axis(
    ax,
    xlabel: str,
    ylabel: str | None = None,
    *,
    ticks: Sequence[int] | None = None,
    log_y: bool = False,
) -> None:
    """A log2 x axis (labelled ``ticks`` if given), labels, a light grid and the legend."""
    ax.set_xscale("log", base=2)
    if ticks is not None:
        ax.set_xticks(ticks, [str(t) for t in ticks])
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.grid(True, which="both" if log_y else "major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def save_figure(fig, path: Path, title: str, dpi: int) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
