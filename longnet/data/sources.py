"""Where long documents come from, and reading them into a ``datasets.Dataset``.

Two kinds of source:

- ``stdlib_source()``: the ``*.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), one document per file. Folders named ``test``,
  ``tests`` or ``idle_test`` (CPython's own test suites, which would be two thirds of the bytes
  and are mostly generated-looking fixtures) and third-party ``site-packages``/``dist-packages``
  are skipped, so the corpus is the same on every machine with the same Python version.
- ``files_source(data_files)``: local files matched by glob patterns. ``.json``/``.jsonl`` rows
  and ``.parquet`` rows are documents (their ``text_column``); any other file is one text
  document, which must be UTF-8 text: a binary file (a NUL byte) or one that is not valid
  UTF-8 is refused, naming every such file, or skipped with a warning and a count when the
  source is made with ``invalid_files="skip"``.

Files are ordered by path, rows by file then row, so reading is deterministic.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from datasets import Dataset, Features, Value, load_dataset
from datasets.exceptions import DatasetGenerationError

from longnet.validation import UsageError

STDLIB_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_ROW_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
InvalidFiles = Literal["error", "skip"]
SHOWN_FILES = 5
"""How many offending files an error or warning names (then a count of the rest)."""


@dataclass(frozen=True)
class DocumentSource:
    """Files to read documents from.

    Attributes:
        name: short label used in cache folder names (``"stdlib"`` or ``"files"``).
        files: the files, in reading order.
        format: ``"text"`` (one document per file), ``"json"`` or ``"parquet"`` (one per row).
        text_column: the column holding the text for json/parquet rows.
        invalid_files: what reading does with a text file that is binary or not UTF-8:
            ``"error"`` (refuse, naming the files) or ``"skip"`` (leave it out, with a warning).
    """

    name: str
    files: tuple[Path, ...]
    format: str
    text_column: str = "text"
    invalid_files: InvalidFiles = "error"

    def file_stats(self) -> list[tuple[str, int, int]]:
        """``(path, size in bytes, mtime in ns)`` of every file: what the cache is keyed by."""
        stats = [(str(path), path.stat()) for path in self.files]
        return [(path, stat.st_size, stat.st_mtime_ns) for path, stat in stats]


def stdlib_source() -> DocumentSource:
    """The running interpreter's standard-library ``*.py`` files, test folders excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (path for path in root.rglob("*.py")
         if STDLIB_SKIPPED_DIRS.isdisjoint(path.relative_to(root).parts[:-1])),
        key=lambda path: path.relative_to(root).as_posix(),
    )
    if not files:
        raise FileNotFoundError(
            f"stdlib_source: no *.py files under {root}; this interpreter ships without its "
            "standard-library sources, so pass data_files= pointing at local documents."
        )
    return DocumentSource(name="stdlib", files=tuple(files), format="text")


def files_source(
    data_files: str | Sequence[str],
    text_column: str = "text",
    invalid_files: InvalidFiles = "error",
) -> DocumentSource:
    """Local files matched by ``data_files`` (one glob or a list; ``**`` recurses).

    ``invalid_files``: ``"error"`` or ``"skip"``, see :class:`DocumentSource` (checked when
    the documents are read, :func:`load_documents`).

    Raises:
        FileNotFoundError: a pattern matches no file (the error names the pattern).
        ValueError: no pattern is given, the files mix text, json and parquet, or
            ``invalid_files`` is not ``"error"``/``"skip"``.
    """
    if invalid_files not in ("error", "skip"):
        raise ValueError(f"invalid_files must be 'error' or 'skip', got {invalid_files!r}.")
    patterns = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    if not patterns:
        raise ValueError("data_files is empty; give at least one path or glob pattern.")
    files: dict[Path, None] = {}
    for pattern in patterns:
        matches = sorted(
            Path(match).resolve()
            for match in glob.glob(os.path.expanduser(str(pattern)), recursive=True)
            if Path(match).is_file()
        )
        if not matches:
            raise FileNotFoundError(
                f"data_files: no file matches {str(pattern)!r} (relative paths are resolved "
                f"from {Path.cwd()}); fix the path or glob, or leave data_files unset to use "
                "the standard-library corpus."
            )
        files.update(dict.fromkeys(matches))
    formats = {_ROW_FORMATS.get(path.suffix.lower(), "text") for path in files}
    if len(formats) > 1:
        raise ValueError(
            f"data_files mixes formats {sorted(formats)}; give files of one format "
            "(text, .json/.jsonl or .parquet) per data module."
        )
    return DocumentSource(
        name="files", files=tuple(files), format=formats.pop(), text_column=text_column,
        invalid_files=invalid_files,
    )


