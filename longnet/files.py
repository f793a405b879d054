"""Files and folders replaced whole (a reader sees the old version or the new one, a killed
writer leaves a valid one), and the checks that refuse a bad target before any work.

The swap is one ``renameat2(RENAME_EXCHANGE)`` on Linux, else two renames (the path is absent
in between: :func:`open_files` waits). A kill leaves ``.<name>.tmp-*``/``.old-*`` siblings.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import BinaryIO

from longnet.validation import UsageError

OPEN_ATTEMPTS = 50
"""How often :func:`open_files` opens a folder that keeps being replaced before giving up."""
_RETRY_SECONDS = 0.002
WRITE_FIXES = {errno.EFBIG: "raise the file size limit (ulimit -f)",
               errno.ENOSPC: "free space on the disk", errno.EDQUOT: "free space in your quota",
               errno.EROFS: "give a path on a writable file system"}
"""What the user can do about each write the machine refused."""
REFUSED_WRITE_ERRNOS = frozenset(WRITE_FIXES)
"""Errors of a write the machine refused (:data:`WRITE_FIXES`)."""
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (``str`` as UTF-8) to ``path`` whole or not at all; returns ``path``.

    Raises:
        UsageError: ``path`` is empty.
        OSError: a refused write (:data:`REFUSED_WRITE_ERRNOS`); the old file is kept.
    """
    path = check_path_given(path, "file")
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = _sibling(path, "tmp")
    try:
        with open(temp, "xb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):  # a read-only file system refuses this too
            temp.unlink(missing_ok=True)
        _raise_refused_write(err, path)
        raise
    return path


@contextmanager
def replace_folder(directory: str | Path, owned: Collection[str] = (),
                   what: str = "folder") -> Iterator[Path]:
    """Replace the folder ``directory`` by what the ``with`` block writes into the yielded
    temporary folder, in one step when the block ends.

    Old entries the block did not write are carried over (hard links or copies), except the
    names in ``owned``. A symbolic link is followed. Concurrent writers are safe: the last to
    finish wins. ``what`` names ``directory`` in the messages.

    Raises:
        UsageError: as :func:`check_replaceable_folder`, before the block runs.
        OSError: a refused write (:data:`REFUSED_WRITE_ERRNOS`); the old folder is kept.
    """
    check_replaceable_folder(directory, what)
    target = Path(os.path.realpath(directory))
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = _sibling(target, "tmp")
    temp.mkdir()
    try:
        yield temp
        for entry in os.scandir(temp):
            if entry.is_file(follow_symlinks=False):
                _fsync(entry.path, os.O_RDONLY)
        while target.is_dir():
            try:
                _carry_over(target, temp, skip=set(owned))
                os.chmod(temp, stat.S_IMODE(target.stat().st_mode))
                break
            except FileNotFoundError:  # another writer replaced it meanwhile: read the new one
                continue
        _swap_in(temp, target)
        _fsync(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    except BaseException as err:
        shutil.rmtree(temp, ignore_errors=True)
        _raise_refused_write(err, Path(directory))
        raise


@contextmanager
def open_files(directory: str | Path, names: Sequence[str]) -> Iterator[dict[str, BinaryIO]]:
    """The files ``names`` of ``directory``, open for binary reading, all from one version of
    the folder; names absent from it are left out.

    Raises:
        FileNotFoundError: there is no folder at ``directory``.
        NotADirectoryError: ``directory`` is a file.
        UsageError: an empty path, or :data:`OPEN_ATTEMPTS` replacements while opening.
    """
    directory = check_path_given(directory, "folder")
    for attempt in range(OPEN_ATTEMPTS):
        if attempt:
            time.sleep(_RETRY_SECONDS)
        try:
            with ExitStack() as stack:
                handles = _open_version(directory, names, stack.enter_context)
                if handles is not None:
                    stack.pop_all()
                    break
        except FileNotFoundError:  # the folder itself: absent, or between two renames
            if attempt == OPEN_ATTEMPTS - 1:
                raise FileNotFoundError(f"no folder at {directory}.") from None
    else:
        raise UsageError(
            f"{directory} was replaced {OPEN_ATTEMPTS} times while it was being read; read it "
            "when the program writing it is done."
        )
    try:
        yield handles
    finally:
        for handle in handles.values():
            handle.close()


def check_output_folder(path: str | Path, files: Sequence[str] = (), what: str = "--out") -> Path:
    """Refuse, before any work, an output folder whose ``files`` cannot be written.

    Raises:
        UsageError: naming the path, what is wrong and the fix.
    """
    path = check_path_given(path, what)
    _check_writable(path, path, what)
    for name in files if path.is_dir() else ():
        file = path / name
        if file.is_dir():
            raise UsageError(
                f"{what} {path}: {file} is a folder where a file is to be written; give "
                f"another {what} or move it away."
            )
        if file.exists() and not os.access(file, os.W_OK):
            raise UsageError(
                f"{what} {path}: {file} is read-only; give another {what} or make it writable."
            )
    return path


def check_replaceable_folder(path: str | Path, what: str = "folder") -> Path:
    """Refuse, before any work, a folder :func:`replace_folder` cannot or must not replace.

    Raises:
        UsageError: a file, the current folder or one holding it, or an unwritable parent.
    """
    path = check_path_given(path, what)
    if os.path.lexists(path) and not path.is_dir():
        raise UsageError(
            f"{what} {path} is a file, not a folder; give a folder path or move the file away."
        )
    target, cwd = Path(os.path.realpath(path)), Path(os.path.realpath(os.getcwd()))
    if target == cwd or target in cwd.parents:
        where = "the current folder" if target == cwd else f"a folder holding the current " \
            f"folder {cwd}"
        raise UsageError(
            f"{what} {path} is {where}: it would be replaced whole by a new folder; give a "
            f"folder of its own, e.g. {path / 'model'}."
        )
    _check_writable(target.parent, path, what)
    return path


MODEL_NAMES = frozenset({"config.json", "lora.json", "index.json", "handoff.json", ".metadata"})
"""Names that make a folder a model, LoRA delta, state, handoff or folder of shards."""
MODEL_SUFFIXES = (".safetensors", ".ckpt", ".gguf", ".bin", ".pt", ".pth")
"""Suffixes of weights and checkpoint files."""
OVERWRITE_FIX = "pass --overwrite (overwrite=True from Python) to replace it"
"""How a writer is asked to replace what its target holds (:func:`check_target`)."""


def held_model(path: str | Path) -> str | None:
    """What at ``path`` a writer must not replace unasked (a file or a model), or None."""
    path = Path(path)
    if path.is_file():
        return f"a file of {path.stat().st_size:,} bytes"
    names = sorted(model_entries(path))
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"a model or checkpoint ({shown})"


def model_entries(folder: str | Path) -> set[str]:
    """The names in ``folder`` that make it a model, checkpoint or state (a writer's own)."""
    folder = Path(folder)
    if not folder.is_dir():
        return set()
    return {name for name in os.listdir(folder)
            if name in MODEL_NAMES or name.endswith(MODEL_SUFFIXES)}


def check_target(path: str | Path, *, sources: Mapping[str, str | Path | None] | None = None,
                 overwrite: bool = False, what: str = "OUTPUT", kind: str = "folder") -> Path:
    """Refuse, before any work, a target a writer of a model folder, checkpoint or state must
    not write; returns ``path``.

    Raises:
        UsageError: ``path`` overlaps one of ``sources`` (``{description: path}`` the write
            reads), holds a model (:func:`held_model`) and not ``overwrite``, or fails
            :func:`check_replaceable_folder` (``kind="folder"``; for a file: a folder, an
            unwritable parent).
    """
    path = check_path_given(path, what)
    for description, source in (sources or {}).items():
        if source is not None and os.path.lexists(source):
            _check_apart(path, Path(source), description, what)
    if kind == "folder":
        check_replaceable_folder(path, what)
    elif path.is_dir():
        raise UsageError(
            f"{what} {path} is a folder, not a checkpoint file; give the file's path, e.g. "
            f"{path / 'last.ckpt'}."
        )
    held = None if overwrite else held_model(path)
    if held:
        raise UsageError(
            f"{what} {path} already holds {held}; {OVERWRITE_FIX}, or give a new "
            f"{'folder' if kind == 'folder' else 'file path'}."
        )
    if kind == "file":
        _check_writable(path.parent, path, what)
    return path


def check_path_given(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a ``Path``, refusing ``""`` (:class:`UsageError`): it is the current folder."""
    if os.fspath(path) == "":
        raise UsageError(f"{what} is empty; give a path (an empty path would be the current "
                         f"folder, {os.getcwd()}).")
    return Path(path)


def refused_write(err: BaseException) -> bool:
    """Whether ``err`` is a write the machine refused: the user's to fix, not a bug."""
    return isinstance(err, OSError) and err.errno in REFUSED_WRITE_ERRNOS


def refused_write_line(err: OSError, rerun: str = "") -> str:
    """The one-line report of a :func:`refused_write`, with its fix."""
    where = f" to {err.filename}" if err.filename else ""
    return (f"error: a write{where} failed: {err.strerror} (errno {err.errno}). "
            f"{WRITE_FIXES[err.errno].capitalize()}, then run the command again{rerun}.")


def link_or_copy(source: str | Path, destination: str | Path) -> None:
    """Hard-link ``source`` to ``destination``, or copy it where links are refused."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


# ---------------------------------------------------------------------- helpers
def _sibling(path: Path, kind: str) -> Path:
    """A fresh name next to ``path``: ``.<name>.<kind>-<random>``."""
    return path.with_name(f".{path.name[:200]}.{kind}-{secrets.token_hex(6)}")


def _check_apart(path: Path, source: Path, description: str, what: str) -> None:
    """Refuse ``path`` when it is ``source``, holds it or is inside it (real paths)."""
    target, other = Path(os.path.realpath(path)), Path(os.path.realpath(source))
    if target == other:
        where = "is"
    elif other in target.parents:
        where = "is inside"
    elif target in other.parents:
        where = "holds"
    else:
        return
    raise UsageError(
        f"{what} {path} {where} {description} {source}: writing there would destroy what it "
        "reads, so this is refused even with --overwrite. Give a new folder outside it."
    )


def _check_writable(folder: Path, subject: Path, what: str) -> None:
    """The nearest existing one of ``folder`` and its parents must be a writable folder."""
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(
            f"{what} {subject}: {existing} is a file, not a folder; give another {what} or "
            "move the file away."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(
            f"{what} {subject}: cannot write in {existing} (no write permission, or a "
            f"read-only file system); give another {what} or make {existing} writable."
        )


def _raise_refused_write(err: BaseException, path: Path) -> None:
    """Raise ``OSError(errno, strerror, path)`` from a refused write ``err``; else return."""
    if isinstance(err, OSError):
        code = err.errno
    else:
        found = re.search(r"\(os error (\d+)\)", str(err))
        code = int(found[1]) if found else None
    if code in REFUSED_WRITE_ERRNOS:
        raise OSError(code, os.strerror(code), str(path)) from err


def _fsync(path: str | Path, flags: int) -> None:
    handle = os.open(path, flags)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _open_version(
    directory: Path, names: Sequence[str], keep: Callable[[BinaryIO], BinaryIO]
) -> dict[str, BinaryIO] | None:
    """``names`` opened relative to one handle of ``directory``; None if it was replaced."""
    folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        handles = {}
        for name in names:
            try:
                handles[name] = keep(os.fdopen(os.open(name, os.O_RDONLY, dir_fd=folder), "rb"))
            except FileNotFoundError:
                continue
        if len(handles) == len(names):
            return handles
        # While ``folder`` is open its inode cannot be reused: equal ids mean the same folder.
        opened = os.fstat(folder)
        try:
            now = os.stat(directory)
        except FileNotFoundError:
            return None
        same = (opened.st_dev, opened.st_ino) == (now.st_dev, now.st_ino)
        return handles if same else None
    finally:
        os.close(folder)


def _carry_over(source: Path, target: Path, skip: set[str]) -> None:
    """Link (or copy) into ``target`` every entry of ``source`` that ``target`` lacks."""
    for entry in os.scandir(source):
        destination = target / entry.name
        if entry.name in skip or os.path.lexists(destination):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), destination)
        elif entry.is_dir():
            shutil.copytree(entry.path, destination, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(entry.path, destination)


def _swap_in(temp: Path, target: Path) -> None:
    """Put the complete folder ``temp`` at ``target`` and delete what was there."""
    while True:
        try:
            os.rename(temp, target)  # nothing (or an empty folder) at target
            return
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        try:
            if _exchange(temp, target):
                shutil.rmtree(temp)  # the old version now
                return
        except FileNotFoundError:  # another writer moved target away meanwhile
            continue
        old = _sibling(target, "old")
        try:
            os.rename(target, old)
        except FileNotFoundError:
            continue
        try:
            os.rename(temp, target)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                os.rename(old, target)
                raise
            shutil.rmtree(old)  # another writer got in first: replace its version next
            continue
        shutil.rmtree(old)
        return


def _exchange(first: Path, second: Path) -> bool:
    """Exchange two paths in one step; False where the system or file system cannot.

    Raises:
        FileNotFoundError: either path is absent.
    """
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second),
                 _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """The C library's ``renameat2`` (Linux, glibc >= 2.28), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    function.restype = ctypes.c_int
    return function
