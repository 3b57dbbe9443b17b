"""The documentation stays navigable: the README is short and starts with the two commands CI
reads, and every relative Markdown link in the README, docs/, .ci/ and the studies' READMEs points
at a file that exists (and, for a link into a Markdown file with #anchor, at a heading there).
Pure text checks: no network, no pipeline code."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 200
TWO_COMMANDS = [
    "make demo   # creates .venv, installs everything, runs the embedded demo study -> reports/demo/report.pdf",
    "make test   # creates .venv, installs everything, runs the test suite",
]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    files = [README, ROOT / ".ci" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "workflow" / "studies").glob("*/README.md")),
             *sorted((ROOT / "reports" / "reference").glob("*/README.md"))]
    return [f for f in files if f.is_file()]


def links(text: str) -> list[str]:
    """Link targets outside code blocks and code spans."""
    return LINK.findall(INLINE_CODE.sub("", FENCE.sub("", text)))


def anchors(markdown: str) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", markdown).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug)
        seen[slug] = 0 if n is None else n + 1
        if n is not None:
            seen[f"{slug}-{n + 1}"] = 0
    return set(seen)


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path.read_text(encoding="utf-8")):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file {shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{anchor} in {shown(dest)}")
    return broken


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, \
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}); move detail to docs/"
    fence = next(i for i, line in enumerate(lines) if line.startswith("```"))
    before = [line for line in lines[:fence] if line.strip()]
    assert len(before) <= 1 and all(line.startswith("# ") for line in before), \
        f"only a title may come before the two commands, found {before}"
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    assert lines[fence + 1:end] == TWO_COMMANDS


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_every_docs_page_is_in_the_index():
    index = {t.partition("#")[0] for t in links((ROOT / "docs" / "README.md").read_text(encoding="utf-8"))}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages - index == set(), "not linked from docs/README.md"


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section: here\n\n[ok](page.md#a-section-here) [gone](missing.md) "
                    "[bad anchor](page.md#nowhere) [web](https://example.org/x) [self](#title)\n"
                    "`[code](missing-too.md)`\n\n```\n[fenced](missing-three.md)\n```\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "page.md#nowhere"]
