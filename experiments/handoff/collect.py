"""results/handoff/README.md from the committed run reports (results/handoff/*.json).

    python experiments/handoff/collect.py

Reads results/handoff/load_tiny.json (experiments/handoff/load_tiny.py's report.json, copied) and writes the
README's generated block: the load run's counts and the fault table. Written atomically.
"""
from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results/handoff"
BEGIN, END = "<!-- BEGIN generated:load_tiny -->", "<!-- END generated:load_tiny -->"


def load_table(rep: dict) -> str:
    load = [r for r in rep["records"] if r["phase"] == "load"]
    target = [r for r in load if r["to_target"]]
    status = Counter((r.get("kvtransfer") or {}).get("status", f"HTTP {r['status']}") for r in load)
    fallbacks = Counter(r["header"] for r in target if not (r.get("header") or "").startswith("mapped"))
    differs = [r for r in target if r.get("differs")]
    checked = [r for r in target if "differs" in r]
    secs = sorted(r["seconds"] for r in load)
    tgt_secs = [r["seconds"] for r in target]
    handed = [r for r in target if r.get("kvtransfer", {}).get("save_s") is not None]
    rows = [("sessions x turns", f"{rep['sessions']} x {rep['turns']} (handoff turn per session: "
                                 f"{', '.join(map(str, rep['handoff_turns']))})"),
            ("requests", len(load)),
            ("served by the source", status.get("source", 0)),
            ("served by the target", len(target)),
            ("handoffs (producer save + map)", len(handed)),
            ("mapped (all target requests incl. later turns)", status.get("mapped", 0)),
            ("fallbacks by reason", ", ".join(f"{k}: {v}" for k, v in fallbacks.items()) or "none"),
            ("responses differing from the target's own prefill (greedy, 8 tokens)",
             f"{len(differs)} / {len(checked)}"),
            ("non-200 responses", sum(r["status"] != 200 for r in load)),
            ("mapped / prefilled tokens (target requests)",
             f"{sum(r['kvtransfer']['mapped'] or 0 for r in target)} / "
             f"{sum(r['kvtransfer']['prefilled'] or 0 for r in target)}"),
            ("request seconds, median (all / target)",
             f"{statistics.median(secs):.3f} / {statistics.median(tgt_secs):.3f}" if tgt_secs else "-"),
            ("producer save seconds, median (handoffs)",
             f"{statistics.median(r['kvtransfer']['save_s'] for r in handed):.3f}" if handed else "-"),
            ("wall seconds: engines' start-up / load phase / faults",
             " / ".join(f"{rep['seconds'][k]:.0f}" for k in ("startup", "load", "faults")))]
    return "| quantity | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


FAULT_ROWS = [("truncated", "entry truncated by 4 KiB"),
              ("corrupt_k_bytes", "bytes flipped inside every layer's K (header intact)"),
              ("foreign_weights", "same architecture and header, other K/V numbers"),
              ("evicted", "entry deleted between a handoff and the session's next turn"),
              ("producer_dead", "producer killed, then a handoff"),
              ("both_dead", "producer and consumer killed, then a target request")]


