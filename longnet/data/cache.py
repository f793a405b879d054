"""The on-disk cache of processed corpora: where it lives, how entries are keyed and built.

An entry ``<cache_dir>/<name>-<fingerprint>`` (a hash of the files' sizes and mtimes and the
settings) is built in a staging folder and renamed into place when complete. Nothing is evicted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from longnet.files import check_output_folder
from longnet.validation import UsageError

COMPLETE_MARKER = "COMPLETE"
CACHE_VARIABLE = "LONGNET_CACHE"


def default_cache_dir() -> Path:
    """The user's cache folder: ``$LONGNET_CACHE`` when set (``~`` expanded), else
    ``$XDG_CACHE_HOME/longnet`` when that is absolute, else ``~/.cache/longnet``.

    Raises:
        UsageError: ``LONGNET_CACHE`` is set to an empty string.
    """
    chosen = os.environ.get(CACHE_VARIABLE)
    if chosen is not None:
        if not chosen.strip():
            raise UsageError(
                f"{CACHE_VARIABLE} is set but empty; set it to the folder for longnet's "
                f"processed corpora, or unset it to use {_user_cache_dir()}."
            )
        return Path(chosen).expanduser()
    return _user_cache_dir()


def _user_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "longnet"


def cache_folder(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The cache folder a ``cache_dir`` option names (``~`` expanded; None: the default).

    Raises:
        ValueError: ``cache_dir`` is an empty string.
    """
    if cache_dir is None:
        return default_cache_dir()
    if not str(cache_dir).strip():
        raise ValueError(
            f"cache_dir is empty; give a folder, or leave it unset (null) for the user cache "
            f"folder ({CACHE_VARIABLE}, else ~/.cache/longnet)."
        )
    return Path(cache_dir).expanduser()


def fingerprint(payload: Mapping[str, Any]) -> str:
    """16 hex digits of the SHA-256 of ``payload`` as canonical JSON."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def is_complete(entry: Path) -> bool:
    """Whether ``entry`` is a finished cache entry."""
    return (entry / COMPLETE_MARKER).is_file()


def build_once(entry: Path, build: Callable[[Path], None]) -> bool:
    """Make the cache entry ``entry`` with ``build(staging_dir)`` unless it is complete.

    Returns:
        Whether this call ran ``build``.

    Raises:
        UsageError: (before ``build``) the cache folder cannot be written.
    """
    if is_complete(entry):
        return False
    check_output_folder(entry.parent, what="cache_dir")
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{entry.name}.partial-", dir=entry.parent))
    try:
        build(staging)
        (staging / COMPLETE_MARKER).write_text("ok\n")
        if is_complete(entry):  # another process finished the same entry meanwhile
            shutil.rmtree(staging)
        else:
            if entry.exists():
                shutil.rmtree(entry)
            os.replace(staging, entry)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True
