"""What the calibration text buys: the maps of experiments/baselines/run.sh step 8 (other draws, 2x and 4x the text,
another and a mixed domain) beside the main map, read from collect.py's analysed results (the same windows, the same
paired bootstrap). Numbers only; collect.py formats them.

Tokens: a calibration's sequences (train and held out) x their 256 tokens. Held-out R²: each calibration's own
held-out sequences (20 % of each part), mean over target heads. The log-linear extrapolation to the paper's
500 x 1,024 tokens is a straight line in log2(tokens) through the main map (40,960 tokens) and the 4x map's paired
difference from it; it is an extrapolation past the measured range, not a measurement.
"""
from __future__ import annotations

import math

# run -> the mode its map is merged under (collect.OTHER_MAPS), in table order after the main map
CALIB_MAPS = {"real_calib_draw1": "transfer_calib_draw1", "real_calib_draw2": "transfer_calib_draw2",
              "real_calib_80k": "transfer_calib_80k", "real_calib_160k": "transfer_calib_160k",
              "real_calib_code": "transfer_code_calib", "real_calib_mixed": "transfer_calib_mixed"}
MAIN_RUN = "real_wikitext2_a"      # a run of the main map: its summary records the main calibration
PAPER_TOKENS = 500 * 1024          # the paper's calibration (FineWeb-Edu, stride 4)
SETS = (("wikitext2", "confirmation"), ("python_stdlib", "all"))


def _calibration(run: dict) -> dict:
    """{"tokens", "sequences", "observations", "domain", "parts": [(domain, draw)], "r2_k", "r2_v"} of a run's
    calibration (a merged one records its parts; a single one its draw in the run's config)."""
    summary = run["summary"]
    c, r2 = summary.get("calibration") or {}, summary.get("r2") or {}
    seqs = (c.get("sequences") or 0) + (c.get("heldout_sequences") or 0)
    draw = int((((run.get("config") or {}).get("calib") or {}).get("draw")) or 0)
    parts = c.get("parts") or [{"domain": c.get("domain"), "draw": draw}]
    return {"tokens": seqs * (c.get("tokens_per_seq") or 0), "sequences": seqs, "observations": c.get("observations"),
            "domain": c.get("domain"), "parts": [(p.get("domain"), p.get("draw", 0)) for p in parts],
            "r2_k": (r2.get("k") or {}).get("heldout"), "r2_v": (r2.get("v") or {}).get("heldout")}


def rows(results: dict, runs: dict) -> list[dict]:
    """One row per calibration whose run finished: its calibration, and per evaluation set (WikiText-2's confirmation
    half, Python source) the gap closed (± SE), the worth in native tokens and the paired difference from the main
    map (None for the main map itself, or where that set was not scored). [] without the main map's run."""
    if MAIN_RUN not in runs:
        return []
    out = []
    for run, mode in (("", "transfer"), *CALIB_MAPS.items()):
        if (run or MAIN_RUN) not in runs:
            continue
        row = {"run": run or MAIN_RUN, "mode": mode, **_calibration(runs[run or MAIN_RUN]), "sets": {}}
        for st, half in SETS:
            res = results.get((st, 256, half)) or {}
            if mode not in (res.get("modes") or {}):
                continue
            row["sets"][st] = {"gap": res["modes"][mode]["gap"], "se": res["modes"][mode]["se"],
                               "windows": res["windows"], "half": half,
                               "worth": (res.get("worth") or {}).get(mode),
                               "versus_main": (res.get("versus_main_map") or {}).get(mode)}
        if row["sets"]:
            out.append(row)
    return out


def spread_between_draws(rows_: list[dict], st: str = "wikitext2") -> dict | None:
    """The standard deviation of the gap closed across the single-draw Wikipedia maps of one size (draws 0, 1, 2),
    beside the windows' own SE (their mean): how much a different 40K-token draw moves the answer."""
    single = [r for r in rows_ if len(r["parts"]) == 1 and r["parts"][0][0] == "wikipedia" and st in r["sets"]]
    if len(single) < 2:
        return None
    g = [r["sets"][st]["gap"] for r in single]
    mean = sum(g) / len(g)
    sd = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
    return {"draws": [r["parts"][0][1] for r in single], "gaps": g, "sd": sd,
            "window_se": sum(r["sets"][st]["se"] for r in single) / len(single)}


def extrapolate(rows_: list[dict], st: str = "wikitext2", tokens: int = PAPER_TOKENS) -> dict | None:
    """The gap closed at `tokens` calibration tokens on a straight line in log2(tokens) through the main map and the
    largest Wikipedia-only map, slope from their paired difference (± its SE); the middle size's distance from the
    line says whether the measured range is straight. An extrapolation; None without the two end points."""
    main = next((r for r in rows_ if r["mode"] == "transfer" and st in r["sets"]), None)
    wiki = [r for r in rows_ if r["mode"] != "transfer" and st in r["sets"] and r["sets"][st]["versus_main"]
            and {d for d, _ in r["parts"]} == {"wikipedia"} and r["tokens"] > (main or {}).get("tokens", math.inf)]
    if main is None or not wiki:
        return None
    far = max(wiki, key=lambda r: r["tokens"])
    doublings = math.log2(far["tokens"] / main["tokens"])
    d, se = far["sets"][st]["versus_main"]
    slope, slope_se = d / doublings, se / doublings
    ahead = math.log2(tokens / main["tokens"])
    g0, g0_se = main["sets"][st]["gap"], main["sets"][st]["se"]
    out = {"from_tokens": main["tokens"], "to_tokens": far["tokens"], "slope": slope, "slope_se": slope_se,
           "tokens": tokens, "doublings": ahead, "gap": g0 + ahead * slope,
           "gap_se": math.sqrt(g0_se ** 2 + (ahead * slope_se) ** 2)}
    mid = [r for r in wiki if r is not far]
    if mid:
        m = mid[0]
        md, mse = m["sets"][st]["versus_main"]
        out["middle"] = {"tokens": m["tokens"], "off_line": md - slope * math.log2(m["tokens"] / main["tokens"]),
                         "se": mse}
    return out
