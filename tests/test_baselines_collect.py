"""experiments/baselines/collect.py on synthetic runs with known answers: the repair is chosen on WikiText-2's
selection half only, each half's gap closed is that half's windows' alone, the equal-cost truncation is the curve
interpolated at the mapped mode's measured cost, and two runs' shared modes must agree."""
from __future__ import annotations

import numpy as np
import pytest

from scripts import load_script
from tolerance import assert_close, assert_within

collect = load_script("experiments/baselines/collect.py")


def _runs(flip: bool = True):
    """Two runs over one draw of 62 windows (one per article): run a has the baselines and r = 0.15 / 0.3 with their
    twins; run b the baselines and the truncation curve. On the selection half recent_0.3 leads its twin by 0.2 and
    recent_0.15 by 0.1 of the gap; on the confirmation half (flip) the other way round."""
    halves = collect.split_halves()
    docs = list(range(62))
    rng = np.random.default_rng(0)
    target = rng.normal(2.0, 0.2, 62)
    floor = target + 1.0
    sel = np.isin(docs, halves["selection"])

    def at(frac):  # an NLL closing `frac` of each window's gap
        return list(floor - (floor - target) * frac)
    lead3, lead15 = np.where(sel | (not flip), 0.2, 0.1), np.where(sel | (not flip), 0.1, 0.2)
    nll_a = {"target": list(target), "no_context": list(floor), "transfer": at(0.3),
             "truncate_0.3": at(0.5), "recompute_recent_0.3": at(0.5 + lead3),
             "truncate_0.15": at(0.4), "recompute_recent_0.15": at(0.4 + lead15)}
    nll_b = {"target": list(target), "no_context": list(floor), "transfer": at(0.3),
             **{f"truncate_tokens_{m}": at(frac) for m, frac in ((1, 0.0), (4, 0.2), (16, 0.4), (64, 0.8))}}
    cost = {"transfer": 0.1, "truncate_tokens_1": 0.01, "truncate_tokens_4": 0.05, "truncate_tokens_16": 0.15,
            "truncate_tokens_64": 0.4, "target": 1.0}

    flops = {"no_context": 0.0, "truncate_tokens_1": 0.0, "truncate_tokens_4": 0.01, "truncate_tokens_16": 0.05, "truncate_tokens_64": 0.25}

    def run(nll):
        row = {"prefix": 256, **{f"{m}_seconds_rel": c for m, c in cost.items() if m in nll},
               **{f"{m}_seconds": c for m, c in cost.items() if m in nll},
               **{f"{m}_flops_rel": c for m, c in flops.items() if m in nll}, "transfer_map_flops_rel": 0.03}
        return {"summary": {"ppl_sets": {"wikitext2": [row]}, "environment": {"commit": "abcdef0", "dirty": False}},
                "scores": {"ppl_sets": {"wikitext2": {"window_doc": docs, "window_nll": {"256": nll}}}}}
    return {"real_a": run(nll_a), "real_b": run(nll_b)}, sel


def test_the_repair_is_chosen_on_the_selection_half_only():
    runs, sel = _runs()
    results = collect.analyse(collect.merge(runs))
    assert collect.choose(results) == "recompute_recent_0.3"   # the selection half's winner ...
    conf = results[("wikitext2", 256, "confirmation")]
    assert conf["twins"]["recompute_recent_0.15"][0] > conf["twins"]["recompute_recent_0.3"][0]  # ... not confirmation's
    assert conf["windows"] == int((~sel).sum()) == 31
    reason = "ratios of float64 means of 31 windows (a few roundings each)"
    assert_close(conf["twins"]["recompute_recent_0.3"][0], 0.1, factor=64, magnitude=1, reason=reason)
    assert_close(results[("wikitext2", 256, "selection")]["twins"]["recompute_recent_0.3"][0], 0.2, factor=64,
                 magnitude=1, reason=reason)
    flipped = collect.analyse(collect.merge(_runs(flip=False)[0]))
    assert collect.choose(flipped) == "recompute_recent_0.3"


