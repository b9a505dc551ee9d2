"""Build data/benchmarks/python_stdlib.jsonl: source code for out-of-domain perplexity (`eval.ppl.sets`).

Top-level modules of the CPython 3.11.7 standard library (`Lib/*.py`, PSF License), a domain no calibration of
this project reads (Wikipedia, the Debian handbook, FineWeb-Edu) and the home domain of the Qwen2.5-Coder pair.
Rule (no choice by hand): every module whose source has at least MIN_CHARS characters, in name order; each
record keeps the first MAX_CHARS characters of the file (enough for 1,024 + 256 tokens of code) and says so:

    {"text": ..., "module": "argparse", "python": "3.11.7", "sha256": <of the whole file>, "chars": <whole file>}

    python experiments/data/python_stdlib.py LIBDIR OUT     # LIBDIR: a CPython 3.11.7 Lib/ directory

`--packages` writes calibration text in the same domain instead, disjoint from those modules: every module inside a
package of LIBDIR (`Lib/<package>/**/*.py`, tests and vendored site-packages left out) of at least PACKAGE_MIN_CHARS
characters, whole, in path order (experiments/baselines/run.sh calibrates a map on it).

    python experiments/data/python_stdlib.py --packages LIBDIR OUT
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

PYTHON = "3.11.7"
MIN_CHARS = 8_000
MAX_CHARS = 12_000
PACKAGE_MIN_CHARS = 2_000
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def records(lib: Path) -> list[dict]:
    """One record per eligible module of `lib`, in name order."""
    out = []
    for path in sorted(lib.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text) < MIN_CHARS:
            continue
        out.append({"text": text[:MAX_CHARS], "module": path.stem, "python": PYTHON,
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "chars": len(text)})
    return out


def package_records(lib: Path) -> list[dict]:
    """One record per module inside a package of `lib` (never a top-level module: disjoint from `records`)."""
    out = []
    for path in sorted(lib.glob("*/**/*.py")):
        rel = path.relative_to(lib)
        if SKIP_DIRS & set(rel.parts):
            continue
        text = path.read_text(encoding="utf-8")
        if len(text) < PACKAGE_MIN_CHARS:
            continue
        out.append({"text": text, "module": ".".join(rel.with_suffix("").parts), "python": PYTHON,
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "chars": len(text)})
    return out


def main(argv: list[str]) -> None:
    packages = argv[:1] == ["--packages"]
    argv = argv[1:] if packages else argv
    lib, out = Path(argv[0]), Path(argv[1])
    license_file = lib / "LICENSE.txt"
    if sys.version.split()[0] != PYTHON and not (license_file.is_file() and license_file.read_text().count(PYTHON)):
        print(f"warning: {lib} may not be CPython {PYTHON}", file=sys.stderr)
    rows = package_records(lib) if packages else records(lib)
    if out.exists():
        raise FileExistsError(f"{out} exists; write elsewhere and compare")
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    print(f"{out}: {len(rows)} modules, {sum(len(r['text']) for r in rows):,} characters")


if __name__ == "__main__":
    main(sys.argv[1:])
