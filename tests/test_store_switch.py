"""experiments/handoff/store_switch.py's bookkeeping: the rounds' ABBA order and the comparison against the goal,
on numbers whose answer is known (the deployment itself runs in the serving environment: the script's smoke
command in its docstring)."""
from __future__ import annotations

import pytest

from scripts import load_script
from tolerance import assert_close

switch = load_script("experiments/handoff/store_switch.py")


def test_rounds_alternate_abba():
    assert switch.order(4) == ["dir", "redis", "redis", "dir"]
    assert switch.order(6) == ["dir", "redis", "redis", "dir", "dir", "redis"]


@pytest.mark.parametrize("redis, met", [([1.0, 1.2, 1.1], True), ([1.6, 1.8, 1.7], False)])
def test_the_comparison_says_whether_redis_is_within_its_se_and_ten_percent(redis, met):
    out = switch.compare({"dir": [1.0, 1.2, 1.1], "redis": redis})
    assert out["dir"]["n"] == 3 and out["dir"]["median_s"] == 1.1
    # each store's SE of the mean: 0.1 / sqrt(3); the difference's SE: sqrt(2) of it
    assert_close(out["redis_minus_dir_se_s"], (2 * 0.01 / 3) ** 0.5, factor=16,
                 reason="float64 means, standard deviations and a square root of a few values")
    assert_close(out["redis_minus_dir_s"], sum(redis) / 3 - 1.1, factor=16, magnitude=2.0,
                 reason="a difference of two float64 means of 3 values")
    assert out["goal_met"] is met
