"""Served TTFT under the per-request gate (issue 30): gated vs mapped vs the target's own full prefill.

    .venv-serve/bin/python experiments/serve/ttft_gate.py --source DIR --target DIR --mapper DIR --gate GATE.json \
        --out DIR [--tokens 256 1024] [--repeats 3] [--dtype float32] [--synthetic]

The source (kv_producer) prefills each prompt once; then two consumer engines of the target answer each prompt with
max_tokens=1, one warm-up and `repeats` timed requests per mode: the ungated connector ("mapped"; and
{"kvtransfer": "off"}, the engine's own full prefill: "full") and the connector with the gate artifact ("gated").
Each gated row records what the gate did (action, fraction, score, the first position the target computed) and the
share of the prompt the target computed itself: the recompute rate the gate chose, at which its TTFT is measured.
Prompts: --synthetic (the tiny family: id 0 + a fixed id pattern) or <|endoftext|> + WikiText-2 text.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def prompts(target: str, sizes: list[int], synthetic: bool) -> dict[int, list[int]]:
    """n tokens per prompt, position 0 the mapper's start token."""
    if synthetic:
        return {n: [0] + [100 + (37 + 11 * i) % 3000 for i in range(n - 1)] for n in sizes}
    sys.path.insert(0, str(HERE))
    from transformers import AutoTokenizer
    from ttft import prompts as wiki

    return wiki(AutoTokenizer.from_pretrained(target), sizes)


def timed(llm, p: list[int], repeats: int, params=None) -> tuple[list[float], dict | None]:
    """`repeats` TTFTs after one warm-up, and the last response's kv_transfer_params."""
    from engines import generate

    runs = generate(llm, [p] * (1 + repeats), 1, logprobs=1, params=params)[1:]
    return [r["seconds"] for r in runs], runs[-1]["kv_transfer_params"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--mapper", required=True)
    ap.add_argument("--gate", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from engines import close, engine, generate, kv_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ps = prompts(args.target, args.tokens, args.synthetic)
    n_max = max(args.tokens) + 64
    src = engine(args.source, dtype=args.dtype, max_model_len=n_max, kv=kv_config("kv_producer", out / "store"))
    for p in ps.values():
        generate(src, [p], 1)
    close(src)
    times: dict[int, dict] = {n: {} for n in ps}
    for label, gate in (("mapped", {}), ("gated", {"gate": args.gate})):
        llm = engine(args.target, dtype=args.dtype, max_model_len=n_max,
                     kv=kv_config("kv_consumer", out / "store", mapper=args.mapper, source_model=args.source,
                                  stats=out / f"stats_{label}.json", **gate))
        for n, p in ps.items():
            if label == "mapped":
                times[n]["full"], _ = timed(llm, p, args.repeats, {"kvtransfer": "off"})
            times[n][label], times[n][f"{label}_params"] = timed(llm, p, args.repeats)
        close(llm)
    rows = []
    for n, t in times.items():
        gate = ((t["gated_params"] or {}).get("kvtransfer") or {}).get("gate") or {}
        row = {"tokens": n, **{f"{m}_s": statistics.median(t[m]) for m in ("full", "mapped", "gated")},
               **{f"{m}_all_s": t[m] for m in ("full", "mapped", "gated")},
               "action": gate.get("action"), "fraction": gate.get("fraction"), "score": gate.get("score"),
               "start": gate.get("start"), "recomputed": gate.get("recomputed"), "reason": gate.get("reason")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
               **_checkout(), "dtype": args.dtype, "source": args.source, "target": args.target, "mapper": args.mapper,
               "gate": args.gate, "repeats": args.repeats, "label": args.label, "load_avg_end": os.getloadavg()}
    (out / "ttft_gate.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    print(table(rows))


def _checkout() -> dict:
    """commit and dirty flag of the checkout (kvtransfer.config.provenance: untracked source counted)."""
    from kvtransfer.config.provenance import json_provenance

    stamp = json_provenance()
    return {"commit": stamp["commit"], "dirty": stamp["dirty"]}


def table(rows: list[dict]) -> str:
    """The TTFT table: per prompt length, full / mapped / gated median TTFT and what the gate did."""
    lines = ["| prompt tokens | full prefill TTFT (s) | mapped TTFT (s) | gated TTFT (s) | gate action | score | "
             "share of the prompt the target computed |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.3g}"
        share = "-" if r["recomputed"] is None else f"{100 * r['recomputed']:.1f} %"
        lines.append(f"| {r['tokens']:,} | {r['full_s']:.3f} | {r['mapped_s']:.3f} | {r['gated_s']:.3f} | "
                     f"{r['action']} | {score} | {share} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
