"""The documentation's relative links resolve: every ``[text](path)`` and ``![alt](path)`` of
README.md, docs/**/*.md, models/*/README.md and data/README.md names a file or folder that
exists, and a ``#anchor`` names a heading of its target (GitHub's heading ids). Web and mail
links are not followed. ``docs/training.md`` stays a reference page of at most 600 lines, the
README at most 150."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]

PAGES = sorted(
    {REPO / "README.md", REPO / "data" / "README.md"}
    | set((REPO / "docs").rglob("*.md"))
    | set((REPO / "lab").rglob("*.md"))
    | set((REPO / "models").glob("*/README.md"))
)

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
HTML_ID = re.compile(r"""<a\s[^>]*(?:name|id)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def prose(text: str) -> str:
    """``text`` with the lines of fenced code blocks emptied and inline code spans blanked
    (line numbers and columns kept)."""
    lines, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            lines.append("")
        else:
            lines.append(INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's id of a heading: its text (links reduced to their text, code marks dropped)
    lower-cased, every character that is not a letter, digit, underscore, hyphen or space
    dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every id a link may point to in ``path``: its headings (a repeated one gets -1, -2,
    ...) and ``<a name/id>`` tags."""
    seen: dict[str, int] = {}
    ids = set()
    raw = path.read_text()
    for raw_line, line in zip(raw.splitlines(), prose(raw).splitlines()):
        if HEADING.match(line) is None:  # a heading outside code (checked on the blanked line)
            continue
        base = slug(HEADING.match(raw_line).group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        ids.add(base if count == 0 else f"{base}-{count}")
    ids.update(HTML_ID.findall(raw))
    return frozenset(ids)


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and link definition of ``page``
    outside code; a link's text may run over several lines."""
    text = prose(page.read_text())
    matches = sorted([*LINK.finditer(text), *DEFINITION.finditer(text)], key=lambda m: m.start())
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in matches]


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """``page:line: target (why)`` for every relative link of ``page`` that does not resolve."""
    problems = []
    for number, target in links(page):
        if target.lower().startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        where = f"{page.relative_to(root)}:{number}: {target}"
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{where} (no such file)")
        elif (
            anchor
            and resolved.suffix == ".md"
            and resolved.is_file()
            and unquote(anchor).lower() not in anchors(resolved)
        ):
            problems.append(f"{where} (no heading with this id)")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    assert broken_links(page) == []


def test_the_pages_are_found_and_have_links():
    names = {str(p.relative_to(REPO)) for p in PAGES}
    assert {
        "README.md",
        "docs/training.md",
        "docs/benchmarks.md",
        "data/README.md",
        "lab/notes/training-log.md",
        "models/longnet-tiny/README.md",
    } <= names
    assert len(links(REPO / "README.md")) >= 5


def test_the_checker_finds_broken_links(tmp_path: Path):
    """A missing file, image or heading is reported; web links and code are not followed."""
    (tmp_path / "other.md").write_text("# Other page\n\n## The `x` option: a, b & c\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Same\n\n## Same\n\n"
        "[ok](other.md) [ok](other.md#the-x-option-a-b--c) [ok](#same-1) [ok](#title)\n"
        "[web](https://example.com/missing) [mail](mailto:a@b.c)\n"
        "`[code](missing-in-code.md)`\n\n```\n[fenced](missing-fenced.md)\n```\n"
        "[bad](missing.md) ![bad](img/missing.png) [bad](other.md#nope) [bad](#same-2)\n"
    )
    assert [p.split(": ", 1)[1] for p in broken_links(page, tmp_path)] == [
        "missing.md (no such file)",
        "img/missing.png (no such file)",
        "other.md#nope (no heading with this id)",
        "#same-2 (no heading with this id)",
    ]


def test_slugs_follow_github():
    assert slug("`SequenceParallelStrategy`") == "sequenceparallelstrategy"
    assert slug("Long context through the ring: the `longnet-tiny-16k` recipe") == (
        "long-context-through-the-ring-the-longnet-tiny-16k-recipe"
    )
    assert slug("2. What dilated attention computes") == "2-what-dilated-attention-computes"
    assert slug("lm-eval (`scripts/eval_harness.py`)") == "lm-eval-scriptseval_harnesspy"
    assert slug("Errors: what a user gets wrong") == "errors-what-a-user-gets-wrong"


def test_training_reference_is_short():
    lines = (REPO / "docs" / "training.md").read_text().splitlines()
    assert len(lines) <= 600, f"docs/training.md has {len(lines)} lines (at most 600)"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"
