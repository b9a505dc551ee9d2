"""Calibration moments, selection and ridge: self-maps, planted maps, shards, resume, guards."""
import warnings

import pytest
import torch

import kvtransfer as kt
from kvtransfer.core.moments import Moments
from kvtransfer.core.ridge import UnderdeterminedFit, check_observations
from tiny_models import random_ids, tiny_model
from tolerance import assert_close

HEAD_DIM = 8


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen3", layers=3, name="tiny-qwen3-3l")


@pytest.fixture(scope="module")
def self_calibration(qwen):
    return kt.collect_moments(qwen, qwen, random_ids(40, 32, seed=1), stride=2, batch_size=8, heldout_fraction=0.2)


def _self_mapper(model, calib, k):
    r2 = kt.r2_matrix(calib.train, heldout=calib.heldout, head_dim=HEAD_DIM)
    selected = kt.select_topk(r2["train"], k)
    fit = kt.fit_ridge(calib.train, selected, heldout=calib.heldout, head_dim=HEAD_DIM)
    return kt.Mapper.from_ridge(fit, model, model, calibration=calib.train.info), r2, fit


@pytest.mark.parametrize("k", [1, 3])
def test_self_map_reproduces_native_logits(qwen, self_calibration, k):
    mapper, r2, fit = _self_mapper(qwen, self_calibration, k)
    # the diagonal wins single-source selection; k=3 uses all layers, so feature order matters
    assert r2["train"]["k"].diag().min() > 0.999
    assert mapper.selected_layers.tolist() == ([[0], [1], [2]] if k == 1 else [[0, 1, 2]] * 3)
    for kind in ("k", "v"):
        assert fit.r2["heldout"][kind].min() > 0.999
    ids = random_ids(2, 40, seed=7)
    native = qwen(input_ids=ids).logits[:, 24:]
    cache = kt.transfer(kt.prefill(qwen, ids[:, :24]), mapper, qwen, qwen, as_layers=True)
    logits = kt.forward_on_cache(qwen, cache, None, ids[:, 24:])
    # argmax is compared exactly (integers): the closest decision has a 3.4e-4 logit margin under
    # the mapped cache, far above the ~1e-6 by which fp32 logits move between BLAS builds
    assert torch.equal(logits.argmax(-1), native.argmax(-1))
    assert (logits - native).abs().max() < 2e-2


def test_self_map_fitted_at_32_tokens_applies_at_256(qwen, self_calibration):
    mapper, _, _ = _self_mapper(qwen, self_calibration, 1)
    ids = random_ids(1, 264, seed=11)
    native = qwen(input_ids=ids).logits[:, 256:]
    cache = kt.transfer(kt.prefill(qwen, ids[:, :256]), mapper, qwen, qwen, as_layers=True)
    logits = kt.forward_on_cache(qwen, cache, None, ids[:, 256:])
    assert torch.equal(logits.argmax(-1), native.argmax(-1))
    assert (logits - native).abs().max() < 2e-2


MAP_REASON = ("float32 map of p = 2 layers x 16 stripped features: a length-p GEMM errs by <= p eps of the output "
              "scale, plus the float32 weights (1) and RoPE's 3 roundings: p + 4; the float64 fit's own error is "
              "~1e-8 relative (ridge_error), below one float32 ulp")


def planted_ridge(moments, kind, cols, w, lam):
    """The ridge solution on data planted exactly on w: (Cxx + lam I)^-1 Cxx w = w - lam (Cxx + lam I)^-1 w,
    over the selected columns, and the rounding bound's factor (3p + 1 + n) kappa(Cxx + lam I), first order:
    - the fit's Cholesky solve of the p x p system is backward stable with |dA| <= (3p + 1) eps |R^T||R|
      (Higham, Thm 10.4), hence a forward error (3p + 1) eps kappa |W|;
    - the planted identity Cxy = Cxx w holds for exact sums only: the computed Cxy and Cxx are two different
      float64 sums over the n rows (y = x w + b rounded first), each within n eps of its |terms|, and that
      residual reaches W through (Cxx + lam I)^-1, i.e. n eps kappa |W|. This term is the one whose rounding
      moves with the CPU capability (the SIMD width reorders the n-row sums); issue 32 found the earlier
      p kappa bound, which left it out, used 0.123 of its allowance on an AVX2 EPYC."""
    a = moments.stats[kind]["cxx"][cols][:, cols]
    reg = a + lam * torch.eye(len(cols), dtype=a.dtype)
    eig = torch.linalg.eigvalsh(reg)
    return w - lam * torch.linalg.solve(reg, w), (3 * len(cols) + 1 + moments.n) * float(eig[-1] / eig[0])


