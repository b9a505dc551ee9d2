"""calib.draw and calib.merge: another disjoint block of the calibration text, and calibrations merged from parts.

The merged moments are checked against raw second moments rebuilt from each part (sum x x^T = cxx + n mean mean^T),
a formula independent of the pairwise update the merge uses; the held-out rows against each part's own."""
from __future__ import annotations

import json

import pytest
import torch

from kvtransfer.core.moments import KINDS, HeldOut
from kvtransfer.runner.calibrate_stage import merge_parts
from kvtransfer.runner.run import Run
from run_configs import compose_config
from tolerance import assert_close, assert_far

SMALL = ("pair=tiny", "device=cpu", "progress=false", "calib.n_sequences=6", "calib.seq_len=48",
         "calib.batch_size=3", "calib.mlp_samples=0", "calib.heldout_fraction=0.34")


def _run(tmp_path, *overrides) -> Run:
    return Run(compose_config(*SMALL, f"cache_dir={tmp_path / 'cache'}", *overrides), tmp_path / "out")


def test_a_draw_is_the_next_disjoint_block_of_the_same_text(tmp_path):
    first, second = _run(tmp_path).token_ids(), _run(tmp_path, "calib.draw=1").token_ids()
    both = _run(tmp_path, "calib.n_sequences=12").token_ids()
    assert second.shape == first.shape == (6, 48)
    assert torch.equal(both[:6], first) and torch.equal(both[6:], second)
    assert not any(torch.equal(a, b) for a in first for b in second)
    with pytest.raises(ValueError, match="calib.draw must be >= 0"):
        _run(tmp_path, "calib.draw=-1").token_ids()


def _raw(m, kind: str):
    """(sum x x^T, sum x y^T, sum x, sum y, n) of moments `m` from its centred statistics."""
    st, n = m.stats[kind], m.n
    mx, my = st["mean_x"], st["mean_y"]
    return st["cxx"] + n * torch.outer(mx, mx), st["cxy"] + n * torch.outer(mx, my), n * mx, n * my, n


def test_merged_moments_are_the_parts_moments_over_their_union(tmp_path):
    merged = _run(tmp_path, "calib.merge=[{draw:1},{draw:2}]")
    train, held, info = merged.moments()
    parts = [_run(tmp_path), _run(tmp_path, "calib.draw=1"), _run(tmp_path, "calib.draw=2")]
    moments = [p.moments() for p in parts]
    assert train.n == sum(t.n for t, _, _ in moments) and train.n > 0
    for kind in KINDS:
        want = [sum(x) for x in zip(*(_raw(t, kind)[:4] for t, _, _ in moments))]
        got = _raw(train, kind)[:4]
        for w, g in zip(want, got):
            assert_close(g, w, factor=64, dtype=torch.float64, reason=(
                "float64 moments of ~10^3 observations: each raw sum is rebuilt as centred sum + n mean mean^T, and "
                "the merge adds three parts' centred sums and Chan terms, a few ulps of the largest raw entry each; "
                "64 eps leaves >10x over the largest error seen (~1 eps)"))
        assert torch.equal(held.x(kind), torch.cat([h.x(kind) for _, h, _ in moments]))
        assert torch.equal(held.y(kind), torch.cat([h.y(kind) for _, h, _ in moments]))
    assert held.seen == sum(h.seen for _, h, _ in moments)
    assert info["sequences"] == sum(i["sequences"] for _, _, i in moments)
    assert [p["key"] for p in info["parts"]] == [p.moments_dir(p.key_space).name for p in parts]
    assert [p["draw"] for p in info["parts"]] == [0, 1, 2]
    # the run's own held-out sequences are the split it checks against (fidelity and the gate read them)
    assert merged.split() == parts[0].split()
    on_disk = json.loads((merged.moments_dir(merged.key_space) / "calibration.json").read_text())
    assert on_disk["observations"] == train.n and on_disk["domain"] == parts[0].calibration_info()["domain"]


def test_a_merged_calibration_fits_a_map_that_differs_from_each_part(tmp_path):
    one = _run(tmp_path, "stage=[calibrate,fit]", "mapper.force=true")
    two = _run(tmp_path, "stage=[calibrate,fit]", "mapper.force=true", "calib.merge=[{draw:1}]")
    assert one.mapper_dir() != two.mapper_dir()
    a, b = one.mapper(), two.mapper()
    assert b.calibration["sequences"] == 2 * a.calibration["sequences"]
    assert a.weight.shape == b.weight.shape
    assert_far(a.weight, b.weight, atol=1e-3, reason="twice the text moves a ridge map fitted with p/n > 1 far more "
               "than any rounding: the two maps differ")


def test_bad_merge_entries_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"sets \['stride'\]"):
        merge_parts(_run(tmp_path, "calib.merge=[{stride:4}]"))
    with pytest.raises(ValueError, match="repeats a calibration"):
        merge_parts(_run(tmp_path, "calib.merge=[{draw:0}]"))
    with pytest.raises(ValueError, match="calib.mlp_samples=0"):
        _run(tmp_path, "calib.merge=[{draw:1}]", "calib.mlp_samples=64").moments()


def test_held_out_rows_join_with_their_offsets():
    def part(seen, rows, fill):
        h = HeldOut.sampled([0, 1], [0], 2, 3, total=seen, capacity=rows, seed=fill)
        x = {k: torch.full((seen, 4), float(fill)) + torch.arange(seen)[:, None] for k in KINDS}
        y = {k: torch.full((seen, 3), -float(fill)) for k in KINDS}
        h.add(x, y)
        return h

    a, b = part(10, 4, 1), part(7, 3, 2)
    j = HeldOut.concat([a, b])
    assert (j.n, j.seen, j.capacity) == (7, 17, 7)
    assert torch.equal(j.select, torch.cat([a.select, b.select + 10]))
    for kind in KINDS:
        assert torch.equal(j.x(kind), torch.cat([a.x(kind), b.x(kind)]))
    with pytest.raises(ValueError, match="different layers"):
        HeldOut.concat([a, HeldOut.sampled([0], [0], 2, 3, total=5, capacity=5)])
