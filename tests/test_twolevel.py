"""Two-level moments (calib.accumulate=twolevel, the default): float32 sums on the target's device for at most
calib.flush_batches batches, folded into float64 masters on the host. The schedule is the config's, so the
checkpoint cadence, a resume mid-flush and the chunking of the fold change no bit."""
import pytest
import torch

import kvtransfer as kt
from kvtransfer.core.calibrate import load_calibration
from kvtransfer.core.moments import Moments
from tiny_models import random_ids, tiny_model
from tolerance import assert_close

HEAD_DIM = 8
KW = dict(stride=2, batch_size=4, heldout_fraction=0.2)


@pytest.fixture(scope="module")
def pair():
    return (tiny_model("qwen3", layers=3, name="tiny-qwen3-3l"),
            tiny_model("qwen3", layers=2, seed=5, name="tiny-qwen3-2l"))


@pytest.fixture(scope="module")
def ids():
    return random_ids(40, 32, seed=1)


@pytest.fixture(scope="module")
def host_and_twolevel(pair, ids):
    return (kt.collect_moments(*pair, ids, **KW),
            kt.collect_moments(*pair, ids, accumulate="twolevel", flush_batches=3, **KW))


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_twolevel_masters_are_float64_and_match_the_float64_host_path(host_and_twolevel):
    """Masters: float64 on the host (means, sums, cyy). Each flush holds <= 3 batches of float32 centred sums
    (relative rounding ~ eps32 x the few GEMM partial sums, measured <= 2 eps32); 16 eps32 bound per statistic
    relative to its largest entry. A lost batch, a wrong Chan term or a double-counted flush is O(1) off."""
    ref, two = host_and_twolevel
    assert two.train.n == ref.train.n and two.train.dtype == torch.float64 and not two.train.wide
    eps32 = torch.finfo(torch.float32).eps
    for kind in ("k", "v"):
        for name, t in ref.train.stats[kind].items():
            assert two.train.stats[kind][name].dtype == torch.float64
            assert_close(torch.tensor(_rel(two.train.stats[kind][name], t)), torch.tensor(0.0), dtype=torch.float32,
                         factor=64, magnitude=1.0, reason="float32 sums of <= 3 batches, relative to the largest "
                         "entry: a few eps32 of GEMM rounding (measured <= 2-3 eps32), x10 headroom")


def test_checkpoint_cadence_and_a_resume_mid_flush_change_no_bit(pair, ids, tmp_path):
    kw = dict(KW, accumulate="twolevel", flush_batches=3, checkpoint_piece_bytes=4096)
    ref = kt.collect_moments(*pair, ids, checkpoint_every=400, **kw)
    often = kt.collect_moments(*pair, ids, checkpoint_path=tmp_path / "often", checkpoint_every=4, **kw)
    ck = tmp_path / "cut"
    part = kt.collect_moments(*pair, ids, checkpoint_path=ck, checkpoint_every=4, stop_after_batches=4, **kw)
    assert not part.train.info["complete"]
    # killed after batch 4 of a flush of 3: the checkpoint holds the master (3 batches) and the buffer (1)
    from kvtransfer.core.io import read_tensor_manifest
    assert set(read_tensor_manifest(ck)["checkpoint"]["moments"]) == {"train", "heldout", "buffer"}
    resumed = kt.collect_moments(*pair, ids, checkpoint_path=ck, checkpoint_every=4, **kw)
    for other in (often, resumed, load_calibration(ck)):
        for kind in ("k", "v"):
            for name, t in ref.train.stats[kind].items():
                assert torch.equal(other.train.stats[kind][name], t), (kind, name)
        assert other.train.n == ref.train.n
    assert set(read_tensor_manifest(tmp_path / "often")["checkpoint"]["moments"]) == {"train", "heldout"}


def test_the_fold_is_the_same_in_any_chunking():
    g = torch.Generator().manual_seed(3)
    x = {k: torch.randn(50, 6, generator=g) + 3 for k in ("k", "v")}
    y = {k: torch.randn(50, 4, generator=g) - 2 for k in ("k", "v")}
    out = []
    for chunk in (8, 1 << 20):
        master = Moments([0, 1], [0], 3, 4)
        buf = Moments([0, 1], [0], 3, 4, dtype=torch.float32, wide=True)
        for r0 in range(0, 50, 10):
            buf.accumulate({k: t[r0:r0 + 10] for k, t in x.items()}, {k: t[r0:r0 + 10] for k, t in y.items()})
            if r0 in (10, 40):
                master.absorb(buf, chunk_bytes=chunk)
        assert buf.n == 0 and master.n == 50 and float(buf.stats["k"]["cxx"].abs().max()) == 0.0
        out.append(master)
    for kind in ("k", "v"):
        for name, t in out[0].stats[kind].items():
            assert torch.equal(out[1].stats[kind][name], t)
    ref = Moments([0, 1], [0], 3, 4)
    ref.add(x, y)
    assert_close(out[0].stats["k"]["cxy"], ref.stats["k"]["cxy"], dtype=torch.float32, factor=64,
                 reason="float32 sums of <= 3 ten-row batches vs one float64 batch: a few eps32 of the entries' "
                        "scale, x10 headroom")


def test_the_fit_is_unchanged_to_float32_rounding(host_and_twolevel):
    ref, two = host_and_twolevel
    r_ref = kt.r2_matrix(ref.train, heldout=ref.heldout, head_dim=HEAD_DIM)
    r_two = kt.r2_matrix(two.train, heldout=two.heldout, head_dim=HEAD_DIM)
    for k in (1, "all"):
        assert kt.select_topk(r_two["train"], k) == kt.select_topk(r_ref["train"], k)
    for split in ("train", "heldout"):
        for kind in ("k", "v"):
            assert_close(r_two[split][kind], r_ref[split][kind], dtype=torch.float32, factor=32, magnitude=1.0,
                         reason="R² is a ratio of sums inheriting the moments' <= 16 eps32 relative error, twice")


def test_the_committed_precision_table_holds_the_default_within_its_tolerance():
    """results/precision/tiny.json (python results/precision/make.py): the default against the float64 host path on
    the committed tiny family -- every output inside the tolerance derived from the moments' perturbation."""
    import json
    from pathlib import Path

    res = json.loads((Path(__file__).resolve().parents[1] / "results/precision/tiny.json").read_text())
    default, ref = res["paths"]["two-level (default)"], res["paths"]["float64 host"]
    assert default["within"] and default["same_selection"] and default["selected"] == ref["selected"]
    for kind in ("k", "v"):
        assert default["dr2"][kind] <= default["tol_heldout_r2"][kind]
        assert int(default["cond"][kind]["cond_max"]) > 100_000   # ill-conditioned: the tolerance is on outputs
    assert default["dlogppl"] <= default["tol_logppl"]
    assert_close(torch.tensor(default["moments_rel_err"]), torch.tensor(0.0), dtype=torch.float32, factor=64,
                 magnitude=1.0, reason="float32 sums of <= 8 batches of 1,024 rows relative to the largest entry: a "
                                       "few eps32 (measured ~2), x10 headroom")