def text_problem(path: Path) -> str | None:
    """Why the file at ``path`` is not UTF-8 text (``"binary: a NUL byte at offset N"`` or
    ``"not UTF-8: byte 0xNN at offset N"``), or None when it is."""
    data = path.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        return f"binary: a NUL byte at offset {nul:,}"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8: byte 0x{data[err.start]:02x} at offset {err.start:,}"
    return None


def _listing(problems: dict[Path, str]) -> str:
    shown = [f"  {path}: {why}" for path, why in list(problems.items())[:SHOWN_FILES]]
    if len(problems) > SHOWN_FILES:
        shown.append(f"  and {len(problems) - SHOWN_FILES} more")
    return "\n".join(shown)


def readable_text_files(source: DocumentSource) -> list[Path]:
    """The files of a text ``source`` that are UTF-8 text; the others raise
    :class:`UsageError` naming them, or with ``invalid_files="skip"`` are left out with a
    warning (a source with no readable file is refused either way)."""
    problems = {path: why for path in source.files if (why := text_problem(path)) is not None}
    if not problems:
        return list(source.files)
    count = f"{len(problems)} of the {len(source.files)} data_files"
    if source.invalid_files == "error" or len(problems) == len(source.files):
        raise UsageError(
            f"{count} are not UTF-8 text:\n{_listing(problems)}\nRemove them from data_files "
            "(or narrow the glob), convert them to UTF-8 (e.g. iconv -f latin1 -t utf-8), or "
            "set invalid_files: skip to leave them out."
        )
    warnings.warn(f"skipping {count} (not UTF-8 text, invalid_files='skip'):\n"
                  f"{_listing(problems)}", stacklevel=2)
    return [path for path in source.files if path not in problems]


def _read_text_files(paths: list[str]) -> Iterator[dict[str, str]]:
    for path in paths:
        yield {"text": Path(path).read_text(encoding="utf-8")}


def load_documents(source: DocumentSource, cache_dir: Path) -> Dataset:
    """Read every document of ``source`` into a dataset with one string column ``text``.

    ``cache_dir`` receives the arrow files ``datasets`` writes (passed explicitly, because
    ``HF_DATASETS_CACHE`` is only read when ``datasets`` is imported). Nothing is downloaded.

    Raises:
        UsageError: text files that are not UTF-8 (:func:`readable_text_files`), json/parquet
            files that cannot be parsed, or ``text_column`` missing or not holding strings.
    """
    paths = [str(path) for path in source.files]
    if source.format == "text":
        return Dataset.from_generator(
            _read_text_files,
            features=Features({"text": Value("string")}),
            cache_dir=str(cache_dir),
            gen_kwargs={"paths": [str(path) for path in readable_text_files(source)]},
        )
    try:
        rows = load_dataset(source.format, data_files=paths, split="train",
                            cache_dir=str(cache_dir))
    except DatasetGenerationError as err:
        cause = err.__cause__ or err
        raise UsageError(
            f"cannot read the {source.format} data_files ({len(paths)} files, e.g. {paths[0]}): "
            f"{type(cause).__name__}: {cause}. Fix or remove the file; every row must be a "
            f"{source.format} record with a text_column."
        ) from None
    if source.text_column not in rows.column_names:
        raise UsageError(
            f"text_column={source.text_column!r} is not a column of the data_files rows "
            f"(columns: {rows.column_names}); set text_column to the column holding the text."
        )
    if rows.features[source.text_column] not in (Value("string"), Value("large_string")):
        raise UsageError(
            f"text_column={source.text_column!r} holds {rows.features[source.text_column]}, not "
            "strings; set text_column to the column holding the document text."
        )
    rows = rows.select_columns([source.text_column])
    if source.text_column != "text":
        rows = rows.rename_column(source.text_column, "text")
    return rows
