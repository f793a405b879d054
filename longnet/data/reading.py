"""A :class:`DocumentSource` and reading its documents into a ``datasets.Dataset``.

The rows of ``.json``/``.jsonl``, ``.parquet``, ``.csv`` and ``.tsv`` files are documents (their
``text_column``); any other file is one document of UTF-8 text.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd
import pyarrow.parquet as pq
from datasets import Dataset, Features, Value, load_dataset
from datasets.exceptions import DatasetGenerationError

from longnet.validation import UsageError

_SEPARATORS = {"csv": ",", "tsv": "\t"}
_READ_ERRORS = (DatasetGenerationError, ValueError)
"""What ``load_dataset`` raises for a table file it cannot parse."""
InvalidFiles = Literal["error", "skip"]
SHOWN_FILES = 5
"""How many offending files an error or warning names (then a count of the rest)."""


@dataclass(frozen=True)
class DocumentSource:
    """Files to read documents from.

    Attributes:
        name: short label used in cache folder names (``"stdlib"``, ``"files"``, ...).
        files: the files, in reading order.
        format: ``"text"`` (a document per file), ``"json"``, ``"parquet"``, ``"csv"``, ``"tsv"``.
        text_column: the column holding the text of table rows.
        invalid_files: a text file not UTF-8 is refused (``"error"``) or skipped (``"skip"``).
    """

    name: str
    files: tuple[Path, ...]
    format: str
    text_column: str = "text"
    invalid_files: InvalidFiles = "error"

    def file_stats(self) -> list[tuple[str, int, int]]:
        """``(path, size in bytes, mtime in ns)`` of every file: what the cache is keyed by.

        Raises:
            UsageError: a file is gone since the source was made.
        """
        gone = [path for path in self.files if not path.is_file()]
        if gone:
            listed = ", ".join(map(str, gone[:SHOWN_FILES]))
            more = f" and {len(gone) - SHOWN_FILES} more" if len(gone) > SHOWN_FILES else ""
            raise UsageError(f"{len(gone)} data file(s) found when the data were set up are "
                             f"gone now (deleted or moved): {listed}{more}; put them back, or "
                             "run again to read the files there are.")
        stats = [(str(path), path.stat()) for path in self.files]
        return [(path, stat.st_size, stat.st_mtime_ns) for path, stat in stats]

    def cache_fields(self) -> dict[str, object]:
        """What the documents depend on, for the cache key (a subclass adds its own)."""
        return {"format": self.format, "text_column": self.text_column,
                "files": self.file_stats()}

    def read_documents(self, cache_dir: Path) -> Dataset:
        """The documents: :func:`load_documents` (a subclass may read them otherwise)."""
        return load_documents(self, cache_dir)


def text_problem(path: Path) -> str | None:
    """Why the file at ``path`` is not UTF-8 text, or None when it is."""
    data = path.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        return f"binary: a NUL byte at offset {nul:,}"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8: byte 0x{data[err.start]:02x} at offset {err.start:,}"
    return None


def file_listing(problems: dict[Path, str]) -> str:
    """One indented line ``path: why`` per file, the first :data:`SHOWN_FILES` then a count."""
    shown = [f"  {path}: {why}" for path, why in list(problems.items())[:SHOWN_FILES]]
    if len(problems) > SHOWN_FILES:
        shown.append(f"  and {len(problems) - SHOWN_FILES} more")
    return "\n".join(shown)


def readable_text_files(source: DocumentSource) -> list[Path]:
    """The files of a text ``source`` that are UTF-8 text; the others per ``invalid_files``."""
    problems = {path: why for path in source.files if (why := text_problem(path)) is not None}
    if not problems:
        return list(source.files)
    count = f"{len(problems)} of the {len(source.files)} data_files"
    if source.invalid_files == "error" or len(problems) == len(source.files):
        raise UsageError(
            f"{count} are not UTF-8 text:\n{file_listing(problems)}\nRemove them from data_files "
            "(or narrow the glob), convert them to UTF-8 (e.g. iconv -f latin1 -t utf-8), or "
            "set invalid_files: skip to leave them out."
        )
    warnings.warn(f"skipping {count} (not UTF-8 text, invalid_files='skip'):\n"
                  f"{file_listing(problems)}", stacklevel=2)
    return [path for path in source.files if path not in problems]


def _read_text_files(paths: list[str]) -> Iterator[dict[str, str]]:
    for path in paths:
        yield {"text": Path(path).read_text(encoding="utf-8")}


def load_documents(source: DocumentSource, cache_dir: Path) -> Dataset:
    """Read every document of ``source`` into a dataset with one string column ``text``;
    ``cache_dir`` gets the arrow files (``HF_DATASETS_CACHE`` is read only at import).

    Raises:
        UsageError: text files that are not UTF-8, a damaged table file, table files whose
            columns differ, or ``text_column`` missing or not strings.
    """
    if source.format == "text":
        return Dataset.from_generator(
            _read_text_files,
            features=Features({"text": Value("string")}),
            cache_dir=str(cache_dir),
            gen_kwargs={"paths": [str(path) for path in readable_text_files(source)]},
        )
    rows = _table_rows(source, cache_dir)
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


def _table_rows(source: DocumentSource, cache_dir: Path) -> Dataset:
    """The rows of the table files of ``source``; an empty file has none."""
    paths = [str(path) for path in source.files if path.stat().st_size > 0]
    if not paths:
        return Dataset.from_dict({source.text_column: []},
                                 features=Features({source.text_column: Value("string")}))
    for path in paths:
        _check_table_file(path, source)
    try:
        return _load_rows(source, paths, cache_dir)
    except _READ_ERRORS as err:
        raise _unreadable_rows(source, paths, cache_dir, err) from None


def _load_rows(source: DocumentSource, paths: list[str], cache_dir: Path) -> Dataset:
    """The rows of the table files ``paths``; csv/tsv columns as strings (no type guessing)."""
    if source.format not in _SEPARATORS:
        return load_dataset(source.format, data_files=paths, split="train",
                            cache_dir=str(cache_dir))
    columns = _table_columns(paths[0], source.format)
    return load_dataset(
        "csv", data_files=paths, split="train", cache_dir=str(cache_dir),
        sep=_SEPARATORS[source.format], na_filter=False,
        features=Features(dict.fromkeys(columns, Value("string"))),
    )


def _table_columns(path: str, file_format: str) -> list[str]:
    return list(pd.read_csv(path, sep=_SEPARATORS[file_format], nrows=0).columns)


def _check_table_file(path: str, source: DocumentSource) -> None:
    """Refuse a damaged parquet or csv/tsv file, or one lacking ``text_column``, by name."""
    try:
        if source.format == "parquet":
            pq.read_schema(path)
        if source.format not in _SEPARATORS:
            return
        columns = _table_columns(path, source.format)
    except (OSError, ValueError) as err:  # pyarrow's and pandas' parse errors are ValueErrors
        raise _damaged(path, source.format, err) from None
    if source.text_column not in columns:
        raise UsageError(
            f"text_column={source.text_column!r} is not a column of {path} (columns: "
            f"{columns}); set text_column to the column holding the text."
        )


def _unreadable_rows(
    source: DocumentSource, paths: list[str], cache_dir: Path, err: Exception
) -> UsageError:
    """The error for files read alone but not together: the damaged one, or differing columns."""
    if len(paths) == 1:
        return _damaged(paths[0], source.format, err)
    for path in paths:
        try:
            _load_rows(source, [path], cache_dir)
        except _READ_ERRORS as alone:
            return _damaged(path, source.format, alone)
    return UsageError(
        f"the {len(paths)} {source.format} data_files are each read alone but not together: "
        f"their columns or column types differ ({_reason(err)}); give files of one layout."
    )


def _damaged(path: str, file_format: str, err: BaseException) -> UsageError:
    return UsageError(
        f"data_files: {path} is damaged or not a valid {file_format} file ({_reason(err)}); "
        "re-create or re-copy it, or leave it out of data_files."
    )


def _reason(err: BaseException) -> str:
    """``"<type>: <message>"`` of ``err``'s cause (or ``err``), on one line."""
    cause = err.__cause__ or err
    return " ".join(f"{type(cause).__name__}: {cause}".split())
