"""Where long documents come from, and reading them into a ``datasets.Dataset``.

Three kinds of source:

- ``stdlib_source()``: the ``*.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), one document per file. Folders named ``test``,
  ``tests`` or ``idle_test`` (CPython's own test suites, which would be two thirds of the bytes
  and are mostly generated-looking fixtures) and third-party ``site-packages``/``dist-packages``
  are skipped, so the corpus is the same on every machine with the same Python version.
- ``package_source(distribution, version)``: the ``*.py`` files of an installed distribution
  (e.g. sympy, which torch depends on), located through its ``RECORD`` with
  ``importlib.metadata`` (never imported), test folders skipped as for the stdlib. Every file
  must match the sha256 of the ``RECORD``, and a pinned ``version`` must be the installed one,
  so the same pin gives the same documents on every machine.
- ``files_source(data_files)``: local files matched by glob patterns (``**`` enters linked
  folders, each real folder once, so a link loop ends; a path naming an existing file is that
  file, even with ``[``, ``*`` or ``?`` in its name). The rows of ``.json``/``.jsonl``,
  ``.parquet``, ``.csv`` and ``.tsv`` files are documents (their ``text_column``); any other
  file is one text document, which must be UTF-8 text: a binary file (a NUL byte) or one that
  is not valid UTF-8 is refused, naming every such file, or skipped with a warning and a count
  when the source is made with ``invalid_files="skip"``. A table file that cannot be parsed is
  refused as damaged, naming it.

``corpus_source(["stdlib", "sympy==1.14.0"])`` reads the first two kinds together, one source
after the other; ``select_source`` picks the source from the data options.
Files are ordered by path, rows by file then row, so reading is deterministic.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import importlib.metadata
import os
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Literal

import pandas as pd
import pyarrow.parquet as pq
from datasets import Dataset, Features, Value, load_dataset
from datasets.exceptions import DatasetGenerationError

from longnet.validation import UsageError

STDLIB_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_ROW_FORMATS = {
    ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv"
}
"""The table formats by file suffix: each row's ``text_column`` is a document."""
_SEPARATORS = {"csv": ",", "tsv": "\t"}
_READ_ERRORS = (DatasetGenerationError, ValueError)
"""What ``load_dataset`` raises for a table file it cannot parse: its wrapper of the error, or
(while it infers the schema from the first file) pyarrow's or pandas' error, a ``ValueError``."""
_RECURSIVE = "**"
InvalidFiles = Literal["error", "skip"]
SHOWN_FILES = 5
"""How many offending files an error or warning names (then a count of the rest)."""
STDLIB_CORPUS = "stdlib"
"""The corpus entry naming :func:`stdlib_source` (any other entry names a distribution)."""
_CORPUS_ENTRY = re.compile(
    r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(?:==(?P<version>[A-Za-z0-9][\w.+!-]*))?"
)


@dataclass(frozen=True)
class DocumentSource:
    """Files to read documents from.

    Attributes:
        name: short label used in cache folder names: ``"stdlib"``, ``"files"``,
            ``"<distribution>-<version>"`` or several of those joined by ``+``.
        files: the files, in reading order.
        format: ``"text"`` (one document per file), ``"json"``, ``"parquet"``, ``"csv"`` or
            ``"tsv"`` (one per row).
        text_column: the column holding the text of table rows.
        invalid_files: what reading does with a text file that is binary or not UTF-8:
            ``"error"`` (refuse, naming the files) or ``"skip"`` (leave it out, with a warning).
    """

    name: str
    files: tuple[Path, ...]
    format: str
    text_column: str = "text"
    invalid_files: InvalidFiles = "error"

    def file_stats(self) -> list[tuple[str, int, int]]:
        """``(path, size in bytes, mtime in ns)`` of every file: what the cache is keyed by.

        Raises:
            UsageError: a file found when the source was made is gone (deleted or moved).
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
        """What the documents depend on, for the cache key: the format, the text column and
        :meth:`file_stats` (a subclass adds its own, e.g. ``repositories.PackageSource``)."""
        return {"format": self.format, "text_column": self.text_column,
                "files": self.file_stats()}

    def read_documents(self, cache_dir: Path) -> Dataset:
        """The documents: :func:`load_documents` (a subclass may read them otherwise)."""
        return load_documents(self, cache_dir)


def _is_document(relative: PurePath) -> bool:
    """Whether the file at ``relative`` (to the root of a source tree: the standard library,
    an installed distribution) is a document: a ``*.py`` file outside the folders
    :data:`STDLIB_SKIPPED_DIRS`."""
    return relative.suffix == ".py" and STDLIB_SKIPPED_DIRS.isdisjoint(relative.parts[:-1])


def stdlib_source() -> DocumentSource:
    """The running interpreter's standard-library ``*.py`` files, test folders excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (path for path in root.rglob("*.py") if _is_document(path.relative_to(root))),
        key=lambda path: path.relative_to(root).as_posix(),
    )
    if not files:
        raise FileNotFoundError(
            f"stdlib_source: no *.py files under {root}; this interpreter ships without its "
            "standard-library sources, so pass data_files= pointing at local documents."
        )
    return DocumentSource(name="stdlib", files=tuple(files), format="text")


