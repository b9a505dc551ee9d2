"""Retention maths: ratios, floor normalisation, gap closed, bootstrap errors, McNemar."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvtransfer.eval.retention import mcnemar_p, per_item_scores, retention_table, task_summary


def test_hand_example():
    row = task_summary({"target": [1, 1, 1, 0], "transfer": [1, 1, 0, 0], "source": [1, 0, 0, 0],
                        "native_injected": [1, 1, 1, 0]}, chance=0.25, metric="acc_norm")
    assert (row["target"], row["transfer"], row["source"]) == (0.75, 0.5, 0.25)
    assert row["retention"] == pytest.approx(2 / 3)
    assert row["retention_vs_chance"] == pytest.approx(0.5) and row["gap_closed_vs_source"] == pytest.approx(0.5)
    assert row["n"] == 4 and row["metric"] == "acc_norm" and row["mcnemar_p"] == 1.0


def test_table_uses_paper_chance_levels_and_averages():
    items = {"winogrande": {"target": [1] * 8 + [0] * 2, "transfer": [1] * 7 + [0] * 3},
             "gsm8k": {"target": [1] * 5 + [0] * 5, "transfer": [1] * 4 + [0] * 6}}
    table = retention_table(items, n_boot=200)
    assert table["winogrande"]["retention_vs_chance"] == pytest.approx((0.7 - 0.5) / (0.8 - 0.5))
    assert table["gsm8k"]["retention_vs_chance"] == pytest.approx(0.8) == table["gsm8k"]["retention"]
    assert table["average"]["retention"] == pytest.approx((0.7 / 0.8 + 0.8) / 2)
    assert table["gsm8k"]["gap_closed_vs_source"] is None and table["gsm8k"]["gap_closed"] is None  # no source/floor


def test_bootstrap_is_seeded_and_sane():
    rng = np.random.default_rng(1)
    t, x = (rng.random(400) < 0.6).astype(float), (rng.random(400) < 0.5).astype(float)
    a = task_summary({"target": t, "transfer": x}, seed=3)
    b = task_summary({"target": t, "transfer": x}, seed=3)
    assert a == b
    assert a["stderr_target"] == pytest.approx(math.sqrt(0.6 * 0.4 / 400), rel=0.15)
    assert a["stderr_retention"] > 0


def test_mcnemar():
    assert mcnemar_p([1] * 5 + [0] * 5, [0] * 5 + [0] * 5) == pytest.approx(2 / 32)  # exact binomial
    a = [1] * 30 + [0] * 10 + [1] * 50
    b = [0] * 30 + [1] * 10 + [1] * 50
    assert mcnemar_p(a, b) == pytest.approx(0.002663, rel=1e-3)  # chi2 (|30-10|-1)^2/40 = 9.025, 1 df
    assert task_summary({"target": [0.5, 1.0], "transfer": [0.2, 1.0]})["mcnemar_p"] is None  # F1 scores


def test_bad_input():
    with pytest.raises(KeyError, match="transfer"):
        task_summary({"target": [1, 0]})
    with pytest.raises(ValueError, match="no items"):
        task_summary({"target": [], "transfer": []})
    with pytest.raises(ValueError, match="different item counts"):
        task_summary({"target": [1, 0], "transfer": [1]})


def test_per_item_scores_from_lm_eval_samples():
    """Items ordered by doc_id; filters selected by 'metric,filter'; groups concatenate subtasks."""
    res = {"samples": {"gsm8k": [{"doc_id": 1, "filter": "strict-match", "exact_match": 0.0},
                                 {"doc_id": 0, "filter": "strict-match", "exact_match": 1.0},
                                 {"doc_id": 0, "filter": "flexible-extract", "exact_match": 0.0}],
                       "mmlu_a": [{"doc_id": 0, "acc": 1.0}], "mmlu_b": [{"doc_id": 0, "acc": 0.0}]},
           "group_subtasks": {"mmlu": ["mmlu_b", "mmlu_a"]}}
    assert per_item_scores(res, "gsm8k", "exact_match,strict-match") == [1.0, 0.0]
    assert per_item_scores(res, "mmlu", "acc") == [1.0, 0.0]
    with pytest.raises(KeyError, match="log_samples"):
        per_item_scores(res, "arc_challenge", "acc_norm")


def test_ppl_gap_closed_and_its_bootstrap():
    """Target NLL 1, floor 2, transfer at exactly half the log-perplexity gap: 0.5, and no spread when every
    window agrees. With window noise the point estimate is still the pooled one and the SE is positive,
    seeded, and shrinks ~1/sqrt(windows)."""
    from kvtransfer.eval.retention import ppl_gap_closed

    half = 1.5  # nats/token: half way from the target's NLL to the floor's
    flat = ppl_gap_closed({"target": [1.0] * 8, "no_context": [2.0] * 8, "transfer": [half] * 8})
    assert flat["gap_closed"] == pytest.approx(0.5, abs=1e-12) and flat["gap_closed_se"] == pytest.approx(0, abs=1e-12)
    rng = np.random.default_rng(3)

    def noisy(w):
        base = rng.normal(0, 0.3, w)  # windows differ in difficulty, shared by the modes (paired)
        return {"target": 1 + base, "no_context": 2 + base, "transfer": half + base + rng.normal(0, 0.1, w)}

    small, big = noisy(16), noisy(256)
    a, b = ppl_gap_closed(small, seed=1), ppl_gap_closed(small, seed=1)
    assert a == b and 0 < a["gap_closed_se"] < 0.5
    want = (np.mean(small["no_context"]) - np.mean(small["transfer"])) / (
        np.mean(small["no_context"]) - np.mean(small["target"]))
    assert a["gap_closed"] == pytest.approx(want, rel=1e-12)
    assert ppl_gap_closed(big)["gap_closed_se"] < a["gap_closed_se"] / 2
    with pytest.raises(ValueError, match="windows"):
        ppl_gap_closed({"target": [1.0], "no_context": [2.0], "transfer": [1.5]})
