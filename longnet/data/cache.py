"""The on-disk cache of processed corpora: where it lives, how entries are keyed and built.

An entry is a folder ``<cache_dir>/<name>-<fingerprint>``; the fingerprint is a hash of
everything the processed data depends on (the source files with their sizes and modification
times, and the processing settings), so any change builds a new entry and an unchanged setup
reuses the old one. Entries are built in a staging folder next to the target and renamed into
place when complete, so a crash never leaves a half-written entry that looks finished, and
concurrent builders (one per node) cannot corrupt each other. Stale entries are never deleted
automatically; remove ``data/cache/`` to reclaim space.
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

COMPLETE_MARKER = "COMPLETE"


def default_cache_dir() -> Path:
    """``data/cache`` of the repository holding this package (a source checkout or editable
    install); for an installed package, ``data/cache`` under the current directory."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "longnet").is_dir():
        return root / "data" / "cache"
    return Path.cwd() / "data" / "cache"


def fingerprint(payload: Mapping[str, Any]) -> str:
    """16 hex digits of the SHA-256 of ``payload`` as canonical JSON."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def is_complete(entry: Path) -> bool:
    """Whether ``entry`` is a finished cache entry."""
    return (entry / COMPLETE_MARKER).is_file()


def build_once(entry: Path, build: Callable[[Path], None]) -> bool:
    """Make the cache entry ``entry`` with ``build(staging_dir)`` unless it is complete already.

    Returns:
        True when this call ran ``build``, False when the entry was already complete.

    Raises:
        UsageError: (before ``build``) the cache folder ``entry.parent`` is a file, lies below
            one, or cannot be written.
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
