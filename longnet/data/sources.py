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
- ``files_source(data_files)``: local files matched by glob patterns. ``.json``/``.jsonl`` rows
  and ``.parquet`` rows are documents (their ``text_column``); any other file is one text
  document, which must be UTF-8 text: a binary file (a NUL byte) or one that is not valid
  UTF-8 is refused, naming every such file, or skipped with a warning and a count when the
  source is made with ``invalid_files="skip"``.

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
    """Local files matched by ``data_files`` (one glob or a list; ``**`` recurses).

    ``invalid_files``: ``"error"`` or ``"skip"``, see :class:`DocumentSource` (checked when
    the documents are read, :func:`load_documents`).

    Raises:
        FileNotFoundError: a pattern matches no file (the error names the pattern, and for a
            folder a glob of its files).
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
