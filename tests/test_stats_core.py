"""The statistics core on synthetic inputs with answers derived by hand: the mean's SE, the clustered SE and its
Student-t interval, the t quantile, the timing SE, the equal-cost interpolation with its frontier and its timing
term, the interleaved timing protocol, and the collect scripts that use them (CoQA and the handoff conversation
clustered by conversation)."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from kvtransfer.eval import metrics as M
from kvtransfer.eval import stats as S
from kvtransfer.core import timing as T
from scripts import load_script
from tolerance import assert_close

FEW = "a few float64 operations on values of order 1"


def test_mean_se_by_hand():
    # 1, 2, 3, 4: mean 2.5, sample variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5 / 3, SE sqrt(5 / 3) / 2
    m, se = S.mean_se([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5
    assert_close(se, math.sqrt(5 / 3) / 2, factor=10, reason=FEW)
    assert S.mean_se([0.7]) == (0.7, None)
    with pytest.raises(ValueError):
        S.mean_se([])
    assert S.binomial_se(0.25, 12) == 0.125   # sqrt(0.25 * 0.75 / 12) = sqrt(1 / 64)


def test_clustered_se_of_equal_clusters_is_the_se_of_the_cluster_means():
    """Clusters {1, 3}, {4, 6}, {7, 9}: cluster means 2, 5, 8 (sd 3), so SE = 3 / sqrt(3) = sqrt(3) with 2 degrees of
    freedom; the interval is 5 -/+ t(0.975, 2) sqrt(3), t(0.975, 2) = 0.95 / sqrt(2 * 0.975 * 0.025) in closed form.
    Treating the 6 values as independent gives sqrt(8.4 / 6) = 1.18: smaller, which is why turns are clustered."""
    values, ids = [1.0, 3.0, 4.0, 6.0, 7.0, 9.0], ["a", "a", "b", "b", "c", "c"]
    r = S.clustered_mean(values, ids)
    assert r["value"] == 5.0 and r["clusters"] == 3 and r["df"] == 2 and r["n"] == 6
    assert_close(r["se"], math.sqrt(3), factor=20, magnitude=2, reason=FEW)
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    bisection = "the t quantile's bisection stops at 1e-13 relative (~450 ulp) of t sqrt(3) ~ 7.5, x10 headroom"
    assert_close(r["lo"], 5 - t2 * math.sqrt(3), factor=1e4, magnitude=8, reason=bisection)
    assert_close(r["hi"], 5 + t2 * math.sqrt(3), factor=1e4, magnitude=8, reason=bisection)
    naive = S.mean_se(values)[1]
    assert_close(naive, math.sqrt(8.4 / 6), factor=20, magnitude=2, reason=FEW)
    assert r["se"] > 1.4 * naive
    # the cluster ids' order and interleaving do not matter: only the totals do
    shuffled = S.clustered_mean([9.0, 1.0, 6.0, 3.0, 4.0, 7.0], ["c", "a", "b", "a", "b", "c"])
    assert_close(shuffled["se"], r["se"], factor=20, magnitude=2, reason=FEW)


def test_clustered_se_of_unequal_clusters_and_of_a_ratio_by_hand():
    # {0, 0, 3} and {6}: value 9 / 4; residual totals (3 - 2.25 * 3) / 4 = -0.9375 and (6 - 2.25) / 4 = 0.9375;
    # SE^2 = 2 / 1 * 2 * 0.9375^2 = 3.515625, SE = 1.875
    r = S.clustered_mean([0.0, 0.0, 3.0, 6.0], [0, 0, 0, 1])
    assert r["value"] == 2.25 and r["df"] == 1
    assert_close(r["se"], 1.875, factor=20, magnitude=2, reason=FEW)
    # a ratio of sums (retention): totals (num, den) (2, 4), (3, 2), (0, 2); R = 5 / 8; residuals (Y - R N) / 8 =
    # -0.0625, 0.21875, -0.15625; SE^2 = 3 / 2 * (0.00390625 + 0.0478515625 + 0.0244140625)
    q = S.clustered_ratio([1.0, 1.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], ["x", "x", "y", "z"])
    assert q["value"] == 0.625
    assert_close(q["se"], math.sqrt(1.5 * 0.076171875), factor=20, reason=FEW)
    one = S.clustered_mean([1.0, 2.0], ["only", "only"])
    assert one["value"] == 1.5 and one["se"] is None and one["lo"] is None   # one cluster: no SE
    assert S.clustered_ratio([1.0], [0.0], [0])["value"] is None
    with pytest.raises(ValueError, match="cluster id per observation"):
        S.clustered_mean([1.0, 2.0], [0])


def test_t_quantile_against_closed_forms():
    """df = 1 (Cauchy): tan(pi (p - 1/2)); df = 2: (2p - 1) / sqrt(2 p (1 - p)); df = inf: the normal's. df = 4 at
    0.975 is the printed table's 2.7764."""
    for p in (0.6, 0.9, 0.975, 0.995):
        assert_close(S.t_quantile(p, 1), math.tan(math.pi * (p - 0.5)), factor=1e4,
                     reason="a bisection stopped at 1e-13 relative (~450 ulp)")
        assert_close(S.t_quantile(p, 2), (2 * p - 1) / math.sqrt(2 * p * (1 - p)), factor=1e4,
                     reason="a bisection stopped at 1e-13 relative (~450 ulp)")
        assert S.t_quantile(1 - p, 3) == -S.t_quantile(p, 3)
    assert round(S.t_quantile(0.975, 4), 4) == 2.7764
    assert S.t_quantile(0.975, math.inf) == statistics.NormalDist().inv_cdf(0.975)
    assert S.t_quantile(0.975, 4) > S.t_quantile(0.975, 30) > S.t_quantile(0.975, math.inf)
    assert S.t_interval(1.0, None, 4) == (None, None)
    with pytest.raises(ValueError):
        S.t_quantile(1.0, 4)


