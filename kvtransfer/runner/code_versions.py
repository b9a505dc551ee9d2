"""How a code fix invalidates cached artifacts: a code version per artifact kind, kept honest by a digest.

Each artifact kind declares the modules that compute it (`Artifact.code` in kvtransfer.runner.artifacts); the
code that computes it is every function, method, class body and module body those modules reach by name, through
imports (lazy or not) and through the attributes of the objects they are handed -- the `run` a stage receives, so
`Run` methods and what they call (`core/data.py`'s tokenization) count for the kinds that use them
(kvtransfer.runner.code_units).
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

from . import artifacts, code_units
from .artifacts import ARTIFACTS, recorded, version  # noqa: F401 -- version: the committed version of a kind

PACKAGE = Path(__file__).resolve().parents[1]   # kvtransfer/


def closure(entries: tuple[str, ...]) -> list[Path]:
    """Sorted module files holding the units `entries` ("runner/fit_stage", ...) reach (kvtransfer.runner.code_units)."""
    return sorted({PACKAGE / rel for rel, _ in code_units.Package(PACKAGE).reach(entries)})


def units_digest(pkg: code_units.Package, units: set, sources: dict | None = None) -> str:
    """sha256 (first 16 hex) of the units' code without comments, docstrings or layout, in (module, name) order
    (`sources`: a cache of unit sources shared across kinds)."""
    sources = {} if sources is None else sources
    h = hashlib.sha256()
    for rel, name in sorted(units):
        if (rel, name) not in sources:
            sources[rel, name] = pkg.source((rel, name))
        h.update(f"{rel}:{name}\n".encode() + sources[rel, name].encode() + b"\n")
    return h.hexdigest()[:16]


def code_digest(files: list[Path]) -> str:
    """sha256 (first 16 hex) of the files' code without comments, docstrings or layout (the syntax tree
    without docstrings, written back by ast.unparse), in path order: what the code does, not how it reads.
    ast.unparse's spelling may differ between Python minor versions, so a digest is compared on the version
    that recorded it (`recorded()["python"]`)."""
    h = hashlib.sha256()
    for path in files:
        tree = code_units.strip_docstrings(ast.parse(path.read_text()))
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\n" + ast.unparse(tree).encode() + b"\n")
    return h.hexdigest()[:16]


def python_minor() -> str:
    """"3.11": the Python version whose ast.unparse a digest depends on."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def current(declared: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """{kind: digest of the code it reaches now, function by function} for `declared` {kind: entry modules}."""
    pkg, sources = code_units.Package(PACKAGE), {}
    return {kind: units_digest(pkg, pkg.reach(entries), sources) for kind, entries in declared.items()}


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
