"""Where a number came from: the code, the command, the config and the machine of a run (summary.json
`environment`), and the checks that keep a results folder from claiming a cleaner origin than it has.

`environment(cfg)` is recorded by every run; `results_provenance(summaries)` is what a collect script
reads back to write a results README's header (dirty trees, several commits, runs that record none).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (kvtransfer/config/provenance.py)
# paths whose changes do not make a checkout "dirty" for provenance: they hold outputs, not code; and Markdown
# (READMEs carry generated blocks that the collect scripts rewrite, and no text changes a computed number)
OUTPUT_PATHS = ("results", "runs")
DOC_GLOBS = ("*.md", "**/*.md")


def _git(*args: str, root: Path = ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state(root: Path = ROOT) -> dict:
    """{"commit": sha, "dirty": bool, "dirty_paths": [...]} of the checkout; {} outside a git checkout.

    dirty: files changed (staged or not) or untracked (and not ignored: a new module the code imports is code
    the commit does not hold) outside `OUTPUT_PATHS` (results/, runs/ at any depth) and Markdown files, so
    writing results and their READMEs does not make the next run's provenance dirty."""
    sha = _git("rev-parse", "HEAD", root=root)
    if sha is None:
        return {}
    excludes = ([f":(exclude,glob){p}/**" for p in OUTPUT_PATHS] + [f":(exclude,glob)**/{p}/**" for p in OUTPUT_PATHS]
                + [f":(exclude,glob){g}" for g in DOC_GLOBS])
    status = _git("status", "--porcelain", "--untracked-files=all", "--", ".", *excludes, root=root)
    paths = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {"commit": sha.strip(), "dirty": status is None or bool(paths), "dirty_paths": paths[:50]}


