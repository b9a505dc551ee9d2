"""results/map_dtype/README.md and map_dtype.json from results/map_dtype/runs/*/scores.json: what applying the real
pair's map in bfloat16 instead of float32 costs (eval.map_dtype), per perplexity set at P = 256, on float32 and on
bfloat16 engines.

    python experiments/map_dtype/collect.py

Per engine dtype, the float32-map run and the bfloat16-map run are paired window by window (the same draw, the same
target and no_context NLLs: they are the same cached results). Reported per set -- WikiText-2's confirmation half
(experiments/baselines/split.yaml) and the Python stdlib set (all windows) --: each map's gap closed (log-ppl) ± a
paired bootstrap SE; loss = gap closed(float32) - gap closed(bfloat16) ± a paired bootstrap SE over windows
(kvtransfer.eval.metrics.gap_closed_difference); the per-window mean NLL difference bfloat16 - float32 (nats/token)
± its SE; and the verdict of the rule fixed before the runs (experiments/map_dtype/margin.yaml): within when
loss + z SE <= margin, outside when loss - z SE > margin, else undecided.

HellaSwag (the `<run>_hellaswag` runs: the first 100 items, acc_norm): loss = accuracy of the float32 map - that of
the bfloat16 map ± an SE from the discordant items with half an item added to each count (margin.yaml: no change
is not an SE of 0), under the same rule with its own margin (hellaswag_margin), and the items the dtype changed. The mapped caches' relative difference is read from cache_diff_<engine
dtype>.json (experiments/map_dtype/cache_diff.py). The default may move to bfloat16 only when every row is within.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.core.io import atomic_write_bytes, atomic_write_json  # noqa: E402
from kvtransfer.eval.metrics import gap_closed_difference, paired_difference, ppl_gap_closed  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = ROOT / "results" / "map_dtype" / "runs"
OUT = ROOT / "results" / "map_dtype"
SPLIT = ROOT / "experiments" / "baselines" / "split.yaml"
PREFIX = 256
SETS = ("wikitext2", "python_stdlib")
# engine dtype -> (the run with the float32 map, the run with the bfloat16 map): experiments/map_dtype/run.sh
ENGINES = {"float32": ("f32_engines_f32_map", "f32_engines_bf16_map"),
           "bfloat16": ("bf16_engines_f32_map", "bf16_engines_bf16_map")}
MODES = ("target", "transfer", "no_context")


def load_margin(path: Path = HERE / "margin.yaml") -> dict:
    """{"margin", "z", "hellaswag_margin"} as fixed before the runs."""
    d = yaml.safe_load(path.read_text())
    return {"margin": float(d["margin"]), "z": float(d["z"]), "hellaswag_margin": float(d["hellaswag_margin"])}


def verdict(loss: float | None, se: float | None, margin: float, z: float) -> str:
    """within when loss + z se <= margin, outside when loss - z se > margin, else undecided (also with no SE)."""
    if loss is None or se is None:
        return "undecided"
    if loss + z * se <= margin:
        return "within"
    return "outside" if loss - z * se > margin else "undecided"


def window_nll(scores: dict, set_name: str, prefix: int = PREFIX) -> tuple[list[int], dict]:
    """(window_doc, {mode: per-window mean NLL}) of one run's scores.json for a perplexity set at `prefix`."""
    entry = (scores.get("ppl_sets") or {}).get(set_name)
    if entry is None:
        raise KeyError(f"scores.json holds no perplexity set {set_name!r} (eval.ppl.sets)")
    nll = entry["window_nll"].get(str(prefix))
    if nll is None:
        raise KeyError(f"set {set_name!r} has no prefix {prefix} (eval.ppl.prefixes)")
    missing = [m for m in MODES if m not in nll]
    if missing:
        raise KeyError(f"set {set_name!r} at P = {prefix} lacks modes {missing} (eval.modes)")
    return list(entry["window_doc"]), {m: list(nll[m]) for m in MODES}


