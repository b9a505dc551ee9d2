"""Regenerate results/plan/: the resource plan of the six paper pairs at the paper's protocol (500 x 1,024 tokens,
stride 4, k as in the paper; every other key at its conf/ default) on every node preset of kvtransfer/plan/node.py.
No weights, no hub, no GPU: shapes come from the real transformers config classes
(kvtransfer/resources/model_configs.py), rates from the device table in kvtransfer/plan/rates.py.

    python3 results/plan/make.py

Writes <preset>/<pair>/plan.json + plan.md, summary.md (the pair x preset table), and the generated `plan_table` /
`plan_verdicts` blocks of results/plan/README.md, docs/running.md and README.md (every resource number the
docs quote comes from here; tests/test_results_plan.py reruns this and compares byte for byte).
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from kvtransfer import plan as P  # noqa: E402
from kvtransfer.report import readme  # noqa: E402

PAIRS = ("qwen3_14b_32b", "qwen3_8b_32b", "llama31_8b_70b", "ministral3_3b_8b", "ministral3_3b_14b",
         "ministral3_8b_14b")
PRESETS = ("dgx-h200", "dgx-h100", "8xh100", "1xh200-cloud", "1xh100-cloud", "h200")
DOCS = {"README.md": ("plan_verdicts",), "docs/running.md": ("plan_nodes", "plan_verdicts", "plan_table"),
        "results/plan/README.md": ("plan_nodes", "plan_verdicts", "plan_table")}


def plans(root: Path = HERE) -> dict[str, dict[str, dict]]:
    """{preset: {pair: plan}}: each plan made by the CLI (as a user types it) and written under root."""
    out: dict = {}
    for node in PRESETS:
        for pair in PAIRS:
            where = root / node / pair
            with contextlib.redirect_stdout(io.StringIO()):
                P.main([f"pair={pair}", "--node", node, "--out", str(where)])
            out.setdefault(node, {})[pair] = json.loads((where / "plan.json").read_text())
    return out


def load_plans(root: Path = HERE) -> dict[str, dict[str, dict]]:
    """{preset: {pair: plan}} of the committed plan.json files (what `plans` wrote)."""
    return {node: {pair: json.loads((root / node / pair / "plan.json").read_text()) for pair in PAIRS}
            for node in PRESETS}


def doc_blocks(all_plans: dict) -> dict[Path, dict[str, str]]:
    """{file: {block: text}} of every generated plan block the docs hold."""
    made = blocks(all_plans)
    return {ROOT / rel: {n: made[n] for n in names} for rel, names in DOCS.items()}


def verdict(plan: dict) -> str:
    if plan["verdict"] == "fits, as typed":
        return "fits, as typed"
    why = []
    for name, reason in plan["refused"].items():
        over = plan["stages"][name]
        hours = f"~{over['seconds'] / 3600:.0f} h > {plan['max_hours']:g} h"
        why.append(f"{name} ({'/'.join(over['over']) or hours})")
    return f"refused: {', '.join(why)}; runs on `{plan['smallest_node']}`"


def nodes_block() -> str:
    lines = ["| preset | GPUs | host | local disk | from |", "|---|---|---|---|---|"]
    for name in PRESETS:
        n = P.NODES[name]
        lines.append(f"| `{name}` | {n['gpus']} x {n['gpu']} {n['gpu_gib']:g} GiB | {n['host_gib']:g} GiB | "
                     f"{n['disk_gib']:,.0f} GiB | {n['source']} |")
    return "\n".join(lines) + "\n"


def verdicts_block(all_plans: dict) -> str:
    """pair x preset: 'fits, as typed' or the refusal with the smallest preset that runs it."""
    lines = ["| pair | " + " | ".join(f"`{n}`" for n in PRESETS) + " |", "|---|" + "---|" * len(PRESETS)]
    for pair in PAIRS:
        lines.append(f"| {pair} | " + " | ".join(verdict(all_plans[n][pair]) for n in PRESETS) + " |")
    return "\n".join(lines) + "\n"


def table_block(all_plans: dict) -> str:
    """pair x preset x stage: peak GPU (per GPU) / host / disk GiB and the estimated time, with the knobs applied."""
    lines = ["Peak GPU (per GPU) / host / disk in GiB, estimated time; the knobs the run applies itself (none changes "
             "a number); '(refused)' marks a stage the run refuses there (see the verdicts).", "",
             "| pair | preset | knobs applied | " + " | ".join(P.STAGES) + " |", "|---|---|---|" + "---|" * len(P.STAGES)]
    for pair in PAIRS:
        for node in PRESETS:
            plan = all_plans[node][pair]
            st = plan["stages"]
            knobs = " ".join(f"`{e['set']}`" for e in plan["applied"]) or "-"
            cells = [f"{st[s]['gpu_gib']:.0f} / {st[s]['host_gib']:.0f} / {st[s]['disk_gib']:.0f}, {P.dur(st[s]['seconds'])}"
                     + ("" if not st[s]["refused"] else " (refused)") for s in P.STAGES]
            lines.append(f"| {pair} | `{node}` | {knobs} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def blocks(all_plans: dict) -> dict[str, str]:
    return {"plan_nodes": nodes_block(), "plan_verdicts": verdicts_block(all_plans), "plan_table": table_block(all_plans)}


def main() -> None:
    all_plans = plans()
    made = blocks(all_plans)
    summary = ["# Resource plan: the six paper pairs at the paper's protocol on every node preset", "",
               "Generated by `python3 results/plan/make.py`. Every key at its default (two-level moments: float32 sums "
               "on the device, float64 masters on the host); the run applies the listed number-neutral knobs itself, "
               "and refuses a stage that fits no number-neutral layout, naming the smallest preset that runs it. "
               "Times are estimates (datasheet rates x efficiency; the host side assumed). Full tables per pair in "
               "`<preset>/<pair>/plan.md`.", "", "## Node presets", "", made["plan_nodes"], "## Verdicts", "",
               made["plan_verdicts"], "## Per stage", "", made["plan_table"]]
    (HERE / "summary.md").write_text("\n".join(summary))
    for rel, names in DOCS.items():
        path = ROOT / rel
        if path.exists() and all(n in readme.blocks(path.read_text()) for n in names):
            readme.rewrite(path, {n: made[n] for n in names})
    print((HERE / "summary.md").read_text())


if __name__ == "__main__":
    main()
