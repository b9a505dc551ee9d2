"""Generated blocks in Markdown READMEs: numbers are written by a collect script, never typed.

A block is the text between `<!-- BEGIN generated:NAME -->` and `<!-- END generated:NAME -->`; the
collect scripts rebuild each block from the runs' summaries and rewrite it in place, and
tests/test_readme_numbers.py regenerates every block and compares.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..core.io import atomic_write_bytes

_BLOCK = re.compile(r"<!-- BEGIN generated:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- END generated:(?P=name) -->",
                    re.S)


def begin(name: str) -> str:
    return f"<!-- BEGIN generated:{name} -->"


def end(name: str) -> str:
    return f"<!-- END generated:{name} -->"


def blocks(text: str) -> dict[str, str]:
    """{name: body} of every generated block in `text` (body without the marker lines)."""
    found = {}
    for m in _BLOCK.finditer(text):
        if m["name"] in found:
            raise ValueError(f"generated block {m['name']!r} appears twice")
        found[m["name"]] = m["body"]
    return found


def replace_blocks(text: str, bodies: dict[str, str], *, path: str = "README") -> str:
    """`text` with the body of each named block replaced; every name must already have its markers (a
    block is placed once by hand, then only rewritten), else ValueError naming the missing markers."""
    present = blocks(text)
    missing = [n for n in bodies if n not in present]
    if missing:
        raise ValueError(f"{path} has no generated block(s) {missing}: add the lines {begin(missing[0])} and "
                         f"{end(missing[0])} where the block belongs")

    def sub(m: re.Match) -> str:
        name = m["name"]
        if name not in bodies:
            return m[0]
        body = bodies[name].rstrip("\n") + "\n"
        return f"{begin(name)}\n{body}{end(name)}"

    return _BLOCK.sub(sub, text)


def rewrite(path: str | Path, bodies: dict[str, str]) -> bool:
    """Rewrite the named blocks of the README at `path` (atomically); returns whether anything changed."""
    path = Path(path)
    text = path.read_text()
    new = replace_blocks(text, bodies, path=str(path))
    if new != text:
        atomic_write_bytes(path, new.encode())
    return new != text


def stale_blocks(path: str | Path, bodies: dict[str, str]) -> list[str]:
    """Names of the generated blocks of file `path` whose text differs from `bodies` (what --check reports)."""
    have = blocks(Path(path).read_text())
    return [name for name, body in bodies.items() if have.get(name) != body.rstrip("\n") + "\n"]


def md_table(header: list[str], rows: list[list]) -> str:
    """A GitHub Markdown table; None cells print as "–"."""
    cell = lambda v: "–" if v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