def test_timing_se_is_the_median_and_sqrt_pi_over_2_times_the_means_se():
    # 1..5: median 3, sd sqrt(2.5), SE sqrt(pi / 2) sqrt(2.5) / sqrt(5) = sqrt(pi) / 2
    med, se = S.median_se([5.0, 1.0, 4.0, 2.0, 3.0])
    assert med == 3.0
    assert_close(se, math.sqrt(math.pi) / 2, factor=20, reason=FEW)
    # one load spike moves the median not at all and the SE up (it errs large, not small)
    spiked = S.median_se([1.0, 2.0, 3.0, 4.0, 50.0])
    assert spiked[0] == 3.0 and spiked[1] > 10 * se
    assert S.median_se([0.2]) == (0.2, None)


def _frontier_case():
    """Windows whose NLL closes an exact share of their own gap: target t_i, floor t_i + 1, a mode at t_i + 1 - share.
    The curve: m = 1 at cost 0.1 closes 0.1, m = 2 at 0.25 closes 0.05 (dearer and worse: off the frontier), m = 4 at
    0.2 closes 0.3, m = 8 at 0.4 closes 0.5; the map closes 0.45 at cost 0.3."""
    t = np.random.default_rng(0).normal(2.0, 0.3, 40)
    nll = {"target": list(t), "no_context": list(t + 1.0)}
    shares = {"m1": 0.1, "m2": 0.05, "m4": 0.3, "m8": 0.5, "map": 0.45}
    nll.update({k: list(t + 1.0 - v) for k, v in shares.items()})
    costs = {"m1": 0.1, "m2": 0.25, "m4": 0.2, "m8": 0.4, "map": 0.3}
    curve = [("m1", 1), ("m2", 2), ("m4", 4), ("m8", 8)]
    return nll, costs, curve


def test_frontier_drops_a_dearer_point_that_closes_less():
    nll, costs, curve = _frontier_case()
    pts = sorted((costs[k], label, k) for k, label in curve)
    assert [p[1] for p in M.frontier(nll, pts)] == [1, 4, 8]   # m = 2 costs more than m = 4 and closes less


