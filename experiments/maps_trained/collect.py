"""results/maps_trained: the trained map beside the paper's map, from the runs of run.sh.

    HS200=1 / ARC100=1 / MMLU100=1 [SHORT=1 LR=...] bash experiments/maps_trained/run.sh    # the runs
    python experiments/maps_trained/collect.py [--allow-dirty] [--check]

Reads results/maps_trained/runs_{hs200,arc100,mmlu100}/<map>/summary.json (+ scores.json) and writes
maps_trained.json and the generated blocks of results/maps_trained/README.md: one row per map (held-out K/V R²,
attention cosine, next-token KL, top-1, log-perplexity gap closed at P = 256 on 32 windows, HellaSwag n = 200,
ARC-C n = 100, MMLU n = 100, apply FLOPs here and at Qwen3-14B -> 32B, fit wall time), the paired differences
to the paper's map on the same items and windows, and the training record (stop-split losses per layer).
Gap closed is against the no-context floor (kvtransfer.eval.metrics); every SE is a paired bootstrap SE.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the checkout this script is in, not an installed kvtransfer
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtransfer.bench.shapes import PAIRS, real_config  # noqa: E402
from kvtransfer.eval.metrics import format_with_se, gap_closed_difference, paired_difference, upgrade_summary  # noqa: E402
from kvtransfer.maps.families import map_cost  # noqa: E402
from kvtransfer.core.io import atomic_write_json  # noqa: E402
from kvtransfer.core.models import kv_shape  # noqa: E402
from kvtransfer.config.provenance import json_provenance, provenance_header, refuse_dirty_write  # noqa: E402
from kvtransfer.report import readme  # noqa: E402

COLLECT = "experiments/maps_trained/collect.py"
OUT = Path("results/maps_trained")
PAPER = "paper_sink1"
SETS = {"hs200": ("hellaswag", "HellaSwag n = 200"), "arc100": ("arc_challenge", "ARC-C n = 100"),
        "mmlu100": ("mmlu", "MMLU n = 100")}
FOLDERS = (*SETS, "ppl32")  # ppl32: fidelity and perplexity only (32 windows), for maps without a HellaSwag run


def flops_14b_32b(k: int) -> float:
    """Apply FLOPs per token of a full-support map with k source layers at Qwen3-14B -> 32B's real shapes."""
    src, tgt, _ = PAIRS["qwen3_14b_32b"]
    s, t = kv_shape(real_config(src)), kv_shape(real_config(tgt))
    return map_cost(t.n_layers, k, s.n_kv, s.head_dim, t.n_kv, t.head_dim, support="full", rank=None)["apply_flops_per_token"]


def hidden_flops_14b_32b(features: str, k: int) -> float:
    """Apply GFLOP/token of a hidden-state map (kvtransfer.core.hidden.hidden_map_cost) at Qwen3-14B -> 32B."""
    from kvtransfer.core.hidden import hidden_map_cost

    from kvtransfer.core.hidden import hidden_size

    src, tgt, _ = PAIRS["qwen3_14b_32b"]
    s, t = kv_shape(real_config(src)), kv_shape(real_config(tgt))
    cost = hidden_map_cost(t.n_layers, k, s.n_layers, hidden_size(real_config(src)), s.n_kv * s.head_dim,
                           t.n_kv * t.head_dim, features)
    return round(cost["apply_flops_per_token"] / 1e9, 2)


def load_runs(out: Path = OUT) -> dict[str, dict[str, dict]]:
    """{set: {map: summary (current schema) + "_scores" (scores.json or None)}} of every finished run."""
    runs: dict[str, dict[str, dict]] = {}
    for name in FOLDERS:
        folder = out / f"runs_{name}"
        for d in sorted(folder.iterdir()) if folder.is_dir() else []:
            if (d / "summary.json").exists():
                s = upgrade_summary(json.loads((d / "summary.json").read_text()))
                s["_scores"] = json.loads((d / "scores.json").read_text()) if (d / "scores.json").exists() else None
                runs.setdefault(name, {})[d.name] = s
    return runs


def primary(runs: dict, name: str) -> dict:
    """The run a map's fidelity and perplexity come from: its HellaSwag run, else its perplexity-only run."""
    return runs.get("hs200", {}).get(name) or runs["ppl32"][name]


def _task_cell(r: dict | None) -> str:
    if not r:
        return "–"
    return (f"{format_with_se(r['transfer'], r.get('stderr_transfer'))}; "
            f"{format_with_se(r.get('gap_closed'), r.get('stderr_gap_closed'), scale=100, unit=' %')}")


