"""Repository-level code documents: one document per package, its files read one after another.

A package read file after file has the far context a single file lacks. ``packages`` entries:

- ``"stdlib"``: each top-level module and package of the standard library, ``stdlib/<name>``;
- ``"installed"``: every distribution installed from a wheel (not editable) that keeps a file;
- ``"<distribution>"`` or ``"<distribution>==<version>"``: that one, the ``*.py`` files its
  ``RECORD`` lists, named by its PEP 503 normalized name.

Left out: tests, :data:`VENDORED_DIRS`, files over :data:`MAX_FILE_BYTES`, and, when read,
generated files (a ``#`` comment saying ``@generated``, ``do not edit``, ...) and non-UTF-8 ones.

Order: ``__init__.py`` first in each folder, then by name, depth first; each file is preceded
by ``# file: <path>``. A package goes whole into the split its name hashes to, or the one
``held_out`` names.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import json
import re
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePath

import numpy as np
from datasets import Dataset, Features, Value

from longnet.data.encoding import SPLITS, check_fractions, document_hash, split_of
from longnet.data.reading import DocumentSource
from longnet.data.sources import _CORPUS_ENTRY, _is_document, stdlib_source
from longnet.validation import UsageError, check_positive_int

STDLIB_PACKAGES = "stdlib"
INSTALLED_PACKAGES = "installed"
PACKAGES_FORMAT = "packages"
PACKAGES_FORMAT_VERSION = 1
"""Part of the cache key: raise it when the rules or the document layout change."""
MAX_FILE_BYTES = 1_000_000
GENERATED_HEAD_BYTES = 2048
VENDORED_DIRS = frozenset({"_vendor", "vendor", "_vendored", "vendored", "third_party",
                           "_third_party"})
HELD_OUT_SPLITS = ("validation", "test")
_TEST_FILE = re.compile(r"test_.*\.py|.*_test\.py|conftest\.py")
_GENERATED = re.compile(
    rb"^[ \t]*#[^\n]*(?:@generated|do not edit|auto-?generated|automatically generated"
    rb"|generated (?:by|from))",
    re.IGNORECASE | re.MULTILINE,
)
_SHOWN_NAMES = 8


@dataclass(frozen=True)
class Package:
    """One package, its files read as one document.

    Attributes:
        name: ``stdlib/<module>`` or the normalized distribution name.
        root: the folder the paths are relative to (``site-packages``, the stdlib's).
        paths: the files' POSIX paths, in reading order.
        split: the split the whole package goes to.
    """

    name: str
    root: Path
    paths: tuple[str, ...]
    split: str = "train"

    @property
    def files(self) -> tuple[Path, ...]:
        """The files, absolute, in reading order."""
        return tuple(self.root / path for path in self.paths)

    def text(self) -> str:
        """The document (module docstring); ``""`` when no file is kept."""
        parts = []
        for path in self.paths:
            text = _source_text((self.root / path).read_bytes())
            if text is not None:
                parts += [f"# file: {path}\n", text, "" if text.endswith("\n") else "\n"]
        return "".join(parts)


def _source_text(data: bytes) -> str | None:
    """``data`` decoded, or None for a generated file, a binary one or one not UTF-8."""
    if b"\0" in data or _GENERATED.search(data[:GENERATED_HEAD_BYTES]):
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class PackageSource(DocumentSource):
    """A :class:`~longnet.data.reading.DocumentSource` of one document per package."""

    packages: tuple[Package, ...] = ()

    def cache_fields(self) -> dict[str, object]:
        """The files' stats and every package's name, split, folder and number of files."""
        packages = [[p.name, p.split, str(p.root), len(p.paths)] for p in self.packages]
        return super().cache_fields() | {
            "packages": packages, "packages_version": PACKAGES_FORMAT_VERSION,
        }

    def read_documents(self, cache_dir: Path) -> Dataset:
        """One row per package: ``text`` (:meth:`Package.text`) and its ``split``."""
        return Dataset.from_generator(
            _package_rows,
            features=Features({"text": Value("string"), "split": Value("string")}),
            cache_dir=str(cache_dir),
            gen_kwargs={"packages": list(self.packages)},
        )


def _package_rows(packages: list[Package]) -> Iterator[dict[str, str]]:
    for package in packages:
        yield {"text": package.text(), "split": package.split}


def file_order(path: PurePath) -> tuple[str, ...]:
    """Sort key of a file's relative path: its parts, ``__init__.py`` first in its folder."""
    return (*path.parts[:-1], "" if path.name == "__init__.py" else path.name)


def _is_package_file(path: PurePath) -> bool:
    return (_is_document(path) and ".." not in path.parts
            and VENDORED_DIRS.isdisjoint(path.parts[:-1]) and not _TEST_FILE.fullmatch(path.name))


def _package(name: str, root: Path, paths: Iterable[PurePath], max_file_bytes: int) -> Package:
    """The package ``name`` of the files at ``paths`` (relative to ``root``) the rules keep."""
    kept = sorted((path for path in paths if _is_package_file(path)), key=file_order)
    return Package(name, root, tuple(
        path.as_posix() for path in kept if _fits(root / path, max_file_bytes)
    ))


def _fits(path: Path, max_bytes: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size <= max_bytes
    except OSError:
        return False


def canonical_name(name: str) -> str:
    """A package name as compared and hashed: a distribution's normalized, ``stdlib/...`` as is."""
    if name.startswith(f"{STDLIB_PACKAGES}/"):
        return name
    return re.sub(r"[-_.]+", "-", name).lower()


def package_split(name: str, val_fraction: float, test_fraction: float) -> str:
    """The split of the package ``name``: ``encoding.split_of`` of its name's BLAKE2b-64."""
    digest = document_hash(np.frombuffer(name.encode("utf-8"), dtype=np.uint8))
    return split_of(digest, val_fraction, test_fraction)


def stdlib_packages(max_file_bytes: int = MAX_FILE_BYTES) -> list[Package]:
    """The standard library's top-level modules and packages, by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    groups: dict[str, list[PurePath]] = {}
    for path in stdlib_source().files:
        relative = path.relative_to(root)
        top = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        if top.isidentifier():
            groups.setdefault(top, []).append(relative)
    packages = [_package(f"{STDLIB_PACKAGES}/{top}", root, groups[top], max_file_bytes)
                for top in sorted(groups)]
    return [package for package in packages if package.paths]


def _install_problem(dist: importlib.metadata.Distribution) -> str | None:
    """Why ``dist`` is not a wheel install whose files can be listed, or None."""
    if dist.read_text("RECORD") is None:
        return "has no RECORD (an egg-info or system install)"
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct_url.get("dir_info", {}).get("editable"):
        return f"is an editable install (its code is the checkout at {direct_url.get('url')})"
    return None


def _distribution_package(dist: importlib.metadata.Distribution, max_file_bytes: int) -> Package:
    root = Path(dist.locate_file(""))
    return _package(canonical_name(dist.name), root, dist.files or (), max_file_bytes)


def installed_packages(max_file_bytes: int = MAX_FILE_BYTES) -> list[Package]:
    """Every wheel-installed distribution that keeps a file, by name (``UsageError``: none)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        if dist.name:  # broken metadata has no name
            found.setdefault(canonical_name(dist.name), dist)
    packages = [_distribution_package(found[name], max_file_bytes) for name in sorted(found)
                if _install_problem(found[name]) is None]
    packages = [package for package in packages if package.paths]
    if not packages:
        raise UsageError(
            f"packages: {INSTALLED_PACKAGES!r} found no distribution installed from a wheel with "
            f"*.py files in this environment ({sys.prefix}); install some (pip install sympy) "
            f"or list {STDLIB_PACKAGES!r}."
        )
    return packages


def distribution_package(entry: str, max_file_bytes: int = MAX_FILE_BYTES) -> Package:
    """The package of the installed distribution ``entry`` (``"name"`` or ``"name==version"``).

    Raises:
        ValueError: a malformed ``entry``.
        UsageError: not installed, another version, not a wheel install, or no file kept.
    """
    match = _distribution_entry(entry)
    name, version = match["name"], match["version"]
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(
            f"packages: the distribution {name!r} is not installed in this environment "
            f"({sys.prefix}){_close_names(name, _installed_names())}; fix the name or install "
            f"it (pip install {entry})."
        ) from None
    pin = f"{dist.name}=={dist.version}"
    if version is not None and dist.version != version:
        raise UsageError(
            f"packages: {dist.name} {dist.version} is installed, not {entry}; install it (pip "
            f"install {entry}) or write {pin}."
        )
    problem = _install_problem(dist)
    if problem is not None:
        raise UsageError(
            f"packages: {pin} {problem}, so its files cannot be listed; install it from a "
            f"wheel (pip install --force-reinstall --no-deps {pin}) or leave it out."
        )
    package = _distribution_package(dist, max_file_bytes)
    if not package.paths:
        raise UsageError(
            f"packages: {pin} at {package.root} has no *.py file outside tests and vendored "
            f"folders of at most {max_file_bytes:,} bytes; leave it out."
        )
    return package


def _distribution_entry(entry: object) -> re.Match[str]:
    match = _CORPUS_ENTRY.fullmatch(entry) if isinstance(entry, str) else None
    if match is None:
        raise ValueError(
            f"packages entry {entry!r} is not {STDLIB_PACKAGES!r}, {INSTALLED_PACKAGES!r}, "
            "'<distribution>' or '<distribution>==<version>' (e.g. 'sympy==1.14.0'); fix it."
        )
    return match


def _package_entries(packages: str | Sequence[str]) -> list[str]:
    entries = [packages] if isinstance(packages, str) else list(packages)
    if not entries:
        raise ValueError(
            f"packages is empty; give {STDLIB_PACKAGES!r}, {INSTALLED_PACKAGES!r} and/or "
            "installed distributions such as 'sympy' or 'sympy==1.14.0'."
        )
    for entry in entries:
        if entry not in (STDLIB_PACKAGES, INSTALLED_PACKAGES):
            _distribution_entry(entry)
    repeated = [entry for entry, count in Counter(entries).items() if count > 1]
    if repeated:
        raise ValueError(f"packages repeats the entry {', '.join(map(repr, repeated))}; list "
                         "each entry once.")
    return entries


def _installed_names() -> list[str]:
    return sorted({canonical_name(d.name) for d in importlib.metadata.distributions() if d.name})


def _close_names(name: str, names: Sequence[str]) -> str:
    """``" (close: a, b)"`` naming the entries of ``names`` close to ``name``, or ``""``."""
    close = difflib.get_close_matches(canonical_name(name), names, n=3, cutoff=0.7)
    return f" (close: {', '.join(close)})" if close else ""


def _entry_packages(entry: str, max_file_bytes: int) -> list[Package]:
    if entry == STDLIB_PACKAGES:
        return stdlib_packages(max_file_bytes)
    if entry == INSTALLED_PACKAGES:
        return installed_packages(max_file_bytes)
    return [distribution_package(entry, max_file_bytes)]


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    return shown + (f" and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else "")


def _check_held_out(held_out: object) -> None:
    """``ValueError`` unless ``held_out`` is ``{"validation": [...], "test": [...]}``."""
    form = "held_out must be {validation: [<package>, ...], test: [<package>, ...]}"
    if not isinstance(held_out, Mapping) or set(held_out) != set(HELD_OUT_SPLITS):
        raise ValueError(f"{form}, got {held_out!r}.")
    for split in HELD_OUT_SPLITS:
        entries = held_out[split]
        if not isinstance(entries, list | tuple) or not entries or not all(
                isinstance(entry, str) for entry in entries):
            raise ValueError(f"{form}: {split} must be a non-empty list of package names, got "
                             f"{entries!r}.")


def held_out_splits(held_out: object, names: Sequence[str]) -> dict[str, str]:
    """``{package name: "validation" or "test"}`` from ``held_out`` (``ValueError`` if bad)."""
    _check_held_out(held_out)
    assigned: dict[str, str] = {}
    for split in HELD_OUT_SPLITS:
        for entry in held_out[split]:
            name = canonical_name(entry)
            if name not in names:
                raise ValueError(
                    f"held_out: {split} names {entry!r}, which is not one of the {len(names)} "
                    f"packages{_close_names(entry, names)}; fix the name or add it to packages."
                )
            if name in assigned:
                raise ValueError(f"held_out names {entry!r} twice; hold each package out once.")
            assigned[name] = split
    if len(assigned) == len(names):
        raise ValueError(
            f"held_out holds out all {len(names)} packages; none is left to train on. Add "
            "packages or hold out fewer."
        )
    return assigned


def package_splits(names: Sequence[str], held_out: object, val_fraction: float,
                   test_fraction: float) -> list[str]:
    """The split of each package of ``names``: by ``held_out`` (the rest in train) when given,
    else :func:`package_split`.

    Raises:
        ValueError: a bad ``held_out``.
        UsageError: a split without a package.
    """
    if held_out is not None:
        assigned = held_out_splits(held_out, names)
        return [assigned.get(name, "train") for name in names]
    splits = [package_split(name, val_fraction, test_fraction) for name in names]
    empty = [split for split in SPLITS if split not in splits]
    if empty:
        raise UsageError(
            f"{len(names)} packages ({_listing(list(names))}) give the "
            f"{' and '.join(empty)} split no package: a package goes whole into the split "
            f"its name hashes to (val_fraction={val_fraction}, test_fraction={test_fraction}). "
            "Add packages, raise the fractions, or choose them: held_out: {validation: "
            "[<package>], test: [<package>]}."
        )
    return splits


def repository_source(
    packages: str | Sequence[str],
    held_out: Mapping[str, Sequence[str]] | None = None,
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> PackageSource:
    """The packages of ``packages`` (one entry or a list, module docstring), one document each,
    split by ``held_out`` when given, else :func:`package_split`; files over ``max_file_bytes``
    are left out.

    Raises:
        ValueError: a bad option (all checked before any package is read).
        UsageError: a distribution that cannot be read, or a split without a package.
    """
    check_fractions(val_fraction, test_fraction)
    max_file_bytes = check_positive_int("max_file_bytes", max_file_bytes)
    if held_out is not None:
        _check_held_out(held_out)
    entries = _package_entries(packages)
    found = [package for entry in entries for package in _entry_packages(entry, max_file_bytes)]
    twice = sorted(name for name, count in Counter(p.name for p in found).items() if count > 1)
    if twice:
        why = (f" ({INSTALLED_PACKAGES!r} includes every installed distribution)"
               if INSTALLED_PACKAGES in entries else "")
        raise ValueError(f"packages lists {len(twice)} package(s) more than once{why}: "
                         f"{_listing(twice)}; list each once.")
    splits = package_splits([p.name for p in found], held_out, val_fraction, test_fraction)
    found = [replace(package, split=split) for package, split in zip(found, splits)]
    return PackageSource(
        name=PACKAGES_FORMAT,
        files=tuple(path for package in found for path in package.files),
        format=PACKAGES_FORMAT,
        packages=tuple(found),
    )


def check_package_options(
    packages: object, held_out: object, data_files: object, corpus: object
) -> None:
    """``ValueError`` for ``packages`` with ``data_files``/``corpus``, or ``held_out`` alone."""
    if packages is None and held_out is not None:
        raise ValueError("held_out is set without packages; it names packages of the "
                         "packages corpus: set packages, or unset held_out.")
    given = [name for name, value in (("data_files", data_files), ("corpus", corpus))
             if value is not None]
    if packages is not None and given:
        raise ValueError(
            f"packages and {' and '.join(given)} are both set; set one: packages reads one "
            "document per package (stdlib modules, installed distributions), corpus one per "
            "file, data_files local files."
        )