def test_worth_and_equal_cost_truncation():
    runs, _ = _runs()
    res = collect.analyse(collect.merge(runs))[("wikitext2", 256, "confirmation")]
    reason = "float64 log-linear interpolation of ratios of means (a few roundings)"
    # the map closes 0.3: between m = 4 (0.2) and 16 (0.4), halfway in log m -> m = 8
    assert_close(res["worth"]["transfer"]["tokens"], 8.0, factor=1024, magnitude=8,
                 reason=reason + "; exp of the interpolated log m multiplies the log's rounding by m: hundreds of ulps")
    # at the map's measured cost 0.1 (between m = 4 at 0.05 and m = 16 at 0.15, halfway) truncation closes 0.3
    eq = res["equal_cost"]["transfer"]
    assert eq["between"] == (4, 16)
    assert_close(eq["truncation"], 0.3, factor=64, magnitude=1, reason=reason)
    assert_close(eq["difference"], 0.0, factor=64, magnitude=1, reason=reason)
    assert res["modes"]["transfer"]["seconds_rel"] == 0.1 and res["modes"]["transfer"]["flops_rel"] == 0.03
    # at the map's FLOPs 0.03 (between m = 4 at 0.01 and m = 16 at 0.05, halfway) truncation closes 0.3 too
    ef = res["equal_flops"]["transfer"]
    assert ef["between"] == (4, 16)
    assert_close(ef["truncation"], 0.3, factor=64, magnitude=1, reason=reason)
    line = collect.headline(collect.analyse(collect.merge(runs)), "recompute_recent_0.3")
    assert "does not separate from truncation" in line and "8.0" in line


def test_runs_must_share_their_windows_and_cached_modes():
    runs, _ = _runs()
    runs["real_b"]["scores"]["ppl_sets"]["wikitext2"]["window_nll"]["256"]["transfer"][0] += 1e-3
    with pytest.raises(ValueError, match="differs"):
        collect.merge(runs)


def test_the_gate_against_the_fixed_rule_at_its_realised_cost_and_its_fitted_rates():
    """A gated run beside run a: the gate closes 0.55 of each gap at FLOPs 0.2 while the fixed rule (map alone at
    0.03, recent 0.15 at 0.18, recent 0.3 at 0.33) interpolates to a known share there; its realised actions (all full
    on the confirmation half) are far from the 70 / 20 / 10 % it was fitted for: it does not pay."""
    runs, sel = _runs(flip=False)
    a = runs["real_a"]
    nll = a["scores"]["ppl_sets"]["wikitext2"]["window_nll"]["256"]
    target, floor = np.asarray(nll["target"]), np.asarray(nll["no_context"])
    gated = list(floor - (floor - target) * 0.55)
    row = dict(a["summary"]["ppl_sets"]["wikitext2"][0],
               **{"recompute_recent_0.3_cost": 0.3, "recompute_recent_0.15_cost": 0.15, "gated_cost": 0.17,
                  "gated_seconds_rel": 0.5})
    events = [{"action": "full" if not s else ["map", "recompute"][i % 2], "cost": 0.17} for i, s in enumerate(sel)]
    runs["real_gate"] = {
        "summary": {"ppl_sets": {"wikitext2": [row]}, "environment": {"commit": "abcdef0", "dirty": False}},
        "scores": {"ppl_sets": {"wikitext2": {"window_doc": list(range(62)), "window_nll": {"256": {**nll, "gated": gated}},
                                              "events": {"gated": {"256": events}}}}},
        "config": {"eval": {"gate": {"enabled": True, "recompute_rate": 0.2, "full_rate": 0.1}}}}
    runs["real_a"]["summary"]["ppl_sets"]["wikitext2"][0].update(row)
    res = collect.analyse(collect.merge(runs))[("wikitext2", 256, "confirmation")]
    reason = "linear interpolation of ratios of float64 means of 31 windows"
    # FLOPs: transfer 0.03; recent 0.15: 0.15 + 0.03 = 0.18 (closes 0.4 + 0.1); recent 0.3: 0.33 (0.7); gated 0.2
    e = res["gate_vs_rule_flops"]
    assert e["between"] == (0.15, 0.3)
    rule = 0.5 + (0.2 - 0.18) / (0.33 - 0.18) * (0.7 - 0.5)
    assert_close(e["truncation"], rule, factor=64, magnitude=1, reason=reason)
    assert_close(e["difference"], 0.55 - rule, factor=64, magnitude=1, reason=reason)
    assert res["gate_rates"]["full"] == 1.0 and res["gate_rates"]["windows"] == 31
    assert res["gate_fitted"] == {"recompute": 0.2, "full": 0.1, "map": 0.7}
    v = collect.gate_verdict(res)
    assert v == {"beats_rule": True, "rates_hold": False, "pays": False}
    sel_res = collect.analyse(collect.merge(runs))[("wikitext2", 256, "selection")]
    picked = [e["action"] for e, s in zip(events, sel) if s]   # the selection half's actions, counted by hand
    assert sel_res["gate_rates"]["full"] == 0.0
    assert sel_res["gate_rates"]["map"] == picked.count("map") / len(picked)
    text = "\n".join(collect.gate_lines(res))
    assert "does not pay" in text and "fitted for 10 %" in text
    assert "The per-request gate does not pay" in collect.headline(collect.analyse(collect.merge(runs)), None)