def package_source(distribution: str, version: str | None = None) -> DocumentSource:
    """The ``*.py`` files of the installed ``distribution``, named ``"<name>-<version>"``.

    The files are those its ``RECORD`` lists (found with ``importlib.metadata``; the package is
    not imported), outside the folders :data:`STDLIB_SKIPPED_DIRS` (test suites), ordered by
    their path inside the distribution, and each one matching its ``RECORD`` hash.

    Raises:
        UsageError: the distribution is not installed, is not ``version`` (when given), lists
            no such file (e.g. an editable install), or has files that are missing or differ
            from its ``RECORD`` (the message names them; reinstalling fixes it).
    """
    dist = _installed_distribution(distribution, version)
    pin = f"{dist.name}=={dist.version}"
    listed = sorted(
        (path for path in dist.files or () if _is_document(path)),
        key=lambda path: path.as_posix(),
    )
    if not listed:
        raise UsageError(
            f"{dist.name} {dist.version} at {dist.locate_file('')}: its RECORD lists no *.py "
            "file outside test folders (an editable or source install lists none); install it "
            f"from a wheel: pip install --force-reinstall {pin}"
        )
    files = [Path(path.locate()) for path in listed]
    problems = {
        file: why for file, path in zip(files, listed) if (why := _record_problem(path)) is not None
    }
    if problems:
        raise UsageError(
            f"{dist.name} {dist.version} at {dist.locate_file('')}: {len(problems)} of its "
            f"{len(files)} *.py files do not match its RECORD:\n{_listing(problems)}\nThe "
            f"installation was modified; reinstall it: pip install --force-reinstall {pin}"
        )
    return DocumentSource(name=f"{dist.name}-{dist.version}", files=tuple(files), format="text")


def _installed_distribution(
    distribution: str, version: str | None
) -> importlib.metadata.Distribution:
    """The installed ``distribution``; :class:`UsageError` when it is not installed or, with
    ``version`` given, is another version."""
    pin = distribution if version is None else f"{distribution}=={version}"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(
            f"the distribution {distribution!r} is not installed in this environment "
            f"({sys.prefix}); install it (pip install {pin}) or fix the name (a corpus entry is "
            f"{STDLIB_CORPUS!r} or an installed distribution)."
        ) from None
    if version is not None and dist.version != version:
        raise UsageError(
            f"{dist.name} {dist.version} is installed, but the corpus asks for {pin}; install "
            f"that version (pip install {pin}) or ask for {dist.name}=={dist.version} (other "
            "documents: another corpus and cache entry)."
        )
    return dist


def _record_problem(path: importlib.metadata.PackagePath) -> str | None:
    """Why the installed file ``path`` does not match its distribution's ``RECORD``
    (``"missing"``, ``"no hash in RECORD"`` or ``"sha256 differs from RECORD"``), or None when
    it matches."""
    try:
        data = path.read_binary()
    except FileNotFoundError:
        return "missing"
    if path.hash is None:
        return "no hash in RECORD"
    digest = hashlib.new(path.hash.mode, data).digest()
    if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != path.hash.value:
        return f"{path.hash.mode} differs from RECORD"
    return None


