"""The metric vocabulary (kvtransfer.eval.metrics), schema upgrade, rounding, and provenance."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvtransfer.eval import metrics as M
from tolerance import assert_within


def test_definitions_by_hand():
    # accuracy: floor 0.30, target 0.50, transfer 0.35 -> a quarter of the floor -> target gap
    assert float(M.gap_closed(0.35, 0.50, 0.30)) == (0.35 - 0.30) / (0.50 - 0.30)
    assert float(M.retention(0.35, 0.50)) == 0.35 / 0.50
    assert float(M.gap_closed_vs_source(0.35, 0.50, 0.25)) == (0.35 - 0.25) / (0.50 - 0.25)
    assert float(M.retention_vs_chance(0.35, 0.50, 0.25)) == (0.35 - 0.25) / (0.50 - 0.25)
    assert math.isnan(float(M.gap_closed(0.3, 0.3, 0.3)))  # no gap: undefined, never a silent 0
    # perplexity: the gap is on log-perplexity (nats/token); e^1 -> e^3 with the transfer at e^2 is half
    assert float(M.log_ppl_gap_closed(math.e ** 2, math.e, math.e ** 3)) == 0.5
    # on raw perplexity the same point would read (e^3 - e^2) / (e^3 - e) = 0.73: a different number
    assert (math.e ** 3 - math.e ** 2) / (math.e ** 3 - math.e) > 0.7


def test_paired_difference_against_a_hand_computation():
    a, b = [1, 0, 1, 1], [0, 0, 1, 0]
    d = M.paired_difference(a, b)
    # differences 1, 0, 0, 1: mean 0.5; sample sd sqrt(4 * 0.25 / 3) = sqrt(1/3); SE sqrt(1/3) / 2
    assert d["difference"] == 0.5 and d["n"] == 4
    assert d["se"] == float(np.sqrt(1 / 3) / 2)
    assert d["z"] == 0.5 / d["se"]
    with pytest.raises(ValueError, match="length"):
        M.paired_difference([1, 0], [1, 0, 1])


def test_paired_se_is_smaller_than_the_two_own_ses_when_items_are_shared():
    rng = np.random.default_rng(0)
    difficulty = rng.random(400)
    a = (rng.random(400) < difficulty).astype(float)
    b = np.where(rng.random(400) < 0.9, a, 1 - a)  # the same items, mostly the same answers
    own = math.hypot(a.std(ddof=1), b.std(ddof=1)) / math.sqrt(400)
    assert M.paired_difference(a, b)["se"] < own / 2


def test_paired_bootstrap_and_gap_difference():
    # target - floor per item is 0 on two items of six: (2/6)^6 = 0.14 % of resamples tie (below MAX_DROPPED)
    target, floor = [1, 1, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0]
    a = {"target": target, "no_context": floor, "transfer": [1, 1, 0, 0, 1, 0]}
    point, se = M.paired_bootstrap(a, lambda m: M.gap_closed(m["transfer"], m["target"], m["no_context"]), seed=1)
    assert point == (3 / 6 - 1 / 6) / (5 / 6 - 1 / 6) and se > 0
    same = M.gap_closed_difference(a, a)
    assert same["difference"] == 0.0 and same["se"] == 0.0
    with pytest.raises(ValueError, match="same items"):
        M.gap_closed_difference(a, dict(a, target=[0] * 6))


def test_the_paired_bootstrap_se_of_a_linear_statistic_is_the_analytic_one():
    """Issue 32: for a mean difference the bootstrap SE has a closed form, the plug-in SE of the paired
    differences, std(a - b, ddof 0) / sqrt(n); the bootstrap's own Monte Carlo error on an SE is ~ SE / sqrt(2 B).
    A resample not shared between modes would give the unpaired SE (here > 3x larger)."""
    rng = np.random.default_rng(0)
    n, n_boot = 200, 20000
    a = rng.normal(size=n)
    b = a + 0.3 * rng.normal(size=n)  # the same items: strongly correlated
    point, se = M.paired_bootstrap({"a": a, "b": b}, lambda m: m["a"] - m["b"], n_boot=n_boot, seed=3)
    analytic = float((a - b).std(ddof=0) / math.sqrt(n))
    unpaired = math.hypot(a.std(ddof=0), b.std(ddof=0)) / math.sqrt(n)
    assert unpaired > 3 * analytic
    assert_within(se, analytic, atol=5 * analytic / math.sqrt(2 * n_boot),
                  reason="5 Monte Carlo sigma of a bootstrap SE (SE / sqrt(2 B), B = 20000)",
                  headroom_exempt="a seeded Monte Carlo draw: the error is this seed's, the same on every machine")
    # and the SE of one mode's mean: std(ddof 0) / sqrt(n)
    _, se_a = M.paired_bootstrap({"a": a}, lambda m: m["a"], n_boot=n_boot, seed=4)
    assert_within(se_a, float(a.std(ddof=0) / math.sqrt(n)), atol=5 * float(a.std()) / math.sqrt(n) / math.sqrt(2 * n_boot),
                  reason="5 Monte Carlo sigma of a bootstrap SE (SE / sqrt(2 B))",
                  headroom_exempt="a seeded Monte Carlo draw: the error is this seed's, the same on every machine")


def test_the_bootstrap_counts_dropped_replicates_and_withholds_the_se_past_the_threshold():
    """Issue 32: a ratio's replicates are non-finite where its denominator resamples to 0. They used to be
    dropped silently (an n = 10 case: point None, an SE from 699 of 1,000 replicates)."""
    # target and floor tie on the means (point undefined) and on many resamples
    target, floor = [1, 0, 0, 0, 0, 0, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0, 0, 1, 0]
    tie = {"target": target, "no_context": floor, "transfer": [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]}
    gap = lambda m: M.gap_closed(m["transfer"], m["target"], m["no_context"])  # noqa: E731
    point, se, dropped = M.paired_bootstrap(tie, gap, seed=0, return_dropped=True)
    assert point is None and se is None and dropped > 10
    # a defined point whose denominator still resamples to 0 often: counted, SE withheld
    close = dict(tie, target=[1, 0, 0, 0, 0, 0, 0, 0, 1, 1])
    point, se, dropped = M.paired_bootstrap(close, gap, seed=0, return_dropped=True)
    assert point is not None and dropped > M.MAX_DROPPED * 1000 and se is None
    # a clear denominator: nothing dropped, an SE
    clear = dict(tie, target=[1] * 10, no_context=[0] * 10)
    point, se, dropped = M.paired_bootstrap(clear, gap, seed=0, return_dropped=True)
    assert dropped == 0 and se is not None and se > 0
    assert M.bootstrap_se([1.0, 2.0, float("nan")]) == (None, 1)  # 1 of 3 > 1 %
    assert M.ppl_gap_closed({"target": [1.0, 2.0], "transfer": [1.5, 2.5], "no_context": [1.0, 2.0]},
                            n_boot=50)["gap_closed_se"] is None
    from kvtransfer.eval.retention import task_summary

    row = task_summary({m: close[m] for m in ("target", "transfer", "no_context")})
    assert row["bootstrap_dropped"]["gap_closed"] > 10 and row["stderr_gap_closed"] is None


def test_upgrade_of_a_schema_1_summary():
    old = {"tasks": {"hellaswag": {"target": 0.5, "transfer": 0.35, "source": 0.25, "no_context": 0.3,
                                   "gap_closed": 0.4, "stderr_gap_closed": 0.2, "context_gap_closed": 0.25,
                                   "stderr_context_gap_closed": 0.1, "floor_normalized": 0.4}},
           "ppl": [{"prefix": 0, "target": 50.0, "transfer": 50.0, "no_context": 50.0},
                   {"prefix": 256, "target": math.e, "transfer": math.e ** 2, "no_context": math.e ** 3,
                    "transfer_gap_closed": 0.73, "transfer_gap_closed_se": 0.03}]}
    new = M.upgrade_summary(old)
    row = new["tasks"]["hellaswag"]
    assert new["schema_version"] == M.SCHEMA_VERSION and new["upgraded_from_schema"] == 1
    assert (row["gap_closed"], row["stderr_gap_closed"]) == (0.25, 0.1)
    assert (row["gap_closed_vs_source"], row["stderr_gap_closed_vs_source"]) == (0.4, 0.2)
    assert row["retention_vs_chance"] == 0.4 and "context_gap_closed" not in row and "floor_normalized" not in row
    p = new["ppl"][1]
    assert p["transfer_gap_closed"] == 0.5 and p["transfer_gap_closed_se"] is None  # no windows: SE needs a rerun
    assert p["transfer_gap_closed_raw_ppl"] == 0.73
    assert "transfer_gap_closed" not in new["ppl"][0]
    assert M.upgrade_summary(new) is new
    with pytest.raises(ValueError, match="newer"):
        M.upgrade_summary({"schema_version": M.SCHEMA_VERSION + 1})


def test_rounding_to_what_the_se_supports():
    assert M.format_with_se(0.39666666666666667, 0.0283) == "0.397 ± 0.028"
    assert M.format_with_se(0.326, 0.139, scale=100, unit=" %") == "33 ± 14 %"
    assert M.format_with_se(0.5031, 0.0312, scale=100, unit=" %") == "50.3 ± 3.1 %"
    assert M.format_with_se(0.25, None) == "0.250" and M.format_with_se(None, 0.1) == "–"


def test_provenance_ignores_results_and_runs(tmp_path, git_repo):
    from kvtransfer.config import provenance

    git = git_repo
    for rel in ("code.py", "results/x/summary.json", "experiments/e/runs/r/summary.json", "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("0")
    git("add", "-A")
    git("commit", "-qm", "init")
    (tmp_path / "results/x/summary.json").write_text("1")
    (tmp_path / "experiments/e/runs/r/summary.json").write_text("1")
    (tmp_path / "README.md").write_text("0")
    assert provenance.git_state(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("1")
    state = provenance.git_state(tmp_path)
    assert state["dirty"] is True and state["dirty_paths"] == ["code.py"]


def test_provenance_header_names_dirty_and_mixed_commits():
    from kvtransfer.config.provenance import provenance_header

    runs = {"a": {"environment": {"commit": "a" * 40, "dirty": False}},
            "b": {"environment": {"commit": "b" * 40, "dirty": True}}, "c": {"environment": {}}}
    with pytest.raises(ValueError, match="not_rerun"):  # a dirty or commit-less run left unexplained
        provenance_header(runs, "collect.py", not_rerun={"c": "too slow"})
    text = provenance_header(runs, "collect.py", reproduced={"b": "`b2` at clean `bbbbbbb`"},
                             not_rerun={"c": "too slow"})
    assert "2 different commits" in text and "dirty" in text and "`c`" in text
    assert "`b`: reproduced by `b2` at clean `bbbbbbb`" in text and "`c`: not rerun: too slow" in text
    clean = provenance_header({"a": runs["a"]}, "collect.py")
    assert "one clean commit" in clean
