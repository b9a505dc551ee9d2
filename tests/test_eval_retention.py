"""Retention maths: ratios, floor normalisation, gap closed, bootstrap errors, McNemar."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvtransfer.eval.retention import mcnemar_p, per_item_scores, retention_table, task_summary
from tolerance import assert_close, assert_within

FEW = "float64 hand arithmetic, a handful of roundings: x10 their count, since a few ops sit near their worst case"


def test_hand_example():
    row = task_summary({"target": [1, 1, 1, 0], "transfer": [1, 1, 0, 0], "source": [1, 0, 0, 0],
                        "native_injected": [1, 1, 1, 0]}, chance=0.25, metric="acc_norm")
    assert (row["target"], row["transfer"], row["source"]) == (0.75, 0.5, 0.25)
    assert_close(row["retention"], 2 / 3, factor=10 * 4, reason=FEW)
    assert_close(row["retention_vs_chance"], 0.5, factor=10 * 4, reason=FEW)
    assert_close(row["gap_closed_vs_source"], 0.5, factor=10 * 4, reason=FEW)
    assert row["n"] == 4 and row["metric"] == "acc_norm" and row["mcnemar_p"] == 1.0


def test_table_uses_paper_chance_levels_and_averages():
    items = {"winogrande": {"target": [1] * 8 + [0] * 2, "transfer": [1] * 7 + [0] * 3},
             "gsm8k": {"target": [1] * 5 + [0] * 5, "transfer": [1] * 4 + [0] * 6}}
    table = retention_table(items, n_boot=200)
    assert_close(table["winogrande"]["retention_vs_chance"], (0.7 - 0.5) / (0.8 - 0.5), factor=10 * 8, reason=FEW)
    assert table["gsm8k"]["retention_vs_chance"] == table["gsm8k"]["retention"]  # chance 0: the same quotient
    assert_close(table["gsm8k"]["retention"], 0.8, factor=10 * 8, reason=FEW)
    assert_close(table["average"]["retention"], (0.7 / 0.8 + 0.8) / 2, factor=10 * 12, reason=FEW)
    assert table["gsm8k"]["gap_closed_vs_source"] is None and table["gsm8k"]["gap_closed"] is None  # no source/floor


def test_bootstrap_is_seeded_and_sane():
    rng = np.random.default_rng(1)
    t, x = (rng.random(400) < 0.6).astype(float), (rng.random(400) < 0.5).astype(float)
    a = task_summary({"target": t, "transfer": x}, seed=3)
    b = task_summary({"target": t, "transfer": x}, seed=3)
    assert a == b
    se = math.sqrt(0.6 * 0.4 / 400)
    assert_within(a["stderr_target"], se, atol=0.15 * se, reason=(
        "statistical: a 1000-draw bootstrap SE of a 400-item mean vs the binomial formula at p = 0.6 (the sample's "
        "own p and the bootstrap's ~2 % noise move it a few %)"), headroom_exempt=(
        "a statistical bound on seeded draws (the same draws on every machine), not a rounding"))
    assert a["stderr_retention"] > 0


def test_mcnemar():
    assert mcnemar_p([1] * 5 + [0] * 5, [0] * 5 + [0] * 5) == 2 / 32  # exact binomial: integers / 2^5, exact
    a = [1] * 30 + [0] * 10 + [1] * 50
    b = [0] * 30 + [1] * 10 + [1] * 50
    # chi2 (|30-10|-1)^2/40 = 9.025, 1 df; the tail to 21 digits from mpmath (erfc(sqrt(9.025 / 2)), 30 digits)
    assert_close(mcnemar_p(a, b), 0.002663119259138554233, factor=10 * 4, reason=(
        "float64 division, sqrt and erfc (libm: ~1 ulp) against a 30-digit reference: ~4 eps, x10 few ops"))
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
    assert_close(flat["gap_closed"], 0.5, factor=10 * 16, magnitude=2.0, reason=(
        "differences and a quotient of 8-window mean NLLs (scale 2 nats), float64: ~16 roundings, x10 few ops"))
    assert_close(flat["gap_closed_se"], 0.0, factor=10 * 16, magnitude=2.0, reason=(
        "every bootstrap resample of identical windows gives the same gap up to those roundings"))
    rng = np.random.default_rng(3)

    def noisy(w):
        base = rng.normal(0, 0.3, w)  # windows differ in difficulty, shared by the modes (paired)
        return {"target": 1 + base, "no_context": 2 + base, "transfer": half + base + rng.normal(0, 0.1, w)}

    small, big = noisy(16), noisy(256)
    a, b = ppl_gap_closed(small, seed=1), ppl_gap_closed(small, seed=1)
    assert a == b and 0 < a["gap_closed_se"] < 0.5
    want = (np.mean(small["no_context"]) - np.mean(small["transfer"])) / (
        np.mean(small["no_context"]) - np.mean(small["target"]))
    assert_close(a["gap_closed"], want, factor=10 * 40, magnitude=2.0, reason=(
        "the same float64 means summed in another order (numpy pairwise vs the code's): ~16 windows x 2 roundings "
        "per mean, x10 few ops"))
    assert ppl_gap_closed(big)["gap_closed_se"] < a["gap_closed_se"] / 2
    with pytest.raises(ValueError, match="windows"):
        ppl_gap_closed({"target": [1.0], "no_context": [2.0], "transfer": [1.5]})


def test_per_item_scores_reads_nested_groups():
    """lm-eval's hub `mmlu` is a group of groups (mmlu -> mmlu_humanities -> subjects): the items are the
    subjects' samples, in (subject, doc_id) order (the dry run of qwen3_14b_32b on the hub task found this)."""
    results = {"group_subtasks": {"mmlu": ["mmlu_stem", "mmlu_humanities"], "mmlu_humanities": ["mmlu_law"],
                                  "mmlu_stem": ["mmlu_physics", "mmlu_algebra"]},
               "samples": {"mmlu_law": [{"doc_id": 1, "acc": 0}, {"doc_id": 0, "acc": 1}],
                           "mmlu_physics": [{"doc_id": 0, "acc": 1}], "mmlu_algebra": [{"doc_id": 0, "acc": 0}]}}
    assert per_item_scores(results, "mmlu", "acc") == [0.0, 1.0, 0.0, 1.0]  # algebra, law (doc 0, 1), physics
    with pytest.raises(KeyError, match="mmlu_algebra"):  # the first subject without samples
        per_item_scores({"group_subtasks": results["group_subtasks"], "samples": {}}, "mmlu", "acc")
