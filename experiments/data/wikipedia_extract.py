"""Rebuild the Wikipedia calibration text of the real pair (`wikipedia_enwiki_extract.jsonl`: 10,328 English
Wikipedia articles, one JSON record {"text"} per line) from its public source, and check its sha256.

Source: the WikiExtractor output in the git repository Vibhas-hs-edu/WikiTasks at commit 52b1f163 (text/AA/wiki_00
... wiki_63; articles with curid 56.56M-57.03M, pages created around early 2018). Recipe: parse the
`<doc id url title>` blocks, html-unescape, strip, keep articles of at least 1,500 characters (most of the dump is
stubs), minus seven articles the original extract left out (EXCLUDED), in file order. Licence of the text: CC BY-SA.

    python experiments/data/wikipedia_extract.py OUT.jsonl [--src DIR]

Without --src it downloads the 64 files (66 MB) from GitHub at that commit. It refuses to overwrite OUT.
"""
from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO, COMMIT = "Vibhas-hs-edu/WikiTasks", "52b1f163137bc40b0f67cbf129d5dab4f6fd5901"
FILES = [f"text/AA/wiki_{i:02d}" for i in range(64)]
MIN_CHARS = 1500
EXCLUDED = {"56637640", "56756597", "56766362", "56848581", "56949488", "56962551", "57021530"}
SHA256 = "a522d24394080559f35ac9b4c4ec87c810f3e1ed6c2fee1876571b52864b88e7"
DOC = re.compile(r'<doc id="(\d+)" url="[^"]*" title="[^"]*">\n(.*?)</doc>', re.S)


def articles(texts) -> list[str]:
    """The kept articles of the WikiExtractor files' contents, in order."""
    out = []
    for text in texts:
        for curid, body in DOC.findall(text):
            body = html.unescape(body).strip()
            if len(body) >= MIN_CHARS and curid not in EXCLUDED:
                out.append(body)
    return out


def read_sources(src: Path | None) -> list[str]:
    if src is not None:
        return [(src / Path(name).name).read_text(encoding="utf-8") for name in FILES]
    texts = []
    for i, name in enumerate(FILES):
        url = f"https://raw.githubusercontent.com/{REPO}/{COMMIT}/{name}"
        print(f"[{i + 1}/{len(FILES)}] {url}", file=sys.stderr, flush=True)
        with urllib.request.urlopen(url, timeout=120) as r:
            texts.append(r.read().decode("utf-8"))
    return texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--src", type=Path, help="a directory holding wiki_00 ... wiki_63 (default: download them)")
    a = ap.parse_args(argv)
    if a.out.exists():
        raise SystemExit(f"{a.out} exists: not overwritten")
    data = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in articles(read_sources(a.src)))
    digest = hashlib.sha256(data.encode("utf-8")).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"sha256 {digest} != {SHA256}: the source or the recipe differs; nothing written")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=a.out.parent, prefix=".wikipedia_")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(data)
    os.replace(tmp, a.out)
    print(f"wrote {a.out} ({data.count(chr(10))} articles, sha256 {digest[:12]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