def halves(set_name: str, docs: list[int], split: Path = SPLIT) -> dict[str, list[int]]:
    """{half: window indices}: WikiText-2's confirmation half (by article), or every window of another set."""
    if set_name != "wikitext2":
        return {"all": list(range(len(docs)))}
    confirmation = set(yaml.safe_load(split.read_text())["confirmation"])
    return {"confirmation": [i for i, d in enumerate(docs) if d in confirmation]}


def compare(f32: dict, bf16: dict, *, margin: float, z: float) -> dict:
    """The bfloat16 map against the float32 map on the same windows: f32 / bf16 are {"target", "transfer",
    "no_context": per-window NLL}. Returns each map's gap closed ± SE, loss (float32 - bfloat16) ± SE, the mean NLL
    difference bfloat16 - float32 ± SE, and the verdict of the margin rule (see the module doc)."""
    loss = gap_closed_difference(f32, bf16)
    nll = paired_difference(bf16["transfer"], f32["transfer"])
    out = {"windows": len(f32["transfer"]), "gap_closed_float32": ppl_gap_closed(f32),
           "gap_closed_bfloat16": ppl_gap_closed(bf16), "loss": loss["difference"], "loss_se": loss["se"],
           "nll_difference": nll["difference"], "nll_difference_se": nll["se"], "margin": margin, "z": z}
    out["verdict"] = verdict(loss["difference"], loss["se"], margin, z)
    return out


def compare_items(f32: dict, bf16: dict, *, margin: float, z: float) -> dict:
    """The bfloat16 map against the float32 map on the same task items: f32 / bf16 are {"target", "transfer",
    "no_context": per-item scores (0/1)}. Returns each mode's accuracy, loss = transfer accuracy float32 - bfloat16
    ± its paired SE, the items whose score the dtype changed, and the verdict of the margin rule."""
    if f32["target"] != bf16["target"] or f32["no_context"] != bf16["no_context"]:
        raise ValueError("the two runs scored different items or baselines: rerun both with the same eval.limit")
    n = len(f32["transfer"])
    b = sum(1 for x, y in zip(f32["transfer"], bf16["transfer"]) if x > y)   # only the float32 map right
    c = sum(1 for x, y in zip(f32["transfer"], bf16["transfer"]) if x < y)   # only the bfloat16 map right
    loss = (b - c) / n
    bb, cc = b + 0.5, c + 0.5   # margin.yaml: half an item on each discordant count, so no change is not SE 0
    se = math.sqrt(bb + cc - (bb - cc) ** 2 / n) / n
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    return {"items": n, "target": mean(f32["target"]), "no_context": mean(f32["no_context"]),
            "transfer_float32": mean(f32["transfer"]), "transfer_bfloat16": mean(bf16["transfer"]),
            "loss": loss, "loss_se": se, "changed": b + c, "only_float32_right": b, "only_bfloat16_right": c,
            "margin": margin, "z": z, "verdict": verdict(loss, se, margin, z)}


def item_scores(scores: dict, task: str) -> dict:
    """{mode: per-item scores} of one task in a run's scores.json; KeyError naming what is missing."""
    entry = (scores.get("tasks") or {}).get(task)
    if entry is None:
        raise KeyError(f"scores.json holds no task {task!r} (eval.tasks)")
    missing = [m for m in MODES if m not in entry]
    if missing:
        raise KeyError(f"task {task!r} lacks modes {missing} (eval.modes)")
    return {m: list(entry[m]) for m in MODES}


