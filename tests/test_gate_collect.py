"""experiments/gate/collect.py's gate control (`allocation`): the gate's choice against a random and the hindsight-best
choice of the same action counts, checked against brute force."""
from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collect():
    spec = importlib.util.spec_from_file_location("gate_collect", ROOT / "experiments/gate/collect.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    assert got["gated"] == pytest.approx(sum(values[a][i] for i, a in enumerate(actions)) / n, abs=1e-12)
    assert got["random"] == pytest.approx(rand, abs=1e-12)
    assert got["oracle"] == pytest.approx(best, abs=1e-12)
    assert got["minus_random"]["difference"] == pytest.approx(got["gated"] - got["random"], abs=1e-12)
    assert got["counts"] == {a: actions.count(a) for a in ("map", "recompute", "full")}


def test_a_gate_that_picks_the_right_requests_beats_random():
    """Accuracy: map hurts items 0-2 (transfer wrong, target right); a gate sending exactly those to full reaches the
    oracle, above a random choice of three."""
    values = {"map": [0, 0, 0, 1, 1, 1], "full": [1, 1, 1, 1, 1, 1], "recompute": [0] * 6}
    got = _collect().allocation(values, ["full"] * 3 + ["map"] * 3, lower_is_better=False)
    assert got["gated"] == 1.0 == got["oracle"] and got["random"] == pytest.approx(0.75)
    worst = _collect().allocation(values, ["map"] * 3 + ["full"] * 3, lower_is_better=False)
    assert worst["gated"] == 0.5 and worst["oracle"] == 1.0
