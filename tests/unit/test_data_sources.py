"""Document sources: installed distributions (fake ones in tmp_path), corpus entries, and the
default standard-library corpus staying exactly as it was."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import re
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

from longnet.cli.entry import command_parser
from longnet.cli.eval import documents_from_args
from longnet.data import (
    CorpusSettings,
    DocumentSource,
    LongDocumentDataModule,
    build_long_document_splits,
    corpus_source,
    package_source,
    stdlib_source,
)
from longnet.data import sources as sources_module
from longnet.data.cache import fingerprint
from longnet.data.corpus import corpus_cache_key
from longnet.data.encoding import document_hash, split_of
from longnet.data.reading import SHOWN_FILES
from longnet.data.tokenizer import ByteTokenizer
from longnet.eval import load_eval_documents
from longnet.validation import UsageError

REPO = Path(__file__).resolve().parents[2]
SETTINGS = CorpusSettings(seq_len=32, val_fraction=0.25, test_fraction=0.25)
FAKE_FILES = {
    **{f"fakedist/mod{index:02d}.py": f"def f{index}():\n    return {index}\n" * (index + 1)
       for index in range(30)},
    "fakedist/__init__.py": '"""A fake distribution."""\n',
    "fakedist/sub/tests/test_sub.py": "def test_sub():\n    pass\n",
    "fakedist/tests/test_mod.py": "def test_mod():\n    pass\n",
    "fakedist/testing/tools.py": "HELPER = 1\n",  # 'testing' is not a test folder: kept
    "fakedist/data.txt": "not python\n",
    "fakedist_top.py": "TOP = 1\n",
}
OTHER_FILES = {f"otherdist/part{index}.py": f"X = {index}\n" * (3 * index + 1)
               for index in range(20)}


def write_distribution(site: Path, name: str, version: str, files: dict[str, str]) -> None:
    """Write ``files`` (path inside the distribution: text) under ``site`` as the installed
    distribution ``name`` ``version``: a ``.dist-info`` folder with METADATA and a RECORD of
    the files' sha256 (computed here with hashlib)."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    record = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    for relative, text in files.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
        record.append(f"{relative},sha256={digest.rstrip(b'=').decode()},{len(text)}")
    (info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` with fakedist 1.0 and otherdist 2.0 installed."""
    folder = tmp_path / "site"
    write_distribution(folder, "fakedist", "1.0", FAKE_FILES)
    write_distribution(folder, "otherdist", "2.0", OTHER_FILES)
    monkeypatch.syspath_prepend(str(folder))
    return folder


def _walk(root: Path, skipped: set[str]) -> list[Path]:
    """The ``*.py`` files under ``root`` outside folders named in ``skipped``, by path."""
    return sorted(
        (path for path in root.rglob("*.py") if not skipped & set(path.relative_to(root).parts)),
        key=lambda path: path.relative_to(root).as_posix(),
    )


def test_package_source_reads_the_py_files_outside_test_folders(site: Path) -> None:
    source = package_source("fakedist", "1.0")
    expected = [path for path in _walk(site, {"tests"}) if "otherdist" not in path.parts]
    assert [path.relative_to(site).as_posix() for path in expected][:3] == [
        "fakedist/__init__.py", "fakedist/mod00.py", "fakedist/mod01.py"
    ]
    assert expected[-1] == site / "fakedist_top.py" and len(expected) == 33
    assert source == DocumentSource(name="fakedist-1.0", files=tuple(expected), format="text")
    assert package_source("fakedist") == source  # unpinned: whatever version is installed


def test_package_source_of_installed_sympy_is_a_walk_of_its_files() -> None:
    """sympy is installed with torch; its RECORD lists exactly the files on disk."""
    version = importlib.metadata.version("sympy")
    root = Path(importlib.metadata.distribution("sympy").locate_file(""))
    source = package_source("sympy", version)
    walk = list(root.glob("isympy.py")) + _walk(root / "sympy", {"tests", "__pycache__"})
    assert source.name == f"sympy-{version}" and list(source.files) == walk
    assert not any(path.name.startswith("test_") for path in source.files)


def test_a_pinned_version_must_be_the_installed_one(site: Path) -> None:
    with pytest.raises(UsageError, match=(
        r"fakedist 1\.0 is installed, but the corpus asks for fakedist==2\.0; install that "
        r"version \(pip install fakedist==2\.0\) or ask for fakedist==1\.0"
    )):
        package_source("fakedist", "2.0")


def test_a_distribution_that_is_not_installed_is_named_with_the_pip_command() -> None:
    with pytest.raises(UsageError, match=(
        r"the distribution 'no-such-dist-8231' is not installed in this environment \(.*\); "
        r"install it \(pip install no-such-dist-8231==1\.0\) or fix the name"
    )):
        corpus_source(["stdlib", "no-such-dist-8231==1.0"])


def test_a_modified_installation_is_refused_naming_the_files(site: Path) -> None:
    (site / "fakedist" / "mod03.py").write_text("tampered = True\n")
    (site / "fakedist" / "mod05.py").unlink()
    with pytest.raises(UsageError, match=(
        rf"(?s)fakedist 1\.0 at {site}: 2 of its 33 \*\.py files do not match its RECORD:\n"
        rf"  {site}/fakedist/mod03\.py: sha256 differs from RECORD\n"
        rf"  {site}/fakedist/mod05\.py: missing\n"
        r"The installation was modified; reinstall it: pip install --force-reinstall "
        r"fakedist==1\.0$"
    )):
        package_source("fakedist", "1.0")
    for index in range(10, 10 + SHOWN_FILES):
        (site / "fakedist" / f"mod{index:02d}.py").write_text("edited\n")
    with pytest.raises(UsageError, match=r"mod12\.py: sha256 differs from RECORD\n  and 2 more\n"):
        LongDocumentDataModule(corpus="fakedist==1.0", cache_dir=str(site / "cache"))
    (site / "fakedist" / "tests" / "test_mod.py").write_text("not read, not checked\n")
    package_source("otherdist", "2.0")  # another distribution is unaffected
    record = site / "otherdist-2.0.dist-info" / "RECORD"
    unhashed = re.sub(r"(?m)^(otherdist/part7\.py),sha256=[^,]*,", r"\1,,", record.read_text())
    record.write_text(unhashed)
    with pytest.raises(UsageError, match=r"(?s)1 of its 20 .*part7\.py: no hash in RECORD"):
        package_source("otherdist", "2.0")


def test_a_distribution_without_python_files_in_its_record(tmp_path: Path, monkeypatch) -> None:
    write_distribution(tmp_path, "editable", "0.1", {"__editable__.editable-0.1.pth": "/src\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"editable 0\.1 at .*: its RECORD lists no \*\.py file "
                       r"outside test folders.*pip install --force-reinstall editable==0\.1"):
        package_source("editable")


@pytest.mark.parametrize(("corpus", "match"), [
    ([], r"corpus is empty; give 'stdlib' and/or installed distributions"),
    ("sympy>=1.14", r"corpus entry 'sympy>=1\.14' is not 'stdlib', '<distribution>' or "
     r"'<distribution>==<version>' \(an exact pin, e\.g\. 'sympy==1\.14\.0'\)"),
    (["stdlib", "sympy="], r"corpus entry 'sympy=' is not"),
    (["==1.0"], r"corpus entry '==1\.0' is not"),
    (["stdlib", 3], r"corpus entry 3 is not"),
    (["stdlib==3.11"], r"the standard library is the running Python's .* takes no version; "
     r"write 'stdlib'"),
    (["fakedist", "FakeDist==1.0", "stdlib"], r"corpus lists fakedist more than once"),
])
def test_bad_corpus_entries_name_the_fix(site: Path, corpus, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        corpus_source(corpus)
    with pytest.raises(ValueError, match=match):
        LongDocumentDataModule(corpus=corpus, cache_dir=str(site / "cache"))


def test_data_files_and_corpus_are_exclusive(site: Path) -> None:
    with pytest.raises(ValueError, match="data_files and corpus are both set; set one"):
        LongDocumentDataModule(data_files=str(site / "fakedist" / "*.py"), corpus="stdlib")


def _documents(files: tuple[Path, ...], settings: CorpusSettings) -> list[dict]:
    """``doc_id``/``split``/``num_bytes`` of every non-empty file read as one document."""
    tokenizer = ByteTokenizer()
    rows = []
    for path in files:
        tokens = tokenizer.encode_array(path.read_text(encoding="utf-8"))
        doc_id = document_hash(tokens)
        split = split_of(doc_id, settings.val_fraction, settings.test_fraction)
        rows.append({"doc_id": doc_id, "split": split, "num_bytes": len(tokens)})
    return [row for row in rows if row["num_bytes"]]


def test_several_sources_are_one_corpus_of_one_document_per_file(site: Path, tmp_path) -> None:
    fake, other = package_source("fakedist", "1.0"), package_source("otherdist", "2.0")
    both = corpus_source(["fakedist==1.0", "otherdist==2.0"])
    assert both == DocumentSource(name="fakedist-1.0+otherdist-2.0",
                                  files=fake.files + other.files, format="text")
    splits = build_long_document_splits(both, SETTINGS, tmp_path / "cache")
    assert splits.path.name.startswith("fakedist-1.0+otherdist-2.0-")
    rows = list(splits.documents.with_format(None))
    assert rows == _documents(both.files, SETTINGS)
    alone = build_long_document_splits(fake, SETTINGS, tmp_path / "cache")
    assert rows[: len(alone.documents)] == list(alone.documents.with_format(None))
    with_stdlib = corpus_source(["stdlib", "otherdist"])
    assert with_stdlib.name == "stdlib+otherdist-2.0"
    assert with_stdlib.files == stdlib_source().files + other.files


# ------------------------------------------------------------ the default corpus is unchanged
@pytest.mark.parametrize("changes", [{}, {"seq_len": 2048, "min_document_bytes": 16384}])
def test_default_corpus_source_and_cache_key_are_unchanged(tmp_path: Path, changes) -> None:
    """The default module reads the stdlib walked as before, under the key it had before."""
    module = LongDocumentDataModule(**changes, cache_dir=str(tmp_path))
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = _walk(root, skipped)
    assert module.source == DocumentSource(name="stdlib", files=tuple(files), format="text")
    settings = {"seq_len": 1024, "val_fraction": 0.05, "test_fraction": 0.05,
                "max_documents": None, "max_bytes": None, "min_document_bytes": 1, **changes}
    stats = [(str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
    key = fingerprint({"version": 1, "format": "text", "text_column": "text", "files": stats,
                       "settings": settings})
    assert corpus_cache_key(module.source, module.settings) == key
    for corpus in ("stdlib", ["stdlib"]):
        explicit = LongDocumentDataModule(**changes, corpus=corpus, cache_dir=str(tmp_path))
        assert explicit.source == module.source and explicit.settings == module.settings


FAKE_STDLIB = {  # file: the number it repeats; the last six are skipped
    "abc.py": 54, "json/__init__.py": 0, "json/decoder.py": 17, "os.py": 1,
    "zipfile/_path.py": 2, "test/test_os.py": 20, "json/tests/test_json.py": 36,
    "idlelib/idle_test/x.py": 45, "site-packages/pkg/mod.py": 3, "__pycache__/x.py": 4,
    "README.txt": 5,
}


def test_default_module_documents_and_splits_are_unchanged(tmp_path: Path, monkeypatch) -> None:
    """The default module on a small stand-in standard library: the documents, their order and
    splits are those the code before the package sources gave (hard-coded)."""
    root = tmp_path / "stdlib"
    for name, number in FAKE_STDLIB.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"value = {number}\n" * 200)
    monkeypatch.setattr(sources_module, "sysconfig",
                        SimpleNamespace(get_paths=lambda: {"stdlib": str(root)}))
    module = LongDocumentDataModule(cache_dir=str(tmp_path / "cache"))
    module.setup()
    assert [path.relative_to(root).as_posix() for path in module.source.files] == [
        "abc.py", "json/__init__.py", "json/decoder.py", "os.py", "zipfile/_path.py"
    ]
    assert module.splits.path.name.startswith("stdlib-")
    assert list(module.splits.documents.with_format(None)) == [
        {"doc_id": "0284b69c56876161", "split": "validation", "num_bytes": 2200},
        {"doc_id": "93c29bee26f7b63b", "split": "train", "num_bytes": 2000},
        {"doc_id": "117f253b03cc2e8d", "split": "test", "num_bytes": 2200},
        {"doc_id": "894b5350a7265a8b", "split": "train", "num_bytes": 2000},
        {"doc_id": "a7193de05a788ee1", "split": "train", "num_bytes": 2000},
    ]
    assert [len(module.splits.train), len(module.splits.validation), len(module.splits.test)] \
        == [5, 3, 3]


# --------------------------------------------------------------------------- evaluation side
def test_eval_documents_read_the_corpus(site: Path) -> None:
    corpus = ["fakedist==1.0", "otherdist==2.0"]
    settings = CorpusSettings(seq_len=8, val_fraction=0.25, test_fraction=0.25)
    expected = _documents(corpus_source(corpus).files, settings)
    documents = load_eval_documents(corpus=corpus, split="all")
    assert [d.doc_id for d in documents] == [row["doc_id"] for row in expected]
    args = command_parser().parse_args(
        ["eval", "perplexity", "--models", "unused", "--corpus", *corpus, "--split",
         "held-out", "--val-fraction", "0.25", "--test-fraction", "0.25"]
    )
    assert args.corpus == corpus
    held_out = [row["doc_id"] for row in expected if row["split"] != "train"]
    assert [d.doc_id for d in documents_from_args(args)] == held_out
    with pytest.raises(ValueError, match="data_files and corpus are both set"):
        load_eval_documents(str(site / "*.py"), corpus=corpus)


def test_a_data_file_deleted_after_the_data_module_is_built_is_named(tmp_path: Path) -> None:
    """The files are found when the module is built and read at ``setup``: one deleted in
    between is named (a ``UsageError``, which the command reports in a few lines)."""
    from longnet.data import LongDocumentDataModule

    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(name * 5000)
    module = LongDocumentDataModule(data_files=[str(tmp_path / "*.txt")], seq_len=64,
                                    batch_size=2, cache_dir=str(tmp_path / "cache"))
    (tmp_path / "a.txt").unlink()
    with pytest.raises(UsageError, match=r"1 data file\(s\) found when the data were set up "
                       r"are gone now \(deleted or moved\): .*a\.txt; put them back"):
        module.setup("fit")
