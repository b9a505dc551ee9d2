"""README.md and docs/: a short front page, one page per job, and no link that points nowhere."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("results/*/README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into a docs/ page"


def broken_links(pages: list[Path]) -> list[str]:
    """'page -> target (why)' for every relative link of `pages` whose file or heading does not exist."""
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name} -> {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name} -> {target} (no such heading)")
    return broken


def test_every_relative_link_resolves():
    assert broken_links(PAGES) == []


def test_the_docs_index_and_the_readme_reach_every_page():
    docs = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert {"running.md", "evaluation.md", "maps.md", "serving.md", "artifacts.md", "api.md", "results.md",
            "layout.md"} <= docs
    index, readme = (ROOT / "docs/README.md").read_text(), (ROOT / "README.md").read_text()
    assert [d for d in sorted(docs) if f"({d})" not in index] == []
    assert [d for d in sorted(docs) if f"(docs/{d})" not in readme] == []


def test_the_results_index_lists_every_results_folder():
    index = (ROOT / "docs/results.md").read_text()
    folders = sorted(p.parent.name for p in ROOT.glob("results/*/README.md"))
    assert [f for f in folders if f"(../results/{f}/README.md)" not in index] == []


def test_the_link_check_catches_a_broken_link(tmp_path):
    """The check above can fail: a missing file and a missing heading are reported, a good anchor is not."""
    (tmp_path / "a.md").write_text("# Title\n[x](missing.md) [y](#nope) [z](#title) [w](a.md#title)\n")
    assert broken_links([tmp_path / "a.md"]) == ["a.md -> missing.md (no such file)", "a.md -> #nope (no such heading)"]
