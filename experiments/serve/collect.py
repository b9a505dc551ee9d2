"""Write the generated blocks of results/serve/README.md from results/serve/{equivalence,ttft}.json.

    (results/serve/commands.sh makes the two JSON files)
    python experiments/serve/collect.py [--check]

The tables are the ones the two experiment scripts print (`equivalence.table`, `ttft.table`), so README, the .md
files and the JSON cannot disagree; --check compares the blocks only (exit 1 on a difference).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the checkout this script is in, not an installed kvtransfer

from kvtransfer.report import readme  # noqa: E402

COLLECT = "experiments/serve/collect.py"
FOLDER = Path("results/serve")
TTFT_GOAL = 10.0  # the goal: at least 10x lower TTFT at 2,048 tokens with the mapped cache


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"serve_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def block_equivalence(eq: dict) -> str:
    """The per-window table and one line: windows, first tokens equal, largest logprob gap against the bound,
    windows whose greedy continuation is equal token for token, and the cold-vs-mapped gap for scale."""
    rows = eq["windows"]
    cold = [r["cold_vs_mapped_first_gap"] for r in rows]
    agree = [r["tokens_agree"] for r in rows]
    return (_script("equivalence").table(rows) + "\n"
            f"{len(rows)} windows, mapper `{Path(eq['mapper']).name}`: first token equal in "
            f"{sum(r['first_token_equal'] for r in rows)} / {len(rows)}, largest first-token logprob gap "
            f"{max(r['first_logprob_gap'] for r in rows):.2e} nats (bound {eq['bound']:.0e}), greedy continuations equal "
            f"token for token in {sum(r['tokens_agree'] == r['tokens'] for r in rows)} / {len(rows)} windows"
            + ("" if all(r["tokens_agree"] == r["tokens"] for r in rows) else
               f" (where they part, the first {min(agree)} tokens agree at least)")
            + f". For scale, the engine's own cold prefill "
            f"differs from the mapped first-token logprobs by {min(cold):.2g}–{max(cold):.2g} nats "
            f"(median {statistics.median(cold):.2g}): the map's error, not the serving path's.\n")


def block_ttft(tt: dict) -> str:
    """The TTFT table and one line: the speed-up at the longest prompt against the goal, and the machine."""
    rows, m = tt["rows"], tt["machine"]
    last = max(rows, key=lambda r: r["tokens"])
    met = "met" if last["speedup"] >= TTFT_GOAL else "NOT met"
    load = ", ".join(f"{x:.2f}" for x in m.get("load_avg_end", []))
    return (_script("ttft").table(rows) + "\n"
            f"Goal ≥ {TTFT_GOAL:.0f}x lower TTFT at {last['tokens']:,} tokens: **{met}** ({last['speedup']:.1f}x; median of "
            f"{len(last['cold_all_s'])} timed requests per mode after one warm-up). Commit `{m['commit'][:7]}`, {m['dtype']}, "
            f"mapper `{Path(m['mapper']).name}`, {m['cpus']} CPUs, load average at the end {load}.\n")


def block_gate(folder: Path) -> str:
    """Issue 30: served gate = harness gate (per family: the equivalence tables and one line) and served TTFT at the
    rate the gate chose (per family: the table and one line), from results/serve/gate/*.json."""
    eqm, ttm = _script("equivalence"), _script("ttft_gate")
    out = []
    for path in sorted((folder / "gate").glob("equivalence_*.json")):
        eq = json.loads(path.read_text())
        rows = eq["windows"]
        same = sum(r["served_action"] == r["harness_action"] and r["served_start"] == r["harness_start"] for r in rows)
        gaps = [abs(r["served_score"] - r["harness_score"]) for r in rows if r["served_score"] is not None
                and r["harness_score"] is not None]
        out.append(f"**{path.stem}** (`{Path(eq['source']).name}` -> `{Path(eq['target']).name}`, mapper "
                   f"`{Path(eq['mapper']).name}`, commit `{eq['commit'][:7]}`{' (dirty)' if eq['dirty'] else ''}):\n\n"
                   + eqm.table(rows) + eqm.gate_table(rows) + "\n"
                   f"{len(rows)} windows: served and harness gate took the same action and start in {same} / {len(rows)}"
                   f" (actions served: {eq['gates']}); largest score difference "
                   f"{max(gaps) if gaps else float('nan'):.2e}; greedy continuations equal token for token in "
                   f"{sum(r['tokens_agree'] == r['tokens'] for r in rows)} / {len(rows)} windows, largest first-token "
                   f"logprob gap {max(r['first_logprob_gap'] for r in rows):.2e} nats (bound {eq['bound']:.0e}).\n")
    for path in sorted((folder / "gate").glob("ttft_*.json")):
        tt = json.loads(path.read_text())
        m = tt["machine"]
        out.append(f"**{path.stem}** (`{Path(m['source']).name}` -> `{Path(m['target']).name}`, gate "
                   f"`{Path(m['gate']).name}`{', ' + m['label'] if m.get('label') else ''}):\n\n" + ttm.table(tt["rows"])
                   + f"\nMedian of {m['repeats']} timed requests per mode after one warm-up; commit `{m['commit'][:7]}`"
                   f"{' (dirty)' if m['dirty'] else ''}, {m['dtype']}, {m['cpus']} CPUs, load average at the end "
                   f"{', '.join(f'{x:.2f}' for x in m['load_avg_end'])}.\n")
    return "\n".join(out) if out else "(not run yet)\n"


def blocks(folder: Path = FOLDER) -> dict[str, str]:
    """{block name: Markdown} of results/serve/README.md."""
    eq = json.loads((folder / "equivalence.json").read_text())
    tt = json.loads((folder / "ttft.json").read_text())
    return {"equivalence": block_equivalence(eq), "ttft": block_ttft(tt), "gate": block_gate(folder)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", default=str(FOLDER))
    ap.add_argument("--check", action="store_true", help="only compare the README's blocks (exit 1 on a difference)")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    want = blocks(folder)
    if args.check:
        stale = readme.stale_blocks(folder / "README.md", want)
        for name in stale:
            print(f"{folder / 'README.md'}: block {name!r} is stale: rerun {COLLECT}")
        return 1 if stale else 0
    readme.rewrite(folder / "README.md", want)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