def test_equal_cost_interpolates_on_the_frontier_and_adds_the_timing_term():
    """At cost 0.3, halfway between m = 4 (0.2, closes 0.3) and m = 8 (0.4, closes 0.5): the curve closes 0.4, the map
    0.45, difference 0.05. Timing term: slope 0.2 / 0.2 = 1, w = 0.5, SEs 0.01 (map), 0.02, 0.02 (curve points):
    1 x sqrt(0.01^2 + 0.25 x 0.02^2 + 0.25 x 0.02^2) = sqrt(3e-4)."""
    nll, costs, curve = _frontier_case()
    e = M.equal_cost(nll, costs, "map", curve, n_boot=200, seed=0,
                     cost_se={"map": 0.01, "m1": 0.0, "m2": 0.05, "m4": 0.02, "m8": 0.02})
    reason = "ratios of float64 means of 40 windows (a few roundings each)"
    assert e["between"] == (4, 8) and not e["below_curve"]
    assert_close(e["truncation"], 0.4, factor=16, magnitude=1, reason=reason)
    assert_close(e["difference"], 0.05, factor=16, magnitude=1, reason=reason)
    # every window closes the same share: the window SE is rounding only, and the total is the timing term
    assert_close(e["difference_se"], 0.0, factor=64, magnitude=1, reason=reason + ": every replicate is the same share")
    slope = ("the slope is a difference of two gap shares (each ~40 roundings in means of 40 windows) over a cost "
             "step of 0.2: ~400 ulp relative, x2 headroom")
    assert_close(e["difference_se_timing"], math.sqrt(3e-4), factor=1024, reason=slope)
    assert_close(e["difference_se_total"], math.hypot(e["difference_se"], math.sqrt(3e-4)), factor=1024, reason=slope)
    # the window resample is the stream the baselines page has used since it was published: default_rng(seed)
    idx = np.random.default_rng(7).integers(0, 40, size=(50, 40))
    noisy = dict(nll, map=list(np.asarray(nll["map"]) + np.random.default_rng(1).normal(0, 0.05, 40)))
    mu = {k: np.asarray(v)[idx].mean(-1) for k, v in noisy.items()}
    g = lambda k: M.gap_closed(mu[k], mu["target"], mu["no_context"])  # noqa: E731
    w = (0.3 - 0.2) / (0.4 - 0.2)   # as the code computes it (not exactly 0.5 in binary)
    by_hand = float(np.nanstd(g("map") - ((1 - w) * g("m4") + w * g("m8")), ddof=1))
    assert M.equal_cost(noisy, costs, "map", curve, n_boot=50, seed=7)["difference_se"] == by_hand
    # below the cheapest point: compared with it, no timing term; dearer than the dearest: no comparison
    below = M.equal_cost(nll, dict(costs, map=0.05), "map", curve, cost_se={k: 0.01 for k in costs})
    assert below["below_curve"] and below["curve_m"] == 1 and below["difference_se_timing"] == 0.0
    assert M.equal_cost(nll, dict(costs, map=0.5), "map", curve) is None
    with pytest.raises(KeyError, match="no SE"):
        M.equal_cost(nll, costs, "map", curve, cost_se={"map": 0.01})


def test_interleaved_timing_protocol():
    """A fake clock: A takes 1, 2, 3, 4, 5 s on its timed calls, B 2 s each; one warm-up round is not timed. Calls run
    A B A B ..., sync brackets every timed call, and A / B per round is 0.5 ... 2.5 (median 1.5, SE sqrt(pi) / 4)."""
    now, log = [0.0], []
    a_times, b_times = iter([100.0, 1.0, 2.0, 3.0, 4.0, 5.0]), iter([100.0] + [2.0] * 5)

    def call(name, times):
        def fn():
            log.append(name)
            now[0] += next(times)
        return fn
    syncs = []
    t = T.interleaved({"A": call("A", a_times), "B": call("B", b_times)}, repeats=5, warmup=1, reference="B",
                      sync=lambda: syncs.append(len(log)), clock=lambda: now[0], machine={"device": "test"},
                      note="synthetic")
    assert log == ["A", "B"] * 6
    assert t["seconds"] == {"A": [1.0, 2.0, 3.0, 4.0, 5.0], "B": [2.0] * 5}
    assert t["median"] == {"A": 3.0, "B": 2.0} and t["median_se"]["B"] == 0.0
    assert_close(t["median_se"]["A"], math.sqrt(math.pi) / 2, factor=20, reason=FEW)
    assert t["relative"]["A"]["ratios"] == [0.5, 1.0, 1.5, 2.0, 2.5] and t["relative"]["A"]["median"] == 1.5
    assert_close(t["relative"]["A"]["se"], math.sqrt(math.pi) / 4, factor=20, reason=FEW)
    assert syncs.count(2) >= 2 and len(syncs) == 1 + 2 * 10   # after warm-up, then before and after each timed call
    assert t["machine"]["device"] == "test" and t["machine"]["cpu_count"] and t["note"] == "synthetic"
    assert set(t["load_avg"]) == {"before", "after"} and t["order"] == ["A", "B"] and t["repeats"] == 5
    with pytest.raises(ValueError, match="at least 5 repeats"):
        T.interleaved({"A": lambda: None}, repeats=4)
    with pytest.raises(KeyError, match="reference"):
        T.interleaved({"A": lambda: None}, reference="B")


