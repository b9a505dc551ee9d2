"""Is the map worth its cost against the target reading a truncated prompt? Reads results/baselines/runs/*/
(summary.json, scores.json, config.json), the committed results/qwen25coder/runs/controls_ppl (the same windows'
transfer / target / no_context NLLs) and experiments/baselines/split.yaml; writes results/baselines/README.md,
results/baselines/figures/cost.png and the `baselines_headline` block of README.md (atomically); prints the
README and the headline. Every SE, interval and interpolation is kvtransfer.eval.metrics' or .stats'.

    python experiments/baselines/collect.py

Definitions. gap closed = (log ppl no_context - log ppl mode) / (log ppl no_context - log ppl target) on the same
windows (one per document), ± a paired bootstrap SE over windows (1,000 resamples, seed 0). truncate_<r>: the target
reads the start id and only the last round(r x (P - 1)) + 1 context tokens, nothing mapped -- exactly the target work
of recompute_recent_<r> without the map; truncate_tokens_<m>: the last m tokens (the truncation curve; m = 1 is
no_context). Measured cost: seconds the target spends reading a context (map + recompute in mapped modes, the
source's prefill excluded; its own prefill of what it reads otherwise) over the seconds of `target`'s re-prefill
of the same context (see "Timing"); FLOPs: the target's, counted from the model config, over a re-prefill's; a
mapped mode adds the map's FLOPs and the target's prefill of the native-sink token (the start id, which truncation
pays for too).
The map's worth in native tokens: the m at which the truncation curve's gap closed reaches the mapped mode's,
interpolated in log m, with the 2.5-97.5 % percentiles of a paired bootstrap over windows. Equal-cost truncation:
the truncation curve's gap closed interpolated (linearly in cost, measured seconds or FLOPs, between the curve
points no cheaper point beats) at the mapped mode's cost; the difference mapped - truncation at equal cost ± a paired
bootstrap SE over windows (the costs held fixed).
Selection: WikiText-2's articles are split once (experiments/baselines/split.yaml, committed before any run); the
repair (rule, r) is chosen on the selection half only -- the largest gap closed above its truncation twin -- and the
confirmation half and the Python stdlib set are reported with that choice. At P = 512, 1,024 (24 articles each) and
2,048 (16) nothing is chosen: the worth table reports all of their windows.
The gate: its realised action shares per half (binomial SEs) against the shares its thresholds were fitted for, and
its gap closed against the fixed rule's (map + recent recompute at the r that ran, then the re-prefill at r = 1)
interpolated at the gate's realised FLOPs; it pays only if it beats that rule by 2 SE and acts at its fitted rates.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.core.io import atomic_write_bytes  # noqa: E402
from kvtransfer.core.timing import median_se  # noqa: E402
from kvtransfer.eval.coqa import coqa_summary_from_scores  # noqa: E402
from kvtransfer.eval.stats import binomial_se, t_quantile  # noqa: E402
from kvtransfer.eval.metrics import (control_statistics, equal_cost, gap_closed, native_token_worth,  # noqa: E402
                                     paired_bootstrap, ppl_gap_closed)
from kvtransfer.report import readme  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibration_curve  # noqa: E402
import gpu_model  # noqa: E402

RUNS = ROOT / "results" / "baselines" / "runs"
TIMINGS = ROOT / "results" / "baselines" / "timing"
OUT = ROOT / "results" / "baselines"
SPLIT = ROOT / "experiments" / "baselines" / "split.yaml"
N_BOOT, SEED = 1000, 0
CHOICE_P = 256   # the P whose selection half chooses the repair
CURVE = "truncate_tokens_"
REVERSE = "@reverse"   # the key suffix of a large -> small run's sets
SET_NAMES = {"wikitext2": "WikiText-2", "python_stdlib": "Python stdlib",
             "wikitext2@reverse": "WikiText-2, large -> small (1.5B reads, 0.5B answers)"}


def load_runs(runs: Path = RUNS) -> dict:
    """{run name: {"summary", "scores"}} of every finished run (a summary and scores.json), by name."""
    out = {}
    for d in sorted(p for p in runs.glob("*") if (p / "summary.json").exists() and (p / "scores.json").exists()):
        out[d.name] = {"summary": json.loads((d / "summary.json").read_text()),
                       "scores": json.loads((d / "scores.json").read_text()),
                       "config": json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}}
    return out


def load_timings(path: Path = TIMINGS) -> dict:
    """{(set, P): a file of experiments/baselines/timing.py (interleaved, repeated, with SEs)} that exist."""
    files = sorted(path.glob("*.json")) if path.is_dir() else []
    return {(d["set"], int(d["prefix"])): d for d in (json.loads(f.read_text()) for f in files)}


def timed_costs(tm: dict) -> dict:
    """{mode: (median seconds / target's re-prefill, its SE)} of a timing file, per-round ratios (timing protocol);
    "transfer+source": the map with the source's prefill counted, (map_i + source_i) / target_i per round."""
    t = tm["timing"]
    out = {m: (r["median"], r["se"]) for m, r in t["relative"].items()}
    if "transfer" in t["seconds"] and "source" in t["seconds"]:
        out["transfer+source"] = median_se([(a + b) / c for a, b, c in zip(
            t["seconds"]["transfer"], t["seconds"]["source"], t["seconds"]["target"])])
    return out


def timing_record(tm: dict) -> dict:
    """What a table says about its seconds: repeats, windows, load before / after, CPU, the commit measured at."""
    t, prov = tm["timing"], tm.get("provenance") or {}
    return {"repeats": t["repeats"], "windows": tm["windows"], "load_avg": t["load_avg"],
            "cpu": (t.get("machine") or {}).get("cpu"), "threads": (t.get("machine") or {}).get("torch_threads"),
            "commit": f"{str(prov.get('commit'))[:7]}{', dirty' if prov.get('dirty') else ''}"}


# committed runs whose mapped and baseline NLLs the target-only truncation runs (real_trunc_*) sit beside: the same
# draw (62 per-document windows of each set at P = 256, 64 scored tokens, seed 0), checked window by window
BASE_RUNS = {"results/qwen25coder/runs/controls_ppl": ("transfer", "target", "no_context")}
# runs whose map is another calibration's: their `transfer` is merged under this name beside the main map's
OTHER_MAPS = dict(calibration_curve.CALIB_MAPS)
WORTH_MAPS = ("transfer", "transfer_code_calib")   # the maps the worth-vs-P table follows over P


def load_base(root: Path = ROOT) -> dict:
    """{path: {"summary", "scores", "modes"}} of BASE_RUNS that exist."""
    out = {}
    for rel, modes in BASE_RUNS.items():
        d = root / rel
        if (d / "summary.json").exists() and (d / "scores.json").exists():
            out[rel] = {"summary": json.loads((d / "summary.json").read_text()),
                        "scores": json.loads((d / "scores.json").read_text()), "modes": modes}
    return out


def merge(runs: dict, base: dict | None = None) -> dict:
    """{(set, P): {"nll": {mode: [per window]}, "docs": [...], "rows": {mode: timing/cost columns}, "runs": [...],
    "commits": {...}, "pair": ..}} over the real-pair runs; a mode two runs share must agree window for window (the
    same cached file), else ValueError."""
    merged: dict = {}
    base = {} if base is None else base
    order = [(rel, {**b, "base": True}) for rel, b in base.items()] + [(n, r) for n, r in runs.items()]
    for name, r in order:
        if not (name.startswith("real_") or r.get("base")):
            continue
        s, sc = r["summary"], r["scores"]
        env = s.get("environment") or {}
        # large -> small is another pair (another target's NLLs): its sets are keyed apart, "<set>@reverse"
        tag = REVERSE if ((r.get("config") or {}).get("pair") or {}).get("direction") == "reverse" else ""
        rows = {(st + tag, row["prefix"]): row for st, rs in (s.get("ppl_sets") or {}).items() for row in rs}
        for st, part in ((k + tag, v) for k, v in (sc.get("ppl_sets") or {}).items()):
            for p, by_mode in (part.get("window_nll") or {}).items():
                if int(p) == 0:
                    continue
                key = (st, int(p))
                m = merged.setdefault(key, {"nll": {}, "docs": part.get("window_doc"), "rows": {}, "runs": [],
                                            "commits": {}, "reproduced": {}, "base": {}})
                if m["docs"] != part.get("window_doc"):
                    raise ValueError(f"{name}: {st} P={p} windows differ from another run's: not one draw")
                renamed = {OTHER_MAPS[name]: "transfer"} if name in OTHER_MAPS else {}
                if renamed:
                    by_mode = {(OTHER_MAPS[name] if k == "transfer" else k): v for k, v in by_mode.items()}
                if r.get("base"):
                    by_mode = {k: v for k, v in by_mode.items() if k in r["modes"]}
                    m["base"].update({k: name for k in by_mode})
                    flops = (s.get("mapper") or {}).get("apply_flops_per_token")
                    if flops:
                        m["map_flops_per_token"] = flops
                for mode, nll in by_mode.items():
                    if mode in m["base"] and not r.get("base"):  # a committed base's NLLs stay; how far this is
                        m["reproduced"][mode] = max(abs(a - b) for a, b in zip(nll, m["nll"][mode]))
                        continue
                    if mode in m["nll"] and m["nll"][mode] != nll:
                        raise ValueError(f"{name}: {st} P={p} mode {mode} differs from another run's")
                    m["nll"][mode] = nll
                for mode, per_p in (part.get("events") or {}).items():  # what the gate / a recompute did per window
                    if per_p.get(str(p)):
                        m.setdefault("events", {})[mode] = per_p[str(p)]
                gcfg = ((r.get("config") or {}).get("eval") or {}).get("gate") or {}
                if gcfg.get("enabled"):  # the action rates the gate's thresholds were fitted for
                    m["gate_fitted"] = {"recompute": gcfg["recompute_rate"], "full": gcfg["full_rate"],
                                        "map": round(1 - gcfg["recompute_rate"] - gcfg["full_rate"], 12)}
                row = rows.get(key) or {}
                for mode in by_mode:
                    src = renamed.get(mode, mode)   # the run's own name of the mode (its row's columns)
                    cols = {k[len(src) + 1:]: v for k, v in row.items() if k.startswith(src + "_") and
                            k[len(src) + 1:] in ("seconds", "seconds_rel", "flops_rel", "map_flops_rel", "cost",
                                                 "source_seconds")}
                    if cols:
                        m["rows"].setdefault(mode, {}).update(cols)
                timing = ((s.get("eval_timing") or {}).get("target") or {}).get(f"ppl.{st.removesuffix(REVERSE)}", {}).get(str(p))
                if timing and timing.get("contexts"):  # a re-prefill's FLOPs per context (the map's FLOPs beside it)
                    m["reference_flops"] = timing["reference_flops"] / timing["contexts"]
                    m["reference_tokens"] = timing["reference_tokens"] / timing["contexts"]
                for t in ((s.get("eval_timing") or {}).values()):
                    tt = (t.get(f"ppl.{st.removesuffix(REVERSE)}") or {}).get(str(p))
                    if tt and tt.get("contexts") and "reference_flops" not in m:
                        m["reference_flops"] = tt["reference_flops"] / tt["contexts"]
                        m["reference_tokens"] = tt["reference_tokens"] / tt["contexts"]
                ns = ((r.get("config") or {}).get("mapper") or {}).get("native_sink")
                if ns is not None:
                    if ns not in (0, 1) or m.setdefault("native_sink", ns) != ns:
                        raise ValueError(f"{name}: mapper.native_sink={ns} (another run of {st} P={p}: "
                                         f"{m.get('native_sink', 'none')}): the map's cost charges a sink of 0 or "
                                         "1 token, "
                                         "one value per (set, P); rerun with the pinned mapper.native_sink=1")
                m["runs"].append(name)
                m["commits"][name] = f"{str(env.get('commit'))[:7]}{', dirty' if env.get('dirty') else ''}"
    return merged


def map_apply_rel(m: dict) -> float | None:
    """The map's own FLOPs over a re-prefill's: apply FLOPs per token x the tokens of each cached prefix (context[:-1],
    start id included) over the target's prefill FLOPs of them (from the truncation runs' timing records)."""
    if m.get("map_flops_per_token") and m.get("reference_flops"):
        return m["map_flops_per_token"] * m["reference_tokens"] / m["reference_flops"]
    return (m["rows"].get("transfer") or {}).get("map_flops_rel")


def map_flops_rel(m: dict) -> float | None:
    """`map_apply_rel` plus the target's own prefill of the native-sink token at position 0 -- the start id, which
    truncation is charged for too (no_context's FLOPs: a prefill of the start id alone)."""
    apply = map_apply_rel(m)
    sink = (m["rows"].get("no_context") or {}).get("flops_rel") if m.get("native_sink", 1) else 0.0
    if apply is None or sink is None:
        return None   # a cost without the sink's prefill would charge the map less than truncation for one token
    return apply + sink


def split_halves() -> dict:
    """{"selection": [article index], "confirmation": [...]} of experiments/baselines/split.yaml."""
    d = yaml.safe_load(SPLIT.read_text())
    return {"selection": list(d["selection"]), "confirmation": list(d["confirmation"])}


def subsets(set_name: str, docs: list[int], prefix: int = 256) -> dict[str, list[int]]:
    """{half: window indices}: at P = 256 (where the repair is chosen) WikiText-2's selection / confirmation halves
    (by article) and all windows; elsewhere all windows (nothing is chosen there: both halves are held out)."""
    every = {"all": list(range(len(docs)))}
    if set_name != "wikitext2" or prefix != CHOICE_P:
        return every
    halves = split_halves()
    return {**{h: [i for i, d in enumerate(docs) if d in set(idx)] for h, idx in halves.items()}, **every}


def _take(nll: dict, idx: list[int]) -> dict:
    return {m: [v[i] for i in idx] for m, v in nll.items()}


def cost_of(mode: str, cols: dict, map_flops: float | None) -> tuple[float | None, float | None]:
    """(measured seconds / target's, FLOPs / a re-prefill's) of a mode's columns; mapped modes count the map's FLOPs
    (`map_flops`) beside the target's."""
    if mode.startswith("transfer"):   # the map alone (the main calibration's or another's)
        return cols.get("seconds_rel"), map_flops
    if mode.startswith("recompute_") or mode == "gated":
        cost = cols.get("cost")
        return cols.get("seconds_rel"), None if cost is None or map_flops is None else cost + map_flops
    return cols.get("seconds_rel"), cols.get("flops_rel")


def curve_points(nll: dict) -> list[int]:
    return sorted(int(m[len(CURVE):]) for m in nll if m.startswith(CURVE))


def truncation_curve(nll: dict) -> list[tuple[str, int | str]]:
    """The truncation curve [(mode, m)] of the modes that ran, in m order, ending at the target's re-prefill (m = P,
    labelled "P": the whole context, cost 1): a mode dearer than the last truncation point is still compared."""
    return [(f"{CURVE}{m}", m) for m in curve_points(nll)] + ([("target", "P")] if "target" in nll else [])


def rule_curve(nll: dict, rule: str = "recent") -> list[tuple[str, float]]:
    """The fixed rule's curve [(mode, r)]: the map alone (r = 0), map + `rule` recompute at each r that ran, and the
    target's re-prefill (r = 1: every token recomputed)."""
    pts = [("transfer", 0.0)] if "transfer" in nll else []
    pts += sorted(((m, float(m.rpartition("_")[2])) for m in nll if m.startswith(f"recompute_{rule}_")),
                  key=lambda x: x[1])
    return pts + [("target", 1.0)]


def gate_rates(events: list[dict | None], idx: list[int]) -> dict | None:
    """The gate's realised actions on windows `idx`: {"windows", "map", "recompute", "full" (shares), and each share's
    binomial SE}; None without records."""
    rows = [events[i] for i in idx if i < len(events) and events[i]]
    if not rows:
        return None
    n = len(rows)
    out = {"windows": n}
    for action in ("map", "recompute", "full"):
        q = sum(r.get("action") == action for r in rows) / n
        out[action], out[f"{action}_se"] = q, binomial_se(q, n)
    return out


def twin_difference(nll: dict, repair: str, twin: str) -> tuple[float, float]:
    """(gap closed of repair - of its truncation twin, paired bootstrap SE over windows)."""
    items = {"t": nll["target"], "f": nll["no_context"], "a": nll[repair], "b": nll[twin]}
    return paired_bootstrap(items, lambda mu: gap_closed(mu["a"], mu["t"], mu["f"]) - gap_closed(mu["b"], mu["t"], mu["f"]),
                            n_boot=N_BOOT, seed=SEED)


def gap(nll: dict, mode: str) -> tuple[float, float]:
    g = ppl_gap_closed({"target": nll["target"], "no_context": nll["no_context"], "transfer": nll[mode]},
                       n_boot=N_BOOT, seed=SEED)
    return g["gap_closed"], g["gap_closed_se"]


def mapped_mode(mode: str) -> bool:
    """A mode that reads the map (the map alone, a fixed repair, the gate): the ones given a worth and equal costs."""
    return (mode.startswith("transfer") and not mode.endswith("_wrong")) or mode == "gated" or \
        mode.startswith("recompute_")


def analyse(merged: dict, timings: dict | None = None) -> dict:
    """Per (set, P, half): every mode's gap closed, costs, the repair - twin differences, the worth, equal-cost.

    Seconds: from the (set, P)'s interleaved timing file when there is one (every mode's cost with its SE, which the
    equal-seconds differences carry); else the eval runs' single wall clocks, marked as such (`timing` None)."""
    out = {}
    timings = {} if timings is None else timings
    for (st, p), m in sorted(merged.items()):
        # a dense prefill's and the map's work depend on the token count, not the text: another set at the same P is
        # priced with WikiText-2's timing, and says so
        tm = timings.get((st, p)) or (None if st.endswith(REVERSE) else timings.get(("wikitext2", p)))
        timed = timed_costs(tm) if tm else None
        if timed is not None and "transfer" in timed:
            for other in OTHER_MAPS.values():   # another calibration's map: the same family, shapes and work
                timed.setdefault(other, timed["transfer"])
        if f"{CURVE}1" not in m["nll"] and "no_context" in m["nll"]:
            # the last 1 token is no_context's read (the start id and the last token): the curve's m = 1 point
            m["nll"][f"{CURVE}1"] = m["nll"]["no_context"]
            m["rows"].setdefault(f"{CURVE}1", dict(m["rows"].get("no_context") or {}))
        for half, idx in subsets(st, m["docs"], p).items():
            nll = _take(m["nll"], idx)
            if len(idx) < 2 or not all(k in nll for k in ("target", "no_context")):
                continue
            res = {"set": st, "prefix": p, "half": half, "windows": len(idx), "modes": {}, "twins": {},
                   "runs": m["runs"], "commits": m["commits"], "timing": timing_record(tm) if tm else None}
            if tm and tm["set"] != st:
                res["timing"]["set"] = tm["set"]
            mf = map_flops_rel(m)
            res["reproduced"] = m.get("reproduced") or {}
            res["base"] = sorted(set((m.get("base") or {}).values()))
            for mode in sorted(nll):
                if mode in ("target", "no_context"):
                    continue
                g, se = gap(nll, mode)
                sec, flops = cost_of(mode, m["rows"].get(mode, {}), mf)
                sec, sec_se = (timed.get(mode, (None, None)) if timed is not None else (sec, None))
                res["modes"][mode] = {"gap": g, "se": se, "seconds_rel": sec, "seconds_rel_se": sec_se,
                                      "flops_rel": flops, "map_flops_rel": m["rows"].get(mode, {}).get("map_flops_rel")}
                if mode.startswith("recompute_"):
                    r = mode.rpartition("_")[2]
                    if f"truncate_{r}" in nll:
                        res["twins"][mode] = twin_difference(nll, mode, f"truncate_{r}")
                if mode in OTHER_MAPS.values() and "transfer" in nll:   # another calibration's map - the main map's
                    res.setdefault("versus_main_map", {})[mode] = twin_difference(nll, mode, "transfer")
            if timed is not None:
                res["target_seconds"] = tm["timing"]["median"]["target"] / tm["windows"]
                res["target_seconds_se"] = (tm["timing"]["median_se"]["target"] or 0.0) / tm["windows"]
            else:
                res["target_seconds"] = m["rows"].get("target", {}).get("seconds")
            if "gated" in nll:  # the gate: its realised actions here, and the fixed rule at its realised cost
                events = (m.get("events") or {}).get("gated") or []
                res["gate_rates"] = gate_rates(events, idx)
                here = [events[i]["cost"] for i in idx if i < len(events) and events[i] and "cost" in events[i]]
                if here and mf is not None:  # its FLOPs on these windows (the run's row averages both halves)
                    res["modes"]["gated"]["flops_rel"] = float(np.mean(here)) + mf
                res["gate_fitted"] = m.get("gate_fitted")
                for field, name in (("seconds_rel", "gate_vs_rule_seconds"), ("flops_rel", "gate_vs_rule_flops")):
                    costs = {k: v[field] for k, v in res["modes"].items() if v.get(field) is not None}
                    costs["target"] = 1.0   # the re-prefill: the rule at r = 1, the unit of every cost here
                    res[name] = equal_cost(nll, costs, "gated", rule_curve(nll), n_boot=N_BOOT, seed=SEED)
            ms = [k for k in curve_points(nll) if k < p]
            if ms:
                res["worth"] = {mode: native_token_worth(nll, {k: nll[f"{CURVE}{k}"] for k in ms}, mode=mode,
                                                         n_boot=N_BOOT, seed=SEED)
                                for mode in nll if mapped_mode(mode)}
                for field, name in (("seconds_rel", "equal_cost"), ("flops_rel", "equal_flops")):
                    costs = {k: v[field] for k, v in res["modes"].items() if v.get(field) is not None}
                    cost_se = ({k: v["seconds_rel_se"] for k, v in res["modes"].items()}
                               if field == "seconds_rel" and timed is not None else None)
                    res[name] = {mode: e for mode in nll if mapped_mode(mode) and (e := equal_cost(
                        nll, costs, mode, truncation_curve(nll), n_boot=N_BOOT, seed=SEED, cost_se=cost_se)) is not None}
                res["counted"] = counted(res, nll, tm, timed)
                if "target_wrong" in nll and "transfer_wrong" in nll:   # the content controls (another context)
                    res["controls"] = control_statistics(
                        {k: nll[k] for k in ("target", "transfer", "target_wrong", "transfer_wrong")},
                        n_boot=N_BOOT, seed=SEED)
                gpu = gpu_costs(res, m)
                if gpu:
                    res["equal_gpu"] = {mode: e for mode in nll if mapped_mode(mode) and (e := equal_cost(
                        nll, gpu, mode, truncation_curve(nll), n_boot=N_BOOT, seed=SEED)) is not None}
            out[(st, p, half)] = res
    return out


def gpu_costs(res: dict, m: dict) -> dict | None:
    """{mode: the H200 model's seconds over the re-prefill's} (gpu_model.py) of every mode with FLOPs; None without the
    re-prefill's FLOPs. A mapped mode's map is its apply FLOPs, the rest of its FLOPs a target prefill."""
    if not m.get("reference_flops") or map_apply_rel(m) is None:
        return None
    bench, apply = gpu_model.load(), map_apply_rel(m)
    out = {mode: gpu_model.mode_cost(bench, flops_rel=v["flops_rel"], map_flops_rel=apply if mapped_mode(mode) else 0.0,
                                     prefix_tokens=m["reference_tokens"], reference_flops=m["reference_flops"])
           for mode, v in res["modes"].items() if v.get("flops_rel") is not None}
    for mode, v in res["modes"].items():
        if mode in out:
            v["gpu_rel"] = out[mode]
    return {**out, "target": 1.0}


def counted(res: dict, nll: dict, tm: dict | None, timed: dict | None) -> dict:
    """The map against truncation with the source's prefill charged to the map (a cold start, not a handoff):
    {"seconds": equal_cost at (map + source) seconds (interleaved timing), "flops": at the map's FLOPs + the
    source's prefill FLOPs over the target's}; empty without a timing file (which holds the source's numbers)."""
    out: dict = {}
    if tm is None or "transfer" not in nll or "transfer+source" not in (timed or {}):
        return out
    nll = {**nll, "transfer+source": nll["transfer"]}
    sec, sec_se = timed["transfer+source"]
    costs = {k: v["seconds_rel"] for k, v in res["modes"].items() if v.get("seconds_rel") is not None}
    cost_se = {k: v["seconds_rel_se"] for k, v in res["modes"].items()}
    costs["transfer+source"], cost_se["transfer+source"] = sec, sec_se
    out["seconds"] = equal_cost(nll, costs, "transfer+source", truncation_curve(nll), n_boot=N_BOOT, seed=SEED,
                                cost_se=cost_se)
    flops = tm.get("flops") or {}
    mf = res["modes"]["transfer"].get("flops_rel")
    if flops.get("source") and flops.get("target") and mf is not None:
        costs = {k: v["flops_rel"] for k, v in res["modes"].items() if v.get("flops_rel") is not None}
        costs["transfer+source"] = mf + flops["source"] / flops["target"]
        out["flops"] = equal_cost(nll, costs, "transfer+source", truncation_curve(nll), n_boot=N_BOOT, seed=SEED)
    return out


def choose(results: dict) -> str | None:
    """The repair chosen on WikiText-2's selection half (P = 256): the largest gap closed above its truncation twin."""
    sel = results.get(("wikitext2", 256, "selection"))
    if not sel or not sel["twins"]:
        return None
    return max(sel["twins"], key=lambda m: sel["twins"][m][0])


def _pct(x, se=None, d=1):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    x = 100 * x + 0.0  # no "-0.0"
    return f"{x:.{d}f} ± {100 * se + 0.0:.{d}f} %" if se is not None else f"{x:.{d}f} %"


def _pp(x, se, d=1):
    """A difference of two gap-closed shares, in percentage points."""
    return f"{100 * x + 0.0:+.{d}f} ± {100 * se:.{d}f} points"


def _num(x, d=3):
    return "–" if x is None else f"{x:.{d}f}"


def _worth(w: dict | None) -> str:
    if not w:
        return "–"
    if w["above"]:
        return f"> {max(w['curve'])} (beyond the curve)"
    if w["below"]:
        return "< 1 (below the no-context floor)"
    hi = "beyond the curve" if w["hi"] is None and w.get("hi_above") else _num(w["hi"], 1)
    lo = "below 1" if w["lo"] is None and w.get("lo_below") else _num(w["lo"], 1)
    return f"{w['tokens']:.1f} [{lo}, {hi}]"


def _se(e: dict) -> float:
    """An equal-cost difference's SE: windows and, where the costs were timed with SEs, the timing's (quadrature)."""
    return e.get("difference_se_total", e["difference_se"])


def _eq_cell(e: dict | None, d: int) -> str:
    if not e:
        return "–"
    where = (f"m = {e['curve_m']} at {e['curve_cost']:.{d}f}, dearer than the mode's {e['cost']:.{d}f}"
             if e.get("below_curve") else f"at {e['cost']:.{d}f}")
    return f"{_pct(e['truncation'])} ({where}); mapped - truncation {_pp(e['difference'], _se(e))}"


def _sec(v: dict) -> str:
    """A mode's measured seconds over the target's, ± the timing SE where it was measured with one."""
    if v.get("seconds_rel") is None:
        return "–"
    return _num(v["seconds_rel"]) + (f" ± {_num(v['seconds_rel_se'])}" if v.get("seconds_rel_se") is not None else "")


def timing_words(res: dict) -> str:
    """Where a table's seconds come from, in one sentence."""
    t = res.get("timing")
    if not t:
        return ("seconds: one wall clock per mode in the eval run that computed it (no SE; modes computed in "
                "different runs were timed at different loads)")
    return (f"seconds: interleaved timing (experiments/baselines/timing.py), median of {t['repeats']} rounds over "
            f"{t['windows']} contexts" + (f" of {SET_NAMES.get(t['set'], t['set'])} (the same token counts)"
                                          if t.get("set") else "") + f", one at a time, ± its SE, load {t['load_avg']['before'][0]:.1f} -> "
            f"{t['load_avg']['after'][0]:.1f} ({t['cpu']}, {t['threads']} threads, commit `{t['commit']}`)")


def table(res: dict) -> list[str]:
    """One (set, P, half) table: mode, gap closed ± SE, measured cost, FLOPs, vs twin, worth, equal-cost."""
    head = f"### {SET_NAMES.get(res['set'], res['set'])}, P = {res['prefix']}, {res['half']} ({res['windows']} windows, one per document)"
    rows = []

    def order(mode):
        if mode.endswith("_wrong"):   # the content controls, last
            return (4, mode)
        if mode.startswith("transfer"):
            return (0, 0 if mode == "transfer" else 1)
        if mode == "gated":
            return (1.5, 0)
        if mode.startswith(CURVE):
            return (2, int(mode[len(CURVE):]))
        if mode.startswith("truncate_"):
            return (3, float(mode.rpartition("_")[2]))
        return (1, float(mode.rpartition("_")[2]))
    for mode in sorted(res["modes"], key=order):
        v = res["modes"][mode]
        twin = res["twins"].get(mode)
        main = (res.get("versus_main_map") or {}).get(mode)
        eq = (res.get("equal_cost") or {}).get(mode)
        ef = (res.get("equal_flops") or {}).get(mode)
        rows.append([f"`{mode}`", _pct(v["gap"], v["se"]), _sec(v), _num(v["flops_rel"]),
                     _pp(*twin) if twin else f"minus `transfer`: {_pp(*main)}" if main else "–",
                     _worth((res.get("worth") or {}).get(mode)),
                     _eq_cell(eq, 3),
                     _eq_cell(ef, 4)])
    target = res.get("target_seconds")
    cnt = res.get("counted") or {}
    cnt_line = ("The source's prefill charged to the map (a cold start, not a handoff): " + "; ".join(
        f"at {what} ({e['cost']:.3g} of a re-prefill) truncation closes {_pct(e['truncation'])}, map - truncation "
        f"{_pp(e['difference'], _se(e))}" for what, e in (("its FLOPs", cnt.get("flops")),
                                                          ("its measured seconds", cnt.get("seconds"))) if e)
        + "." if any(cnt.values()) else "")
    gate = gate_lines(res)
    lines = [head, "", readme.md_table(
        ["mode", "gap closed", "measured seconds (x target's re-prefill)", "FLOPs (x re-prefill; mapped: + the map's)",
         "minus its truncation twin", "worth in native tokens [95 % interval]", "truncation at the same measured seconds",
         "truncation at the same FLOPs"],
        rows).rstrip("\n"), "",
        *([cnt_line, ""] if cnt_line else []),
        f"{timing_words(res)}; target's re-prefill: "
        + (f"{_num(target, 2)}" + (f" ± {_num(res['target_seconds_se'], 2)}" if res.get("target_seconds_se") is not None
                                   else "") + " s per context; runs: " if target else "runs: ")
        + ", ".join(f"`{r}` ({c})" for r, c in res["commits"].items()) + "."
        + (f" transfer / target / no_context NLLs from the committed {', '.join(f'`{b}`' for b in res['base'])}"
           " (the same windows)" if res.get("base") else "")
        + ("; this page's own runs reproduce them within " + ", ".join(
            f"{k} {v:.1e} nats" for k, v in sorted(res["reproduced"].items())) if res.get("reproduced") else "")
        + ".", ""] + gate
    return lines


def gate_verdict(res: dict) -> dict | None:
    """Does the gate pay on these windows? {"beats_rule": its gap closed above the fixed rule's at its realised FLOPs by
    more than 2 SE, "rates_hold": every realised action share within 2 binomial SEs of the share it was fitted for
    (a zero SE: equal), "pays": both}; None when the gate did not run here."""
    rates, fitted, rule = res.get("gate_rates"), res.get("gate_fitted"), res.get("gate_vs_rule_flops")
    if not rates or not fitted:
        return None
    if not rule:   # the gate's cost is off the rule's curve (below the map alone): no comparison to make
        return None
    beats = rule["difference"] - 2 * rule["difference_se"] > 0
    hold = all(abs(rates[a] - fitted[a]) <= 2 * rates[f"{a}_se"] if rates[f"{a}_se"] > 0 else rates[a] == fitted[a]
               for a in ("map", "recompute", "full"))
    return {"beats_rule": beats, "rates_hold": hold, "pays": beats and hold}


def gate_lines(res: dict) -> list[str]:
    """The gate's paragraph under a table: realised actions against the fitted rates; the fixed rule at its cost."""
    rates, fitted = res.get("gate_rates"), res.get("gate_fitted")
    if not rates:
        return []
    acts = ", ".join(f"{a} {_pct(rates[a], rates[a + '_se'], 0)}" + (f" (fitted for {100 * fitted[a]:.0f} %)"
                                                                        if fitted else "")
                     for a in ("map", "recompute", "full"))
    out = [f"The gate (`gated`, thresholds fitted on held-out calibration text): realised actions over "
           f"{rates['windows']} windows: {acts}."]
    for key, what in (("gate_vs_rule_flops", "FLOPs"), ("gate_vs_rule_seconds", "measured seconds (over both halves)")):
        e = res.get(key)
        if e:
            out.append(f"At its realised {what} ({e['cost']:.3f} of a re-prefill) the fixed rule (map + recent "
                       f"recompute, interpolated between r = {e['between'][0]:g} and {e['between'][1]:g}) closes "
                       f"{_pct(e['truncation'])}; gate - rule {_pp(e['difference'], e['difference_se'])}.")
    v = gate_verdict(res)
    if v:
        out.append("Verdict here: the gate " + ("pays (it beats the fixed rule at equal FLOPs and acts at the rates "
                                               "it was fitted for)." if v["pays"] else
                                               "does not pay: " + "; ".join(
                                                   x for x, bad in (("it does not beat the fixed rule at equal FLOPs",
                                                                     not v["beats_rule"]),
                                                                    ("its realised actions are not the rates it was "
                                                                     "fitted for", not v["rates_hold"])) if bad) + "."))
    return [" ".join(out), ""]


def tiny_panels(runs: dict) -> dict:
    """The tiny-pair check's rows as figure panels {("tiny", P, "all"): {"modes": {mode: gap, se, seconds_rel}}}."""
    r = runs.get("tiny_check")
    out = {}
    for row in (r["summary"].get("ppl") or []) if r else []:
        if row["prefix"] == 0:
            continue
        modes = {}
        for k in row:
            if k.endswith("_seconds_rel"):
                mode = k[:-len("_seconds_rel")]
                g = row.get("transfer_gap_closed" if mode == "transfer" else f"{mode}_gap_closed")
                if g is not None:
                    se = row.get("transfer_gap_closed_se" if mode == "transfer" else f"{mode}_gap_closed_se")
                    flops = row.get(f"{mode}_cost") if mode.startswith("recompute_") else \
                        0.0 if mode == "transfer" else row.get(f"{mode}_flops_rel")
                    modes[mode] = {"gap": g, "se": se, "seconds_rel": row[k], "flops_rel": flops}
        out[("tiny pair", row["prefix"], "all")] = {"set": "tiny pair", "prefix": row["prefix"], "half": "all",
                                                    "windows": row.get("windows"), "modes": modes}
    return out


def save_figure(fig, path: Path) -> None:
    """Lay out `fig` and write it to `path` as a PNG atomically (a temporary file renamed), then close it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)
    plt.close(fig)


def figure(results: dict, path: Path) -> bool:
    """Gap closed against cost, one curve per rule (truncation in m order, map + recent in r order), the map alone and
    the target, ± SE; one column per (set, P, half), measured seconds (top) and target FLOPs (bottom, exact), both
    as a fraction of the target's re-prefill; False when matplotlib or data are missing."""
    panels = [r for r in results.values() if r["modes"]]
    if not panels:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def key(mode):
        return int(mode[len(CURVE):]) if mode.startswith(CURVE) else float(mode.rpartition("_")[2])
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.2), squeeze=False)
    for col, res in enumerate(panels):
        series = {"truncation (last m tokens)": [m for m in res["modes"] if m.startswith(CURVE)],
                  "truncation twin of r": [m for m in res["modes"] if m.startswith("truncate_") and not m.startswith(CURVE)],
                  "map + recent recompute r": [m for m in res["modes"] if m.startswith("recompute_recent_")],
                  "map alone": ["transfer"] if "transfer" in res["modes"] else [],
                  "gate": ["gated"] if "gated" in res["modes"] else []}
        for row, (field, label) in enumerate((("seconds_rel", "measured seconds"), ("flops_rel", "target FLOPs"))):
            ax = axes[row][col]
            for name, modes in series.items():
                pts = [(res["modes"][m].get(field), 100 * res["modes"][m]["gap"], 100 * (res["modes"][m]["se"] or 0))
                       for m in sorted(modes, key=lambda m: 0 if m in ("transfer", "gated") else key(m))]
                pts = [p for p in pts if p[0] is not None]
                if pts:
                    x, y, e = zip(*pts)
                    # measured seconds need not rise with m (warm-up, weight reads): points, not a line, there
                    ax.errorbar(x, y, yerr=e, marker="o", ms=4, capsize=2, label=name,
                                linestyle="-" if len(pts) > 1 and field == "flops_rel" else "none")
            ax.errorbar([1.0], [100.0], marker="*", ms=9, linestyle="none", label="target (re-prefill)", color="k")
            ax.set_xlabel(f"{label} (x the target's re-prefill)")
            ax.set_ylabel("log-ppl gap closed (%)")
            ax.set_title(f"{SET_NAMES.get(res['set'], res['set'])} P={res['prefix']} {res['half']} "
                         f"(n={res['windows']})", fontsize=9)
            ax.grid(alpha=0.3)
    handles = {}
    for ax in axes.flat:   # one legend for every series any panel draws
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    axes[0][0].legend(list(handles.values()), list(handles), fontsize=7)
    save_figure(fig, path)
    return True