def fault_table(rep: dict) -> str:
    f = rep["faults"]
    by_phase = {r["phase"]: r for r in rep["records"]}
    lines = ["| fault | what | proxy's answer (X-KVTransfer or HTTP status) | served tokens == target's own prefill | "
             "next clean handoff |", "|---|---|---|---|---|"]
    for key, what in FAULT_ROWS:
        rec = by_phase.get(f"fault:{key}", {})
        answer = f[key].get("header") or f"HTTP {f[key].get('status')}"
        same = "-" if "differs" not in rec else ("no" if rec["differs"] else "yes")
        lines.append(f"| {key} | {what} | {answer} | {same} | {f[key].get('after', '-')} |")
    bad = f["bad_requests"]
    lines.append(f"| bad requests | {len(bad)} malformed bodies | HTTP {', '.join(map(str, sorted(set(bad))))} "
                 f"(all {len(bad)}) | - | - |")
    lines.append(f"\nProxy alive after every fault: {'yes' if f['proxy_alive_after'] else 'NO'}; proxy crashed: "
                 f"{'yes' if rep['crashed']['proxy'] else 'no'}; proxy 5xx from its own errors: "
                 f"{sum(v for k, v in rep['proxy_stats']['errors'].items() if k.startswith('proxy_error'))}. "
                 f"Consumer connector's reasons over the whole run: "
                 f"{', '.join(f'{k}: {v}' for k, v in sorted((rep['consumer_reasons'] or {}).items()))}. "
                 f"Proxy counters: {json.dumps(rep['proxy_stats']['counts'])}, fallbacks "
                 f"{json.dumps(rep['proxy_stats']['fallbacks'])}, errors {json.dumps(rep['proxy_stats']['errors'])}.")
    return "\n".join(lines)


def render(rep: dict) -> str:
    m = rep["machine"]
    return (f"{BEGIN}\nRun at commit `{m['commit'][:7]}`{' (dirty tree)' if m['dirty'] else ''}, {m['cpus']} CPUs, "
            f"{m['platform']}.\n\n{load_table(rep)}\n\n{fault_table(rep)}\n{END}")


def real_pair(rep: dict) -> str:
    """The real pair's handoff latency and conversation tables."""
    m = rep["machine"]
    lines = [f"Run at commit `{m['commit'][:7]}`{' (dirty tree)' if m['dirty'] else ''}, {m['cpus']} CPUs.", "",
             "| prompt tokens | rep | handoff: request -> target's first token, save included (s) | producer save (s) "
             "| target cold prefill (s) | speed-up | proxy's answer | first token handoff / cold |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rep["latency"]:
        k = r["kvtransfer"]
        lines.append(f"| {r['n']:,} | {r['rep']} | {r['handoff_s']:.2f} | {k['save_s']:.2f} | {r['cold_s']:.2f} | "
                     f"{r['cold_s'] / r['handoff_s']:.1f}x | {k['summary']} | {r['first_token']} / "
                     f"{r['cold_first_token']} |")
    lines += ["", "| turn | prompt tokens | served by | proxy's answer | TTFT (s) | target re-prefill TTFT (s) | "
                  "answer (proxy) | answer (target re-prefill) | same | gold |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["conversation"]:
        k = r.get("kvtransfer") or {}
        rp = f"{r['reprefill_ttft_s']:.2f}" if "reprefill_ttft_s" in r else "-"
        same = "-" if "same_answer" not in r else ("yes" if r["same_answer"] else "no")
        lines.append(f"| {r['turn']} | {r['prompt']:,} | {r['engine']} | {k.get('summary', 'source')} | "
                     f"{r['ttft_s']:.2f} | {rp} | {json.dumps(r['answer'])} | {json.dumps(r.get('reprefill_answer', '-'))} "
                     f"| {same} | {json.dumps(r['gold'])} |")
    lines.append(f"\nConsumer connector's reasons: {json.dumps(rep.get('consumer_reasons'))}; engines' start-up "
                 f"{rep['startup_s']:.0f} s.")
    return "\n".join(lines)


def readme_blocks(out: Path = OUT) -> dict[str, str]:
    """{block name: body} of results/handoff/README.md from the committed reports (kvtransfer.report.readme)."""
    rep = json.loads((out / "load_tiny.json").read_text())
    bodies = {"load_tiny": render(rep)[len(BEGIN) + 1:-len(END) - 1]}
    if (out / "real_pair.json").exists():
        bodies["real_pair"] = real_pair(json.loads((out / "real_pair.json").read_text()))
    return bodies


def main() -> None:
    from kvtransfer.report import readme

    readme.rewrite(OUT / "README.md", readme_blocks())


if __name__ == "__main__":
    main()
