"""Write the generated blocks of results/tiny/README.md and README.md from results/tiny/summary.json.

    rm -rf results/tiny.new && nice python run.py out_dir=results/tiny.new progress=false   # the default run
    rsync/copy results/tiny.new over results/tiny (see results/tiny/README.md), then:
    python experiments/tiny/collect.py [--allow-dirty] [--check]

Every number comes from the summary (read in the current schema, kvtransfer.eval.metrics) and its
scores.json where a paired SE needs the per-item scores; --check compares the blocks only (exit 1 on a difference).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the checkout this script is in, not an installed kvtransfer
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtransfer.eval.metrics import format_with_se, upgrade_summary  # noqa: E402
from kvtransfer.config.provenance import provenance_header, refuse_dirty_write  # noqa: E402
from kvtransfer.report import readme  # noqa: E402
from kvtransfer.report.figures import machine_label  # noqa: E402

COLLECT = "experiments/tiny/collect.py"
MODES = ("target", "source", "transfer", "no_context", "native_injected")
CONTROLS = ("target_wrong", "transfer_wrong", "mean_map", "random_map")  # kvtransfer.maps.controls


def _pct(r: dict, key: str, se_key: str) -> str | None:
    """A percentage with its SE; "not measurable at this n" where the SE exceeds the value's magnitude."""
    value, se = r.get(key), r.get(se_key)
    if value is None:
        return None
    if se is not None and se > abs(value):
        return "not measurable at this n"
    return format_with_se(value, se, scale=100, unit=" %") if se is not None else f"{100 * value:.1f} % (SE needs rerun)"


def load(folder: Path) -> dict:
    """results/tiny/summary.json in the current schema."""
    return upgrade_summary(json.loads((folder / "summary.json").read_text()))


def block_tasks(s: dict) -> str:
    """Per task: every mode ± its paired bootstrap SE, gap closed (vs no context) and retention ± SE."""
    rows = []
    for task, r in (s.get("tasks") or {}).items():
        rows.append([f"{task} ({r['n']})", r.get("metric"),
                     *(format_with_se(r.get(m), r.get(f"stderr_{m}")) if r.get(m) is not None else None for m in MODES),
                     _pct(r, "gap_closed", "stderr_gap_closed"),
                     format_with_se(r.get("retention"), r.get("stderr_retention"), scale=100, unit=" %")])
    return readme.md_table(["task (n)", "metric", *MODES, "gap closed", "retention"], rows)


def block_controls(s: dict) -> str:
    """Per task and perplexity prefix: the content controls' scores, the content share and the gap closed above
    the mean and random maps (kvtransfer.eval.metrics), each ± its paired bootstrap SE."""
    rows = []
    for task, r in (s.get("tasks") or {}).items():
        if r.get("content_share") is None and r.get("target_wrong") is None:
            continue
        rows.append([f"{task} ({r['n']})", *(None if r.get(m) is None else f"{r[m]:.3f}" for m in CONTROLS),
                     _pct(r, "content_share", "content_share_se"),
                     _pct(r, "gap_closed_above_mean_map", "gap_closed_above_mean_map_se"),
                     _pct(r, "gap_closed_above_random_map", "gap_closed_above_random_map_se")])
    for r in s.get("ppl", []):
        if r["prefix"] == 0 or r.get("target_wrong") is None:
            continue
        rows.append([f"perplexity, P = {r['prefix']} ({r.get('windows')} windows, {r.get('documents')} documents)",
                     *(None if r.get(m) is None else f"{r[m]:.1f}" for m in CONTROLS),
                     _pct(r, "content_share", "content_share_se"),
                     _pct(r, "gap_closed_above_mean_map", "gap_closed_above_mean_map_se"),
                     _pct(r, "gap_closed_above_random_map", "gap_closed_above_random_map_se")])
    if not rows:  # a summary made before the controls existed
        return ""
    return readme.md_table(["task (n) / perplexity", *CONTROLS, "content share", "gap closed above mean map",
                            "gap closed above random map"], rows)


def block_ppl(s: dict) -> str:
    """Perplexity per prefix and mode, and the log-perplexity gap closed ± its paired bootstrap SE over windows."""
    rows = []
    for r in s.get("ppl", []):
        gap = r.get("transfer_gap_closed")
        cell = None if gap is None else _pct(r, "transfer_gap_closed", "transfer_gap_closed_se")
        rows.append([r["prefix"], *(None if r.get(m) is None else f"{r[m]:.1f}" for m in MODES[:4]), cell])
    return readme.md_table(["prefix P", *MODES[:4], "gap closed (log-ppl)"], rows)


def block_speed(s: dict) -> str:
    rows = [[f"{r['tokens']:,}", f"{r['mapper_ms']:.1f} ({r['mapper_ms_min']:.1f}–{r['mapper_ms_max']:.1f})",
             f"{r['prefill_ms']:.1f} ({r['prefill_ms_min']:.1f}–{r['prefill_ms_max']:.1f})", f"{r['speedup']:.1f}×"]
            for r in s.get("speed", [])]
    return readme.md_table(["tokens", "mapper ms, median (min–max)", "re-prefill ms, median (min–max)", "speedup"], rows)


def blocks(s: dict) -> dict[str, str]:
    """{block name: Markdown} of results/tiny/README.md."""
    env = s.get("environment") or {}
    load = (env.get("machine") or {}).get("load_avg")
    machine = f"Machine: {machine_label(s)}" + (f"; load average (1/5/15 min) at the start {load}" if load else "") + ".\n"
    out = {"provenance": provenance_header({"tiny": s}, COLLECT) + "\n" + machine, "tasks": block_tasks(s),
           "ppl": block_ppl(s), "speed": block_speed(s)}
    return {**out, "controls": block_controls(s)} if block_controls(s) else out


def top_blocks(s: dict) -> dict[str, str]:
    """{"tiny": the top-level README's table of the default run}."""
    controls = block_controls(s)
    return {"tiny": block_tasks(s) + "\n" + block_ppl(s) + ("\n" + controls if controls else "")}


def check(folder: Path, top: Path) -> int:
    s = load(folder)
    bad = 0
    for path, want in ((folder / "README.md", blocks(s)), (top, top_blocks(s))):
        for name in readme.stale_blocks(path, want):
            print(f"{path}: block {name!r} differs from {folder}/summary.json")
            bad = 1
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default="results/tiny")
    ap.add_argument("--readme", default="README.md")
    ap.add_argument("--allow-dirty", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    folder = Path(args.folder)
    if args.check:
        raise SystemExit(check(folder, Path(args.readme)))
    refuse_dirty_write(folder, args.allow_dirty)
    s = load(folder)
    readme.rewrite(folder / "README.md", blocks(s))
    readme.rewrite(Path(args.readme), top_blocks(s))
    print(f"wrote the generated blocks of {folder}/README.md and {args.readme}")


if __name__ == "__main__":
    main()