def test_coqa_drift_summary_is_clustered_by_conversation():
    """Three conversations of two turns: target per conversation 1, 0, 0.5 (pooled 0.5, SE 0.5 / sqrt(3)); transfer
    0.5, 0, 0.25 (pooled 0.25, SE 0.25 / sqrt(3)); gap 0.5, 0, 0.25 likewise; 2 degrees of freedom."""
    from kvtransfer.eval.coqa import coqa_summary_from_scores, drift_summary

    def conv(*f1):
        return [{"turn": i + 1, "f1": f} for i, f in enumerate(f1)]
    ref = [conv(1.0, 1.0), conv(0.0, 0.0), conv(1.0, 0.0)]
    got = [conv(0.5, 0.5), conv(0.0, 0.0), conv(0.5, 0.0)]
    s = drift_summary(ref, got)
    assert s["target_f1"] == 0.5 and s["transfer_f1"] == 0.25 and s["retention"] == 0.5 and s["se_df"] == 2
    assert_close(s["target_f1_se"], 0.5 / math.sqrt(3), factor=20, reason=FEW)
    assert_close(s["transfer_f1_se"], 0.25 / math.sqrt(3), factor=20, reason=FEW)
    assert_close(s["gap_se"], 0.25 / math.sqrt(3), factor=20, reason=FEW)
    assert_close(s["retention_se"], 0.0, factor=20, magnitude=1, reason=FEW + ": transfer is half the target in each")
    # from a run's scores.json layout {protocol: {mode: [[F1 per turn]]}}: the same rows, twins after transfer
    scores = {"once": {"target": [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]], "transfer": [[0.5, 0.5], [0.0, 0.0], [0.5, 0.0]],
                       "truncate_tokens_32": [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]}}
    rows = coqa_summary_from_scores(scores)
    assert rows["drift_summary"][0]["transfer_f1_se"] == s["transfer_f1_se"]
    twin = rows["coqa_twins"][0]
    assert twin["tokens"] == 32 and twin["transfer_minus_twin"] == -0.25 and twin["se_df"] == 2
    assert twin["transfer_minus_twin_se"] == s["gap_se"]


def test_the_handoff_conversation_se_is_clustered_by_conversation():
    """Two target turns in each of three conversations, handed-over minus target-only F1 per conversation -0.5, 0,
    -0.25: the mean -0.25 with SE 0.25 / sqrt(3), not the SE over 6 turns."""
    c = load_script("experiments/handoff/collect.py")
    rows = [{"conversation": k, "turn": t, "engine": "target", "ttft_s": 1.0, "target_only_ttft_s": 1.0,
             "f1": f, "target_only_f1": 0.5, "same_answer": False, "kvtransfer": {"summary": "mapped"}}
            for k, fs in enumerate(((0.0, 0.0), (0.5, 0.5), (0.5, 0.0))) for t, f in zip((3, 4), fs)]
    text = c.conversation_table({"provenance": {"commit": "abcdef0"}, "rows": rows})
    assert f"paired difference -0.250 ± {0.25 / math.sqrt(3):.3f} SE clustered by conversation" in text
    assert "6 turns of 3 conversations" in text and "Student t with 2 degrees of freedom" in text


def test_qwen25coder_takes_coqa_ses_only_from_turns_that_reproduce_main():
    c = load_script("experiments/qwen25coder/collect.py")
    from kvtransfer.eval.coqa import coqa_summary_from_scores

    turns = {"once": {"target": [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]], "transfer": [[0.5, 0.5], [0.0, 0.0], [0.5, 0.0]]}}
    rows = coqa_summary_from_scores(turns)
    main = {"drift": [{k: v for k, v in r.items() if k != "f1_se"} for r in rows["drift"]],
            "drift_summary": [dict(rows["drift_summary"][0], target_f1_se=0.01, transfer_f1_se=0.01, se_df=None)]}
    out = c.with_coqa_ses(main, turns, "elsewhere")
    assert out["drift_summary"][0]["transfer_f1_se"] == rows["drift_summary"][0]["transfer_f1_se"] != 0.01
    assert out["drift_summary"][0]["se_df"] == 2 and out["coqa_ses_from"] == "elsewhere"
    other = {"once": dict(turns["once"], transfer=[[0.5, 0.5], [0.0, 0.0], [0.0, 0.5]])}   # turn means differ
    with pytest.raises(ValueError, match="not the main configuration's"):
        c.with_coqa_ses(main, other, "elsewhere")