def map_row(name: str, runs: dict) -> dict:
    """One map's row: fidelity and perplexity from its HS200 run, each benchmark from its own run."""
    s = primary(runs, name)
    m, fid = s["mapper"], (s.get("fidelity") or {}).get("per_layer", {})
    cos = fid.get("attn_cosine") or []
    p256 = {r["prefix"]: r for r in s.get("ppl", [])}.get(256, {})
    tr = m.get("training") or {}
    detail = m.get("features") or (tr.get("objective") if tr else None)
    row = {"map": name, "kind": m["kind"] + (f" ({detail})" if detail else ""), "k": m["k"],
           "K R² held-out": round(s["r2"]["k"]["heldout"], 4),
           "V R² held-out": round(s["r2"]["v"]["heldout"], 4),
           "attn cos": round(sum(cos) / len(cos), 4) if cos else None,
           "next-token KL": round(fid["kl"], 4) if "kl" in fid else None,
           "top-1 agree": round(fid["top1_agreement"], 3) if "top1_agreement" in fid else None,
           "ppl@256": round(p256["transfer"], 2) if p256 else None,
           "log-ppl gap closed @256": format_with_se(p256.get("transfer_gap_closed"), p256.get("transfer_gap_closed_se"),
                                                     scale=100, unit=" %") if p256 else "–",
           "apply MFLOP/token": round(m["apply_flops_per_token"] / 1e6, 2),
           # full support: the paper's and the trained map's count at any pair; a hidden-state map's is its own
           "apply GFLOP/token @14B->32B": (round(flops_14b_32b(m["k"]) / 1e9, 2) if not m.get("features")
                                           else hidden_flops_14b_32b(m["features"], m["k"])),
           "fit s": m.get("fit_seconds"),
           "collect s / train s": (f"{tr['collect_seconds']:.0f} / {tr['train_seconds']:.0f}" if tr else None)}
    for key, (task, label) in SETS.items():
        r = runs.get(key, {}).get(name)
        row[label] = _task_cell((r or {}).get("tasks", {}).get(task))
    return row


def differences(name: str, runs: dict) -> dict:
    """name − the paper's map on the same items / windows: gap-closed and accuracy differences with paired SEs,
    per benchmark and for the log-perplexity gap at P = 256 (None where either run lacks its scores)."""
    out = {}
    for key, (task, label) in SETS.items():
        a, b = runs.get(key, {}).get(name), runs.get(key, {}).get(PAPER)
        if not (a and b and a["_scores"] and b["_scores"] and task in a["_scores"]["tasks"]):
            continue
        sa, sb = a["_scores"]["tasks"][task], b["_scores"]["tasks"][task]
        out[label] = {"gap_closed": gap_closed_difference(sa, sb), "accuracy": paired_difference(sa["transfer"], sb["transfer"])}
    both = [k for k in ("hs200", "ppl32") if name in runs.get(k, {}) and PAPER in runs.get(k, {})]
    a, b = (runs[both[0]][name], runs[both[0]][PAPER]) if both else (None, None)
    if a and b and a["_scores"] and b["_scores"]:
        out["log-ppl @256"] = {"gap_closed": gap_closed_difference(a["_scores"]["ppl_window_nll"]["256"],
                                                                   b["_scores"]["ppl_window_nll"]["256"])}
    return out


GOAL = {"log-ppl @256": 0.60, "HellaSwag n = 200": 0.50}  # set before the runs: gap closed to reach, against the floor


def block_goal(runs: dict, diffs: dict[str, dict]) -> str:
    """Issue 23's goal per map: >= 60 % of the log-perplexity gap at P = 256 and >= 50 % of the HellaSwag gap,
    with the paired difference to the paper's map above two SEs on both, at no more apply FLOPs."""
    paper = runs["hs200"][PAPER]
    lines = []
    for name, d in diffs.items():
        s = primary(runs, name)
        p256 = {r["prefix"]: r for r in s["ppl"]}[256]
        hs = (s.get("tasks") or {}).get("hellaswag") or {}
        reached = {"log-ppl @256": p256["transfer_gap_closed"], "HellaSwag n = 200": hs.get("gap_closed")}
        ok = [reached[m] is not None and reached[m] >= GOAL[m] and m in d and d[m]["gap_closed"]["difference"] > 2 * d[m]["gap_closed"]["se"]
              for m in GOAL]
        flops_ok = s["mapper"]["apply_flops_per_token"] <= paper["mapper"]["apply_flops_per_token"]
        parts = [f"{m}: {format_with_se(reached[m], None, scale=100, places=1)} % (goal {100 * GOAL[m]:.0f} %), "
                 f"paired difference {format_with_se(d[m]['gap_closed']['difference'], d[m]['gap_closed']['se'], scale=100)}"
                 f" points ({d[m]['gap_closed']['difference'] / d[m]['gap_closed']['se']:+.1f} SE)"
                 for m in GOAL if m in d]
        missing = [m for m in GOAL if m not in d]
        lines.append(f"- `{name}`: " + "; ".join(parts) + (f"; not measured: {', '.join(missing)}" if missing else "")
                     + f"; apply FLOPs {'≤' if flops_ok else '>'} the paper map's. "
                     + (f"Goal **{'met' if all(ok) and flops_ok else 'not met'}**." if not missing else
                        "Goal **not decided** (not every measure ran)."))
    return "\n".join(lines) + "\n"


