"""The documentation holds together: links resolve, anchors exist, the README stays a front door.

Fast (no model, no network): reads README.md, docs/**/*.md, and the code's mentions of docs pages.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# a folder under docs/ (docs/measurements/) is one entry of the README: its README.md indexes its pages
SUBPAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.parent != ROOT / "docs")
PAGES = [README, *DOCS, *SUBPAGES]

FENCE = re.compile(r"^(```|~~~)")
# [text](target) and ![alt](target); the target ends at whitespace or ')'
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def strip_inline_code(line: str) -> str:
    return INLINE_CODE.sub("", line)


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: markup dropped, lowercase, punctuation other than '-', '_' and
    spaces removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and underscores (unicode too)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, duplicates numbered -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        found += LINK.findall(strip_inline_code(line))
    return found


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I))  # http:, https:, mailto:, ...


def test_the_slug_follows_githubs_rules():
    assert github_slug("Training (`agentrl train`)") == "training-agentrl-train"
    assert github_slug("Rollout selection: the field's methods as stages (`--select`)") == \
        "rollout-selection-the-fields-methods-as-stages---select"
    assert github_slug("The warm start and GRPO on real games (measured 2026-11-23)") == \
        "the-warm-start-and-grpo-on-real-games-measured-2026-11-23"
    assert github_slug("The learning measurement (benchmarks/bench_learning.py)") == \
        "the-learning-measurement-benchmarksbench_learningpy"
    assert github_slug("Experiment logging: TensorBoard and W&B (`--log-to`)") == \
        "experiment-logging-tensorboard-and-wb---log-to"


def test_duplicate_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n## Notes\n```\n# not a heading\n```\n## Notes\n### Notes\n")
    assert anchors(page) == {"a", "notes", "notes-1", "notes-2"}


def broken_links(page: Path) -> list[str]:
    """The relative links of a page whose file or #fragment does not exist."""
    broken = []
    for target in links(page):
        if not target or is_external(target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
            continue
        if fragment:
            if dest.suffix != ".md":
                broken.append(f"{target}: a fragment into a file that is not markdown")
            elif fragment not in anchors(dest):
                broken.append(f"{target}: no heading with anchor #{fragment} in {dest.name}")
    return broken


def test_broken_links_are_found(tmp_path):
    (tmp_path / "b.md").write_text("# Bee (`b`)\n")
    page = tmp_path / "a.md"
    page.write_text("# Hi\n[ok](b.md#bee-b) [ok](#hi) [web](https://x.org/#y) `[code](none.md)`\n"
                    "[gone](c.md) [bad](b.md#nope) [bad](#nope)\n```\n[fenced](none.md)\n```\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["c.md", "b.md#nope", "#nope"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page: Path):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_readme_is_a_front_door_under_10_kb():
    size = README.stat().st_size
    assert size < 10240, f"README.md is {size} bytes; move detail into docs/"


def linked_files(page: Path) -> set[Path]:
    return {(page.parent / t.partition("#")[0]).resolve() for t in links(page)
            if not is_external(t) and t.partition("#")[0]}


def test_every_docs_page_is_linked_from_the_readme():
    assert DOCS, "docs/ has no pages"
    folders = {p.parent / "README.md" for p in SUBPAGES}
    linked = linked_files(README)
    missing = [p.relative_to(ROOT).as_posix() for p in [*DOCS, *sorted(folders)] if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def test_every_page_of_a_docs_folder_is_linked_from_its_index():
    for index in {p.parent / "README.md" for p in SUBPAGES}:
        assert index.is_file(), f"{index.parent.relative_to(ROOT)} has no README.md (its index)"
        linked = linked_files(index)
        missing = [p.relative_to(ROOT).as_posix() for p in SUBPAGES
                   if p.parent == index.parent and p != index and p.resolve() not in linked]
        assert not missing, f"pages not linked from {index.relative_to(ROOT)}: {missing}"


@pytest.mark.parametrize("page", SUBPAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_page_of_a_docs_folder_opens_with_a_title_and_a_line_of_scope(page: Path):
    lines = page.read_text(encoding="utf-8").splitlines()
    assert lines and lines[0].startswith("# "), f"{page.relative_to(ROOT)} does not start with a '# ' title"
    scope = next((line for line in lines[1:] if line.strip()), "")
    assert scope and not scope.startswith("#"), f"{page.relative_to(ROOT)}: no line of scope under the title"


DOC_MENTION = re.compile(r"\bdocs/[\w./-]*\.md\b")


def test_the_docs_pages_the_code_names_exist():
    """Comments, help strings and configs point users at docs pages: a moved page must not
    leave them pointing at nothing."""
    named = [p for d in ("src", "benchmarks", "configs") for p in (ROOT / d).rglob("*")
             if p.suffix in {".py", ".yaml", ".yml", ".sh", ".toml"}] + [ROOT / "Makefile"]
    gone = [f"{p.relative_to(ROOT)}: {m}" for p in named if p.is_file()
            for m in DOC_MENTION.findall(p.read_text(encoding="utf-8", errors="replace"))
            if not (ROOT / m).is_file()]
    assert not gone, "docs pages named in the code that do not exist:\n" + "\n".join(gone)


def test_the_readme_gives_the_test_command_ci_calls():
    assert re.search(r"(?m)^make test\b|`make test`", README.read_text(encoding="utf-8"))