def collect(runs: Path = RUNS, *, margin: dict | None = None, split: Path = SPLIT) -> dict:
    """{engine dtype: {"<set>/<half>": compare(...), "hellaswag": compare_items(...)}} for every engine whose runs
    are there (a row per pair of runs found)."""
    margin = margin or load_margin()
    ppl_margin = {"margin": margin["margin"], "z": margin["z"]}
    out: dict = {}
    for engine, (name_f32, name_bf16) in ENGINES.items():
        rows = {}
        paths = [runs / f"{n}_hellaswag" / "scores.json" for n in (name_f32, name_bf16)]
        if all(p.is_file() for p in paths):
            a, b = (item_scores(json.loads(p.read_text()), "hellaswag") for p in paths)
            rows["hellaswag"] = compare_items(a, b, margin=margin["hellaswag_margin"], z=margin["z"])
        if rows:
            out[engine] = rows
        paths = [runs / n / "scores.json" for n in (name_f32, name_bf16)]
        if not all(p.is_file() for p in paths):
            continue
        s32, s16 = (json.loads(p.read_text()) for p in paths)
        for set_name in SETS:
            try:
                docs, a = window_nll(s32, set_name)
                docs_b, b = window_nll(s16, set_name)
            except KeyError:
                continue
            if docs != docs_b:
                raise ValueError(f"{engine} engines, {set_name}: the two runs drew different windows ({name_f32} vs "
                                 f"{name_bf16}); rerun both with the same eval.ppl settings")
            for half, idx in halves(set_name, docs, split).items():
                take = lambda d: {m: [d[m][i] for i in idx] for m in MODES}  # noqa: E731
                rows[f"{set_name}/{half}"] = compare(take(a), take(b), **ppl_margin)
        out[engine] = dict(sorted(rows.items(), key=lambda kv: kv[0] == "hellaswag"))   # perplexity rows first
    return out


def cache_diffs(out: Path = OUT) -> dict:
    """{engine dtype: cache_diff.py's summary and setting} of the cache_diff_<engine>.json files there."""
    found = {}
    for engine in ENGINES:
        path = out / f"cache_diff_{engine}.json"
        if path.is_file():
            d = json.loads(path.read_text())
            found[engine] = {k: d[k] for k in ("set", "prefix", "windows", "summary", "provenance")}
    return found


def decision(result: dict) -> str:
    """Whether the default may move to bfloat16: every row of both engine dtypes within, else why not."""
    missing = [e for e in ENGINES if e not in result]
    if missing:
        return f"not decided: no runs yet on {', '.join(missing)} engines"
    rows = sorted({name for r in result.values() for name in r})
    gaps = [f"{e} engines {name}" for e in ENGINES for name in rows if name not in result[e]]
    if gaps:
        return f"not decided: no runs yet for {'; '.join(gaps)}"
    bad = [f"{e} engines {name}: {r['verdict']}" for e, rows in result.items() for name, r in rows.items()
           if r["verdict"] != "within"]
    if bad:
        return "float32 stays the default: " + "; ".join(bad)
    return ("every row is within its margin: bfloat16 is the default on CUDA (`eval.map_dtype=auto`, float32 "
            "elsewhere), the float32 map timed beside it")


def _pct(x, se=None) -> str:
    if x is None:
        return "–"
    return f"{100 * x:.2f}" + ("" if se is None else f" ± {100 * se:.2f}") + " %"


