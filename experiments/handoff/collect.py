"""results/handoff/README.md's generated blocks from the committed reports (results/handoff/*.json).

    python experiments/handoff/collect.py

Reads load_tiny.json (experiments/handoff/load_tiny.py's report.json), and where present latency.json,
latency_reverse.json (real_pair.py --reverse's latency.json), overhead.json, conversation.json
(experiments/handoff/real_pair.py), store_switch.json (experiments/handoff/store_switch.py), switch_floor.json
(experiments/handoff/switch_floor.py) and store_io.json
(experiments/handoff/store_io.py); writes one generated block per report into results/handoff/README.md
(atomically); prints nothing. The conversation's SE is kvtransfer.eval.stats' (clustered by conversation).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # the checkout's kvtransfer, installed or not
OUT = ROOT / "results/handoff"

from kvtransfer.eval.stats import clustered_mean, median_se  # noqa: E402


def _run_line(prov: dict) -> str:
    return (f"Run at commit `{str(prov.get('commit'))[:7]}`{' (dirty tree)' if prov.get('dirty') else ''}, "
            f"{prov.get('cpus', '?')} CPUs ({prov.get('cpu', 'unknown CPU')}).")


def _pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def load_table(rep: dict) -> str:
    """The load phase: counts, what each switch and later turn computed, and latency quantiles by kind of turn."""
    load = [r for r in rep["records"] if r["phase"] == "load"]
    target = [r for r in load if r["to_target"]]
    switches = [r for r in target if r.get("switch")]
    later = [r for r in target if not r.get("switch")]
    status = Counter((r.get("kvtransfer") or {}).get("status", f"HTTP {r['status']}") for r in load)
    checked = [r for r in target if "differs" in r]

    def q(rows):
        s = [r["seconds"] for r in rows]
        return f"{_pct(s, .5):.2f} / {_pct(s, .95):.2f} / {max(s):.2f}" if s else "-"

    rows = [("sessions x turns", f"{rep['sessions']} x {rep['turns']} (switch turn per session: "
                                 f"{', '.join(map(str, rep['handoff_turns']))})"),
            ("requests (non-200)", f"{len(load)} ({sum(r['status'] != 200 for r in load)})"),
            ("outcomes", ", ".join(f"{k}: {v}" for k, v in sorted(status.items()))),
            ("switches that sent anything to the source (its prompt-token counter moved, or a save step)",
             f"{sum(bool(r.get('producer_prompt_tokens')) or r['kvtransfer'].get('save_s') is not None for r in switches)}"
             f" / {len(switches)}"),
            ("switch: tokens mapped / prefilled (sum)", f"{sum(r['kvtransfer']['mapped'] or 0 for r in switches)} / "
                                                        f"{sum(r['kvtransfer']['prefilled'] or 0 for r in switches)}"),
            ("later target turns: cached / prefilled (sum); new tokens those turns added",
             f"{sum(r['kvtransfer'].get('cached') or 0 for r in later)} / "
             f"{sum(r['kvtransfer']['prefilled'] or 0 for r in later)}; {sum(r['new_tokens'] for r in later)}"),
            ("target answers differing from the target's own prefill (identity map, greedy, 8 tokens)",
             f"{sum(bool(r['differs']) for r in checked)} / {len(checked)}"),
            ("seconds p50 / p95 / max: source turns", q([r for r in load if not r["to_target"]])),
            ("seconds p50 / p95 / max: switches", q(switches)),
            ("seconds p50 / p95 / max: later target turns", q(later)),
            ("wall seconds: engines' start-up (apart) / load phase / faults",
             " / ".join(f"{rep['seconds'][k]:.0f}" for k in ("startup", "load", "faults")))]
    return "| quantity | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


FAULT_ROWS = [("truncated", "the last stored block of a prompt truncated by 4 KiB"),
              ("corrupt_k_bytes", "bytes flipped inside a block's K (header intact)"),
              ("foreign_weights", "a block with the same header and other K/V numbers"),
              ("evicted", "a handed-over session's blocks deleted before its next turn"),
              ("producer_dead", "the source killed, then a session it never served switches"),
              ("both_dead", "both engines killed, then a target request")]


def fault_table(rep: dict) -> str:
    f = rep["faults"]
    by_phase = {r["phase"]: r for r in rep["records"] if "phase" in r}
    lines = ["| fault | what | proxy's answer (X-KVTransfer or HTTP status) | served == target's own prefill | "
             "next clean switch |", "|---|---|---|---|---|"]
    for key, what in FAULT_ROWS:
        rec = by_phase.get(f"fault:{key}", {})
        answer = f[key].get("header") or f"HTTP {f[key].get('status')}"
        same = "-" if "differs" not in rec else ("no" if rec["differs"] else "yes")
        lines.append(f"| {key} | {what} | {answer} | {same} | {f[key].get('after', '-')} |")
    bad = f["bad_requests"]
    lines.append(f"| bad requests | {len(bad)} malformed bodies | HTTP {', '.join(map(str, sorted(set(bad))))} "
                 f"(all {len(bad)}) | - | - |")
    t = f.get("takeover")  # reports before sessions were keyed by (API key, id)
    if t:
        lines.append(f"| takeover | another API key on an open session | HTTP {t['thief']} (owner: {t['owner']}) | - | - |")
    k = f.get("second_key")
    if k:
        other = k.get("other_kvtransfer") or {}
        lines.append(f"| second key | another API key on an open session's id | HTTP {k['other']}: a session of its own "
                     f"(save step {other.get('save_s') is not None}, cached {other.get('cached') or 0}) | - | "
                     f"owner's switch: {k['owner_switch']} |")
    b = f.get("distinct_bad_sessions")
    if b:
        lines.append(f"| distinct bad sessions | {sum(b['codes'].values())} bad requests, each with its own 2 KB session "
                     f"id | HTTP {', '.join(b['codes'])}; sessions {b['sessions_before']} -> {b['sessions_after']}; "
                     f"proxy RSS {b['rss_kb_before'] / 1024:.0f} -> {b['rss_kb_after'] / 1024:.0f} MiB | - | - |")
    lines.append(f"\nProxy alive after every fault: {'yes' if f['proxy_alive_after'] else 'NO'}; proxy crashed: "
                 f"{'yes' if rep['crashed']['proxy'] else 'no'}; proxy 5xx from its own errors: "
                 f"{sum(v for k, v in rep['proxy_stats']['errors'].items() if k.startswith('proxy_error'))}. "
                 f"Target connector's reasons over the whole run: "
                 f"{', '.join(f'{k}: {v}' for k, v in sorted((rep['consumer_reasons'] or {}).items()))}. "
                 f"Proxy handoff counters: {json.dumps(rep['proxy_stats'].get('handoff', {}))}.")
    return "\n".join(lines)


def latency_table(rep: dict) -> str:
    """The switch against the cold prefill and the truncation twin, per context size: medians ± their SE over the
    repeats (`stats.median_se`), maxima, and whether the switch's median is monotone in the size."""
    lines = [_run_line(rep["provenance"]), "",
             "| context tokens | n | switch: median ± SE / max (s) | target's cold prefill: median ± SE / max (s) | "
             "speed-up (medians) | target reads only the last 128 tokens: median ± SE (s) | mapped / prefilled "
             "(median) | first token = cold's: switch / truncation |", "|---|---|---|---|---|---|---|---|"]
    medians = []
    for r in rep["rows"]:
        h, c, t = r["handoff_ttft_s"], r["cold_ttft_s"], r["truncate_ttft_s"]
        (mh, sh), (mc, sc), (mt, st) = median_se(h), median_se(c), median_se(t)
        medians.append(mh)
        lines.append(f"| {r['tokens']:,} | {len(h)} | {mh:.2f} ± {sh:.2f} / {max(h):.2f} | "
                     f"{mc:.2f} ± {sc:.2f} / {max(c):.2f} | {mc / mh:.1f}x | {mt:.2f} ± {st:.2f} | "
                     f"{statistics.median(r['mapped']):.0f} / {statistics.median(r['prefilled']):.0f} | "
                     f"{r['first_token_equal_cold']} / {r['first_token_equal_truncate']} of {len(h)} |")
    monotone = all(a <= b for a, b in zip(medians, medians[1:]))
    lines.append(f"\nThe switch's median {'rises' if monotone else 'does not rise'} monotonically with the context "
                 f"size. Engines' start-up {rep['startup_s']:.0f} s (not in any row). Proxy handoff counters: "
                 f"{json.dumps(rep['proxy_stats'].get('handoff', {}))}.")
    return "\n".join(lines)


