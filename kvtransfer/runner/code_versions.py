"""How a code fix invalidates cached artifacts: a code version per artifact kind, kept honest by a digest.

Each artifact kind declares the modules that compute it (`Artifact.code` in kvtransfer.runner.artifacts); the
code that computes it is those modules and every kvtransfer module they import, lazily or not (`closure`).
`code_versions.json` (next to this file) holds, per kind, its version and the digest of that code as last
reviewed. The digest reads the syntax tree without docstrings, so comments, docstrings and formatting never
change it; any other edit does, and tests/test_code_versions.py then fails until someone decides:

    python -m kvtransfer.runner.code_versions              # which kinds' code changed since it was reviewed
    python -m kvtransfer.runner.code_versions --update     # the change keeps every number: record the digests
    python -m kvtransfer.runner.code_versions --bump KIND  # it changes KIND's numbers: version + 1 (and record)

A kind's version enters its key from version 2 on (version 1 is the code the key rules of KEY_VERSION 3 were
written for, so the keys of artifacts made before code versions existed stay valid), and through the upstream
keys every artifact computed from it moves too: a bumped calibration refits the maps and rescores the mapped
modes, and leaves the baseline scores (which never read it) cached.

The versions themselves are read by runner.artifacts (`version`) when it computes a key; this module computes
and records the digests (standard library only).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
from pathlib import Path

from . import artifacts
from .artifacts import ARTIFACTS, recorded, version  # noqa: F401 -- version: the committed version of a kind

PACKAGE = Path(__file__).resolve().parents[1]   # kvtransfer/


def _module_file(parts: list[str]) -> Path | None:
    """The file of kvtransfer module `parts` (["core", "rope"] -> kvtransfer/core/rope.py), None if none."""
    path = PACKAGE.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def imported_modules(path: Path) -> set[Path]:
    """The kvtransfer module files `path` imports anywhere in its body (function-level imports included);
    `from . import a, b` names modules a and b, not the package's __init__."""
    package = list(path.relative_to(PACKAGE).parts[:-1])
    out: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvtransfer" and (f := _module_file(alias.name.split(".")[1:])):
                    out.add(f)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif (node.module or "").split(".")[0] == "kvtransfer":
                base = node.module.split(".")[1:]
            else:
                continue
            names = [_module_file(base + [alias.name]) for alias in node.names]
            out |= {f for f in names if f is not None}
            if any(f is None for f in names) and (f := _module_file(base)):  # a name defined in the module itself
                out.add(f)
    return out


def closure(entries: tuple[str, ...]) -> list[Path]:
    """Sorted module files of `entries` ("runner/fit_stage", ...) and everything they import within kvtransfer."""
    todo = [PACKAGE / f"{e}.py" for e in entries]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        if not path.is_file():
            raise FileNotFoundError(f"{path} is declared as producing code but does not exist: fix Artifact.code")
        seen.add(path)
        todo += imported_modules(path)
    return sorted(seen)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def code_digest(files: list[Path]) -> str:
    """sha256 (first 16 hex) of the files' code without comments, docstrings or layout (the syntax tree
    without docstrings, written back by ast.unparse), in path order: what the code does, not how it reads.
    ast.unparse's spelling may differ between Python minor versions, so a digest is compared on the version
    that recorded it (`recorded()["python"]`)."""
    h = hashlib.sha256()
    for path in files:
        tree = _strip_docstrings(ast.parse(path.read_text()))
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\n" + ast.unparse(tree).encode() + b"\n")
    return h.hexdigest()[:16]


def python_minor() -> str:
    """"3.11": the Python version whose ast.unparse a digest depends on."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def current(declared: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """{kind: digest of its producing code now} for `declared` {kind: entry modules}."""
    return {kind: code_digest(closure(entries)) for kind, entries in declared.items()}


def changed(declared: dict[str, tuple[str, ...]], versions: dict | None = None) -> dict[str, tuple[str | None, str]]:
    """{kind: (recorded digest or None, current digest)} of every kind whose code differs from its record."""
    versions = artifacts.recorded() if versions is None else versions
    now = current(declared)
    return {k: (versions.get(k, {}).get("digest"), d) for k, d in now.items() if versions.get(k, {}).get("digest") != d}


def main(argv: list[str] | None = None) -> int:
    """CLI: report changed kinds; --update records digests; --bump KIND raises KIND's version and records."""
    p = argparse.ArgumentParser(prog="python -m kvtransfer.runner.code_versions", description=__doc__.split("\n")[0])
    p.add_argument("--update", action="store_true", help="record the current digests (the change keeps the numbers)")
    p.add_argument("--bump", nargs="*", default=[], metavar="KIND", help="kinds whose numbers the change moves")
    args = p.parse_args(argv)
    declared = {name: art.code for name, art in ARTIFACTS.items()}
    unknown = sorted(set(args.bump) - set(declared))
    if unknown:
        p.error(f"unknown artifact kinds {unknown}; known: {sorted(declared)}")
    if artifacts.recorded().get("python") not in (None, python_minor()):
        p.error(f"the digests were recorded on Python {artifacts.recorded()['python']}, this is {python_minor()}: "
                "ast.unparse may spell code differently, so compare or record them on that version")
    versions = {k: dict(v) for k, v in artifacts.recorded().items() if k in declared}
    diff = changed(declared, versions)
    for kind, (was, now) in sorted(diff.items()):
        print(f"{kind}: code changed ({was} -> {now}), version {versions.get(kind, {}).get('version', 1)}")
    if not (args.update or args.bump):
        return 1 if diff else 0
    now = current(declared)
    for kind in declared:
        entry = versions.setdefault(kind, {"version": 1})
        entry["version"] = int(entry["version"]) + (kind in args.bump)
        entry["digest"] = now[kind]
    artifacts.CODE_VERSIONS_FILE.write_text(json.dumps({"python": python_minor(), **dict(sorted(versions.items()))},
                                                       indent=2) + "\n")
    artifacts.recorded.cache_clear()
    print(f"wrote {artifacts.CODE_VERSIONS_FILE}" + (f"; bumped {', '.join(args.bump)}" if args.bump else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
