"""Same numbers as the harness: vLLM + kvtransfer's connector vs the project's `transfer` mode (issue 22).

    KVT_HARNESS_PYTHON=python3 .venv-serve/bin/python experiments/serve/equivalence.py \
        --real ~/.cache/kvtransfer-real --mapper <mapper dir> --out results/serve/equivalence [--windows 32]
        [--gate <gate artifact>]     # the gated configuration (issue 30): served gate = harness gate

1. the harness side (experiments/serve/harness_side.py, in the project's environment: KVT_HARNESS_PYTHON)
2. vLLM, float32, eager: the 0.5B source as kv_producer prefills every context (its entries land in the
   store), then the 1.5B target as kv_consumer with the mapper: 32 greedy tokens per context, the first
   token's top-20 logprobs, the tail it computed (stats); and the same contexts again with
   {"kvtransfer": "off"} (the engine's own cold prefill: the floor of engine-vs-engine rounding)
3. equivalence.json / equivalence.md: per window, first-token logprob gap on the top-20 tokens both
   sides list, tokens equal up to the first divergence.
With --gate both sides run the gate (harness: harness_side.py --gate, core.gate's score and decision with the
served rule serve.gating.recompute_start; vLLM: the consumer with extra config "gate"): per window also the
action and the first position the target computed on each side, which must agree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# float32 on both sides, different kernels (vLLM's CPU attention and GEMMs vs HF's sdpa) through 28 layers:
# logits of magnitude ~30 carry a relative error of order 1e-6 (eps 1.2e-7 x accumulation over thousands of
# terms), so a few 1e-4 nats; the bound leaves 10x room
BOUND = 2e-3


def gap(a: dict, b: dict) -> float:
    shared = set(a) & set(b)
    return max(abs(a[t] - b[t]) for t in shared) if shared else float("inf")


def agree(a: list[int], b: list[int]) -> int:
    """Number of leading tokens that agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def vllm_side(args, ctxs: list[list[int]], out: Path) -> dict:
    from engines import close, engine, generate, kv_config

    from kvtransfer.serve.policy import Counters

    src, tgt = Path(args.source), Path(args.target)
    llm = engine(src, kv=kv_config("kv_producer", out / "store"))
    generate(llm, ctxs, 1)
    close(llm)
    stats = out / "stats.json"
    gate = {"gate": args.gate} if args.gate else {}
    llm = engine(tgt, kv=kv_config("kv_consumer", out / "store", mapper=args.mapper, source_model=src, stats=stats,
                                   **gate))
    mapped = generate(llm, ctxs, args.max_new, logprobs=20)
    cold = generate(llm, ctxs, args.max_new, logprobs=20, params={"kvtransfer": "off"})
    close(llm)
    return {"mapped": mapped, "cold": cold, "stats": Counters.load(stats),
            "worker": json.loads(Path(f"{stats}.worker.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", default=os.path.expanduser(os.environ.get("KVT_REAL_DIR", "~/.cache/kvtransfer-real")))
    ap.add_argument("--mapper", default=os.environ.get("KVT_REAL_MAPPER"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--gate", default=None)
    ap.add_argument("--fit-gate", default=None, help="the harness side fits a gate here on held-out windows "
                    "(harness_side.py --fit-gate) and both sides use it")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's cache block (CPU default 128): the granularity "
                    "of the served recompute, which the harness side reproduces")
    ap.add_argument("--source", default=None, help="source model dir (default: <real>/hf/qwen25coder-0.5b)")
    ap.add_argument("--target", default=None, help="target model dir (default: <real>/hf/qwen25coder-1.5b)")
    args = ap.parse_args()
    args.source = args.source or str(Path(args.real) / "hf/qwen25coder-0.5b")
    args.target = args.target or str(Path(args.real) / "hf/qwen25coder-1.5b")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    harness = out / "harness.json"
    if not harness.is_file():
        py = os.environ.get("KVT_HARNESS_PYTHON", "python3")
        subprocess.run([py, str(HERE / "harness_side.py"), "--real", args.real, "--mapper", args.mapper, "--out",
                        str(harness), "--windows", str(args.windows), "--max-new", str(args.max_new),
                        "--source", args.source, "--target", args.target,
                        *(["--fit-gate", args.fit_gate] if args.fit_gate else
                          ["--gate", args.gate] if args.gate else []),
                        *(["--block-size", str(args.block_size)] if args.gate or args.fit_gate else [])],
                       check=True, cwd=HERE.parents[1])
    args.gate = args.fit_gate or args.gate
    h = json.loads(harness.read_text())["windows"]
    v = vllm_side(args, [row["context"] for row in h], out)
    records = list(v["stats"]["requests"].values())[:len(h)]  # the mapped requests, in order
    rows = []
    for i, row in enumerate(h):
        m, c = v["mapped"][i], v["cold"][i]
        hf_first = {int(k): x for k, x in row["first_logprobs"].items()}
        rows.append({"window": i, "reason": records[i]["reason"], "tail": records[i]["tail"],
                     "first_token_equal": m["tokens"][0] == row["tokens"][0],
                     "first_logprob_gap": gap(m["first_logprobs"], hf_first),
                     "tokens_agree": agree(m["tokens"], row["tokens"]), "tokens": len(row["tokens"]),
                     "cold_vs_mapped_first_gap": gap(c["first_logprobs"], m["first_logprobs"]),
                     "map_ms": next((x.get("map_s", 0) * 1e3 for x in v["worker"]["loads"]
                                     if x["req_id"] == list(v["stats"]["requests"])[i]), None)})
        if args.gate:
            served = (m["kv_transfer_params"] or {}).get("kvtransfer", {}).get("gate") or {}
            rows[-1] |= {"served_action": served.get("action"), "harness_action": row["gate"]["action"],
                         "served_start": served.get("start"), "harness_start": row["gate"]["start"],
                         "served_score": served.get("score"), "harness_score": row["gate"]["score"]}
    from kvtransfer.config.provenance import json_provenance

    stamp = json_provenance()  # the checkout: commit, dirty (untracked source counted), time
    report = {"bound": BOUND, "mapper": args.mapper, "gate": args.gate, "windows": rows,
              "reasons": v["stats"]["reasons"], "gates": v["stats"].get("gates"), "source": args.source,
              "target": args.target, "commit": stamp["commit"], "dirty": stamp["dirty"], "provenance": stamp}
    (out / "equivalence.json").write_text(json.dumps(report, indent=1))
    (out / "equivalence.md").write_text(table(rows) + (gate_table(rows) if args.gate else ""))
    print(table(rows) + (gate_table(rows) if args.gate else ""))


def table(rows: list[dict]) -> str:
    lines = ["| window | tail | first token equal | max first-token logprob gap (nats, top-20) | greedy tokens equal |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['window']} | {r['tail']} | {'yes' if r['first_token_equal'] else 'NO'} | "
                     f"{r['first_logprob_gap']:.2e} | {r['tokens_agree']} / {r['tokens']} |")
    n = len(rows)
    lines.append(f"| **all {n}** | | {sum(r['first_token_equal'] for r in rows)} / {n} | "
                 f"max {max(r['first_logprob_gap'] for r in rows):.2e} (bound {BOUND:.0e}) | "
                 f"{sum(r['tokens_agree'] == r['tokens'] for r in rows)} / {n} windows all equal |")
    return "\n".join(lines) + "\n"


def gate_table(rows: list[dict]) -> str:
    """The gate's decision per window on both sides (action, first position the target computed, score)."""
    lines = ["", "| window | served action | harness action | served start | harness start | served score | "
             "harness score |", "|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['window']} | {r['served_action']} | {r['harness_action']} | {r['served_start']} | "
                     f"{r['harness_start']} | {fmt(r['served_score'])} | {fmt(r['harness_score'])} |")
    same = sum(r["served_action"] == r["harness_action"] and r["served_start"] == r["harness_start"] for r in rows)
    lines.append(f"| **all {len(rows)}** | | | {same} / {len(rows)} same action and start | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