def test_coqa_twins_table():
    rows = [{"protocol": p, "mode": f"truncate_tokens_{m}", "tokens": m, "conversations": 5, "turns": 50,
             "twin_f1": tf, "twin_f1_se": 0.01, "transfer_f1": 0.15, "transfer_f1_se": 0.05,
             "transfer_minus_twin": 0.15 - tf, "transfer_minus_twin_se": 0.04}
            for p in ("every_turn", "once") for m, tf in ((32, 0.3), (128, 0.5))]
    runs = {"real_coqa": {"summary": {"coqa_twins": rows, "environment": {"commit": "abcdef0123", "dirty": False},
                                      "drift_summary": [{"protocol": "every_turn", "target_f1": 0.7,
                                                         "target_f1_se": 0.03}]}}}
    text = "\n".join(collect.coqa_lines(runs))
    assert "`abcdef0`" in text and "the target reading its last 32 tokens" in text
    line = next(x for x in text.splitlines() if x.startswith("| every_turn"))
    assert "5 x 10" in line and "0.700 ± 0.030" in line and "transfer - twin -0.150 ± 0.040" in line
    assert "transfer - twin -0.350" in line
    assert collect.coqa_lines({}) == ["No CoQA run on the real pair has finished (run.sh step 7).", ""]
    clause = collect.coqa_sentence(runs)
    assert clause.startswith("on CoQA (5 conversations x 10 turns) a mapped story answers at F1 0.150")
    assert "0.300 reading the last 32 tokens (map - twin -0.150 ± 0.040)" in clause and collect.coqa_sentence({}) is None


def test_a_dearer_curve_point_that_closes_less_is_not_interpolated():
    """Measured seconds need not rise with m (warm-up, weight streaming): m = 1 timed at 0.12 sits between m = 16
    (0.15) and m = 4 (0.05) in cost; the equal-cost truncation uses only the points no cheaper point beats."""
    runs, _ = _runs()
    runs["real_b"]["summary"]["ppl_sets"]["wikitext2"][0]["truncate_tokens_1_seconds_rel"] = 0.12
    res = collect.analyse(collect.merge(runs))[("wikitext2", 256, "confirmation")]
    eq = res["equal_cost"]["transfer"]          # the map at 0.1: between m = 4 (0.05) and m = 16 (0.15), as before
    assert eq["between"] == (4, 16)
    assert_close(eq["truncation"], 0.3, factor=64, magnitude=1, reason="float64 interpolation of ratios of means")