def markdown(result: dict, diffs: dict | None = None) -> str:
    """The README: one row per engine dtype and set, HellaSwag's rows, the caches' relative difference, the decision."""
    lines = ["# The map's dtype on the real pair: bfloat16 against float32", "",
             "Made by `bash experiments/map_dtype/run.sh` and `python experiments/map_dtype/collect.py` on a 2-core "
             "CPU (the runs' machine and commit are in each run's summary.json). The same "
             "map (Qwen2.5-Coder 0.5B -> 1.5B, conf/experiment/baselines_cpu.yaml) applied in float32 and in "
             f"bfloat16 (`eval.map_dtype`), P = {PREFIX}, the same windows; loss = gap closed of the float32 map minus "
             "the bfloat16 map's, ± a paired bootstrap SE over windows. The margin and the rule were fixed before "
             "the runs (experiments/map_dtype/margin.yaml): within when loss + z SE <= margin, outside when "
             "loss - z SE > margin, else undecided.", "",
             "| engines | set | windows | gap closed, float32 map | gap closed, bfloat16 map | loss | "
             "NLL bf16 - f32 (nats/token) | margin | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for engine, rows in result.items():
        for name, r in rows.items():
            if name == "hellaswag":
                continue
            g32, g16 = r["gap_closed_float32"], r["gap_closed_bfloat16"]
            lines.append(f"| {engine} | {name} | {r['windows']} | {_pct(g32['gap_closed'], g32['gap_closed_se'])} | "
                         f"{_pct(g16['gap_closed'], g16['gap_closed_se'])} | {_pct(r['loss'], r['loss_se'])} | "
                         f"{r['nll_difference']:.2e} ± {r['nll_difference_se']:.1e} | {_pct(r['margin'])} | "
                         f"{r['verdict']} |")
    if not any(name != "hellaswag" for rows in result.values() for name in rows):
        lines.append("| – | no pair of runs yet | | | | | | | |")
    hs = [(engine, rows["hellaswag"]) for engine, rows in result.items() if "hellaswag" in rows]
    lines += ["", "HellaSwag, the first 100 items (lm-eval's acc_norm); loss = accuracy of the float32 map minus the "
              "bfloat16 map's, (b - c) / n with b, c the items only one of them gets right, ± sqrt(b' + c' - (b' - "
              "c')^2 / n) / n with half an item added to b and c (so that no change is not an SE of 0); changed = "
              "b + c.", "",
              "| engines | items | target | no_context | transfer, float32 map | transfer, bfloat16 map | loss | "
              "changed | margin | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for engine, r in hs:
        lines.append(f"| {engine} | {r['items']} | {r['target']:.2f} | {r['no_context']:.2f} | "
                     f"{r['transfer_float32']:.2f} | {r['transfer_bfloat16']:.2f} | {_pct(r['loss'], r['loss_se'])} | "
                     f"{r['changed']} | {_pct(r['margin'])} | {r['verdict']} |")
    if not hs:
        lines.append("| – | no pair of runs yet | | | | | | | | |")
    lines += ["", "The mapped caches (experiments/map_dtype/cache_diff.py): per context, over every target layer and "
              "every position after the native sink, rel = |bf16 map - f32 map|_F / |f32 map|_F, the float32 map's "
              "own error |f32 map - target|_F / |target|_F, and share = |bf16 map - f32 map|_F / |f32 map - target|_F; "
              "mean ± SE over the contexts, and the largest per-layer rel.", "",
              "| engines | contexts | kind | rel, bf16 vs f32 map | f32 map vs target | share | largest layer rel |",
              "|---|---|---|---|---|---|---|"]
    for engine, d in (diffs or {}).items():
        for kind, k in d["summary"].items():
            lines.append(f"| {engine} | {d['windows']} ({d['set']}, P = {d['prefix']}) | {kind} | "
                         f"{k['rel_dtype']['mean']:.2e} ± {k['rel_dtype']['se']:.1e} | "
                         f"{k['rel_map']['mean']:.3f} ± {k['rel_map']['se']:.3f} | "
                         f"{k['share']['mean']:.2e} ± {k['share']['se']:.1e} | {k['max_layer_rel_dtype']:.2e} |")
    if not diffs:
        lines.append("| – | not measured yet | | | | | |")
    lines += ["", f"**Decision:** {decision(result)}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    """Collect the runs and write results/map_dtype/map_dtype.json and README.md (or into --out)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=str(RUNS))
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    result = collect(Path(a.runs))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    diffs = cache_diffs(out)
    from kvtransfer.config.provenance import json_provenance

    atomic_write_json(out / "map_dtype.json", {"prefix": PREFIX, "rows": result, "cache_diff": diffs,
                                               "decision": decision(result), **load_margin(),
                                               "provenance": json_provenance()})   # the collect's tree; each run
    #                                                                               keeps its own in runs/
    text = markdown(result, diffs)
    atomic_write_bytes(out / "README.md", text.encode())
    print(text)
    return result


if __name__ == "__main__":
    main()