def _flops_phrase(ratio: float) -> str:
    return ", at the same apply FLOPs" if abs(ratio - 1) < 1e-9 else f", at {ratio:.2f}x the paper map's apply FLOPs"


def headline_label(mapper: dict, name: str) -> str:
    """What a map is, for the top-level README (its run folder's name means little to a reader)."""
    if mapper.get("features"):
        return "the hidden-state map"
    training = mapper.get("training") or {}
    if training.get("objective") == "end_to_end":
        return f"the end-to-end trained map ({training.get('steps')} Adam steps, lr {training.get('lr'):g})"
    if training.get("objective") == "layer_local":
        return "the layer-locally trained map"
    return f"`{name}`"


def top_block(runs: dict, diffs: dict[str, dict]) -> str:
    """The top-level README's line: each trained map against the paper's, floor-based gaps with paired SEs."""
    paper = runs["hs200"][PAPER]
    pp = {r["prefix"]: r for r in paper["ppl"]}[256]
    parts = []
    for name, d in diffs.items():
        s = primary(runs, name)
        p256 = {r["prefix"]: r for r in s["ppl"]}[256]
        g = d["log-ppl @256"]["gap_closed"]
        h = d.get("HellaSwag n = 200", {}).get("gap_closed")
        label = headline_label(s["mapper"], name)
        parts.append(f"{label} closes {format_with_se(p256['transfer_gap_closed'], p256['transfer_gap_closed_se'], scale=100, unit=' %')} "
                     f"of the log-perplexity gap at P = 256 against the paper map's "
                     f"{format_with_se(pp['transfer_gap_closed'], pp['transfer_gap_closed_se'], scale=100, unit=' %')} "
                     f"(paired difference {format_with_se(g['difference'], g['se'], scale=100)} points, 32 windows)"
                     + (f" and {format_with_se(s['tasks']['hellaswag']['gap_closed'], s['tasks']['hellaswag']['stderr_gap_closed'], scale=100, unit=' %')} "
                        f"of the HellaSwag gap (paired difference {format_with_se(h['difference'], h['se'], scale=100)} points, n = 200)"
                        if h else "") + _flops_phrase(s["mapper"]["apply_flops_per_token"] / paper["mapper"]["apply_flops_per_token"]))
    return "; ".join(parts) + ".\n"


def block_table(rows: list[dict]) -> str:
    cols = list(rows[0])
    return readme.md_table(cols, [[r.get(c) for c in cols] for r in rows])


def block_differences(diffs: dict[str, dict]) -> str:
    lines = []
    for name, d in diffs.items():
        for label, x in d.items():
            g = x["gap_closed"]
            acc = x.get("accuracy")
            lines.append([name, label, format_with_se(g["difference"], g["se"], scale=100, unit=" points"),
                          f"{g['difference'] / g['se']:+.1f}" if g["se"] else "–",
                          format_with_se(acc["difference"], acc["se"]) if acc else "–"])
    return readme.md_table(["map − paper_sink1", "measure", "gap closed difference", "in SEs", "accuracy difference"], lines)


def _trained(runs: dict, objective: str):
    """(name, training record) of every map trained with `objective`, from its primary run, sorted by name."""
    for name in sorted(set(runs.get("hs200", {})) | set(runs.get("ppl32", {}))):
        tr = primary(runs, name)["mapper"].get("training")
        if tr and tr["objective"] == objective:
            yield name, tr


def block_training(runs: dict) -> str:
    """Per trained map: the stop-split loss (relative attention-output error) at the ridge start and at the end,
    summed over what each layer kept; layers kept at ridge; steps run; still improving at the step cap."""
    rows = []
    for name, tr in _trained(runs, "layer_local"):
        layers = tr["layers"]
        ratio = [x["stop_loss_final"] / x["stop_loss_ridge"] for x in layers if x["stop_loss_ridge"]]
        cap = tr["settings"]["steps"]
        rows.append([name, tr["settings"]["lr"], f"{len(tr['fit_index'])} + {len(tr['stop_index'])}", cap,
                     f"{min(ratio):.3f}–{max(ratio):.3f} (mean {sum(ratio) / len(ratio):.3f})",
                     len(tr["layers_worse_than_ridge"]), sum(1 for x in layers if x["best_step"] == x["steps"] == cap),
                     f"{sum(x['steps'] for x in layers) / len(layers):.0f}"])
    return readme.md_table(["map", "lr", "fit + stop sequences", "step cap", "stop loss final / ridge, over layers",
                            "layers kept at ridge", "layers still improving at the cap", "mean steps"], rows)


