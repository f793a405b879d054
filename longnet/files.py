"""Files and folders replaced whole: a reader sees the old version or the new one, never a torn file
or a mix of the two, and a writer killed at any instant leaves a valid version.

:func:`write_atomic` replaces one file, :func:`replace_folder` a folder of files that belong
together (a model: its config and its weights); :func:`open_files` reads a folder's files from one
version of it. Before any work, :func:`check_output_folder` refuses an output that cannot be
written, and :func:`check_target` (every writer of a model folder, checkpoint or state) a target
that must not be replaced; an empty path is refused everywhere (:func:`check_path_given`).

The swap: on Linux one ``renameat2(RENAME_EXCHANGE)`` call exchanges the two folders, so the path
always holds a complete version. Where the system or the file system cannot (macOS, NFS, ...), two
renames: the old folder moves to ``.<name>.old-<random>``, then the new one in; for that instant the
path is absent (:func:`open_files` waits for it; a reader that looks for the folder itself then
finds none), and a kill in between leaves the old version under the ``.old-`` name. A kill before
the swap leaves a ``.<name>.tmp-<random>`` folder or file next to the target, ignored by readers,
which can be deleted.

New files and folders get the permission bits of anything created with ``open`` / ``mkdir``
(``0o666`` / ``0o777`` less the umask: ``0644`` / ``0755`` under umask ``022``); a replaced folder
keeps the old one's bits. Reading needs ``dir_fd`` (POSIX systems).
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
"""What the user can do about each write the machine refused: no room (the file size limit, a
full disk, a quota) or a read-only file system."""
REFUSED_WRITE_ERRNOS = frozenset(WRITE_FIXES)
"""Errors of a write the machine refused (:data:`WRITE_FIXES`)."""
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (``str`` as UTF-8) to ``path`` whole or not at all; returns ``path``.

    The data goes to ``.<name>.tmp-<random>`` next to ``path``, is flushed to disk and renamed
    over it: a concurrent reader sees the old content or the new one; a kill leaves the old
    file. The parent folders are created. The file gets the bits of a new file (module
    docstring).

    Raises:
        UsageError: ``path`` is empty.
        OSError: no room for the file or a read-only file system
            (:data:`REFUSED_WRITE_ERRNOS`, naming ``path``); the old file is kept.
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
    (empty, temporary) folder, in one step when the block ends (module docstring).

    Entries of the old folder that the block did not write are carried over (hard links, or
    copies where links are refused), except the names in ``owned``: the files this writer
    makes, which a new version must not inherit from an old one. A symbolic link at
    ``directory`` is followed: the folder it points to is replaced. Concurrent writers are
    safe: the last to finish wins. ``what`` names ``directory`` in the messages.

    Raises:
        UsageError: ``directory`` is empty, a file, the current folder or a folder holding it,
            or its parent cannot be written (before the block runs).
        OSError: no room for the new version or a read-only file system
            (:data:`REFUSED_WRITE_ERRNOS`, naming ``directory``); the old folder is kept.
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
    the folder (see :func:`replace_folder`); names absent from that version are left out.

    The folder is opened once and every file relative to it, so a folder swapped in the
    meantime changes nothing. A file missing because a writer deleted the version being
    opened (the path now holds another) makes it open the current version again.

    Raises:
        FileNotFoundError: there is no folder at ``directory``.
        NotADirectoryError: ``directory`` is a file.
        UsageError: ``directory`` is empty, or the folder was replaced :data:`OPEN_ATTEMPTS`
            times in a row while being opened.
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
    """Refuse, before any work, an output folder whose ``files`` cannot be written; returns
    ``path``.

    ``path`` may be absent (it is created later) if its nearest existing parent is a writable
    folder; an existing ``path`` must be a writable folder, and each of ``files`` (names
    inside it) absent or a writable file; it must not be empty. ``what`` names the setting in
    the messages.

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
    """Refuse, before any work, a folder :func:`replace_folder` cannot or must not replace: an
    empty path, a file, the current folder or a folder holding it (the folder being worked in
    would be swapped for a new one), or one (existing or not) whose parent cannot be written;
    returns ``path``. ``what`` names the setting in the messages.

    Raises:
        UsageError: naming the path, what is wrong and the fix.
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
"""Names that make a folder a model, LoRA delta, packed state, handoff or folder of shards
(``.metadata``: ``torch.distributed.checkpoint``'s index)."""
MODEL_SUFFIXES = (".safetensors", ".ckpt", ".gguf", ".bin", ".pt", ".pth")
"""Suffixes of weights and checkpoint files."""
OVERWRITE_FIX = "pass --overwrite (overwrite=True from Python) to replace it"
"""How a writer is asked to replace what its target holds (:func:`check_target`)."""


def held_model(path: str | Path) -> str | None:
    """What at ``path`` a writer must not replace unasked: ``"a file of N bytes"`` for a file,
    ``"a model or checkpoint (names)"`` for a folder holding :func:`model_entries`; None for
    nothing, or a folder of other files (which the writers keep: :func:`replace_folder`)."""
    path = Path(path)
    if path.is_file():
        return f"a file of {path.stat().st_size:,} bytes"
    names = sorted(model_entries(path))
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"a model or checkpoint ({shown})"


def model_entries(folder: str | Path) -> set[str]:
    """The names in ``folder`` that make it a model, checkpoint or state (:data:`MODEL_NAMES`,
    :data:`MODEL_SUFFIXES`; none for no folder): what a writer replacing it owns, so that the
    new version inherits none of them (:func:`replace_folder`'s ``owned``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return set()
    return {name for name in os.listdir(folder)
            if name in MODEL_NAMES or name.endswith(MODEL_SUFFIXES)}


def check_target(path: str | Path, *, sources: Mapping[str, str | Path | None] | None = None,
                 overwrite: bool = False, what: str = "OUTPUT", kind: str = "folder") -> Path:
    """Refuse, before any work, a target a writer of a model folder, checkpoint or state must
    not write; returns ``path``.

    - ``path`` is, holds or is inside one of ``sources`` (``{description: path}``: what the
      write reads, e.g. ``{"the source": SRC, "the LoRA base": BASE}``; None values and
      absent paths are skipped), compared by ``os.path.realpath``: always refused,
      ``overwrite`` or not;
    - ``path`` holds a model or checkpoint (:func:`held_model`): refused unless ``overwrite``;
    - ``kind="folder"``: as :func:`check_replaceable_folder`; ``kind="file"``: ``path`` must
      not be a folder and its parent must be writable.

    Raises:
        UsageError: any of the above, naming the path (as ``what``), what it holds and the fix.
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
    """``path`` as a :class:`~pathlib.Path`, refusing an empty one (:class:`UsageError`):
    ``Path("")`` is the current folder, so an empty setting would read or write there without
    a word. (Only a string can be empty: check a setting before turning it into a ``Path``.)
    ``what`` names the setting in the message."""
    if os.fspath(path) == "":
        raise UsageError(f"{what} is empty; give a path (an empty path would be the current "
                         f"folder, {os.getcwd()}).")
    return Path(path)


def refused_write(err: BaseException) -> bool:
    """Whether ``err`` is a write the machine refused (:data:`REFUSED_WRITE_ERRNOS`): the
    user's to fix, not a bug."""
    return isinstance(err, OSError) and err.errno in REFUSED_WRITE_ERRNOS


def refused_write_line(err: OSError, rerun: str = "") -> str:
    """``error: a write to <file> failed: <reason> (errno N). <The fix>, then run the command
    again<rerun>.``: how the ``longnet`` command and the scripts report a
    :func:`refused_write`."""
    where = f" to {err.filename}" if err.filename else ""
    return (f"error: a write{where} failed: {err.strerror} (errno {err.errno}). "
            f"{WRITE_FIXES[err.errno].capitalize()}, then run the command again{rerun}.")


def link_or_copy(source: str | Path, destination: str | Path) -> None:
    """Make ``destination`` a hard link to the file ``source``, or a copy where the file system
    refuses links (another device, no link support)."""
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
    """The nearest existing one of ``folder`` and its parents must be a writable folder (for
    the messages: ``subject`` is the path given as ``what``)."""
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
    """Raise ``OSError(errno, strerror, path)`` from ``err`` when ``err`` is a write the machine
    refused (:data:`REFUSED_WRITE_ERRNOS`): an ``OSError`` (naming no file, or the temporary
    one), or an error whose message says ``(os error N)`` (``safetensors``' way); else
    return."""
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
    """``names`` opened relative to one open handle of ``directory`` (each handed to
    ``keep``); None when one is missing because the folder was replaced meanwhile."""
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
