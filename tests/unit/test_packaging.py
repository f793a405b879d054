"""The package's shape: its layers import downwards only (docs/architecture.md §1); the wheel
holds every package of ``longnet/`` and the zoo (``models/`` as ``longnet/_zoo``), and an
installed package finds that zoo. ``.ci/run`` builds and installs the real wheel and loads a
zoo model from it; these tests check the pieces without a build."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from longnet.modeling import hub

REPO = Path(__file__).resolve().parents[2]


LAYERS = ["constants", "validation", "files", "denormals", "distributed", "attention", "nn",
          "modeling", "planning", "data", "training", "eval", "hf", "bench", "cli", "__main__"]
"""``longnet``'s layers from the bottom up: shared constants and validators, atomic file
writes, the CPU's subnormal-float switch, the process-group launcher, then the library's layers
(``planning``: the memory models, over attention and modeling), the Hugging Face adapters
(``hf``, on top of evaluation: its lm-eval harness loads models with ``longnet.eval``), the
benchmark harness, and ``cli``/``__main__`` (the command) on top."""


def _layer(module: str) -> int:
    """Layer index of a ``longnet...`` module name; -1 for the package root ``longnet``, which
    imports none of the layers (``import longnet`` stays light)."""
    parts = module.removesuffix(".__init__").split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 else -1


def test_layers_import_downwards_only():
    upward = []
    for path in sorted(REPO.glob("longnet/**/*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        own = _layer(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # lazy imports too
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                assert not isinstance(node, ast.ImportFrom), f"{path}: use absolute imports"
                continue
            for name in names:
                if name.startswith("longnet.") and _layer(name) > own:
                    upward.append(f"{module} imports {name}")
    assert upward == []


HF_ONLY = ("transformers", "tokenizers", "lm_eval")
"""Packages of the optional extras ``hf`` / ``eval-harness``, imported by ``longnet.hf`` only."""


def test_only_longnet_hf_imports_the_hugging_face_extras():
    offending = []
    for path in sorted(REPO.glob("longnet/**/*.py")):
        if path.relative_to(REPO).parts[1] == "hf":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            offending += [f"{path.name} imports {n}" for n in names
                          if n.split(".")[0] in HF_ONLY]
    assert offending == []


def _setuptools_config() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_and_the_zoo_are_in_the_wheel():
    config = _setuptools_config()
    packages = set(config["packages"])
    inits = REPO.glob("longnet/**/__init__.py")
    on_disk = {".".join(init.parent.relative_to(REPO).parts) for init in inits}
    assert on_disk - packages == set(), "add these packages to [tool.setuptools] packages"
    assert packages - on_disk == {f"longnet.{hub.PACKAGED_ZOO}"}
    assert config["package-dir"] == {f"longnet.{hub.PACKAGED_ZOO}": "models"}
    assert config["package-data"][f"longnet.{hub.PACKAGED_ZOO}"] == ["**/*"]


def _fake_install(root: Path, monkeypatch) -> Path:
    """A copy of ``hub.py`` at ``root/longnet/modeling/hub.py``, as a wheel installs it."""
    fake = root / "longnet" / "modeling" / "hub.py"
    fake.parent.mkdir(parents=True)
    shutil.copy(hub.__file__, fake)
    monkeypatch.setattr(hub, "__file__", str(fake))
    monkeypatch.delenv(hub.MODELS_DIR_ENV, raising=False)
    return root / "longnet" / hub.PACKAGED_ZOO


def test_installed_package_finds_the_zoo_it_carries(tmp_path, monkeypatch):
    """In site-packages the zoo is longnet/_zoo, even when site-packages has a stray
    ``models`` folder of some other distribution."""
    zoo = _fake_install(tmp_path / "site-packages", monkeypatch)
    (tmp_path / "site-packages" / "models" / "other").mkdir(parents=True)
    (zoo / "longnet-x").mkdir(parents=True)
    (zoo / "longnet-x" / "config.json").write_text("{}")
    assert hub.models_dir() == zoo
    assert hub.list_models() == ["longnet-x"]
    assert hub.resolve_model_dir("longnet-x") == zoo / "longnet-x"
    monkeypatch.setenv(hub.MODELS_DIR_ENV, str(tmp_path / "elsewhere"))
    assert hub.models_dir() == tmp_path / "elsewhere"


def test_checkout_reads_its_models_folder(tmp_path, monkeypatch):
    """A source checkout (or editable install) reads and writes the top-level models/."""
    _fake_install(tmp_path / "checkout", monkeypatch)
    (tmp_path / "checkout" / "models").mkdir()
    (tmp_path / "checkout" / "pyproject.toml").write_text("")
    assert hub.models_dir() == tmp_path / "checkout" / "models"


def test_attention_modules_stay_small():
    """One job per module in the attention core: none grows past 500 lines."""
    sizes = {path.name: len(path.read_text().splitlines())
             for path in (REPO / "longnet" / "attention").glob("*.py")}
    assert max(sizes.values()) <= 500, sizes
