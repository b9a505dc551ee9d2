"""What a user reads -- README.md, docs/, conf/ and results/*/README.md -- carries no issue numbers, no absolute paths
of one machine, no internal run names in the headline text and no words about how the work was organised."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (what is banned, pattern); case-insensitive
BANNED = [
    ("an issue number", r"\bissues?[\s-]*#?\d+|(?<![\w&/])#\d{1,3}\b"),
    ("an absolute path of one machine", r"(?<![\w.])(/home/\w|/root/|/work/|/Users/\w|/scratch/|/mnt/\w)"),
    ("a home-directory path other than the user cache", r"(?<![\w$])~/(?!\.cache/)[\w.-]"),
    ("a path that is not in the repository", r"docs/_incoming|\.\./shared/|PAPER\.md"),
    ("words about how the work was organised",
     r"\bcoordinator\b|\bdev (EPYC|machine|box)\b|\b(this|the previous|an earlier|a later|earlier) sessions?\b"
     r"|\bsession's commits\b|\bworktree\b|\bengineers?\b|\bthe lead\b|\bother jobs\b|\bbranch's commits\b"
     r"|\bhidden-features branch\b|\bagents?'? (jobs?|runs?)\b|\bother agents?\b|\bhelper agents?\b"),
]
# Run names that only mean something to whoever launched them: not in the README or docs/ (a results folder names
# its own run directories, which it ships).
RUN_NAMES = ("an internal run name", r"\bmain_ppl\b|\b\w+_lr\d+e-\d+\w*|\bcpu48\b")


def user_text_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "results").glob("*/README.md"))]
    files += sorted(p for p in (ROOT / "conf").rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml", ".md"))
    return files


def findings(path: Path, text: str) -> list[str]:
    rules = list(BANNED)
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    if not rel.startswith(("results/", "conf/")):
        rules.append(RUN_NAMES)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in rules:
            m = re.search(pattern, line, re.I)
            if m:
                out.append(f"{rel}:{n}: {what}: {m.group(0)!r} in {line.strip()[:160]!r}")
    return out


def test_the_check_catches_each_kind():
    bad = {"issue 30's gate": "an issue number", "see #12 for": "an issue number",
           "models in /root/.cache/x": "an absolute path", "PYTHONPATH=$PWD /work/venv-serve/bin/python": "absolute",
           "cd ~/kvtransfer": "home-directory", "at the issue-32 commit": "an issue number", "`docs/_incoming/x.md`": "not in the repository",
           "run ../shared/realmodels/get.sh": "not in the repository", "made on the dev EPYC": "organised",
           "at this session's commit, this session": "organised", "`main_ppl` closes": "run name",
           "`e2e_lr1e-4_cpu48_sink1` closes": "run name"}
    for text, kind in bad.items():
        got = findings(ROOT / "README.md", text)
        assert len(got) == 1 and kind in got[0], (text, got)
    good = ["the handoff session's next turn", "KVT_REAL_DIR=~/.cache/kvtransfer-real", "a 2-core EPYC",
            "the session store", "HellaSwag n = 200", "tokens/s", "`runs/main_ppl` (results folder)"]
    assert findings(ROOT / "README.md", "\n".join(good[:-1])) == []
    assert findings(ROOT / "results" / "x" / "README.md", good[-1]) == []


def test_user_text_is_free_of_issue_numbers_machine_paths_and_notebook_words():
    files = user_text_files()
    assert ROOT / "README.md" in files and any(p.parent.name == "pair" for p in files) and len(files) > 30
    bad = [f for path in files for f in findings(path, path.read_text())]
    assert bad == [], "\n".join(bad)