def test_another_calibrations_map_sits_beside_the_main_one():
    """real_calib_code's `transfer` (another calibration) is merged as transfer_code_calib: its own gap closed, worth
    and costs, and its paired difference against the main map on the same windows."""
    runs, _ = _runs()
    base = runs["real_b"]
    nll = base["scores"]["ppl_sets"]["wikitext2"]["window_nll"]["256"]
    target, floor = np.asarray(nll["target"]), np.asarray(nll["no_context"])
    other = {"target": nll["target"], "no_context": nll["no_context"], "transfer": list(floor - (floor - target) * 0.4)}
    row = {"prefix": 256, "transfer_seconds_rel": 0.1, "transfer_map_flops_rel": 0.03}
    runs["real_calib_code"] = {"summary": {"ppl_sets": {"wikitext2": [row]}, "environment": {"commit": "abcdef0"}},
                               "scores": {"ppl_sets": {"wikitext2": {"window_doc": list(range(62)),
                                                                     "window_nll": {"256": other}}}}}
    res = collect.analyse(collect.merge(runs))[("wikitext2", 256, "confirmation")]
    reason = "ratios of float64 means of 31 windows"
    assert_close(res["modes"]["transfer"]["gap"], 0.3, factor=64, magnitude=1, reason=reason)  # the main map, intact
    assert_close(res["modes"]["transfer_code_calib"]["gap"], 0.4, factor=64, magnitude=1, reason=reason)
    assert_close(res["versus_main_map"]["transfer_code_calib"][0], 0.1, factor=64, magnitude=1, reason=reason)
    assert res["modes"]["transfer_code_calib"]["seconds_rel"] == 0.1
    assert "transfer_code_calib" in res["worth"]
    text = "\n".join(collect.table(res))
    assert "minus `transfer`: +10.0" in text


def _timing(windows: int = 8) -> dict:
    """A timing file (experiments/baselines/timing.py) for run b's modes at P = 256: 5 rounds in which every mode
    takes the same time, so each median ratio is known; SEs given by hand; the source reads 3 / 10 of the target's
    seconds and 2 / 10 of its FLOPs."""
    rel = {"target": (1.0, 0.0), "transfer": (0.1, 0.01), "source": (0.3, 0.02), "truncate_tokens_1": (0.01, 0.0),
           "truncate_tokens_4": (0.05, 0.005), "truncate_tokens_16": (0.15, 0.005), "truncate_tokens_64": (0.4, 0.01)}
    return {"set": "wikitext2", "prefix": 256, "windows": windows, "flops": {"target": 100.0, "source": 20.0},
            "timing": {"repeats": 5, "seconds": {m: [8.0 * r] * 5 for m, (r, _) in rel.items()},
                       "median": {m: 8.0 * r for m, (r, _) in rel.items()},
                       "median_se": {m: 0.08 * r for m, (r, _) in rel.items()},
                       "relative": {m: {"median": r, "se": se} for m, (r, se) in rel.items()},
                       "load_avg": {"before": [1.0, 1.0, 1.0], "after": [1.5, 1.0, 1.0]},
                       "machine": {"cpu": "a CPU", "torch_threads": 2}},
            "provenance": {"commit": "0123456789", "dirty": False}}


def test_interleaved_timings_price_every_mode_with_their_se_and_the_cold_start():
    """With a timing file the seconds are its per-round medians (a mode it did not time has none: never the eval's
    wall clock beside them), the equal-seconds SE adds the delta-method timing term in quadrature, and the cold start
    charges the map the source's prefill: (map + source) / target per round, and FLOPs map + source / target."""
    runs, _ = _runs()
    timings = {("wikitext2", 256): _timing()}
    res = collect.analyse(collect.merge(runs), timings)[("wikitext2", 256, "confirmation")]
    assert res["modes"]["truncate_tokens_16"]["seconds_rel"] == 0.15
    assert res["modes"]["truncate_tokens_16"]["seconds_rel_se"] == 0.005
    assert res["modes"]["recompute_recent_0.3"]["seconds_rel"] is None   # run a timed it by wall clock: not mixed in
    assert res["timing"]["repeats"] == 5 and res["timing"]["commit"] == "0123456"
    reason = ("linear interpolation of ratios of float64 means of 31 windows: up to 31 roundings per mean, a few means "
              "per ratio (numpy's summation order varies with the CPU's SIMD)")
    eq = res["equal_cost"]["transfer"]
    # the map at 0.1 +- 0.01 sits halfway between m = 4 (0.05 +- 0.005, closes 0.2) and m = 16 (0.15 +- 0.005, 0.4)
    slope, w = (0.4 - 0.2) / (0.15 - 0.05), 0.5
    by_hand = slope * np.sqrt(0.01 ** 2 + (1 - w) ** 2 * 0.005 ** 2 + w ** 2 * 0.005 ** 2)
    assert_close(eq["difference_se_timing"], by_hand, factor=256, magnitude=1, reason=reason)
    assert_close(eq["difference_se_total"], np.hypot(eq["difference_se"], by_hand), factor=64, magnitude=1,
                 reason=reason)
    cold = res["counted"]
    # seconds: (0.8 + 2.4) / 8 = 0.4 per round, the m = 64 point (closes 0.8): the map's 0.3 - 0.8
    assert_close(cold["seconds"]["cost"], 0.4, factor=256, magnitude=1, reason=reason)
    assert_close(cold["seconds"]["difference"], 0.3 - 0.8, factor=256, magnitude=1, reason=reason)
    # FLOPs: the map's 0.03 + sink 0 + 20 / 100 = 0.23, 0.9 of the way from m = 16 (0.05, 0.4) to m = 64 (0.25, 0.8)
    assert_close(cold["flops"]["cost"], 0.23, factor=256, magnitude=1, reason=reason)
    assert_close(cold["flops"]["difference"], 0.3 - (0.4 + 0.9 * 0.4), factor=256, magnitude=1, reason=reason)
    text = "\n".join(collect.table(res))
    assert "interleaved timing" in text and "0.150 ± 0.005" in text and "a cold start" in text
    untimed = collect.analyse(collect.merge(runs), {})[("wikitext2", 256, "confirmation")]
    assert untimed["modes"]["transfer"]["seconds_rel"] == 0.1 and "counted" in untimed and not untimed["counted"]
    assert "one wall clock per mode" in "\n".join(collect.table(untimed))


