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
"""
from __future__ import annotations

import argparse
import json
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
    """{"margin", "z"} as fixed before the runs."""
    d = yaml.safe_load(path.read_text())
    return {"margin": float(d["margin"]), "z": float(d["z"])}


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
    se = loss["se"]
    if loss["difference"] is None or se is None:
        out["verdict"] = "undecided"
    elif loss["difference"] + z * se <= margin:
        out["verdict"] = "within"
    elif loss["difference"] - z * se > margin:
        out["verdict"] = "outside"
    else:
        out["verdict"] = "undecided"
    return out


def collect(runs: Path = RUNS, *, margin: dict | None = None, split: Path = SPLIT) -> dict:
    """{engine dtype: {"<set>/<half>": compare(...)}} for every engine whose two runs are there."""
    margin = margin or load_margin()
    out: dict = {}
    for engine, (name_f32, name_bf16) in ENGINES.items():
        paths = [runs / n / "scores.json" for n in (name_f32, name_bf16)]
        if not all(p.is_file() for p in paths):
            continue
        s32, s16 = (json.loads(p.read_text()) for p in paths)
        rows = {}
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
                rows[f"{set_name}/{half}"] = compare(take(a), take(b), **margin)
        out[engine] = rows
    return out


def _pct(x, se=None) -> str:
    if x is None:
        return "–"
    return f"{100 * x:.2f}" + ("" if se is None else f" ± {100 * se:.2f}") + " %"


def markdown(result: dict) -> str:
    """The README: one row per engine dtype and set."""
    lines = ["# The map's dtype on the real pair: bfloat16 against float32", "",
             "Made by `bash experiments/map_dtype/run.sh` and `python experiments/map_dtype/collect.py`. The same "
             "map (Qwen2.5-Coder 0.5B -> 1.5B, conf/experiment/baselines_cpu.yaml) applied in float32 and in "
             f"bfloat16 (`eval.map_dtype`), P = {PREFIX}, the same windows; loss = gap closed of the float32 map minus "
             "the bfloat16 map's, ± a paired bootstrap SE over windows. The margin and the rule were fixed before "
             "the runs (experiments/map_dtype/margin.yaml).", "",
             "| engines | set | windows | gap closed, float32 map | gap closed, bfloat16 map | loss | "
             "NLL bf16 - f32 (nats/token) | margin | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for engine, rows in result.items():
        for name, r in rows.items():
            g32, g16 = r["gap_closed_float32"], r["gap_closed_bfloat16"]
            lines.append(f"| {engine} | {name} | {r['windows']} | {_pct(g32['gap_closed'], g32['gap_closed_se'])} | "
                         f"{_pct(g16['gap_closed'], g16['gap_closed_se'])} | {_pct(r['loss'], r['loss_se'])} | "
                         f"{r['nll_difference']:.2e} ± {r['nll_difference_se']:.1e} | {_pct(r['margin'])} | "
                         f"{r['verdict']} |")
    if not result:
        lines.append("| – | no pair of runs yet | | | | | | | |")
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
    atomic_write_json(out / "map_dtype.json", {"prefix": PREFIX, "rows": result, **load_margin()})
    atomic_write_bytes(out / "README.md", markdown(result).encode())
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
