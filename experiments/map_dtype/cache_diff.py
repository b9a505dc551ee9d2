"""The mapped caches' relative difference: the real pair's map applied in bfloat16 against the same map in float32, on
the contexts the evaluation scores, beside the float32 map's own distance from the target's cache.

    python experiments/map_dtype/cache_diff.py --run results/map_dtype/runs/f32_engines_f32_map
    python experiments/map_dtype/cache_diff.py --run results/map_dtype/runs/bf16_engines_f32_map

Reads the run's resolved config (models, map, start ids, the windows' draw) and loads what its eval loaded. For the
first --windows windows of --set's draw at P = --prefix, one context at a time: the source prefills the context[:-1]
the eval's transfer mode reads (its prefix cut), the map is applied twice (kvtransfer.core.transfer.transfer, the
target's native-sink prefill included, as the eval builds the cache) with the map's weights in float32 and in
bfloat16 (kvtransfer.core.map_dtype.in_map_dtype), and the target prefills the same tokens itself. Per context and
kind (keys, values), over every target layer and every position after the native sink (the sink's rows are the
target's own in all three):

    rel_dtype = |bf16 map - f32 map|_F / |f32 map|_F      what the bfloat16 apply moves
    rel_map   = |f32 map - target|_F / |target|_F          the float32 map's own error
    share     = |bf16 map - f32 map|_F / |f32 map - target|_F

Keys are compared as the cache stores them (RoPE applied: a rotation, so norms and distances are those of the
content-space keys). Each is reported as the mean over contexts ± its standard error, with the largest per-layer
rel_dtype. Writes results/map_dtype/cache_diff_<engine dtype>.json once (never over an existing file).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.config.provenance import produced_by  # noqa: E402
from kvtransfer.core.cache import prefill  # noqa: E402
from kvtransfer.core.io import atomic_write_json  # noqa: E402
from kvtransfer.core.map_dtype import in_map_dtype  # noqa: E402
from kvtransfer.core.transfer import transfer  # noqa: E402
from kvtransfer.eval.stats import mean_se  # noqa: E402
from kvtransfer.eval.perplexity import ppl_contexts  # noqa: E402
from kvtransfer.runner.eval_stage import eval_lm  # noqa: E402
from kvtransfer.runner.run import Run  # noqa: E402

OUT = ROOT / "results" / "map_dtype"
KINDS = ("keys", "values")


def distances(a: list, b: list, ref: list, start: int) -> dict:
    """{kind: (|a - b|_F, |ref|_F, [per-layer |a - b|_F / |ref|_F])} over positions `start`.. of per-layer
    (keys, values) [1, n_kv, seq, d] lists `a`, `b`, `ref` (accumulated in float64)."""
    out = {}
    for i, kind in enumerate(KINDS):
        diff2 = ref2 = 0.0
        per_layer = []
        for la, lb, lr in zip(a, b, ref):
            x, y, r = (t[i][:, :, start:].double() for t in (la, lb, lr))
            d2, r2 = float((x - y).pow(2).sum()), float(r.pow(2).sum())
            diff2, ref2 = diff2 + d2, ref2 + r2
            per_layer.append((d2 / r2) ** 0.5 if r2 else 0.0)
        out[kind] = (diff2 ** 0.5, ref2 ** 0.5, per_layer)
    return out


@torch.no_grad()
def compare(lm, contexts: list[list[int]]) -> dict:
    """{kind: {"rel_dtype", "rel_map", "share": [per context], "max_layer_rel_dtype": float}} for the contexts
    (see the module docstring)."""
    source, target = lm.source_model, lm.target_model
    maps = {name: in_map_dtype(lm.mapper, name) for name in ("float32", "bfloat16")}
    rows = {kind: {"rel_dtype": [], "rel_map": [], "share": [], "max_layer_rel_dtype": 0.0} for kind in KINDS}
    for context in contexts:
        prefix = lm.cut(context)[0]
        ids = torch.tensor([prefix], dtype=torch.long, device=source.device)
        mask = torch.ones_like(ids)
        cache = prefill(source, ids, mask)
        mapped = {name: transfer(cache, m, source, target, attention_mask=mask, input_ids=ids,
                                 native_sink=lm.native_sink, as_layers=True, rope_at_inference=lm.rope_at_inference)
                  for name, m in maps.items()}
        own = prefill(target, ids.to(target.device), mask.to(target.device))
        start = min(lm.native_sink, ids.shape[1])
        by_dtype = distances(mapped["bfloat16"], mapped["float32"], mapped["float32"], start)
        by_map = distances(mapped["float32"], own, own, start)
        for kind in KINDS:
            (d_dtype, n_f32, layers), (d_map, n_own, _) = by_dtype[kind], by_map[kind]
            row = rows[kind]
            row["rel_dtype"].append(d_dtype / n_f32)
            row["rel_map"].append(d_map / n_own)
            row["share"].append(d_dtype / d_map)
            row["max_layer_rel_dtype"] = max(row["max_layer_rel_dtype"], max(layers))
    return rows


def summary(rows: dict) -> dict:
    """{kind: {statistic: {"mean", "se"}}, "max_layer_rel_dtype"} of compare()'s per-context rows."""
    out = {}
    for kind, row in rows.items():
        out[kind] = {stat: dict(zip(("mean", "se"), mean_se(row[stat]))) for stat in ("rel_dtype", "rel_map", "share")}
        out[kind]["max_layer_rel_dtype"] = row["max_layer_rel_dtype"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, type=Path, help="a finished run directory (its config.json is read)")
    ap.add_argument("--set", default="wikitext2", help="perplexity set (default: wikitext2)")
    ap.add_argument("--prefix", type=int, default=256, help="P, the context tokens (default: 256)")
    ap.add_argument("--windows", type=int, default=16, help="the first N windows of the draw (default: 16)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    cfg = json.loads((args.run / "config.json").read_text())
    engines = str(cfg["pair"].get("dtype", "float32"))
    path = args.out / f"cache_diff_{engines}.json"
    if path.exists():
        raise SystemExit(f"{path} exists: results are never overwritten (remove it to measure again)")
    run = Run(cfg, args.run)
    lm, _ = eval_lm(run, ["transfer"])
    contexts, docs = ppl_contexts(lm, cfg["eval"], args.set, args.prefix, args.windows, cfg.get("seed", 0))
    rows = compare(lm, contexts)
    out = {"engines": engines, "set": args.set, "prefix": args.prefix, "windows": len(contexts), "docs": docs,
           "run": args.run.name, "native_sink": lm.native_sink, "summary": summary(rows), "per_context": rows,
           "provenance": produced_by()}
    atomic_write_json(path, out)
    for kind, s in out["summary"].items():
        print(f"{kind:6s} bf16 vs f32 {s['rel_dtype']['mean']:.2e} ± {s['rel_dtype']['se']:.1e}  "
              f"f32 map vs target {s['rel_map']['mean']:.3f}  share {s['share']['mean']:.2e}  "
              f"max layer {s['max_layer_rel_dtype']:.2e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