def produced_by(code_version: int | None = None) -> dict:
    """What made an artifact, stored inside it when it is written: the checkout's commit, dirty flag and first
    dirty paths (`git_state`), the UTC time, the kvtransfer / torch / transformers / lm-eval versions, and the
    producing code's version (kvtransfer.runner.code_versions) when the caller names it."""
    import datetime

    from .. import __version__

    state = git_state()
    packages = package_versions(("torch", "transformers", "lm_eval"))
    out = {"commit": state.get("commit"), "dirty": state.get("dirty"), "dirty_paths": state.get("dirty_paths", [])[:10],
           "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "kvtransfer": __version__, **packages}
    if code_version is not None:
        out["code_version"] = code_version
    return out


def summarize_producers(producers: dict[str, dict]) -> dict:
    """summary.json `producers`: {"artifacts": {path: produced_by + artifact}, "commits": {sha7: [path, ...]},
    "dirty": [path, ...], "not_recorded": [path, ...]} of the cached artifacts a run read (Run.note)."""
    commits: dict[str, list[str]] = {}
    dirty, none = [], []
    for where, stamp in sorted(producers.items()):
        if not stamp.get("commit"):
            none.append(where)
            continue
        commits.setdefault(stamp["commit"][:7], []).append(where)
        if stamp.get("dirty"):
            dirty.append(where)
    return {"artifacts": dict(sorted(producers.items())), "commits": commits, "dirty": dirty, "not_recorded": none}


def json_provenance() -> dict:
    """The `provenance` block of a committed JSON result written outside a run (serve, handoff, plan files):
    {"commit", "dirty", "dirty_paths", "time"} of the checkout that wrote it."""
    stamp = produced_by()
    return {k: stamp[k] for k in ("commit", "dirty", "dirty_paths", "time")}


def config_digest(cfg: dict | None) -> str | None:
    """sha256 (first 16 hex) of the resolved config as canonical JSON (sorted keys); None without one."""
    if cfg is None:
        return None
    blob = json.dumps(cfg, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """CPU model, logical CPUs, torch threads, 1/5/15-min load average and memory of this machine now."""
    out = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform()}
    try:
        out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        out["load_avg"] = None
    try:
        import torch

        out["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            out["device"] = torch.cuda.get_device_name(0)
            out["cuda"] = torch.version.cuda
            out["gpus"] = torch.cuda.device_count()
        else:
            out["device"] = "cpu"
    except ImportError:
        out["device"] = "cpu"
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        out["memory_gib"] = round(pages * size / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return out


PACKAGES = ("torch", "transformers", "lm_eval", "numpy", "safetensors", "hydra", "pandas", "matplotlib")


def package_versions(names=PACKAGES) -> dict:
    """{package: version} of the libraries a number depends on (None where not installed)."""
    from importlib import metadata

    dist = {"lm_eval": "lm_eval", "hydra": "hydra-core"}
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(dist.get(name, name))
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment(cfg: dict | None = None, argv: list[str] | None = None) -> dict:
    """summary.json's `environment`: kvtransfer and package versions, python, the git commit and dirty flag
    (`git_state`), the command line, the resolved config's digest, and the machine (`machine`).

    Keeps the keys of earlier summaries (kvtransfer, python, torch, transformers, platform, cpu_count,
    commit, dirty, device)."""
    from .. import __version__

    packages = package_versions()
    mach = machine()
    return {"kvtransfer": __version__, "python": platform.python_version(), "torch": packages.get("torch"),
            "transformers": packages.get("transformers"), "platform": mach["platform"], "cpu_count": mach["cpu_count"],
            "device": mach.get("device", "cpu"), **{k: mach[k] for k in ("cuda", "gpus") if k in mach},
            **git_state(), "argv": list(sys.argv if argv is None else argv), "config_sha256": config_digest(cfg),
            "machine": mach, "packages": packages}


def describe_commit(env: dict | None) -> str:
    """"abc1234", "abc1234 (dirty)" or "no commit recorded" for one summary's environment."""
    env = env or {}
    if not env.get("commit"):
        return "no commit recorded"
    return env["commit"][:7] + (" (dirty)" if env.get("dirty") else "")


def public_path(value) -> str:
    """A path as a results file shows it: relative to the repository when inside it, the home directory as `~`, so a
    collected README names no directory of the machine that made it. Anything else is returned as given."""
    text = str(value)
    if not text.startswith("/"):
        return text
    path = Path(text)
    for base, shown in ((ROOT, "."), (Path.home(), "~")):
        try:
            rel = path.relative_to(base)
        except ValueError:
            continue
        return rel.as_posix() if shown == "." else f"~/{rel.as_posix()}"
    return text


def results_provenance(summaries: dict[str, dict]) -> dict:
    """What a results folder's summaries say about their origin: {"commits": {sha7: [run, ...]},
    "dirty": [run, ...], "no_commit": [run, ...], "runs": n}."""
    commits: dict[str, list[str]] = {}
    dirty, none = [], []
    for name, s in summaries.items():
        env = s.get("environment") or {}
        if not env.get("commit"):
            none.append(name)
            continue
        commits.setdefault(env["commit"][:7], []).append(name)
        if env.get("dirty"):
            dirty.append(name)
    return {"commits": commits, "dirty": dirty, "no_commit": none, "runs": len(summaries)}


def provenance_header(summaries: dict[str, dict], collected_by: str, *, reproduced: dict[str, str] | None = None,
                      not_rerun: dict[str, str] | None = None) -> str:
    """A Markdown block for a results README: which commits made its runs, and a warning when any ran from a
    dirty tree, at several commits, or records no commit. Written by the collect scripts (never typed).

    `reproduced` {run: what reproduced it}: runs whose numbers a rerun at a clean commit reproduced (the collect
    checked it); `not_rerun` {run: why}: why a dirty or commit-less run was not rerun. Every dirty or
    commit-less run must be in one of them, so the block never leaves one unexplained (ValueError otherwise).
    """
    reproduced, not_rerun = reproduced or {}, not_rerun or {}
    p = results_provenance(summaries)
    unexplained = sorted(set(p["dirty"] + p["no_commit"]) - set(reproduced) - set(not_rerun))
    if unexplained:
        raise ValueError(f"{collected_by}: runs {unexplained} ran from a dirty tree or record no commit; say which "
                         "clean rerun reproduced each (reproduced=) or why it was not rerun (not_rerun=)")
    lines = [f"**Provenance** (written by `{collected_by}` from the runs' `summary.json` → `environment`): "
             f"{p['runs']} run{'s' if p['runs'] != 1 else ''}."]
    if len(p["commits"]) > 1:
        lines.append(f"- **The runs were made at {len(p['commits'])} different commits**; each row's numbers are "
                     "those of its own commit:")
    for sha, names in sorted(p["commits"].items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  - `{sha}`: {', '.join(f'`{n}`' for n in sorted(names))}")
    if p["dirty"]:
        lines.append(f"- **Ran from an uncommitted (dirty) tree**, so the commit does not fully describe the code: "
                     f"{', '.join(f'`{n}`' for n in sorted(p['dirty']))}.")
    if p["no_commit"]:
        lines.append(f"- **Record no commit** (made before summaries kept one): "
                     f"{', '.join(f'`{n}`' for n in sorted(p['no_commit']))}.")
    for name in sorted(set(p["dirty"] + p["no_commit"])):
        if name in reproduced:
            lines.append(f"  - `{name}`: reproduced by {reproduced[name]}.")
        else:
            lines.append(f"  - `{name}`: not rerun: {not_rerun[name]}.")
    if not (p["dirty"] or p["no_commit"]) and len(p["commits"]) == 1:
        lines.append("- Every run is at one clean commit.")
    lines += producer_lines(summaries)
    return "\n".join(lines)


def producer_lines(summaries: dict[str, dict]) -> list[str]:
    """Markdown lines on the cached artifacts the runs read (summary.json `producers`): the commits that made
    them (by artifact kind), those made from a dirty tree, those that record none, and the runs made before
    summaries listed producers (their cached artifacts may be older than the run's own commit)."""
    kinds: dict[str, dict[str, int]] = {}
    dirty: dict[str, int] = {}
    unrecorded: dict[str, int] = {}
    older = sorted(name for name, s in summaries.items() if "producers" not in s)
    for name, s in summaries.items():
        for where, stamp in (s.get("producers") or {}).get("artifacts", {}).items():
            kind = stamp.get("artifact", "?")
            if not stamp.get("commit"):
                unrecorded[kind] = unrecorded.get(kind, 0) + 1
                continue
            per = kinds.setdefault(stamp["commit"][:7], {})
            per[kind] = per.get(kind, 0) + 1
            if stamp.get("dirty"):
                dirty[kind] = dirty.get(kind, 0) + 1

    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{k} × {n}" for k, n in sorted(d.items()))
    lines = []
    if kinds:
        lines.append("- Cached artifacts the runs read were made at " + "; ".join(
            f"`{sha}` ({counts(per)})" for sha, per in sorted(kinds.items(), key=lambda kv: -sum(kv[1].values()))) + ".")
    if dirty:
        lines.append(f"- **Cached artifacts made from an uncommitted (dirty) tree**: {counts(dirty)}.")
    if unrecorded:
        lines.append(f"- Cached artifacts that record no producer (made before artifacts carried one): {counts(unrecorded)}.")
    if older:
        lines.append(f"- Made before summaries listed the producers of the cached artifacts they read, which may be "
                     f"older than the run's own commit: {', '.join(f'`{n}`' for n in older)}.")
    return lines


def refuse_dirty_write(target: str | Path, allow_dirty: bool) -> dict:
    """The checkout's git_state; raises SystemExit naming the fix when it is dirty (outside results/ and
    runs/) and `allow_dirty` is false, since a results folder written from it could not be reproduced."""
    state = git_state()
    if state.get("dirty") and not allow_dirty:
        raise SystemExit(f"refusing to write {target} from a dirty tree ({', '.join(state['dirty_paths'][:5])} ...): "
                         "commit first, or pass --allow-dirty (the README header then says so)")
    return state
