"""Where named models live: the folders of ``models/`` at the repository root.

The zoo folder is found relative to this package, ``Path(__file__).parents[2] / "models"``
(``longnet/modeling/hub.py`` -> repository root), i.e. it exists in a source checkout or an
editable install.  Set the environment variable ``LONGNET_MODELS_DIR`` to use another folder
(e.g. for a non-editable install).
"""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIR_ENV = "LONGNET_MODELS_DIR"


def models_dir() -> Path:
    """The zoo folder (``$LONGNET_MODELS_DIR`` or ``<repo>/models``)."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "models"


def list_models() -> list[str]:
    """Names of the zoo models: sub-folders of :func:`models_dir` that hold a ``config.json``."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())


def resolve_model_dir(name_or_dir: str | os.PathLike) -> Path:
    """A folder holding ``config.json``: an existing folder path, or a zoo model name."""
    path = Path(name_or_dir)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json; give a folder written by save_pretrained, a "
                "Hugging Face checkpoint folder, or a zoo name."
            )
        return path
    name = str(name_or_dir)
    candidate = models_dir() / name
    if name and "/" not in name and (candidate / "config.json").is_file():
        return candidate
    known = list_models()
    raise FileNotFoundError(
        f"{name!r} is neither a model folder nor a known model name. Known models (in "
        f"{models_dir()}): {', '.join(known) if known else 'none'}."
    )