def coqa_rows(runs: dict | None) -> dict:
    """The real pair's CoQA rows ({"coqa_twins", "drift_summary"}) of `real_coqa`: recomputed from its per-turn F1s
    (scores.json) where it kept them, so every SE is the current one (clustered by conversation), else its summary's.
    A recomputed F1 that is not the summary's is an error: the scores and the summary are not one run."""
    r = (runs or {}).get("real_coqa") or {}
    s = r.get("summary") or {}
    per_turn = (r.get("scores") or {}).get("coqa")
    if not per_turn:
        return {k: s.get(k) or [] for k in ("coqa_twins", "drift_summary")}
    new = coqa_summary_from_scores(per_turn)
    for key, fields in (("coqa_twins", ("twin_f1", "transfer_f1")), ("drift_summary", ("target_f1", "transfer_f1"))):
        for a, b in zip(new.get(key) or [], s.get(key) or []):
            if any(a[f] != b[f] for f in fields):
                raise ValueError(f"real_coqa: {key} recomputed from scores.json differs from its summary: {a} vs {b}")
    return {k: new.get(k) or [] for k in ("coqa_twins", "drift_summary")}


def coqa_sentence(runs: dict | None) -> str | None:
    """CoQA's twins in one clause: the mapped story / prompt against the target reading its last m tokens."""
    rows = coqa_rows(runs)["coqa_twins"]
    if not rows:
        return None
    out = []
    for protocol, what in (("once", "a mapped story"), ("every_turn", "a mapped whole prompt")):
        rs = sorted((r for r in rows if r["protocol"] == protocol), key=lambda r: r["tokens"])
        if rs:
            twins = ", ".join(f"{r['twin_f1']:.3f} reading the last {r['tokens']} tokens (map - twin "
                              f"{r['transfer_minus_twin']:+.3f} ± {r['transfer_minus_twin_se']:.3f})" for r in rs)
            out.append(f"{what} answers at F1 {rs[0]['transfer_f1']:.3f} against the target's {twins}")
    n = rows[0]
    return (f"on CoQA ({n['conversations']} conversations x {n['turns'] // max(1, n['conversations'])} turns) "
            + "; ".join(out))