def test_the_map_is_charged_the_native_sink_prefill_truncation_pays_for():
    """The map's FLOPs add the target's prefill of the sink token (no_context's FLOPs: the start id alone)."""
    runs, _ = _runs()
    for r in runs.values():
        r["summary"]["ppl_sets"]["wikitext2"][0]["no_context_flops_rel"] = 0.01
    res = collect.analyse(collect.merge(runs), {})[("wikitext2", 256, "confirmation")]
    assert_close(res["modes"]["transfer"]["flops_rel"], 0.03 + 0.01, factor=4, magnitude=1,
                 reason="one float64 addition")
    runs["real_a"]["config"] = {"mapper": {"native_sink": 4}}
    with pytest.raises(ValueError, match="native_sink=1"):
        collect.merge(runs)


def test_the_headline_leads_with_the_longest_context_and_its_convention():
    """A second (set, P) at 1,024 (run b's windows again): the worth table has both, the lead names the handoff
    convention first and speaks of P = 1,024, and says how the worth moved with P."""
    runs, _ = _runs()
    import copy
    long = copy.deepcopy(runs["real_b"])
    long["summary"]["ppl_sets"]["wikitext2"][0]["prefix"] = 1024
    wn = long["scores"]["ppl_sets"]["wikitext2"]["window_nll"]
    wn["1024"] = wn.pop("256")
    runs["real_long"] = long
    results = collect.analyse(collect.merge(runs), {})
    rows = collect.worth_rows(results)
    assert [(r["prefix"], r["windows"]) for r in rows if r["mode"] == "transfer"] == [(256, 62), (1024, 62)]
    first = collect.lead(results)
    assert first.startswith("**In a handoff (the source has read the context already")
    assert "P = 1,024" in first and "8.0 tokens at P = 256" in first and "8.0 tokens at P = 1,024" in first
    assert collect.headline(results, None).startswith(first)
    assert "## Worth as the context grows" in "\n".join(collect.worth_table(results))


def test_another_set_is_priced_by_wikitext2s_timing_at_its_p_and_m1_is_no_context():
    """Python source at P = 256 takes WikiText-2's timing at 256 (the same token counts), says so in its table; a run
    without truncate_tokens_1 gets the curve's m = 1 point from no_context (the same tokens read)."""
    runs, _ = _runs()
    for r in runs.values():
        sc = r["scores"]["ppl_sets"]
        sc["python_stdlib"] = sc.pop("wikitext2")
        r["summary"]["ppl_sets"]["python_stdlib"] = r["summary"]["ppl_sets"].pop("wikitext2")
    nll_b = runs["real_b"]["scores"]["ppl_sets"]["python_stdlib"]["window_nll"]["256"]
    with_m1 = collect.analyse(collect.merge(runs), {("wikitext2", 256): _timing()})[("python_stdlib", 256, "all")]
    del nll_b["truncate_tokens_1"]
    res = collect.analyse(collect.merge(runs), {("wikitext2", 256): _timing()})[("python_stdlib", 256, "all")]
    assert res["modes"]["transfer"]["seconds_rel"] == 0.1 and res["timing"]["set"] == "wikitext2"
    assert "of WikiText-2 (the same token counts)" in "\n".join(collect.table(res))
    assert res["modes"]["truncate_tokens_1"]["gap"] == with_m1["modes"]["truncate_tokens_1"]["gap"]
    assert res["worth"]["transfer"]["curve"] == with_m1["worth"]["transfer"]["curve"]