def block_agreement(runs: dict, names: list[str]) -> str:
    """Per benchmark and map: the share of items whose transfer outcome (correct or not) is the no-context
    floor's, and the target's -- a map the target reads as if there were no context sits near 1 in the first."""
    rows = []
    for key, (task, label) in SETS.items():
        for name in names:
            r = runs.get(key, {}).get(name)
            sc = ((r or {}).get("_scores") or {}).get("tasks", {}).get(task)
            if not sc:
                continue
            tr = sc["transfer"]
            same = {m: sum(a == b for a, b in zip(tr, sc[m])) / len(tr) for m in ("no_context", "target")}
            rows.append([label, name, len(tr), f"{same['no_context']:.2f}", f"{same['target']:.2f}"])
    return readme.md_table(["benchmark", "map", "n", "transfer outcome = no-context's", "transfer outcome = target's"], rows)


def block_training_e2e(runs: dict) -> str:
    """Per end-to-end map (all layers jointly): the stop-split next-token KL (nats/token) at the ridge start, at
    the best evaluation and of the weights kept; the train KL of the first and last evaluation windows; steps."""
    rows = []
    for name, tr in _trained(runs, "end_to_end"):
        kl = [f"{e['step']}: {e['stop_kl']:.4f}" if e["stop_kl"] is not None else f"{e['step']}: –" for e in tr["evaluations"]]
        rows.append([name, tr["settings"]["lr"], f"{len(tr['fit_index'])} + {len(tr['stop_index'])}",
                     tr["settings"]["batch_sequences"], f"{tr['steps']} of {tr['settings']['steps']}", tr["best_step"],
                     f"{tr['stop_kl_start']:.4f}", "; ".join(kl), f"{tr['stop_kl_final']:.4f}",
                     "ridge (start kept)" if tr["kept_start"] else "trained",
                     f"{tr['train_kl_first']:.4f} → {tr['train_kl_last']:.4f}" if tr["train_kl_first"] is not None else "–"])
    if not rows:
        return "No end-to-end map has run yet (`E2E=1 PPL32=1 bash experiments/maps_trained/run.sh`).\n"
    return readme.md_table(["map", "lr", "fit + stop sequences", "sequences per step", "steps run", "best step",
                            "stop KL at the ridge start", "stop KL per evaluation (step: KL)", "stop KL kept",
                            "weights kept", "train KL, first → last window"], rows)


def collect(out: Path = OUT) -> tuple[dict, dict[str, str]]:
    """(maps_trained.json content, README blocks) from the runs alone (no model, no timing)."""
    runs = load_runs(out)
    if PAPER not in runs.get("hs200", {}):
        raise SystemExit(f"{out}/runs_hs200/{PAPER} is missing: run HS200=1 bash experiments/maps_trained/run.sh")
    names = [PAPER] + sorted((set(runs["hs200"]) | set(runs.get("ppl32", {}))) - {PAPER})
    rows = [map_row(n, runs) for n in names]
    diffs = {n: differences(n, runs) for n in names if n != PAPER}
    summaries = {f"runs_{k}/{n}": s for k, v in runs.items() for n, s in v.items()}
    blocks = {"provenance": provenance_header(summaries, COLLECT), "table": block_table(rows), "goal": block_goal(runs, diffs),
              "differences": block_differences(diffs), "training": block_training(runs), "training_e2e": block_training_e2e(runs),
              "agreement": block_agreement(runs, names)}
    return {"rows": rows, "differences": diffs, "top": top_block(runs, diffs)}, blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--readme", default="README.md", help="the top-level README (its maps_trained_headline block)")
    ap.add_argument("--allow-dirty", action="store_true", help="write from an uncommitted tree (the header says so)")
    ap.add_argument("--check", action="store_true", help="only compare the README's blocks (exit 1 on a difference)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    data, blocks = collect(out)
    if args.check:
        stale = readme.stale_blocks(out / "README.md", blocks)
        stale += readme.stale_blocks(args.readme, {"maps_trained_headline": data["top"]})
        for name in stale:
            print(f"{out / 'README.md'}: block {name!r} is stale: rerun {COLLECT}")
        return 1 if stale else 0
    refuse_dirty_write(out, args.allow_dirty)
    atomic_write_json(out / "maps_trained.json", {**data, "provenance": json_provenance()})
    readme.rewrite(out / "README.md", blocks)
    readme.rewrite(Path(args.readme), {"maps_trained_headline": data["top"]})
    print(f"wrote {out}: {len(data['rows'])} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
