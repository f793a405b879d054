"""The package's shape: its layers import downwards only (docs/architecture.md §1), no module
passes 500 lines and no package 12 modules, nothing imports the lab; the wheel holds every
package of ``longnet/`` and the zoo (``models/`` as ``longnet/_zoo``) and nothing else, and an
installed package finds that zoo. ``.ci/run`` builds and installs the real wheel and loads a
zoo model from it; these tests check the pieces without a build."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from longnet.modeling import hub

REPO = Path(__file__).resolve().parents[2]


LAYERS = ["constants", "validation", "files", "denormals", "compiled", "distributed",
          "attention", "nn", "modeling", "data", "training", "eval", "hf", "cli", "__main__"]
"""``longnet``'s layers from the bottom up: shared constants and validators, atomic file
writes, the CPU's subnormal-float switch, the refusals under ``torch.compile``, the
process-group plumbing, then the library's layers, the Hugging Face adapters (``hf``, on top
of evaluation: its lm-eval harness loads models with ``longnet.eval``), and
``cli``/``__main__`` (the command) on top."""


def _layer(module: str) -> int:
    """Layer index of a ``longnet...`` module name; -1 for the package root ``longnet``, which
    imports none of the layers (``import longnet`` stays light)."""
    parts = module.removesuffix(".__init__").split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 else -1


def _module_name(path: Path) -> str:
    """``longnet/a/b.py`` -> ``longnet.a.b``; a package's ``__init__.py`` -> the package."""
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _imported(path: Path) -> list[str]:
    """Every ``longnet`` name that ``path`` imports, from its syntax tree: module-level,
    lazy (inside functions) and type-only (under ``if TYPE_CHECKING:``) imports alike; for
    ``from package import name``, ``package.name`` when that is a module of its own."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                folder = REPO.joinpath(*submodule.split("."))
                is_module = folder.with_suffix(".py").exists() or (folder / "__init__.py").exists()
                names.append(submodule if is_module else node.module)
        else:
            assert not isinstance(node, ast.ImportFrom), f"{path}: use absolute imports"
    return [name for name in names if name == "longnet" or name.startswith("longnet.")]


def _import_graph() -> dict[str, set[str]]:
    """``module -> the longnet modules it imports`` for every module of ``longnet/``."""
    return {_module_name(path): set(_imported(path))
            for path in sorted(REPO.glob("longnet/**/*.py"))}


def test_layers_import_downwards_only():
    upward = [f"{module} imports {name}" for module, names in _import_graph().items()
              for name in sorted(names) if _layer(name) > _layer(module)]
    assert upward == []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` through each strongly connected component of ``graph``
    that has one (Tarjan's algorithm, then a shortest path back to the component's first
    member)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        first = component[0]
        if len(component) == 1 and first not in graph.get(first, ()):
            continue
        paths, frontier = {first: [first]}, [first]
        while True:  # breadth first: every member of a component reaches every other
            successors = [(n, s) for n in frontier for s in sorted(graph[n]) if s in component]
            closing = next((n for n, s in successors if s == first), None)
            if closing is not None:
                cycles.append([*paths[closing], first])
                break
            frontier = []
            for node, successor in successors:
                if successor not in paths:
                    paths[successor] = [*paths[node], successor]
                    frontier.append(successor)
    return cycles


def test_no_import_cycles():
    """No module of ``longnet`` imports itself through others, not even through an import
    made only for type checking or inside a function."""
    cycles = [" -> ".join(cycle) for cycle in import_cycles(_import_graph())]
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_finds_a_type_only_cycle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(import_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    (tmp_path / "m.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from longnet.attention import plan\n"
    )
    assert _imported(tmp_path / "m.py") == ["longnet.attention.plan"]


HF_ONLY = ("transformers", "lm_eval")
"""Packages of the optional extras ``hf`` / ``eval-harness``, imported by ``longnet.hf`` only
(``tokenizers`` is a dependency of the core: ``longnet.data`` trains BPEs with it)."""
LAZY_TRANSFORMERS = "longnet/data/subword.py"
"""The one module outside ``longnet.hf`` that imports ``transformers``, inside the function
that reads a Hugging Face tokenizer folder (``AutoTokenizer``), so the core runs without it."""


def test_only_longnet_hf_imports_the_hugging_face_extras():
    offending = []
    for path in sorted(REPO.glob("longnet/**/*.py")):
        if path.relative_to(REPO).parts[1] == "hf":
            continue
        tree = ast.parse(path.read_text(), str(path))
        if str(path.relative_to(REPO)) == LAZY_TRANSFORMERS:
            offending += [f"{path.name} imports transformers at module level"
                          for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                          and "transformers" in ast.unparse(node)]
            continue
        for node in ast.walk(tree):
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
    """One job per module in the attention core: none grows past 400 lines."""
    sizes = {str(path.relative_to(REPO)): len(path.read_text().splitlines())
             for path in (REPO / "longnet" / "attention").glob("**/*.py")}
    assert {name: size for name, size in sizes.items() if size > 400} == {}


MAX_FILE_LINES = 500
MAX_PACKAGE_FILES = 12


def test_the_library_reads_in_an_afternoon():
    """No module of ``longnet`` passes 500 lines and no package holds more than 12 modules
    (docs/architecture.md §1): a module has one job, a package a few."""
    modules = sorted((REPO / "longnet").glob("**/*.py"))
    sizes = {str(path.relative_to(REPO)): len(path.read_text().splitlines())
             for path in modules}
    assert {name: size for name, size in sizes.items() if size > MAX_FILE_LINES} == {}
    counts = Counter(str(path.parent.relative_to(REPO)) for path in modules)
    assert {name: count for name, count in counts.items() if count > MAX_PACKAGE_FILES} == {}


def test_the_library_never_imports_the_lab():
    """``lab/`` (benchmarks, planners, run operations) sits beside the library, outside the
    wheel: nothing in ``longnet`` imports it, lazily or for type checking."""
    lab_imports = []
    for path in sorted((REPO / "longnet").glob("**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            lab_imports += [f"{path.relative_to(REPO)}: {name}" for name in names
                            if name == "lab" or name.startswith("lab.")]
    assert lab_imports == []


def test_the_wheel_holds_the_library_and_the_zoo_and_no_lab(tmp_path):
    """The wheel built from this checkout's sources (copied: a ``build/`` folder of an
    earlier build would add the modules it kept): ``longnet`` with every package and the zoo
    as ``longnet/_zoo``, and nothing of ``lab/`` or ``tests/``."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("longnet", "models"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path), str(source)],
                   check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("longnet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"longnet", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    modules = {name for name in names if name.endswith(".py")}
    on_disk = {str(path.relative_to(REPO)) for path in (REPO / "longnet").glob("**/*.py")}
    assert modules - {n for n in modules if n.startswith("longnet/_zoo/")} == on_disk
    assert any(name.startswith("longnet/_zoo/longnet-tiny/") for name in names)