def test_a_large_to_small_run_is_its_own_pair():
    """A run with pair.direction=reverse over the same set and P is keyed apart (its target is another model: its
    NLLs would otherwise collide with the forward runs'), borrows no timing, and gets its own headline clause."""
    import copy
    runs, _ = _runs()
    rev = copy.deepcopy(runs["real_b"])
    nll = rev["scores"]["ppl_sets"]["wikitext2"]["window_nll"]["256"]
    nll["transfer"] = [x + 0.01 for x in nll["transfer"]]   # another pair's map: differs from the forward one's
    rev["config"] = {"pair": {"direction": "reverse"}}
    runs["real_reverse_wikitext2"] = rev
    results = collect.analyse(collect.merge(runs), {("wikitext2", 256): _timing()})
    res = results[("wikitext2@reverse", 256, "all")]
    assert res["windows"] == 62 and res["timing"] is None and res["runs"] == ["real_reverse_wikitext2"]
    assert results[("wikitext2", 256, "all")]["timing"] is not None
    assert "Large -> small (the 1.5B reads the context" in collect.headline(results, None)


def _calib_run(nll: dict, sequences: int, parts=None, r2=(0.7, 0.5), draw: int = 0):
    """A run of one calibration's map over the synthetic draw: its NLLs and a summary recording that calibration (a
    merged one lists its parts; a single one's draw is in the run's config, as the runner writes them)."""
    run = _runs()[0]["real_b"]
    run["config"] = {"calib": {"draw": draw, "merge": [{"draw": p["draw"]} for p in (parts or [])[1:]]}}
    run["scores"]["ppl_sets"]["wikitext2"]["window_nll"]["256"] = nll
    run["summary"] = {**run["summary"], "r2": {"k": {"heldout": r2[0]}, "v": {"heldout": r2[1]}},
                      "calibration": {"sequences": sequences * 4 // 5, "heldout_sequences": sequences // 5,
                                      "tokens_per_seq": 256, "domain": "wikipedia", **({"parts": parts} if parts else {})}}
    return run


