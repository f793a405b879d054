"""The documentation's signatures and examples match the code.

* A signature block is a ```python block of README.md or docs/*.md whose first line is
  ``# Signatures`` ...: imports, then ``def`` stubs of functions and ``class`` stubs holding
  ``def`` stubs of their methods (``@classmethod`` for class methods). Each stub must have the
  parameters of the real object (``inspect.signature``): the same names in the same order,
  of the same kinds, with the same defaults. Annotations are not compared.
* In every other ```python block that parses, a call of a name the block imports from
  ``longnet`` passes only keywords its real signature names (not ones a ``**deprecated``
  catch-all would take with a warning).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted({REPO / "README.md"} | set((REPO / "docs").glob("*.md")))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
MARK = "# Signatures"


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every ```python block of ``page`` (``line``: its first code line)."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def signature_blocks() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(REPO)}:{line}", code)
            for page in PAGES for line, code in python_blocks(page) if code.startswith(MARK)]


def imported(tree: ast.Module) -> dict[str, Any]:
    """The names the block's ``import``/``from ... import`` statements bind, imported (an
    optional package that is not installed, e.g. ``transformers``, binds nothing)."""
    namespace: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                exec(compile(ast.Module([node], []), "<docs>", "exec"), namespace)
            except ImportError:
                continue
    namespace.pop("__builtins__", None)
    return namespace


def stub_parameters(stub: ast.FunctionDef, namespace: dict[str, Any]) -> list[tuple]:
    """``(name, kind, default)`` of the stub's parameters (defaults evaluated in the block's
    namespace; ``inspect.Parameter.empty`` where none), ``cls`` of a class method dropped."""
    args = stub.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        eval(ast.unparse(d), dict(namespace)) for d in args.defaults]
    kinds = ([inspect.Parameter.POSITIONAL_ONLY] * len(args.posonlyargs)
             + [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(args.args))
    params = [(a.arg, kind, d) for a, kind, d in zip(positional, kinds, defaults)]
    if args.vararg:
        params.append((args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        default = inspect.Parameter.empty if d is None else eval(ast.unparse(d), dict(namespace))
        params.append((a.arg, inspect.Parameter.KEYWORD_ONLY, default))
    if args.kwarg:
        params.append((args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    if any(isinstance(d, ast.Name) and d.id == "classmethod" for d in stub.decorator_list):
        params = params[1:]
    return params


def real_parameters(obj: Any) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]


def signature_difference(stub: ast.FunctionDef, real: Any, namespace: dict[str, Any]) -> str:
    """'' when ``stub`` has ``real``'s parameters, else both lists, one per line."""
    documented, actual = stub_parameters(stub, namespace), real_parameters(real)
    if documented == actual:
        return ""
    return f"documented {_show(documented)}\n    actual {_show(actual)}"


def _show(params: list[tuple]) -> str:
    words = []
    for name, kind, default in params:
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*",
                  inspect.Parameter.VAR_KEYWORD: "**"}.get(kind, "")
        suffix = "" if default is inspect.Parameter.empty else f"={default!r}"
        marker = " (keyword-only)" if kind is inspect.Parameter.KEYWORD_ONLY else ""
        words.append(f"{prefix}{name}{suffix}{marker}")
    return "(" + ", ".join(words) + ")"


def block_differences(code: str) -> list[str]:
    """What differs between each stub of the signature block ``code`` and the code."""
    tree = ast.parse(code)
    namespace = imported(tree)
    differences = []
    for node in tree.body:
        stubs: list[tuple[str, ast.FunctionDef, Any]] = []
        if isinstance(node, ast.FunctionDef):
            stubs.append((node.name, node, namespace.get(node.name)))
        elif isinstance(node, ast.ClassDef):
            owner = namespace.get(node.name)
            stubs += [(f"{node.name}.{item.name}", item, getattr(owner, item.name, None))
                      for item in node.body if isinstance(item, ast.FunctionDef)]
        for name, stub, real in stubs:
            if real is None:
                differences.append(f"{name}: not found (import it in the block)")
            elif difference := signature_difference(stub, real, namespace):
                differences.append(f"{name}:\n    {difference}")
    return differences


@pytest.mark.parametrize("where, code", signature_blocks(), ids=[w for w, _ in signature_blocks()])
def test_documented_signatures_are_the_real_ones(where, code):
    differences = block_differences(code)
    assert not differences, f"{where}: the signatures differ from the code:\n" + "\n".join(
        differences)


def test_the_model_docs_show_their_signatures():
    """docs/models.md documents the forwards, the layers and sequence parallelism as checked
    stubs (one of each at least)."""
    shown = "\n".join(code for where, code in signature_blocks() if "models.md" in where)
    for name in ("class LongNetLM:", "def forward(", "class MultiheadDilatedAttention:",
                 "class SequenceParallel:", "def parallelize(", "def dilated_attention("):
        assert name in shown, f"docs/models.md has no checked stub of {name!r}"


def example_calls() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(REPO)}:{line}", code) for page in PAGES
            for line, code in python_blocks(page) if not code.startswith(MARK)]


def undeclared_keywords(code: str) -> list[str]:
    """``name(keyword=)`` of each call in ``code`` of a ``longnet`` name the block imports whose
    keyword is not a named parameter of the real signature."""
    try:
        tree = ast.parse(code)
    except SyntaxError:  # an example with elisions (...) or shell lines: nothing to check
        return []
    namespace = {name: obj for name, obj in imported(tree).items()
                 if callable(obj) and getattr(obj, "__module__", "").startswith("longnet")}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in namespace):
            continue
        try:
            parameters = inspect.signature(namespace[node.func.id]).parameters
        except (TypeError, ValueError):
            continue
        named = {n for n, p in parameters.items()
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        found += [f"{node.func.id}({k.arg}=)" for k in node.keywords
                  if k.arg is not None and k.arg not in named]
    return found


@pytest.mark.parametrize("where, code", example_calls(), ids=[w for w, _ in example_calls()])
def test_examples_pass_only_keywords_the_code_names(where, code):
    assert not undeclared_keywords(code), (
        f"{where}: these keywords are not parameters of the code (renamed or deprecated): "
        f"{undeclared_keywords(code)}")


def test_the_checks_find_a_wrong_signature_and_a_deprecated_keyword():
    wrong = ("# Signatures\nfrom longnet.distributed import SequenceParallel, parallelize\n"
             "def parallelize(model, sequence_parallel=None): ...\n"
             "class SequenceParallel:\n"
             "    def __init__(self, process_group, transport='ring', layout='contiguous'): ...\n")
    differences = block_differences(wrong)
    assert len(differences) == 2
    assert "sequence_parallel=None" in differences[0] and "layout" in differences[1]
    assert block_differences(wrong.replace("parallelize(model, sequence_parallel=None)",
                                           "parallelize(model, sequence_parallel)"))[0].startswith(
        "SequenceParallel.__init__")
    example = ("from longnet.attention import dilated_attention\n"
               "out = dilated_attention(q, k, v, pattern, causal=True, process_group=group)\n")
    assert undeclared_keywords(example) == ["dilated_attention(process_group=)"]