def _planted(source, n_tokens=600, target_kv=(2, 8), seed=0, plan=None):
    """Real stripped source features and a planted affine map into a target of another shape."""
    feats = kt.kv_features(source, random_ids(n_tokens // 30, 30, seed=seed + 3), stride=1)
    g = torch.Generator().manual_seed(seed)
    width_s = feats["k"].shape[1] // 3
    q = target_kv[0] * target_kv[1]
    plan = plan or {0: [2], 1: [0, 1]}  # target layer -> source layers
    w = {(t, kind): torch.randn(len(src) * width_s, q, generator=g, dtype=torch.float64) / 4
         for t, src in plan.items() for kind in ("k", "v")}
    b = {(t, kind): torch.randn(q, generator=g, dtype=torch.float64) for t in plan for kind in ("k", "v")}
    cols = {t: torch.cat([torch.arange(width_s) + s * width_s for s in src]) for t, src in plan.items()}
    y = {kind: torch.cat([feats[kind].double()[:, cols[t]] @ w[t, kind] + b[t, kind] for t in plan], dim=1)
         for kind in ("k", "v")}
    return feats, y, plan, w, b, width_s, q


def test_planted_cross_layer_map_is_recovered_also_from_shards(qwen):
    feats, y, plan, w, b, width_s, q = _planted(qwen)
    whole = Moments([0, 1, 2], [0, 1], width_s, q)
    whole.add(feats, y)
    shards = []
    for rows in torch.arange(feats["k"].shape[0]).chunk(3):
        part = Moments([0, 1, 2], [0, 1], width_s, q)
        for sub in rows.chunk(2):  # several batches per shard
            part.add({k: v[sub] for k, v in feats.items()}, {k: v[sub] for k, v in y.items()})
        shards.append(part)
    merged = shards[0].merge(shards[1]).merge(shards[2])
    assert merged.n == whole.n
    for kind in ("k", "v"):
        for name, t in whole.stats[kind].items():
            assert_close(merged.stats[kind][name], t, factor=600, reason=(
                "float64 sums over the 600 rows in another grouping (3 shards x 2 batches, merged with mean "
                "corrections): worst case ~n eps of the statistic's scale"))
    for moments in (whole, merged):
        r2 = kt.r2_matrix(moments, head_dim=8)
        assert kt.select_topk(r2["train"], 1)[0] == [2]
        assert kt.select_topk(r2["train"], 2)[1] == [0, 1]
        fit = kt.fit_ridge(moments, [plan[0], plan[1]], lam=1e-9)
        for t in plan:
            for i, kind in enumerate(("k", "v")):
                cols = torch.cat([torch.arange(width_s) + s * width_s for s in plan[t]])
                want, factor = planted_ridge(moments, kind, cols, w[t, kind], 1e-9)  # w to ~1e-8 (lam / sigma_min)
                assert_close(fit.weights[kind][t].weight, want, factor=factor, reason=(
                    "float64 Cholesky solve of a p x p system on n-row sums: (3p + 1 + n) eps kappa(Cxx + lam I) of "
                    "|W| (planted_ridge)"))
                x_bar = moments.stats[kind]["mean_x"][cols]
                assert_close(fit.weights[kind][t].bias, b[t, kind] + x_bar @ (w[t, kind] - want), factor=2 * factor,
                             magnitude=float(x_bar.abs().sum() * w[t, kind].abs().max() + b[t, kind].abs().max()),
                             reason="b = mean_y - mean_x W: the weights' error through |mean_x|_1, plus the sum's")
                assert fit.r2["train"][kind][t].min() > 1 - 1e-8


def test_greedy_selection_finds_planted_layers(qwen):
    feats, y, plan, *_ , width_s, q = _planted(qwen)
    moments = Moments([0, 1, 2], [0, 1], width_s, q)
    moments.add(feats, y)
    assert kt.select_greedy(moments, 1, head_dim=8)[0] == [2]
    greedy2 = kt.select_greedy(moments, 2, head_dim=8)
    assert 2 in greedy2[0] and greedy2[1] == [0, 1]


def test_planted_map_into_mismatched_kv_target_through_transfer(qwen):
    """Source 2 kv x 8 -> target 4 kv x 16 (another model, other RoPE): the cache comes out right."""
    target = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, name="tiny-llama-wide")
    feats, y, plan, w, b, width_s, q = _planted(qwen, target_kv=(4, 16), plan={0: [1, 2], 1: [0, 1]})
    moments = Moments([0, 1, 2], [0, 1], width_s, q)
    moments.add(feats, y)
    fit = kt.fit_ridge(moments, [plan[0], plan[1]], lam=1e-9, head_dim=16)
    mapper = kt.Mapper.from_ridge(fit, qwen, target)
    assert mapper.weight.shape == (2, 2, 2 * width_s, 64)
    ids = random_ids(2, 50, seed=5)
    src_layers = kt.prefill(qwen, ids)
    mapped = kt.transfer(src_layers, mapper, qwen, target, as_layers=True)
    src_codec, tgt_codec = kt.codec_for(qwen), kt.codec_for(target)
    pos = torch.arange(50)
    stripped = [(src_codec.strip(k, pos), v) for k, v in src_layers]
    for t, srcs in plan.items():
        for i, kind in enumerate(("k", "v")):
            x = torch.cat([stripped[s][i].permute(0, 2, 1, 3).reshape(100, -1) for s in srcs], 1).double()
            expected = (x @ w[t, kind] + b[t, kind]).view(2, 50, 4, 16).permute(0, 2, 1, 3)
            if kind == "k":
                expected = tgt_codec.apply(expected, pos)
            assert_close(mapped[t][i], expected, dtype=torch.float32, factor=2 * 16 + 4, reason=MAP_REASON)
    assert mapped[0][0].shape == (2, 4, 50, 16)


def test_target_layer_shards_concatenate_to_full(qwen):
    other = tiny_model("qwen3", layers=3, seed=5, name="tiny-qwen3-other")
    ids = random_ids(12, 24, seed=2)
    full = kt.collect_moments(qwen, other, ids, stride=3, batch_size=4, heldout_fraction=0.25)
    parts = [kt.collect_moments(qwen, other, ids, stride=3, batch_size=4, heldout_fraction=0.25, target_layers=t)
             for t in ([0], [1, 2])]
    joined = Moments.concat_targets([p.train for p in parts])
    assert joined.target_layers == [0, 1, 2]
    eps = torch.finfo(full.train.dtype).eps  # fp64: 2.2e-16
    for kind in ("k", "v"):
        for name, t in full.train.stats[kind].items():
            if name in ("mean_x", "cxx"):
                # source-only statistics: the same kernels on the same shapes in every shard, so
                # bit-identity is a property of the code (concat_targets itself relies on it)
                assert torch.equal(joined.stats[kind][name], t), name
            else:
                # Not bitwise: each shard forms x^T y, column means and sums of squares over fewer
                # target columns (one wide GEMM vs two narrower ones), and BLAS picks its blocking,
                # hence the summation order, by shape and CPU. Agreement is to rounding: relative
                # 4096 eps (~1e-12 in fp64), absolute 4096 eps of the statistic's largest entry for
                # entries that cancel to ~0. A wrong column or a lost batch is off by O(1).
                assert_close(joined.stats[kind][name], t, factor=96, reason=(
                    "float64 x^T y, sums and column means over 96 rows (12 x 24 / stride 3) in another GEMM "
                    "blocking: worst case n eps of the statistic's largest entry"))


def test_resumed_calibration_is_bit_identical(qwen, tmp_path):
    other = tiny_model("qwen3", layers=3, seed=5, name="tiny-qwen3-other")
    ids = random_ids(20, 24, seed=4)
    # pieces of <= 4 KiB: every large tensor of the checkpoint goes to disk in row blocks
    kwargs = dict(stride=2, batch_size=4, heldout_fraction=0.2, checkpoint_every=4, heldout_observations=20,
                  checkpoint_piece_bytes=4096)
    from kvtransfer.maps.mlp import FeatureSampler

    # the MLP's feature sample rides along: 4 train batches, 3 rows kept from each
    sample_ref = FeatureSampler(12, 4, seed=1)
    reference = kt.collect_moments(qwen, other, ids, feature_sink=sample_ref, **kwargs)
    ck = tmp_path / "calib.ckpt.safetensors"
    state = tmp_path / "sample.partial.safetensors"
    partial = kt.collect_moments(qwen, other, ids, checkpoint_path=ck, stop_after_batches=2,
                                 feature_sink=FeatureSampler(12, 4, seed=1, state_path=state), **kwargs)
    assert not partial.train.info["complete"] and ck.is_dir() and len(list(ck.glob("train.k.cxy@*"))) > 1
    sample = FeatureSampler(12, 4, seed=1, state_path=state)   # a new process: starts from the saved rows
    assert 0 < len(sample.batches) < 4 and not sample.complete
    resumed = kt.collect_moments(qwen, other, ids, checkpoint_path=ck, feature_sink=sample, **kwargs)
    assert resumed.train.info["complete"]
    assert sample.complete and sample_ref.complete
    for name, t in sample_ref.tensors().items():
        assert torch.equal(sample.tensors()[name], t), name
    # bitwise on every machine: the same batches go through the same kernels in the same order, and
    # the checkpoint stores the running fp64 state exactly
    a, b = reference.train, resumed.train
    assert a.n == b.n
    for kind in ("k", "v"):
        for name in a.stats[kind]:
            assert torch.equal(a.stats[kind][name], b.stats[kind][name]), (kind, name)
    # the held-out rows kept: the same sample (fixed before the first batch), the same values
    a, b = reference.heldout, resumed.heldout
    assert (a.n, a.seen) == (b.n, b.seen) == (20, 4 * 12) and torch.equal(a.select, b.select)
    for kind in ("k", "v"):
        assert torch.equal(a.x(kind), b.x(kind)) and torch.equal(a.y(kind), b.y(kind))
    with pytest.raises(ValueError, match="other data or settings"):
        kt.collect_moments(qwen, other, ids[:, :20], checkpoint_path=ck, **kwargs)


def test_sequential_capture_equals_co_resident(qwen, tmp_path):
    other = tiny_model("qwen3", layers=2, seed=6, name="tiny-qwen3-2l")
    ids = random_ids(10, 24, seed=8)
    loads = []

    def loader(model):
        return lambda: loads.append(model.name_or_path) or model

    co = kt.collect_moments(qwen, other, ids, stride=2, batch_size=4)
    seq = kt.collect_moments(loader(qwen), loader(other), ids, stride=2, batch_size=4, capture="sequential",
                             feature_dir=tmp_path / "features")
    assert loads == ["tiny-qwen3-3l", "tiny-qwen3-2l"]  # each model loaded once, source first
    # bitwise on every machine: the same forward passes and moment updates on the same shapes; only
    # when each model is resident differs
    for kind in ("k", "v"):
        for name, t in co.train.stats[kind].items():
            assert torch.equal(seq.train.stats[kind][name], t), name


def test_moments_save_load_roundtrip(self_calibration, tmp_path):
    path = tmp_path / "m.safetensors"
    self_calibration.train.save(path)
    back = Moments.load(path)
    assert back.n == self_calibration.train.n and back.info == self_calibration.train.info
    assert torch.equal(back.stats["v"]["cxy"], self_calibration.train.stats["v"]["cxy"])


def test_observation_guard():
    assert check_observations(10, 1000) == 10 / 1000  # p / n, the same float64 division
    with pytest.warns(UserWarning, match="add 1,000 observations"):
        check_observations(200, 1000)
    with pytest.raises(UnderdeterminedFit, match=r"p/n=0\.50.*more calibration tokens at stride 4"):
        check_observations(500, 1000, stride=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert check_observations(500, 1000, force=True) == 0.5


def test_fit_refuses_underdetermined_moments(qwen):
    ids = random_ids(3, 8, seed=3)
    calib = kt.collect_moments(qwen, qwen, ids, stride=4, batch_size=4, heldout_fraction=0.0)
    with pytest.raises(UnderdeterminedFit):
        kt.fit_ridge(calib.train, [[0, 1, 2]] * 3)