def test_the_calibration_rows_difference_the_main_map_and_extrapolate_in_log_tokens():
    """Synthetic maps closing known shares: the main map 0.30 (40,960 tokens), draws 1 and 2 at 0.26 and 0.34,
    4x the text 0.40 (two doublings: +0.05 per doubling), 2x 0.35 (on that line). The paper's 512,000 tokens are
    log2(12.5) doublings past the main map: 0.30 + 0.05 log2(12.5)."""
    runs, _ = _runs()
    base = runs["real_b"]["scores"]["ppl_sets"]["wikitext2"]["window_nll"]["256"]
    target, floor = np.array(base["target"]), np.array(base["no_context"])
    rng = np.random.default_rng(1)

    def at(frac):   # every window closes `frac` of its gap, up to a small noise that keeps the SEs finite
        return list(floor - (floor - target) * (frac + rng.normal(0, 0.01, target.size)))
    curve = {k: v for k, v in base.items() if k.startswith("truncate_tokens_")}
    main = {"target": base["target"], "no_context": base["no_context"], "transfer": at(0.30), **curve}
    runs = {"real_wikitext2_a": _calib_run(main, 160)}
    for name, frac, seqs, draws in (("real_calib_draw1", 0.26, 160, [1]), ("real_calib_draw2", 0.34, 160, [2]),
                                    ("real_calib_80k", 0.35, 320, [0, 1]), ("real_calib_160k", 0.40, 640, [0, 1, 2, 3])):
        parts = [{"domain": "wikipedia", "draw": d} for d in draws] if len(draws) > 1 else None
        runs[name] = _calib_run({**main, "transfer": at(frac)}, seqs, parts, draw=draws[0] if not parts else 0)
    results = collect.analyse(collect.merge(runs))
    cc = collect.calibration_curve
    rows = cc.rows(results, runs)
    assert [r["mode"] for r in rows] == ["transfer", "transfer_calib_draw1", "transfer_calib_draw2",
                                         "transfer_calib_80k", "transfer_calib_160k"]
    assert [r["tokens"] for r in rows] == [40_960, 40_960, 40_960, 81_920, 163_840]
    assert [r["parts"] for r in rows][:3] == [[("wikipedia", 0)], [("wikipedia", 1)], [("wikipedia", 2)]]
    by = {r["mode"]: r["sets"]["wikitext2"] for r in rows}
    assert by["transfer"]["versus_main"] is None and by["transfer"]["half"] == "confirmation"
    noise = "per-window noise of SD 0.01 on ~31 windows: each mean within ~0.002 of its share, 0.01 is 5 SE"
    assert_within(by["transfer_calib_160k"]["versus_main"][0], 0.10, atol=0.01, reason=noise,
                  headroom_exempt="seeded synthetic windows: the same numbers on every machine (a statistical bound, not rounding)")
    spread = cc.spread_between_draws(rows)
    assert spread["draws"] == [0, 1, 2]
    assert_within(spread["sd"], 0.04, atol=0.01, reason="the standard deviation of 0.30, 0.26, 0.34; " + noise,
                  headroom_exempt="seeded synthetic windows: the same numbers on every machine (a statistical bound, not rounding)")
    ex = cc.extrapolate(rows)
    assert (ex["from_tokens"], ex["to_tokens"]) == (40_960, 163_840)
    assert_within(ex["slope"], 0.05, atol=0.005, reason="half the 4x map's difference; " + noise,
                  headroom_exempt="seeded synthetic windows: the same numbers on every machine (a statistical bound, not rounding)")
    assert_within(ex["gap"], 0.30 + 0.05 * np.log2(512_000 / 40_960), atol=0.03,
                  reason="3.6 doublings of the slope's noise plus the main map's", headroom_exempt="seeded synthetic windows: the same numbers on every machine (a statistical bound, not rounding)")
    assert_within(ex["middle"]["off_line"], 0.0, atol=3 * ex["middle"]["se"] + 0.01,
                  reason="the 2x map lies on the line by construction: 3 of its SEs plus the noise", headroom_exempt="seeded synthetic windows: the same numbers on every machine (a statistical bound, not rounding)")
    lines = "\n".join(collect.calibration_lines(results, runs))
    assert "Extrapolation (not a measurement)" in lines and "`transfer_calib_160k`" in lines
    assert "163,840 Wikipedia tokens" in collect.calibration_sentence(results, runs)


def test_the_content_share_comes_from_the_wrong_context_controls_and_they_are_not_priced():
    """The map closes 0.3 of each window's gap, 0.1 on another article's context; the target 1 and 0.5 there: the map
    carries (0.3 - 0.1) / (1 - 0.5) = 0.4 of the target's own gain from its context."""
    runs, _ = _runs()
    nll = runs["real_b"]["scores"]["ppl_sets"]["wikitext2"]["window_nll"]["256"]
    target, floor = np.array(nll["target"]), np.array(nll["no_context"])
    nll["transfer_wrong"] = list(floor - (floor - target) * 0.1)
    nll["target_wrong"] = list(floor - (floor - target) * 0.5)
    res = collect.analyse(collect.merge({"real_b": runs["real_b"]}))[("wikitext2", 256, "all")]
    exact = "a ratio of means of exactly linear NLLs: a few float64 roundings of O(1) numbers"
    assert_close(res["controls"]["content_share"], 0.4, factor=256, magnitude=1, reason=exact)
    assert "transfer_wrong" not in res["worth"] and "transfer_wrong" not in res["equal_flops"]
    row = next(r for r in collect.worth_rows({("wikitext2", 256, "all"): res}) if r["mode"] == "transfer")
    assert_close(row["content"]["content_share"], 0.4, factor=256, magnitude=1, reason=exact)