def verdict(e: dict) -> str:
    """"beats" / "loses to" / "does not separate from": an equal-cost difference against 2 of its SEs."""
    return "beats" if e["difference"] - 2 * _se(e) > 0 else \
        "loses to" if e["difference"] + 2 * _se(e) < 0 else "does not separate from"


def worth_rows(results: dict) -> list[dict]:
    """One row per (set, P, map) over all of a (set, P)'s windows: gap closed, worth in native tokens and its share
    of P, map - truncation at equal FLOPs and seconds (handoff), and with the source's prefill charged; P order."""
    rows = []
    for (st, p, half), res in sorted(results.items(), key=lambda kv: (kv[0][0] != "wikitext2", kv[0][0], kv[0][1])):
        if half != "all":
            continue
        for mode in WORTH_MAPS:
            if mode not in res["modes"]:
                continue
            w = (res.get("worth") or {}).get(mode)
            rows.append({"set": st, "prefix": p, "windows": res["windows"], "mode": mode,
                         "gap": res["modes"][mode]["gap"], "se": res["modes"][mode]["se"], "worth": w,
                         "flops": (res.get("equal_flops") or {}).get(mode),
                         "gpu": (res.get("equal_gpu") or {}).get(mode),
                         "seconds": (res.get("equal_cost") or {}).get(mode),
                         "counted": (res.get("counted") or {}) if mode == "transfer" else {},
                         "content": (res.get("controls") or {}) if mode == "transfer" else {},
                         "timed": res.get("timing") is not None})
    return rows


