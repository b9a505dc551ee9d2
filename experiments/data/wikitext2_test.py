"""Rebuild data/benchmarks/wikitext2.jsonl: all 62 WikiText-2 raw test articles, one JSON record {"page"} each.

The recipe of data/benchmarks/README.md ("WikiText-2 (raw, document level)"): the 2,891 non-blank article lines of
a raw copy, put back at their positions in the blank-line layout of the tokenised sibling file, then split into
pages by the EleutherAI wikitext_document_level rule. Inputs are two public git snapshots (not committed here):

    python experiments/data/wikitext2_test.py RAW TOKENS OUT
      RAW     Tylogi/TyloQuant @ 7989d038, data/wikitext-2-raw/wiki.test.raw
      TOKENS  pytorch/examples @ 77f55b91, word_language_model/data/wikitext-2/test.txt

It checks that every raw line matches its tokenised line (equal up to <unk>), that there are 62 pages and that
the first 15 equal the 15-page file this replaces, and writes OUT atomically (refusing to overwrite it).
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path


def _matches(raw: str, tok: str) -> bool:
    """A raw line and its tokenised sibling agree where the tokenised one has no <unk> (spaces ignored)."""
    pattern = re.escape(re.sub(r"\s+", "", tok)).replace(re.escape("<unk>"), ".+?")
    return re.fullmatch(pattern, re.sub(r"\s+", "", raw)) is not None


def rebuild(raw_path: Path, tok_path: Path) -> list[str]:
    """The 62 test pages (strings), article text from RAW, line layout from TOKENS."""
    raw = [line.rstrip("\r\n") for line in raw_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    tok = tok_path.read_text(encoding="utf-8").split("\n")
    if tok and tok[-1] == "":
        tok = tok[:-1]
    non_blank = [i for i, t in enumerate(tok) if t.strip()]
    if len(non_blank) != len(raw):
        raise ValueError(f"{len(raw)} raw lines vs {len(non_blank)} non-blank tokenised lines: wrong inputs")
    lines = [" "] * len(tok)
    for i, r in zip(non_blank, raw):
        if not _matches(r, tok[i]):
            raise ValueError(f"line {i}: raw {r[:60]!r} does not match tokenised {tok[i][:60]!r}")
        lines[i] = r
    pages: list[list[str]] = []
    for line in lines:
        head = line.replace("= = =", "===").replace("= =", "==").strip()
        if head.startswith("= ") and head.endswith(" ="):
            pages.append([])
        if pages:
            pages[-1].append(line)
    return ["\n".join(p) for p in pages]


def main(argv: list[str]) -> None:
    raw_path, tok_path, out = (Path(a) for a in argv)
    pages = rebuild(raw_path, tok_path)
    if len(pages) != 62:
        raise ValueError(f"{len(pages)} pages, expected the 62 of wikitext_document_level wikitext-2-raw-v1 test")
    old = Path(__file__).resolve().parents[2] / "data" / "benchmarks" / "wikitext2.jsonl"
    if old.is_file():
        first = [json.loads(line)["page"] for line in old.open() if line.strip()]
        if pages[:len(first)] != first:
            raise ValueError(f"the first {len(first)} rebuilt pages differ from {old}")
    if out.exists():
        raise FileExistsError(f"{out} exists; write elsewhere and compare")
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for p in pages:
            f.write(json.dumps({"page": p}, ensure_ascii=False) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    print(f"{out}: {len(pages)} pages, {sum(len(p) for p in pages):,} characters")


if __name__ == "__main__":
    main(sys.argv[1:])