def store_switch_table(rep: dict) -> str:
    """The switch with the Redis store against the directory store (store_switch.py): per store the switches'
    median, mean ± SE and tokens mapped, then the difference of means and the goal."""
    sm = rep["summary"]
    lines = [_run_line(rep["provenance"]), "",
             f"{rep['tokens']:,}-token contexts, {rep['dtype']} engines; rounds {', '.join(rep['rounds'])} "
             f"({rep['per_round']} counted switches each, after one warm-up).", "",
             "| store | switches | median (s) | mean ± SE (s) | tokens mapped (median) |", "|---|---|---|---|---|"]
    for store, name in (("dir", "directory"), ("redis", "Redis")):
        r = sm[store]
        lines.append(f"| {name} | {r['n']} | {r['median_s']:.2f} | {r['mean_s']:.2f} ± {r['se_s']:.2f} | "
                     f"{rep['mapped_median'][store]:.0f} |")
    verdict = "met" if sm["goal_met"] else "not met"
    lines.append(f"\nRedis - directory: {sm['redis_minus_dir_s']:+.2f} ± {sm['redis_minus_dir_se_s']:.2f} s "
                 f"(goal: at most that SE + 10 % of the directory's mean: {verdict}).")
    return "\n".join(lines)


def _ms(x: dict | None) -> str:
    """A median ± SE in seconds, as "1.23 ± 0.04" ("–" where nothing was recorded)."""
    if x is None:
        return "–"
    return f"{x['median']:.2f}" + ("" if x.get("se") is None else f" ± {x['se']:.2f}")