def _diff(e: dict | None) -> str:
    return "–" if not e else ("vs a dearer point: " if e.get("below_curve") else "") + _pp(e["difference"], _se(e))


def worth_table(results: dict) -> list[str]:
    """The "worth vs P" table: every (set, P) with all of its windows, one row per map."""
    rows = worth_rows(results)
    if not rows:
        return []
    cells = [[SET_NAMES.get(r["set"], r["set"]), f"{r['prefix']:,}", str(r["windows"]), f"`{r['mode']}`",
              _pct(r["gap"], r["se"]), _worth(r["worth"]),
              "–" if not r["worth"] or r["worth"]["above"] or r["worth"]["below"] else
              f"{100 * r['worth']['tokens'] / r['prefix']:.1f} %",
              _diff(r["flops"]), _diff(r["seconds"]) + ("" if r["timed"] or not r["seconds"] else " (one wall clock)"),
              _diff(r["gpu"]), _diff(r["counted"].get("flops")), _diff(r["counted"].get("seconds")),
              _pct(r["content"].get("content_share"), r["content"].get("content_share_se"))] for r in rows]
    return ["## Worth as the context grows", "",
            "Every window of each (set, P) (both WikiText-2 halves: nothing is chosen here). Worth: the m at which the "
            "target's own last-m-token curve reaches the map's gap closed [95 % interval]; share: worth / P. The "
            "map - truncation columns interpolate the truncation curve at the map's cost; a handoff charges the map "
            "its own work and the target's prefill of the native-sink token, a cold start the source's prefill "
            "too. H200 model: each mode's FLOPs priced at the rates the harness's bench measured on one H200 "
            "(experiments/baselines/gpu_model.py: a model, not a GPU measurement of this pair). Content share: "
            "(transfer - transfer on another article's context) / (target - target on it), in NLL, where those "
            "controls ran: the share of the target's own gain from this context that the map carries. "
            "Figure: [figures/worth_vs_p.png](figures/worth_vs_p.png).", "",
            readme.md_table(["set", "P", "windows", "map", "gap closed", "worth in native tokens [95 %]",
                             "share of P", "map - truncation, equal FLOPs", "equal measured seconds (CPU)",
                             "equal H200-model seconds", "source prefill charged: equal FLOPs",
                             "equal measured seconds", "content share"], cells).rstrip("\n"),
            ""]


