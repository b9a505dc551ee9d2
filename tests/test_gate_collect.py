"""experiments/gate/collect.py's gate control (`allocation`): the gate's choice against a random and the hindsight-best
choice of the same action counts, checked against brute force."""
from __future__ import annotations

import itertools
import random

import pytest
from scripts import load_script
from tolerance import assert_within


def _collect():
    return load_script("experiments/gate/collect.py")


def _brute(values, actions, lower):
    """Mean over every distinct assignment of the gate's action multiset (random), and its best (oracle)."""
    n = len(actions)
    outs = [sum(values[a][i] for i, a in enumerate(p)) / n for p in set(itertools.permutations(actions))]
    return sum(outs) / len(outs), (min(outs) if lower else max(outs))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lower", [True, False])
def test_allocation_matches_brute_force(seed, lower):
    rng = random.Random(seed)
    n = 7
    values = {a: [rng.random() for _ in range(n)] for a in ("map", "recompute", "full")}
    actions = [rng.choice(["map", "recompute", "full"]) for _ in range(n)]
    got = _collect().allocation(values, actions, lower_is_better=lower)
    rand, best = _brute(values, actions, lower)
    why = "float64 means of 7 values in [0, 1] summed in other orders: error <= ~10 eps64 ~ 2e-15"
    assert_within(got["gated"], sum(values[a][i] for i, a in enumerate(actions)) / n, atol=1e-12, reason=why)
    assert_within(got["random"], rand, atol=1e-12, reason=why)
    assert_within(got["oracle"], best, atol=1e-12, reason=why)
    assert_within(got["minus_random"]["difference"], got["gated"] - got["random"], atol=1e-12, reason=why)
    assert got["counts"] == {a: actions.count(a) for a in ("map", "recompute", "full")}


def test_a_gate_that_picks_the_right_requests_beats_random():
    """Accuracy: map hurts items 0-2 (transfer wrong, target right); a gate sending exactly those to full reaches the
    oracle, above a random choice of three."""
    values = {"map": [0, 0, 0, 1, 1, 1], "full": [1, 1, 1, 1, 1, 1], "recompute": [0] * 6}
    got = _collect().allocation(values, ["full"] * 3 + ["map"] * 3, lower_is_better=False)
    assert got["gated"] == 1 == got["oracle"]
    assert_within(got["random"], 3 / 4, atol=1e-12, reason="a float64 mean of 6 exact quarters: error <= ~6 eps64")
    worst = _collect().allocation(values, ["map"] * 3 + ["full"] * 3, lower_is_better=False)
    assert worst["gated"] == 0.5 and worst["oracle"] == 1.0


def test_a_run_that_read_a_dirty_artifact_says_so():
    summary = {"producers": {"dirty": ["mappers/m"], "artifacts": {"mappers/m": {
        "commit": "819a392d73", "dirty": True, "dirty_paths": ["kvtransfer/serve/gating.py"]}}}}
    line = _collect().dirty_producers(summary)[0]
    assert "mappers/m" in line and "819a392" in line and "kvtransfer/serve/gating.py" in line
    assert _collect().dirty_producers({"producers": {"dirty": []}}) == []
