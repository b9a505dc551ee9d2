"""Issue 10 §2, fit by design: held-out R² from a subsample of raw held-out features instead of held-out
moments."""
import pytest
import torch

import kvtransfer as kt
from kvtransfer.calibrate import subsample_positions
from kvtransfer.moments import HeldOut, Moments
from tiny_models import random_ids, tiny_model

HEAD_DIM = 8
STRIDE, BATCH = 2, 4


@pytest.fixture(scope="module")
def pair():
    return (tiny_model("qwen3", layers=3, name="tiny-qwen3-3l"),
            tiny_model("qwen3", layers=2, seed=5, name="tiny-qwen3-2l"))


@pytest.fixture(scope="module")
def calib_all(pair):
    return kt.collect_moments(*pair, random_ids(30, 24, seed=11), stride=STRIDE, batch_size=BATCH,
                              heldout_fraction=0.3)


def _heldout_moments(held: HeldOut) -> Moments:
    """The held-out moments the old calibration accumulated: the same held-out batches (BATCH sequences x
    kept positions) added in order, in fp64."""
    m = Moments(held.source_layers, held.target_layers, held.source_width, held.target_width)
    rows = BATCH * len(subsample_positions(24, STRIDE))
    for i in range(0, held.n, rows):
        m.add({k: held.x(k)[i:i + rows] for k in ("k", "v")}, {k: held.y(k)[i:i + rows] for k in ("k", "v")})
    return m


def test_heldout_r2_from_raw_features_equals_the_moment_based_one(calib_all):
    held = calib_all.heldout
    assert held.n == held.seen == 9 * 12 and held.x("k").dtype == torch.float32
    moments = _heldout_moments(held)
    assert moments.n == held.n
    train = calib_all.train
    # Same observations, both in fp64 from the same float32 features (exact in fp64). The moment route
    # expands SSE = Cyy - 2 W.Cxy + W.Cxx W + n offset^2 and sums products in another order than the direct
    # residuals, so the two agree to fp64 rounding of terms of size ~SST: |dR²| ~ a few eps(fp64)
    # (measured: <= 2 eps here, also for the self-map below where SSE/SST ~ 1e-9 cancels most digits).
    # 64 eps = 1.4e-14 absolute; a lost batch, a wrong column or an fp32 evaluation is >= 1e-7 off.
    tol = 64 * torch.finfo(torch.float64).eps
    r2_raw = kt.r2_matrix(train, heldout=held, head_dim=HEAD_DIM)
    r2_mom = kt.r2_matrix(train, heldout=moments, head_dim=HEAD_DIM)
    for kind in ("k", "v"):
        assert torch.equal(r2_raw["train"][kind], r2_mom["train"][kind])
        torch.testing.assert_close(r2_raw["heldout"][kind], r2_mom["heldout"][kind], rtol=0, atol=tol)
    selected = kt.select_topk(r2_raw["train"], "all")
    fit_raw = kt.fit_ridge(train, selected, heldout=held, head_dim=HEAD_DIM)
    fit_mom = kt.fit_ridge(train, selected, heldout=moments, head_dim=HEAD_DIM)
    for kind in ("k", "v"):
        torch.testing.assert_close(fit_raw.r2["heldout"][kind], fit_mom.r2["heldout"][kind], rtol=0, atol=tol)
        assert fit_raw.r2["heldout"][kind].abs().max() > 1e-3   # not trivially zero


def test_heldout_r2_of_a_near_perfect_self_map_matches_too(pair):
    """Self-map: R² ~ 1 - 1e-9, the case where the moment expansion cancels most digits."""
    q = pair[0]
    c = kt.collect_moments(q, q, random_ids(30, 24, seed=11), stride=STRIDE, batch_size=BATCH, heldout_fraction=0.3)
    moments = _heldout_moments(c.heldout)
    fit = {name: kt.fit_ridge(c.train, [[0], [1], [2]], heldout=h, head_dim=HEAD_DIM)
           for name, h in (("raw", c.heldout), ("moments", moments))}
    tol = 64 * torch.finfo(torch.float64).eps
    for kind in ("k", "v"):
        assert fit["raw"].r2["heldout"][kind].min() > 0.999
        torch.testing.assert_close(fit["raw"].r2["heldout"][kind], fit["moments"].r2["heldout"][kind],
                                   rtol=0, atol=tol)


def test_a_subsample_keeps_exactly_the_selected_rows(pair, calib_all):
    sub = kt.collect_moments(*pair, random_ids(30, 24, seed=11), stride=STRIDE, batch_size=BATCH,
                             heldout_fraction=0.3, heldout_observations=40)
    full = calib_all.heldout
    assert (sub.heldout.n, sub.heldout.seen) == (40, full.n) and sub.heldout.select.unique().numel() == 40
    for kind in ("k", "v"):
        assert torch.equal(sub.heldout.x(kind), full.x(kind)[sub.heldout.select])
        assert torch.equal(sub.heldout.y(kind), full.y(kind)[sub.heldout.select])
    # the train moments do not depend on the held-out sample
    for kind in ("k", "v"):
        for name, t in calib_all.train.stats[kind].items():
            assert torch.equal(sub.train.stats[kind][name], t)
    # the sample spreads over the held-out sequences (uniform, not the first 40 rows)
    assert int(sub.heldout.select.max()) > 60


def test_heldout_features_save_and_load(calib_all, tmp_path):
    held = calib_all.heldout
    held.save(tmp_path / "h.safetensors")
    back = HeldOut.load(tmp_path / "h.safetensors")
    assert (back.n, back.seen, back.info) == (held.n, held.seen, held.info)
    assert torch.equal(back.x("v"), held.x("v")) and torch.equal(back.select, held.select)
    with pytest.raises(ValueError, match="not a kvtransfer held-out"):
        calib_all.train.save(tmp_path / "m.safetensors")
        HeldOut.load(tmp_path / "m.safetensors")