def calibration_lines(results: dict, runs: dict) -> list[str]:
    """The "calibration text" section: every calibration's map beside the main one at P = 256 (calibration_curve),
    the spread between draws and the log-linear extrapolation to the paper's calibration size."""
    rows = calibration_curve.rows(results, runs)
    if len(rows) < 2:
        return []
    def cell(r, st):
        x = r["sets"].get(st)
        if not x:
            return ["–", "–", "–"]
        vm = x["versus_main"]
        return [_pct(x["gap"], x["se"]), _worth(x["worth"]), _pp(*vm) if vm else "(the main map)"]
    labels = {"wikipedia": "Wikipedia", "python_packages": "Python packages"}
    cells = [[f"`{r['mode']}`", " + ".join(f"{labels.get(d, d)} draw {k}" for d, k in r["parts"]), f"{r['tokens']:,}",
              _num(r["r2_k"]), _num(r["r2_v"]), *cell(r, "wikitext2"), *cell(r, "python_stdlib")] for r in rows]
    out = ["## Calibration text: size, draw and domain", "", calibration_curve.__doc__.split("\n\n", 1)[1].strip()
           .replace("\n", " "), "",
           readme.md_table(["map", "calibration text", "tokens", "held-out R² K", "held-out R² V",
                            "WikiText-2 (confirmation) gap closed", "worth [95 %]", "- main map",
                            "Python source gap closed", "worth [95 %]", "- main map"], cells).rstrip("\n"), ""]
    spread = calibration_curve.spread_between_draws(rows)
    if spread:
        out += [f"Between draws: {len(spread['draws'])} disjoint 40,960-token Wikipedia draws close "
                + ", ".join(_pct(g) for g in spread["gaps"]) + f" on WikiText-2's confirmation half, a standard "
                f"deviation of {100 * spread['sd']:.1f} points against the windows' own SE of "
                f"{100 * spread['window_se']:.1f}. The differences from the main map carry the windows' SE only (the "
                "same windows score both maps); another draw of the same size moves the gap closed by that standard "
                "deviation, so a difference within about twice it is what a different draw alone could give.", ""]
    ex = calibration_curve.extrapolate(rows)
    if ex:
        mid = ex.get("middle")
        out += [f"Extrapolation (not a measurement): from {ex['from_tokens']:,} to {ex['to_tokens']:,} tokens the gap "
                f"closed on WikiText-2's confirmation half moves {_pp(ex['slope'], ex['slope_se'])} per doubling"
                + (f" (the {mid['tokens']:,}-token map sits {_pp(mid['off_line'], mid['se'])} off that line)"
                   if mid else "") + f"; a straight line in log tokens puts the paper's {ex['tokens']:,} tokens "
                f"({ex['doublings']:.1f} doublings past the main map) at {_pct(ex['gap'], ex['gap_se'])}.", ""]
    return out