def corpus_source(corpus: str | Sequence[str]) -> DocumentSource:
    """The source of the corpus entries ``corpus`` (one or a list), read in the order given,
    one document per file: ``"stdlib"`` is :func:`stdlib_source`, ``"<distribution>"`` or
    ``"<distribution>==<version>"`` is :func:`package_source`. One entry returns its source
    unchanged; several return one source named after theirs joined by ``+`` (e.g.
    ``"stdlib+sympy-1.14.0"``).

    Raises:
        ValueError: no entry, an entry that is not of those forms, or a source listed twice.
        UsageError: from :func:`package_source`.
    """
    entries = [corpus] if isinstance(corpus, str) else list(corpus)
    if not entries:
        raise ValueError(
            f"corpus is empty; give {STDLIB_CORPUS!r} and/or installed distributions such as "
            "'sympy==1.14.0', or leave it unset for the standard library."
        )
    specs = [_corpus_entry(entry) for entry in entries]
    names = [re.sub(r"[-_.]+", "-", name).lower() for name, _ in specs]
    if len(set(names)) < len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"corpus lists {', '.join(twice)} more than once; list each once.")
    sources = [
        stdlib_source() if name == STDLIB_CORPUS else package_source(name, version)
        for name, version in specs
    ]
    if len(sources) == 1:
        return sources[0]
    return DocumentSource(
        name="+".join(source.name for source in sources),
        files=tuple(path for source in sources for path in source.files),
        format="text",
    )


def _corpus_entry(entry: object) -> tuple[str, str | None]:
    """``(name, version or None)`` of a corpus entry such as ``"sympy==1.14.0"``;
    ``ValueError`` naming the entry and the accepted forms when it is not one."""
    match = _CORPUS_ENTRY.fullmatch(entry) if isinstance(entry, str) else None
    if match is None:
        raise ValueError(
            f"corpus entry {entry!r} is not {STDLIB_CORPUS!r}, '<distribution>' or "
            "'<distribution>==<version>' (an exact pin, e.g. 'sympy==1.14.0'); fix the entry."
        )
    if match["name"] == STDLIB_CORPUS and match["version"] is not None:
        raise ValueError(
            f"corpus entry {entry!r}: the standard library is the running Python's "
            f"({sys.version.split()[0]}) and takes no version; write {STDLIB_CORPUS!r}."
        )
    return match["name"], match["version"]


def select_source(
    data_files: str | Sequence[str] | None = None,
    corpus: str | Sequence[str] | None = None,
    text_column: str = "text",
    invalid_files: InvalidFiles = "error",
) -> DocumentSource:
    """The source the data options select: :func:`files_source` of ``data_files``,
    :func:`corpus_source` of ``corpus``, or with neither the default :func:`stdlib_source`.

    Raises:
        ValueError: both ``data_files`` and ``corpus`` are given; and what the chosen
            function raises.
    """
    if data_files is not None and corpus is not None:
        raise ValueError(
            "data_files and corpus are both set; set one: data_files reads local files, corpus "
            f"the offline corpora ({STDLIB_CORPUS!r}, installed distributions such as "
            "'sympy==1.14.0')."
        )
    if data_files is not None:
        return files_source(data_files, text_column, invalid_files)
    return stdlib_source() if corpus is None else corpus_source(corpus)


def files_source(
    data_files: str | Sequence[str],
    text_column: str = "text",
    invalid_files: InvalidFiles = "error",
) -> DocumentSource:
    """Local files matched by ``data_files`` (one glob or a list, ``~`` expanded), read in
    pattern order, each pattern's files by path, each file once.

    A pattern naming an existing file is that file, glob characters in its name included
    (``a[1].txt``); any other is a glob (:func:`_glob`: ``**`` recurses, entering linked
    folders but each real folder once, so a link loop ends).
    ``invalid_files``: ``"error"`` or ``"skip"``, see :class:`DocumentSource` (checked when
    the documents are read, :func:`load_documents`).

    Raises:
        FileNotFoundError: a pattern matches no file (the error names the pattern, and for a
            folder a glob of its files).
        ValueError: no pattern or an empty one is given, the files mix formats (text, json,
            parquet, csv, tsv), or ``invalid_files`` is not ``"error"``/``"skip"``.
    """
    if invalid_files not in ("error", "skip"):
        raise ValueError(f"invalid_files must be 'error' or 'skip', got {invalid_files!r}.")
    patterns = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    if not patterns:
        raise ValueError("data_files is empty; give at least one path or glob pattern.")
    if any(not str(pattern).strip() for pattern in patterns):
        raise ValueError(
            f"data_files has an empty path ({data_files!r}); give a file or glob (e.g. "
            "'docs/**/*.txt'), or leave data_files unset to use the standard-library corpus."
        )
    files: dict[Path, None] = {}
    for pattern in patterns:
        matches = _matching_files(os.path.expanduser(str(pattern)))
        if not matches:
            folder = os.path.expanduser(str(pattern))
            if Path(folder).is_dir():
                raise FileNotFoundError(
                    f"data_files: {str(pattern)!r} is a folder; give a glob of its files, e.g. "
                    f"'{os.path.join(folder, '*.txt')}' (or '{os.path.join(folder, '**', '*')}' "
                    "with its subfolders)."
                )
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
            "(text, .json/.jsonl, .parquet, .csv or .tsv) per data module."
        )
    return DocumentSource(
        name="files", files=tuple(files), format=formats.pop(), text_column=text_column,
        invalid_files=invalid_files,
    )


