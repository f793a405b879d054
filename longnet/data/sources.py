"""Where long documents come from: the data options' :class:`~longnet.data.reading.DocumentSource`.

- :func:`stdlib_source`: the standard library's ``*.py`` files, tests skipped.
- :func:`package_source`: the ``*.py`` files an installed distribution's ``RECORD`` lists,
  checked against its sha256, so a pin gives the same documents everywhere.
- :func:`files_source`: local files matched by glob patterns: text, or tables (a row each).

:func:`select_source` picks one from the data options.
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
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePath

from longnet.data.reading import DocumentSource, InvalidFiles, file_listing
from longnet.validation import UsageError

STDLIB_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_ROW_FORMATS = {
    ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv"
}
_RECURSIVE = "**"
STDLIB_CORPUS = "stdlib"
_CORPUS_ENTRY = re.compile(
    r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(?:==(?P<version>[A-Za-z0-9][\w.+!-]*))?"
)


def _is_document(relative: PurePath) -> bool:
    """Whether ``relative`` is a ``*.py`` file outside :data:`STDLIB_SKIPPED_DIRS`."""
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
    """The ``*.py`` files the ``RECORD`` of ``distribution`` lists, as ``"<name>-<version>"``.

    Raises:
        UsageError: the distribution is missing, not ``version``, lists no such file, or has
            files that differ from its ``RECORD``.
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
            f"{len(files)} *.py files do not match its RECORD:\n{file_listing(problems)}\nThe "
            f"installation was modified; reinstall it: pip install --force-reinstall {pin}"
        )
    return DocumentSource(name=f"{dist.name}-{dist.version}", files=tuple(files), format="text")


def _installed_distribution(
    distribution: str, version: str | None
) -> importlib.metadata.Distribution:
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
    """Why the installed file ``path`` does not match its ``RECORD``, or None."""
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
    """The source of the corpus entries ``corpus`` (one or a list), in order: ``"stdlib"``
    (:func:`stdlib_source`), ``"<distribution>"`` or ``"<distribution>==<version>"``
    (:func:`package_source`); several sources are joined, their names by ``+``.

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
    """``(name, version or None)`` of a corpus entry such as ``"sympy==1.14.0"``."""
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
    :func:`corpus_source` of ``corpus``, or with neither :func:`stdlib_source`.

    Raises:
        ValueError: both ``data_files`` and ``corpus`` are given.
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
    """Local files matched by ``data_files`` (globs, ``~`` expanded), in pattern order, each
    pattern's files by path, each file once; ``invalid_files``: see :class:`DocumentSource`.

    Raises:
        FileNotFoundError: a pattern matches no file.
        ValueError: no or an empty pattern, mixed formats, or a bad ``invalid_files``.
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
    """The files ``pattern`` names, resolved and sorted: the file of that name, else the glob's."""
    if os.path.isfile(pattern):
        return [Path(pattern).resolve()]
    return sorted({Path(match).resolve() for match in _glob(pattern) if os.path.isfile(match)})


def _glob(pattern: str) -> Iterator[str]:
    """``glob.iglob(pattern, recursive=True)``, but ``**`` enters each linked folder once."""
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
    """``top`` and the folders below it, hidden ones left out, each real folder once."""
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