def worth_figure(results: dict, path: Path) -> bool:
    """Worth in native tokens (95 % interval) and gap closed (± SE) against P, one line per (set, map); False when
    matplotlib or data are missing."""
    rows = [r for r in worth_rows(results) if r["worth"] and not (r["worth"]["above"] or r["worth"]["below"])]
    if not rows:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key in sorted({(r["set"], r["mode"]) for r in rows}):
        pts = sorted((r for r in rows if (r["set"], r["mode"]) == key), key=lambda r: r["prefix"])
        x = [r["prefix"] for r in pts]
        y = [r["worth"]["tokens"] for r in pts]
        lo = [max(0.0, yy - (r["worth"]["lo"] if r["worth"]["lo"] is not None else yy)) for yy, r in zip(y, pts)]
        hi = [max(0.0, (r["worth"]["hi"] if r["worth"]["hi"] is not None else yy) - yy) for yy, r in zip(y, pts)]
        label = f"{SET_NAMES.get(key[0], key[0])}, {key[1]}"
        a.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=label)
        b.errorbar(x, [100 * r["gap"] for r in pts], yerr=[100 * (r["se"] or 0) for r in pts], marker="o",
                   capsize=3, label=label)
    a.set(xscale="log", xlabel="context P (tokens)", ylabel="worth (native tokens, 95 % interval)")
    b.set(xscale="log", xlabel="context P (tokens)", ylabel="log-ppl gap closed (%, ± SE)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)
    return True


# how the headline names each cost convention: FLOPs count work; seconds are this CPU's, one context at a time (a
# handoff serves one session); the H200 model prices the FLOPs at a GPU's measured rates (gpu_model.py)
COST_WORDS = {"FLOPs": "FLOPs",
              "measured seconds": "measured seconds (this CPU, one context at a time)",
              "H200 model": "modelled H200 seconds (the FLOPs at the rates the bench measured on one H200, a model)"}


def lead(results: dict) -> str | None:
    """The headline's first sentence: the cost convention, then the map against truncation at the longest context
    measured on WikiText-2 (all its windows), and with the source's prefill charged."""
    rows = [r for r in worth_rows(results) if r["set"] == "wikitext2" and r["mode"] == "transfer"]
    if not rows:
        return None
    r = rows[-1]
    got = [(what, e) for what, e in (("FLOPs", r["flops"]), ("measured seconds", r["seconds"]),
                                     ("H200 model", r["gpu"])) if e]
    if not got:
        return None
    words = {**COST_WORDS, **({} if r["timed"] else {"measured seconds": "measured seconds (this CPU, one batched "
                                                     "wall clock per mode in the eval run, not the timing protocol)"})}
    parts = [f"{verdict(e)} truncation at equal {words[what]} ({_pp(e['difference'], _se(e))})" for what, e in got]
    s = (f"**In a handoff (the source has read the context already, so its prefill is not charged; both sides pay "
         f"for every token the target prefills), at the longest context measured -- WikiText-2, P = {r['prefix']:,}, "
         f"{r['windows']} articles -- the map {' and '.join(parts)}.** It closes {_pct(r['gap'], r['se'])} of the "
         "log-perplexity gap" + (f", what the target gets from its own last {_worth(r['worth'])} tokens"
                                 if r["worth"] else ""))
    cnt = [(what, e) for what, e in (("FLOPs", r["counted"].get("flops")),
                                     ("measured seconds", r["counted"].get("seconds"))) if e]
    if cnt:
        s += (". Charging the source's prefill too (a cold start), it " + " and ".join(
            f"{verdict(e)} truncation at equal {what} ({_pp(e['difference'], _se(e))})" for what, e in cnt))
    by_p = [x for x in rows if x["worth"] and not (x["worth"]["above"] or x["worth"]["below"])]
    if len(by_p) > 1:
        a, b = by_p[0]["worth"], by_p[-1]["worth"]
        overlap = None not in (a["lo"], a["hi"], b["lo"], b["hi"]) and a["lo"] <= b["hi"] and b["lo"] <= a["hi"]
        trend = ("about a fixed number of the target's tokens, not a share of P" if overlap else
                 "more of the target's tokens as P grows" if b["tokens"] > a["tokens"] else
                 "fewer of the target's tokens as P grows")
        s += (f". The map carries {trend} (95 % intervals {'overlap' if overlap else 'apart'}): " + ", ".join(
            f"{x['worth']['tokens']:.1f} tokens at P = {x['prefix']:,} ({100 * x['worth']['tokens'] / x['prefix']:.1f} "
            "% of P)" for x in by_p))
    for name, label in SET_NAMES.items():   # every other set at its longest context measured, in the same convention
        other = [x for x in worth_rows(results) if x["set"] == name and x["mode"] == "transfer"]
        if name == "wikitext2" or not other or other[-1]["prefix"] <= 256:
            continue
        o = other[-1]
        got = [f"{verdict(e)} truncation at equal {what} ({_pp(e['difference'], _se(e))})"
               for what, e in (("FLOPs", o["flops"]), ("measured seconds", o["seconds"])) if e]
        if got:
            s += (f". On {label} at P = {o['prefix']:,} ({o['windows']} windows) the map " + " and ".join(got)
                  + (f", worth {_worth(o['worth'])} native tokens" if o["worth"] else ""))
    return s


def headline(results: dict, chosen: str | None, runs: dict | None = None) -> str:
    """The top README's paragraph: the cost convention and the map against truncation at the longest context measured
    first, then WikiText-2's confirmation half at P = 256 (the repair, the gate, CoQA, Python source)."""
    conf = results.get(("wikitext2", 256, "confirmation"))
    if not conf or "transfer" not in conf["modes"]:
        return ("not yet measured on the real pair: none of the 6 real-pair runs of experiments/baselines/run.sh has "
                "finished (on 2 shared CPU cores they did not fit the time this was made in); the modes, timing and "
                "worth are checked on the tiny pair (results/baselines).")
    parts = []
    first = lead(results)
    if first:
        parts.append(first)
    w = (conf.get("worth") or {}).get("transfer")
    t = conf["modes"]["transfer"]
    costs = [(e, what) for e, what in (((conf.get("equal_flops") or {}).get("transfer"), "FLOPs"),
                                       ((conf.get("equal_cost") or {}).get("transfer"), "measured seconds")) if e]
    at256 = "; ".join(f"at equal {what} {'it' if i else 'the map'} {verdict(e)} {'it' if i else 'truncation'}"
                      for i, (e, what) in enumerate(costs))
    s = (f"**{at256[0].upper() + at256[1:]}.** On" if at256 and not first else
         f"at P = 256 {at256}: on" if at256 else "On") + (
        f" WikiText-2's confirmation half ({conf['windows']} articles" + ("" if first else ", P = 256")
        + ") the mapped prefix closes "
        f"{_pct(t['gap'], t['se'])} of the log-perplexity gap" + (
            f", what the target gets from reading its own last {_worth(w)} tokens" if w else ""))
    for e, what in costs:
        at = (f"the target reading its last {e['curve_m']} tokens, which costs more ({e['curve_cost']:.3g}), closes"
              if e.get("below_curve") else "truncation closes")
        s += (f"; at the map's {what} ({e['cost']:.3g} of a re-prefill, the source's prefill not counted) {at} "
              f"{_pct(e['truncation'])} (map - truncation {_pp(e['difference'], _se(e))})")
    cnt = [(what, e) for what, e in (("FLOPs", (conf.get("counted") or {}).get("flops")),
                                     ("measured seconds", (conf.get("counted") or {}).get("seconds"))) if e]
    if cnt:
        s += ("; with the source's prefill charged the map " + " and ".join(
            f"{verdict(e)} truncation at equal {what} ({_pp(e['difference'], _se(e))})" for what, e in cnt))
    parts.append(s + ("" if not any(w == "measured seconds" for _, w in costs) else
                      " -- on this CPU a forward's time is mostly reading the weights, so a few native tokens cost "
                      "about what the map costs"))
    if chosen and chosen in conf["twins"]:
        d, se = conf["twins"][chosen]
        r = conf["modes"][chosen]
        tw = conf["modes"].get(f"truncate_{chosen.rpartition('_')[2]}", {})
        parts.append(f"the repair chosen on the selection half, `{chosen}`, closes {_pct(r['gap'], r['se'])} at "
                     f"{_num(r['seconds_rel'])} of a re-prefill's measured time against its truncation twin's "
                     f"{_pct(tw.get('gap'), tw.get('se'))} at {_num(tw.get('seconds_rel'))} (difference {_pp(d, se)})"
                     + (f"; at the repair's own measured seconds the truncation curve closes {_pct(e['truncation'])} "
                        f"(repair - truncation {_pp(e['difference'], _se(e))}), so the confirmation half "
                        + ("confirms it at equal measured seconds" if verdict(e) == "beats" else
                           "confirms it against its twin but not at equal measured seconds" if d - 2 * se > 0 else
                           "confirms it neither against its twin nor at equal measured seconds")
                        if (e := (conf.get("equal_cost") or {}).get(chosen)) and not e.get("below_curve") else ""))
    v = gate_verdict(conf)
    if v:
        rule, rates = conf.get("gate_vs_rule_flops"), conf["gate_rates"]
        parts.append(f"the per-request gate {'pays' if v['pays'] else 'does not pay'} there: "
                     f"{_pct(conf['modes']['gated']['gap'], conf['modes']['gated']['se'])} at "
                     f"{_num(conf['modes']['gated']['flops_rel'])} of a re-prefill's FLOPs"
                     + (f", gate - fixed rule at those FLOPs {_pp(rule['difference'], rule['difference_se'])}"
                        if rule else "")
                     + f", full prefills on {_pct(rates['full'], None, 0)} of windows (fitted for "
                     f"{100 * conf['gate_fitted']['full']:.0f} %)")
    if (c := coqa_sentence(runs)) is not None:
        parts.append(c)
    st = results.get(("python_stdlib", 256, "all"))
    if st and "transfer" in st["modes"]:
        ws = (st.get("worth") or {}).get("transfer")
        eqs = [f"{_pp(e['difference'], _se(e))} at equal {what}" for e, what in (
            ((st.get("equal_flops") or {}).get("transfer"), "FLOPs"),
            ((st.get("equal_cost") or {}).get("transfer"), "measured seconds")) if e and not e.get("below_curve")]
        rep = ""
        if chosen and chosen in (st.get("twins") or {}):   # the rule chosen on WikiText-2's selection half, run here
            d, se = st["twins"][chosen]
            e = (st.get("equal_cost") or {}).get(chosen)
            rep = (f"; the repair chosen on WikiText-2, `{chosen}`, closes "
                   f"{_pct(st['modes'][chosen]['gap'], st['modes'][chosen]['se'])} there, {_pp(d, se)} against its "
                   "truncation twin"
                   + (f", and {verdict(e)} truncation at equal measured seconds ({_pp(e['difference'], _se(e))})"
                      if e and not e.get("below_curve") else ""))
        parts.append(f"on Python source ({st['windows']} modules) the map closes "
                     f"{_pct(st['modes']['transfer']['gap'], st['modes']['transfer']['se'])}"
                     + (f", worth {_worth(ws)} native tokens" if ws else "")
                     + (f" (map - truncation {', '.join(eqs)})" if eqs else "") + rep)
    rv = results.get(("wikitext2" + REVERSE, CHOICE_P, "all"))
    if rv and "transfer" in rv["modes"]:
        wr = (rv.get("worth") or {}).get("transfer")
        clock = "" if rv.get("timing") else " (one batched wall clock per mode, no interleaved timing)"
        eqs = [f"{verdict(e)} truncation at equal {what} ({_pp(e['difference'], _se(e))})" for e, what in (
            ((rv.get("equal_flops") or {}).get("transfer"), "FLOPs"),
            ((rv.get("equal_cost") or {}).get("transfer"), "measured seconds" + clock)) if e and not e.get("below_curve")]
        parts.append(f"large -> small (the 1.5B reads the context, the 0.5B answers; {rv['windows']} WikiText-2 "
                     f"articles, P = {CHOICE_P}) the map closes "
                     f"{_pct(rv['modes']['transfer']['gap'], rv['modes']['transfer']['se'])}"
                     + (f", worth {_worth(wr)} of the 0.5B's own tokens" if wr else "")
                     + (f", content share {_pct(cs['content_share'], cs['content_share_se'])} (the share of the 0.5B's "
                        "own gain from this context over another article's that the map carries)"
                        if (cs := rv.get("controls") or {}).get("content_share") is not None else "")
                     + (f", and {' and '.join(eqs)}" if eqs else ""))
    code = [(r, (r.get("versus_main_map") or {}).get("transfer_code_calib"), what) for r, what in (
        (results.get(("python_stdlib", 256, "all")), "Python source"), (conf, "WikiText-2's confirmation half")) if r]
    code = [(r, d, what) for r, d, what in code if d]
    if code:
        parts.append("calibrated on Python source instead (the standard library's package modules, disjoint from the "
                     "evaluated ones) the map closes " + "; ".join(
                         f"{_pct(r['modes']['transfer_code_calib']['gap'], r['modes']['transfer_code_calib']['se'])}"
                         f" on {what} ({_pp(*d)} against the main map)" for r, d, what in code))
    if runs and (c := calibration_sentence(results, runs)):
        parts.append(c)
    return ". ".join(x[0].upper() + x[1:] for x in parts) + "."


SET_WHERE = {"wikitext2": "WikiText-2's confirmation half", "python_stdlib": "Python source"}   # calibration_curve.SETS


def calibration_sentence(results: dict, runs: dict) -> str | None:
    """The headline's clause on calibration text: what 2x and 4x the main text, another draw and the mixed domains do
    to the gap closed (paired differences from the main map); None before those runs."""
    rows = {r["mode"]: r for r in calibration_curve.rows(results, runs)}
    bits = []
    more = [(r, r["sets"]["wikitext2"]["versus_main"]) for m, r in rows.items()
            if m in ("transfer_calib_80k", "transfer_calib_160k") and (r["sets"].get("wikitext2") or {}).get("versus_main")]
    if more:
        bits.append("calibrating on " + " and ".join(f"{r['tokens']:,}" for r, _ in more) + " Wikipedia tokens instead "
                    f"of {rows['transfer']['tokens']:,} moves the gap closed on WikiText-2's confirmation half by "
                    + " and ".join(_pp(*d) for _, d in more))
    ex = calibration_curve.extrapolate(list(rows.values()))
    if more and ex:
        bits[-1] += (f" ({_pp(ex['slope'], ex['slope_se'])} per doubling; a straight line in log tokens, an "
                     f"extrapolation, puts the paper's {ex['tokens']:,} tokens at {_pct(ex['gap'], ex['gap_se'])})")
    spread = calibration_curve.spread_between_draws(list(rows.values()))
    if spread:
        bits.append(f"another draw of the same size moves it by {100 * spread['sd']:.1f} points (standard deviation "
                    f"over {len(spread['draws'])} draws)")
    mixed = rows.get("transfer_calib_mixed")
    if mixed:
        bits.append(f"the mixed map (Wikipedia and Python packages, {mixed['tokens']:,} tokens) closes " + "; ".join(
            f"{_pct(x['gap'], x['se'])} on {SET_WHERE[st]}"
            + (f" ({_pp(*x['versus_main'])} against the main map)" if x["versus_main"] else "")
            for st, x in mixed["sets"].items()))
    return "; ".join(bits) if bits else None


def tiny_lines(runs: dict) -> list[str]:
    """The tiny-pair check: truncate_0.3 beside recompute_recent_0.3 with measured seconds and the map's worth."""
    r = runs.get("tiny_check")
    if not r:
        return ["The tiny-pair check (`tiny_check`) has not been run.", ""]
    env = r["summary"].get("environment") or {}
    rows0 = [row for row in r["summary"].get("ppl") or [] if row["prefix"] > 0]
    windows = rows0[0].get("windows") if rows0 else "?"
    cont = ((r.get("config") or {}).get("eval") or {}).get("ppl", {}).get("continuation", "?")
    out = [f"### Tiny-pair check (`tiny_check`, commit `{str(env.get('commit'))[:7]}`"
           f"{', dirty tree' if env.get('dirty') else ''})", "",
           f"The embedded tiny pair (models/tiny), {windows} windows of its own text (one per document), "
           f"{cont} scored tokens each; every mode's measured seconds per context and relative to `target`'s "
           "re-prefill in the same run, and the truncation curve (gap closed at m native tokens):", ""]
    rows = []
    for row in r["summary"].get("ppl") or []:
        if row["prefix"] == 0:
            continue
        for mode in ("transfer", "recompute_recent_0.3", "truncate_0.3", "no_context", "target"):
            g = row.get(f"{mode}_gap_closed") if mode != "transfer" else row.get("transfer_gap_closed")
            se = row.get(f"{mode}_gap_closed_se") if mode != "transfer" else row.get("transfer_gap_closed_se")
            rows.append([row["prefix"], f"`{mode}`", _pct(g, se) if g is not None else "–",
                         _num(row.get(f"{mode}_seconds"), 4), _num(row.get(f"{mode}_seconds_rel")),
                         _num(row.get(f"{mode}_flops_rel") if mode != "recompute_recent_0.3" else row.get(f"{mode}_cost")),
                         _worth(row.get(f"{mode}_native_tokens")) if mode in ("transfer", "recompute_recent_0.3") else ""])
    out += [readme.md_table(["P", "mode", "gap closed", "seconds per context", "x target's", "target FLOPs x re-prefill",
                             "worth in native tokens [95 %]"], rows).rstrip("\n"), ""]
    for row in rows0:
        ms = sorted(int(k[len(CURVE):-len("_gap_closed")]) for k in row if k.startswith(CURVE) and k.endswith("_gap_closed"))
        out += [f"Truncation curve at P = {row['prefix']}: " + ", ".join(
            f"m = {m}: {_pct(row[f'{CURVE}{m}_gap_closed'], row.get(f'{CURVE}{m}_gap_closed_se'))} "
            f"(x {_num(row.get(f'{CURVE}{m}_seconds_rel'))})" for m in ms) + ".", ""]
    return out


def coqa_lines(runs: dict) -> list[str]:
    """The CoQA twins' table of the real pair's `real_coqa` run (its summary's coqa_twins and drift_summary)."""
    r = runs.get("real_coqa")
    found = coqa_rows(runs)
    rows = found["coqa_twins"]
    if not rows:
        return ["No CoQA run on the real pair has finished (run.sh step 7).", ""]
    env = r["summary"].get("environment") or {}
    target = {d["protocol"]: d for d in found["drift_summary"]}
    table_rows = []
    for protocol in dict.fromkeys(x["protocol"] for x in rows):
        t = target.get(protocol) or {}
        first = next(x for x in rows if x["protocol"] == protocol)
        cells = [protocol, f"{first['conversations']} x {first['turns'] // max(1, first['conversations'])}",
                 _num(t.get("target_f1")) + (f" ± {_num(t.get('target_f1_se'))}" if t.get("target_f1_se") else ""),
                 f"{_num(first['transfer_f1'])} ± {_num(first['transfer_f1_se'])}"]
        for x in sorted((x for x in rows if x["protocol"] == protocol), key=lambda x: x["tokens"]):
            cells.append(f"{_num(x['twin_f1'])} ± {_num(x['twin_f1_se'])}; transfer - twin "
                         f"{x['transfer_minus_twin']:+.3f} ± {_num(x['transfer_minus_twin_se'])}")
        table_rows.append(cells)
    ms = sorted({x["tokens"] for x in rows})
    df = rows[0].get("se_df")
    se_words = ("SEs and the paired transfer - twin SE from a bootstrap over whole conversations." if df is None else
                "SEs and the paired transfer - twin SE clustered by conversation (from each conversation's total); "
                f"with {df + 1} conversations a 95 % interval is ± "
                f"{t_quantile(0.975, df):.2f} SE (Student t, {df} degrees of freedom), not ± 1.96 SE.")
    return [f"### CoQA against its twins (`real_coqa`, commit `{str(env.get('commit'))[:7]}"
            f"{', dirty' if env.get('dirty') else ''}`)", "",
            "Mean CoQA F1 over every turn of every conversation; " + se_words + " The twin `truncate_tokens_<m>` is "
            "the target reading the start id and the last "
            "m tokens: of each turn's whole prompt (`every_turn`, where the map carries the whole prompt), or of the "
            "story, the turns then read natively (`once`, where the map carries the story).", "",
            readme.md_table(["protocol", "conversations x turns", "target F1", "transfer F1",
                             *[f"the target reading its last {m} tokens" for m in ms]], table_rows).rstrip("\n"), ""]


def blocks(runs: dict, timings: dict | None = None) -> tuple[dict, dict, str | None]:
    """({"baselines": the results README block}, {"baselines_headline": the top README line}, chosen repair);
    timings: {(set, P): timing file} (default: results/baselines/timing/)."""
    results = analyse(merge(runs, load_base()), load_timings() if timings is None else timings)
    chosen = choose(results)
    body = ["## The real pair (Qwen2.5-Coder 0.5B -> 1.5B, CPU)", ""]
    if results:
        body += [headline(results, chosen, runs), ""]
    if not results:
        body += ["No real-pair run has finished yet (experiments/baselines/run.sh).", ""]
    else:
        sel = results.get(("wikitext2", 256, "selection"))
        if chosen:
            d, se = sel["twins"][chosen]
            body += [f"Chosen on the selection half: `{chosen}` (gap closed above its truncation twin {_pp(d, se)}; "
                     "candidates: " + ", ".join(f"`{m}` {_pp(*v)}" for m, v in sel["twins"].items()) + ").", ""]
        else:
            body += ["No repair was run on the selection half: nothing chosen.", ""]
        body += worth_table(results)
        body += calibration_lines(results, runs)
        order = {"selection": 0, "confirmation": 1, "all": 2}
        for key in sorted(results, key=lambda k: (k[0] != "wikitext2", k[1], order[k[2]])):
            if key[0] == "wikitext2" and key[1] == CHOICE_P and key[2] == "all":
                continue   # its halves' tables are there; its row is in the worth table
            body += table(results[key])
    body += coqa_lines(runs)
    body += ["## The check on the tiny pair", ""] + tiny_lines(runs)
    return {"baselines": "\n".join(body)}, {"baselines_headline": headline(results, chosen, runs)}, chosen


README_HEAD = """# Is the map worth its cost? Equal-cost baselines

Generated by `python experiments/baselines/collect.py` from `results/baselines/runs/*` (runs: `bash
experiments/baselines/run.sh`; settings pinned in `conf/experiment/baselines_cpu.yaml`; the split of WikiText-2's
articles in `experiments/baselines/split.yaml`). Figure: [figures/cost.png](figures/cost.png).

"""


def timing_note(runs: dict) -> str:
    """TIMING_NOTE with what the eval runs' own wall clocks (batched, single) said at P = 256 on the confirmation half."""
    conf = analyse(merge(runs, load_base()), {}).get(("wikitext2", CHOICE_P, "confirmation")) or {}
    e = (conf.get("equal_cost") or {}).get("transfer")
    batched = "" if not e else (
        f": the eval runs' own wall clocks ({conf['modes']['transfer']['seconds_rel']:.3f} of a re-prefill for the "
        "map, 8 contexts per batch, one aggregate per mode, in runs at different loads) put the map "
        f"{_pp(e['difference'], _se(e))} from truncation at equal seconds on WikiText-2's confirmation half at "
        f"P = {CHOICE_P}")
    return TIMING_NOTE.format(batched=batched)


def main() -> None:
    runs = load_runs()
    body, top, _ = blocks(runs)
    doc = README_HEAD + __doc__.split("\n\n", 2)[2].strip() + "\n\n## Timing\n\n" + timing_note(runs) + "\n\n" + \
        readme.begin("baselines") + "\n" + body["baselines"].rstrip("\n") + "\n" + readme.end("baselines") + "\n"
    atomic_write_bytes(OUT / "README.md", doc.encode())
    results = analyse(merge(runs, load_base()), load_timings())
    figure({**{k: v for k, v in results.items() if not (k[0] == "wikitext2" and k[1] == CHOICE_P and k[2] == "all")},
            **tiny_panels(runs)}, OUT / "figures" / "cost.png")
    worth_figure(results, OUT / "figures" / "worth_vs_p.png")
    readme.rewrite(ROOT / "README.md", top)
    print(doc)
    print(top["baselines_headline"])


TIMING_NOTE = ("Where a table names experiments/baselines/timing.py, its seconds follow the timing protocol: every "
               "mode's pre-scoring work timed one context at a time -- a handoff serves one session; batching "
               "contexts spreads the weight reads that dominate a short prefill on this CPU over several, which "
               "favours truncation{batched}. In that protocol every "
               "mode's work (the map, with the target's native-sink prefill; a truncation's or the "
               "target's own prefill; the source's prefill, for the cold-start convention) is timed in one process on a "
               "fixed subsample of contexts, one context at a time, in interleaved rounds (a warm-up, then at least 5 "
               "timed rounds); each mode's cost is the median over rounds of its time over the target's re-prefill "
               "in the same round, with that median's SE, and the equal-seconds differences carry the timing's SE "
               "beside the windows' (quadrature). The load average before and after and the CPU are printed with "
               "each table. Elsewhere the seconds are one wall clock per mode, in the eval run that computed it, at "
               "whatever load that run saw, and say so. FLOPs are exact counts. On the tiny pair a context takes "
               "milliseconds, so its seconds are mostly noise; read its FLOPs panel there. On this CPU a forward's "
               "time is mostly reading the weights (6 GB in float32), so reading a few tokens costs nearly what "
               "reading a hundred does; a GPU forward over hundreds of tokens is closer to its FLOPs. The H200 model "
               "prices each mode's FLOPs at the rates the harness's bench measured on one H200, floored at one read of "
               "the target's weights (experiments/baselines/gpu_model.py); it is a model: no GPU timing of the real "
               "pair is committed.")


if __name__ == "__main__":
    main()