def _matching_files(pattern: str) -> list[Path]:
    """The files ``pattern`` names, resolved and sorted: the file of that very name when one
    exists, else the files the glob :func:`_glob` matches (folders left out)."""
    if os.path.isfile(pattern):
        return [Path(pattern).resolve()]
    return sorted({Path(match).resolve() for match in _glob(pattern) if os.path.isfile(match)})


def _glob(pattern: str) -> Iterator[str]:
    """The paths ``pattern`` matches, as ``glob.iglob(pattern, recursive=True)`` (``*`` and
    ``**`` skip hidden names) except that a ``**`` component walks :func:`_folders_once`: it
    enters linked folders, but each real folder once, so a link loop (``sub -> ..``) ends."""
    parts = pattern.split(os.sep)
    if _RECURSIVE not in parts:
        yield from glob.iglob(pattern)
        return
    at = parts.index(_RECURSIVE)
    head = os.sep.join(parts[:at]) or (os.sep if at else os.curdir)
    rest = os.sep.join(parts[at + 1:]) or "*"
    for top in glob.iglob(head):
        for folder in _folders_once(top):
            yield from _glob(os.path.join(glob.escape(folder), rest))


def _folders_once(top: str) -> Iterator[str]:
    """``top`` (when it is a folder) and the folders below it, hidden ones left out, linked
    ones entered: each real folder (device and inode) once, under the first path found."""
    seen: set[tuple[int, int]] = set()
    pending = [top]
    while pending:
        folder = pending.pop()
        try:
            status = os.stat(folder)
            if (status.st_dev, status.st_ino) in seen:
                continue
            seen.add((status.st_dev, status.st_ino))
            with os.scandir(folder) as entries:
                pending += [entry.path for entry in entries
                            if entry.is_dir() and not entry.name.startswith(".")]
        except OSError:  # not a folder, unreadable, or gone meanwhile
            continue
        yield folder


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
        UsageError: text files that are not UTF-8 (:func:`readable_text_files`), a table file
            that cannot be parsed (named as damaged), table files that differ in their columns,
            or ``text_column`` missing or not holding strings.
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
    """The rows of the table files of ``source`` (json, parquet, csv or tsv); an empty file
    has none (as an empty text file is no document), a file that cannot be parsed is refused
    as damaged, naming it."""
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
    """The rows of the table files ``paths`` of ``source``, read by ``datasets``; csv/tsv
    columns are read as strings (no type guessing: ``42`` and ``NA`` stay text), with the
    header of the first file."""
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
    """The column names of the header of the csv/tsv file at ``path``."""
    return list(pd.read_csv(path, sep=_SEPARATORS[file_format], nrows=0).columns)


def _check_table_file(path: str, source: DocumentSource) -> None:
    """Refuse, before ``datasets`` reads it, a parquet file whose schema cannot be read (cut
    short, not parquet) or a csv/tsv file whose header cannot be parsed or lacks
    ``text_column``: :class:`UsageError` naming the file."""
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
    """The error for table files ``paths`` that ``datasets`` could not read together (``err``):
    the first file that cannot be read alone, named as damaged, or else files whose columns
    differ."""
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
    """:class:`UsageError`: the file at ``path`` cannot be parsed as ``file_format``."""
    return UsageError(
        f"data_files: {path} is damaged or not a valid {file_format} file ({_reason(err)}); "
        "re-create or re-copy it, or leave it out of data_files."
    )


def _reason(err: BaseException) -> str:
    """``"<type>: <message>"`` of the error ``err`` is about (its cause, for the wrapper that
    ``datasets`` raises), on one line."""
    cause = err.__cause__ or err
    return " ".join(f"{type(cause).__name__}: {cause}".split())