def switch_floor_table(rep: dict) -> str:
    """The switch against its floor (switch_floor.py): per size the switch, the floor's three parts, switch / floor
    against the 1.5x goal, and the worker's read, map and scatter beside their floors."""
    lines = [_run_line(rep["provenance"]), "",
             f"{rep['dtype']} engines, the map applied in {rep['map_dtype']}; {rep['per_size']} counted switches per "
             f"size (after one warm-up); medians ± SE over switches, seconds.", "",
             "| context tokens | n | switch | floor = store read + map + new turn | switch / floor (goal ≤ "
             f"{rep['summary'][0]['goal']:.1f}x) | worker: read (its floor) | worker: map (its floor) | "
             "worker: scatter | rest: proxy, scheduler, forward beyond the new turn | prefilled: switch / new turn |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["summary"]:
        f, w = r["floor_parts_s"], r["worker_s"]
        lines.append(
            f"| {r['tokens']:,} | {r['n']} | {_ms(r['switch_s'])} | {_ms(r['floor_s'])} = {f['read_s']:.3f} + "
            f"{f['map_s']:.3f} + {_ms(f['next_turn_s'])} | {_ms(r['ratio'])}x ({'met' if r['goal_met'] else 'not met'}) | "
            f"{_ms(w['read_s'])} ({f['read_s']:.3f}) | {_ms(w['map_s'])} ({f['map_s']:.3f}) | {_ms(w['scatter_s'])} | "
            f"{_ms(r['rest_beyond_next_turn_s'])} | {r['prefilled']['switch']:.0f} / {r['prefilled']['next_turn']:.0f} |")
    mf = rep["map_floor"]
    lines.append(f"\nMap floor: k = {mf['k']} source layers per target layer ({mf['n_source_used']} used), every target "
                 f"layer; GEMM rate {max(v['gemm_flops_per_s'] for v in mf['per_tokens'].values()) / 1e9:.0f} GFLOP/s "
                 f"(best), copy {mf['copy_bytes_per_s'] / 1e9:.1f} GB/s; plain-file read "
                 + ", ".join(f"{float(v) / 1e9:.2f} GB/s at {int(n):,}" for n, v in rep["read_bytes_per_s"].items())
                 + f". Load average at the end: {rep['loadavg_end'][0]:.1f}.")
    return "\n".join(lines)


def overhead_table(rep: dict) -> str:
    """Write-through overhead (real_pair.py --overhead): each side's TTFT median ± SE over the interleaved pairs, and
    the overhead as the median ± SE of the per-pair ratios through / plain - 1."""
    pairs = rep["pairs"]
    through, plain = (median_se([p[k] for p in pairs]) for k in ("through", "plain"))
    ratio = median_se([p["through"] / p["plain"] - 1 for p in pairs])
    return (f"{_run_line(rep['provenance'])}\n\n| source turn, {rep['tokens']:,} tokens | n | TTFT median ± SE (s) |\n"
            f"|---|---|---|\n| written through (connector, background write) | {len(pairs)} | {_pm(through)} |\n"
            f"| plain engine (no connector) | {len(pairs)} | {_pm(plain)} |\n\nOverhead of write-through (median of the "
            f"per-pair ratios, pairs interleaved): {100 * ratio[0]:+.1f} ± {100 * ratio[1]:.1f} %.")


def _pm(x: tuple[float, float | None]) -> str:
    """(median, SE) as "1.23 ± 0.04" (the SE left out below 2 values)."""
    return f"{x[0]:.2f}" + ("" if x[1] is None else f" ± {x[1]:.2f}")


def conversation_table(rep: dict) -> str:
    rows = rep["rows"]
    turns = sorted({r["turn"] for r in rows})
    lines = [_run_line(rep["provenance"]), "", f"{len({r['conversation'] for r in rows})} CoQA conversations; turns 1-2 on "
             "the source, then the target (switch at turn 3).", "",
             "| turn | proxy's answer (first conversation) | TTFT handed over, median ± SE (s) | TTFT target-only "
             "session, median ± SE (s) | F1 handed over | F1 target-only | answers equal |", "|---|---|---|---|---|---|---|"]
    for t in turns:
        sel = [r for r in rows if r["turn"] == t]
        k = (sel[0].get("kvtransfer") or {}).get("summary", "source")
        lines.append(f"| {t} | {k} | {_pm(median_se([r['ttft_s'] for r in sel]))} | "
                     f"{_pm(median_se([r['target_only_ttft_s'] for r in sel]))} | "
                     f"{statistics.mean(r['f1'] for r in sel):.2f} | {statistics.mean(r['target_only_f1'] for r in sel):.2f} | "
                     f"{sum(r['same_answer'] for r in sel)} / {len(sel)} |")
    tgt = [r for r in rows if r["engine"] == "target"]
    if tgt:
        # turns of one conversation share its story and history: the SE is clustered by conversation
        d = clustered_mean([r["f1"] - r["target_only_f1"] for r in tgt], [r["conversation"] for r in tgt])
        se = "–" if d["se"] is None else f"{d['se']:.3f}"
        ci = "" if d["lo"] is None else (f"; 95 % interval [{d['lo']:+.3f}, {d['hi']:+.3f}], Student t with {d['df']} "
                                         "degrees of freedom")
        lines.append(f"\nTarget turns (3-10): F1 handed over {statistics.mean(r['f1'] for r in tgt):.3f} vs target-only "
                     f"{statistics.mean(r['target_only_f1'] for r in tgt):.3f} (paired difference {d['value']:+.3f} "
                     f"± {se} SE clustered by conversation: {d['n']} turns of {d['clusters']} conversations{ci}); "
                     f"answers equal {sum(r['same_answer'] for r in tgt)} / {len(tgt)}.")
    return "\n".join(lines)


def store_table(rep: dict) -> str:
    """The store's throughput (store_io.py): per size the four rates (from median seconds) and store / plain, the
    median ± SE of the per-repeat ratios where the report has them."""
    la = rep.get("load_avg") or {}
    lines = [_run_line(rep["provenance"]) + (f" {rep['repeats']} interleaved repeats; load average "
                                             f"{la['before'][0]:.1f} before, {la['after'][0]:.1f} after."
                                             if la.get("before") and la.get("after") else ""), "",
             f"| tokens | MB | store write (MB/s) | plain file write (MB/s) | store read + verify (MB/s) | plain read (MB/s) "
             f"| write / plain | read / plain |", "|---|---|---|---|---|---|---|---|"]

    def ratio(r, kind):
        se = r.get(f"{kind}_vs_plain_se")
        return f"{r[f'{kind}_vs_plain']:.2f} ± {se:.2f}x" if se is not None else f"{r[f'{kind}_vs_plain']:.1f}x"
    for r in rep["rows"]:
        lines.append(f"| {r['tokens']:,} | {r['mb']:.0f} | {r['store_write_mb_s']:.0f} | {r['plain_write_mb_s']:.0f} | "
                     f"{r['store_read_mb_s']:.0f} | {r['plain_read_mb_s']:.0f} | {ratio(r, 'write')} | "
                     f"{ratio(r, 'read')} |")
    return "\n".join(lines)


SOURCES = {"load_tiny": ("load_tiny.json", lambda rep: f"{_run_line(rep['machine'])}\n\n{load_table(rep)}\n\n"
                                                        f"{fault_table(rep)}"),
           "latency": ("latency.json", latency_table), "latency_reverse": ("latency_reverse.json", latency_table),
           "store_switch": ("store_switch.json", store_switch_table),
           "switch_floor": ("switch_floor.json", switch_floor_table), "overhead": ("overhead.json", overhead_table),
           "conversation": ("conversation.json", conversation_table), "store_io": ("store_io.json", store_table)}


def readme_blocks(out: Path = OUT) -> dict[str, str]:
    """{block name: body} of results/handoff/README.md from the committed reports present (kvtransfer.report.readme)."""
    return {name: render(json.loads((out / file).read_text()))
            for name, (file, render) in SOURCES.items() if (out / file).exists()}


def main() -> None:
    from kvtransfer.report import readme

    readme.rewrite(OUT / "README.md", readme_blocks())


if __name__ == "__main__":
    main()
