"""The per-request gate (kvtransfer.core.gate, issue 30): the tail score, decide (never raises), thresholds fitted
for stated rates, action counts, ROC AUC, the artifact."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvtransfer.core.cache import prefill
from kvtransfer.core.gate import (action_counts, bootstrap_auc, decide, fit_thresholds, layer_errors, load_gate, roc_auc,
                             save_gate, tail_score)
from tiny_models import random_ids, tiny_model
from tolerance import FORWARD, assert_close, assert_within, forward_factor

T = {"recompute": 0.1, "full": 0.5, "fraction": 0.15}


def test_decide_maps_recomputes_or_falls_back_and_never_raises():
    assert decide(0.05, T).action == "map" and decide(0.05, T).fraction == 0.0
    d = decide(0.3, T)
    assert (d.action, d.fraction, d.score) == ("recompute", 0.15, 0.3)
    assert decide(0.9, T).action == "full" and decide(0.9, T).fraction == 1.0
    assert decide(0.1, T).action == "map" and decide(0.5, T).action == "recompute"  # thresholds are inclusive
    for score in (float("nan"), float("inf"), None, "x", [1]):
        d = decide(score, T)
        assert d.action == "full" and d.fraction == 1.0 and d.score is None and d.reason
    for bad in (None, {}, {"recompute": 0.1, "full": 0.5}, {"recompute": 0.6, "full": 0.5, "fraction": 0.1},
                {"recompute": 0.1, "full": 0.5, "fraction": 0.0}, {"recompute": "a", "full": 0.5, "fraction": 0.1},
                {"recompute": float("nan"), "full": 0.5, "fraction": 0.1}):
        d = decide(0.05, bad)
        assert d.action == "full" and d.reason.startswith("bad thresholds")


def test_thresholds_are_quantiles_for_the_stated_rates():
    scores = [i / 100 for i in range(101)] + [float("nan")]
    t = fit_thresholds(scores, recompute_rate=0.3, full_rate=0.1, fraction=0.15)
    assert t["n"] == 101 and t["fraction"] == 0.15 and t["rates"] == {"recompute": 0.3, "full": 0.1}
    reason = ("a float64 linear-interpolated quantile: the index q (n - 1) and the interpolation weight each rounded, "
              "then one multiply-add of values <= 1: ~4 roundings, x25 headroom")
    assert_close(t["full"], 0.9, factor=100, reason=reason)
    assert_close(t["recompute"], 0.6, factor=100, reason=reason)
    counts = action_counts([decide(s, t) for s in scores[:-1]])
    assert counts["full"] == 10 and counts["recompute"] == 30 and counts["map"] == 61 and counts["fallbacks"] == 0
    counts = action_counts([decide(s, t) for s in scores])
    assert counts["requests"] == 102 and counts["fallbacks"] == 1 and counts["full"] == 11
    assert_close(counts["recompute_rate"], (30 * 0.15 + 11) / 102, factor=200, reason="a float64 mean of 102 terms")
    with pytest.raises(ValueError, match="together <= 1"):
        fit_thresholds(scores, recompute_rate=0.8, full_rate=0.3, fraction=0.1)
    with pytest.raises(ValueError, match="no finite gate score"):
        fit_thresholds([float("nan")], recompute_rate=0.3, full_rate=0.1, fraction=0.1)


def test_tail_score_is_zero_for_the_native_cache_and_grows_with_the_error():
    model = tiny_model("qwen3", layers=3, hidden=48, heads=6, seed=1)
    ids = random_ids(2, 20, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    native = prefill(model, ids, mask)
    score, per_layer = tail_score(model, native, ids, mask, tail=4)
    assert per_layer.shape == (2, 3)
    assert_within(score, torch.zeros(2, dtype=torch.float64), atol=(3e-7 * forward_factor(model, 20)) ** 2 * 100,
                  reason="the native cache's tail recomputed on itself: a squared relative error of float32 forward "
                         "rounding (FORWARD: eps x forward_factor), squared, with 100x for the sum over entries")
    g = torch.Generator().manual_seed(0)
    small = [(k + 0.01 * torch.randn(k.shape, generator=g), v) for k, v in native]
    large = [(k + 1.0 * torch.randn(k.shape, generator=g), v) for k, v in native]
    s_small, s_large = tail_score(model, small, ids, mask, 4)[0], tail_score(model, large, ids, mask, 4)[0]
    assert (s_small < s_large).all() and (s_small > score).all()
    short = torch.ones_like(ids)
    short[1, :17] = 0  # 3 real tokens: fewer than tail + 1
    s, _ = tail_score(model, prefill(model, ids, short), ids, short, 4)
    assert math.isfinite(s[0]) and math.isnan(s[1]) and decide(s[1], T).action == "full"
    with pytest.raises(ValueError, match="tail >= 1"):
        tail_score(model, native, ids, mask, 0)


def test_layer_errors_definition():
    k = torch.ones(1, 1, 2, 2)
    v = torch.full((1, 1, 2, 2), 2.0)
    e = layer_errors([(k * 1.5, v)], [(k, v)])  # K off by 0.5 everywhere: 0.25 relative; V exact
    assert e.shape == (1, 1) and e.item() == 0.125


def test_roc_auc_and_bootstrap():
    assert roc_auc([1, 2, 3, 4], [False, False, True, True]) == 1.0
    assert roc_auc([4, 3, 2, 1], [False, False, True, True]) == 0.0
    assert roc_auc([1, 1, 1, 1], [False, True, False, True]) == 0.5
    assert math.isnan(roc_auc([1, 2], [True, True]))
    b = bootstrap_auc([1, 2, 3, 4, 5, 6], [False, True, False, True, True, False], n_boot=200, seed=1)
    # an AUC lies in [0, 1], so any spread of its replicates is at most half that range
    assert b["n"] == 6 and b["positives"] == 3 and 0 < b["se"] and 2 * b["se"] < 1
    assert b["auc"] == roc_auc([1, 2, 3, 4, 5, 6], [False, True, False, True, True, False])


def test_gate_artifact_round_trip_and_refuses_other_files(tmp_path):
    path = tmp_path / "gate.json"
    save_gate(path, dict(T, rates={"recompute": 0.3, "full": 0.1}, n=12), {"tail": 8, "calibration": "heldout"})
    data = load_gate(path)
    assert data["thresholds"]["full"] == 0.5 and data["thresholds"]["n"] == 12 and data["tail"] == 8
    (tmp_path / "other.json").write_text(json.dumps({"thresholds": T}))
    with pytest.raises(ValueError, match="not a kvtransfer gate"):
        load_gate(tmp_path / "other.json")
