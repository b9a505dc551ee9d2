"""Issue 23 §2: the map fitted from the source's hidden states (kvtransfer.core.hidden, mapper=hidden).

- a planted linear map from hidden states to target K/V is recovered by the closed-form fit, and the artifact's
  apply path (`map_layers` with `source_hidden`) computes x @ W + b;
- exactness: a model's own layer-l normed input reproduces its own layer-l K (RoPE-stripped) and V, since
  k_proj / v_proj are linear in it;
- on two different tiny models of the repo: hidden_kv contains the K/V features, so its penalised train objective
  is at most the K/V map's (the invariant behind "train R² at least as high" at lambda -> 0);
- the runner: calibrate -> fit mapper=hidden -> save -> load -> fidelity / lm-eval transfer / bench; the p/n
  guard names the fix; a mapper given no hidden states says how to get them; mapper.features keys the artifacts;
- the cost the artifact and the plan state.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from run_configs import ROOT, compose_config
from tiny_models import random_ids, tiny_model
from tolerance import assert_close, assert_rounded, assert_within, eps

from kvtransfer.core.cache import prefill
from kvtransfer.core.calibrate import collect_moments, kv_features
from kvtransfer.core.hidden import FEATURES, hidden_map_cost, prefill_with_hidden, used_layers
from kvtransfer.core.mapper import HiddenMapper, Mapper, load_mapper, mapper_class
from kvtransfer.core.moments import KINDS, Moments
from kvtransfer.core.ridge import UnderdeterminedFit, fit_ridge
from kvtransfer.core.select import r2_matrix, select_topk
from kvtransfer.core.transfer import codec_for, map_layers, map_layers_reference, transfer

HALF_ULP32 = 2.0 ** -24  # float32 round-to-nearest: |fl(v) - v| <= 2^-24 |v|
MARKOV = 30.0  # P(|Z|^2 > 900 E|Z|^2) <= 1/900 (Markov): a statistical bound with 30x headroom at the typical value


# -- a planted map -------------------------------------------------------------------------------------------------
def _planted(n=4096, hidden=16, q=8, sigma=1e-3, seed=0):
    """x [n, 2 source layers, hidden] N(0, 1); target layer t (q columns) of kind K/V = x_t @ a[kind, t] + b + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, hidden, generator=g, dtype=torch.float64)
    a = torch.randn(2, 2, hidden, q, generator=g, dtype=torch.float64) / math.sqrt(hidden)
    b = torch.randn(2, 2, q, generator=g, dtype=torch.float64)
    noise = sigma * torch.randn(2, n, 2, q, generator=g, dtype=torch.float64)
    y = torch.einsum("nlh,klhq->knlq", x, a) + b[:, None] + noise  # [kind, n, target layer, q]
    return x, a, b, y, sigma


def _identity_models(hidden=16, q_heads=2, d_t=4):
    """Model objects that only name the pair's shapes for the artifact (source H = hidden; target 2 x d_t)."""
    return (tiny_model("qwen3", layers=2, hidden=hidden, heads=2, kv_heads=2, head_dim=8, seed=1),
            tiny_model("qwen3", layers=2, hidden=16, heads=2, kv_heads=q_heads, head_dim=d_t, seed=2))


def test_a_planted_linear_map_from_hidden_states_is_recovered():
    n, hidden, q, lam = 4096, 16, 8, 0.01
    x, a, b, y, sigma = _planted(n, hidden, q)
    x32, y32 = x.float(), y.float()  # what calibration hands the moments (float32 features)
    moments = Moments([0, 1], [0, 1], hidden, q)
    moments.add({kind: x32.reshape(n, -1) for kind in KINDS}, {kind: y32[i].reshape(n, -1) for i, kind in enumerate(KINDS)})
    fit = fit_ridge(moments, [[0], [1]], lam=lam, head_dim=4)
    src, tgt = _identity_models(hidden)
    mapper = HiddenMapper.from_ridge(fit, src, tgt, features="hidden", hidden_size=hidden, key_space="rotated")
    for t in range(2):
        xc = x32[:, t].double() - x32[:, t].double().mean(0)
        gram = xc.T @ xc
        evals = torch.linalg.eigvalsh(gram)
        for i in range(2):
            # the fit sees x32 and y32: the planted relation then carries, besides the noise, the float32 rounding of
            # y (<= 2^-24 |y|) and of x pushed through a (<= 2^-24 max|x| max_j |a[:, j]|_1); as noise variances
            rounding = HALF_ULP32 * (float(y[i, :, t].abs().max()) + float(x[:, t].abs().max())
                                     * float(a[i, t].abs().sum(0).max()))
            var = sigma ** 2 + rounding ** 2
            # least squares with an intercept: cov(W - A) = var (Xc^T Xc)^-1 per column, so E|W - A|_F^2 = var q tr(G^-1)
            spread = math.sqrt(var * q * float((1 / evals).sum()))
            a_norm = float(a[i, t].norm())
            bias = lam / float(evals[0] + lam) * a_norm                      # ridge shrinkage: |lam (G + lam)^-1 A|
            solve = hidden * float(evals[-1] / evals[0]) * eps(torch.float64) * a_norm  # fp64 Cholesky, kappa(G)
            store = HALF_ULP32 * 1.01 * a_norm                                # the artifact keeps float32 weights
            err = float((mapper.weight[t, i].double() - a[i, t]).norm())
            assert_within(err, 0.0, atol=MARKOV * spread + bias + solve + store,
                          reason="Markov on |W - A|_F^2 (E = var q tr((Xc^T Xc)^-1), var = noise + float32 rounding) "
                                 "+ ridge shrinkage + fp64 solve + float32 storage")
            # the intercept: b_hat - b = mean(noise) - mean(x) (W - A)
            b_err = float((mapper.bias[t, i].double() - b[i, t]).norm())
            w_bound = MARKOV * spread + bias + solve + store
            assert_within(b_err, 0.0, atol=MARKOV * math.sqrt(var * q / n) + float(x32[:, t].double().mean(0).norm())
                          * w_bound + HALF_ULP32 * 1.01 * float(b[i, t].norm()),
                          reason="Markov on |mean noise|^2 (E = var q / n) + |mean x| |W - A| + float32 storage")


def test_the_hidden_map_is_applied_to_the_hidden_states_it_was_fitted_on():
    """map_layers (and map_layers_reference) with source_hidden compute x_l @ W[t] + b[t] for each target layer t."""
    n, hidden = 4096, 64  # float32 dot products of length H err ~sqrt(H) eps typically, the bound is (H + 1) eps
    x, _, _, y, _ = _planted(n, hidden)
    moments = Moments([0, 1], [0, 1], hidden, 8)
    moments.add({kind: x.float().reshape(n, -1) for kind in KINDS},
                {kind: y[i].float().reshape(n, -1) for i, kind in enumerate(KINDS)})
    src, tgt = _identity_models(hidden)
    fit = fit_ridge(moments, [[0], [1]], head_dim=4)
    # key_space="rotated": no RoPE on either side, so the output is the map itself (RoPE is tested in the e2e test)
    mapper = HiddenMapper.from_ridge(fit, src, tgt, features="hidden", hidden_size=hidden, key_space="rotated")
    batch, seq = 4, 32
    xs = x[:batch * seq].float()
    hid = {s: xs[:, s].reshape(batch, seq, hidden) for s in (0, 1)}
    cache = [(torch.zeros(batch, 2, seq, 8), torch.zeros(batch, 2, seq, 8)) for _ in range(2)]  # not read
    pos = torch.arange(seq)
    kw = {"source_codec": None, "target_codec": None, "target_n_kv": 2}
    fast = map_layers(cache, mapper, pos, source_hidden=hid, **kw)
    plain = map_layers_reference(cache, mapper, pos, source_hidden=hid, **kw)
    for t in range(2):
        for i in range(2):
            w, bias = mapper.weight[t, i].double(), mapper.bias[t, i].double()
            want = (xs[:, t].double() @ w + bias).reshape(batch, seq, 2, 4).transpose(1, 2)
            scale = float((xs[:, t].double().abs() @ w.abs() + bias.abs()).max())
            for got in (fast[t][i], plain[t][i]):
                assert_close(got, want, factor=hidden + 1, dtype=torch.float32, magnitude=scale,
                             reason="a float32 dot product of length H plus the bias: <= (H + 1) eps32 sum |x w| + |b|")


# -- exactness: a layer's own normed input ---------------------------------------------------------------------------
def test_a_layers_normed_input_reproduces_its_own_k_and_v():
    """Source = target (Llama: no k_norm, no biases), target layer t from source layer t's normed input: k_proj and
    v_proj are linear in it, so the least-squares fit's train residual is only the float32 rounding of K and V."""
    hidden, seq = 32, 32
    model = tiny_model("llama", layers=2, hidden=hidden, heads=4, kv_heads=2, head_dim=8, seed=3)
    ids = random_ids(16, seq, seed=4)
    x = kv_features(model, ids, stride=1, features="hidden")  # [n, 2 * H], the same block for K and V
    y = kv_features(model, ids, stride=1)                       # [n, 2 * 16]: stripped K, V
    n = x["k"].shape[0]
    moments = Moments([0, 1], [0, 1], hidden, 16)
    moments.add(x, y)
    fit = fit_ridge(moments, [[0], [1]], lam=0.0, head_dim=8)
    layers = model.model.layers
    for t in range(2):
        cols = moments.source_columns([t])
        gram = moments.cov_xx("k", cols).double()
        evals = torch.linalg.eigvalsh(gram)
        kappa = float(evals[-1] / evals[0])
        for kind, proj in (("k", layers[t].self_attn.k_proj), ("v", layers[t].self_attn.v_proj)):
            xs = x[kind][:, cols].double()
            f = fit.weights[kind][t]
            pred = xs @ f.weight + f.bias
            want = y[kind][:, moments.target_columns(t)]
            scale = float((xs.abs() @ proj.weight.detach().double().T.abs()).max())  # sum |x_i a_ij|: what the GEMM rounds
            # delta_y per element <= eps32 (H [k_proj GEMM] + 2 seq [RoPE angle pos * inv_freq, applied and stripped]
            # + 8 [cos/sin products]) sum |x a|; the LS residual (I - P) delta_y has column norm <= |delta_y|_2 <=
            # sqrt(n) max|delta_y|; the fp64 solve adds kappa p eps64 on the same scale
            factor = math.sqrt(n) * (hidden + 2 * seq + 8) + kappa * hidden * eps(torch.float64) / eps(torch.float32)
            assert_close(pred.float(), want, factor=factor, dtype=torch.float32, magnitude=scale,
                         reason="least-squares residual of an exactly linear target = its float32 rounding (see comment)")


# -- two different tiny models of the repo ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def repo_pair():
    """models/tiny qwen3-tiny-1m -> qwen3-tiny-7m (different widths and depths) and calibration text."""
    from kvtransfer.core.data import read_documents, token_sequences
    from kvtransfer.core.models import load_model

    source, tok = load_model(str(ROOT / "models/tiny/qwen3-tiny-1m"), dtype="float32", device="cpu")
    target, _ = load_model(str(ROOT / "models/tiny/qwen3-tiny-7m"), dtype="float32", device="cpu")
    docs = read_documents([str(ROOT / "data/tiny/calib.jsonl")], "text")
    ids = token_sequences(docs, tok, 40, 64)
    return source, target, ids


def _objective(moments: Moments, kind: str, fit, t: int, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(J, its rounding scale) per target column: J = |Yc - Xc w|^2 + lam |w|^2 from the moments (fp64), and
    M = (sqrt(cyy) + |w| . sqrt(diag Cxx))^2 + lam |w|^2, which bounds the absolute sums of every term of J
    (Cauchy-Schwarz on the cross products)."""
    cols, tc = fit.columns, moments.target_columns(t)
    cxx, cxy = moments.cov_xx(kind, cols).double(), moments.cov_xy(kind, cols, t).double()
    cyy, w = moments.stats[kind]["cyy"][tc].double(), fit.weight
    j = cyy - 2 * (w * cxy).sum(0) + (w * (cxx @ w)).sum(0) + lam * (w * w).sum(0)
    m = (cyy.sqrt() + w.abs().T @ cxx.diagonal().clamp_min(0).sqrt()) ** 2 + lam * (w * w).sum(0)
    return j, m


def test_hidden_kv_contains_the_kv_features_so_its_train_objective_is_no_worse(repo_pair):
    """hidden_kv's block per layer is [normed input | K or V]: the K/V map (hidden columns at 0) is one of its
    candidates, so with the same layers and lambda its penalised train objective J is <= the K/V map's, column by
    column; at lambda -> 0 that is "its train R² >= the K/V map's"."""
    source, target, ids = repo_pair
    lam = 0.01
    cal = {f: collect_moments(source, target, ids, stride=2, batch_size=8, features=f) for f in ("kv", "hidden_kv")}
    head_dim = 32
    selected = select_topk(r2_matrix(cal["kv"].train, head_dim=head_dim)["train"], 1)
    fits = {f: fit_ridge(c.train, selected, lam=lam, heldout=c.heldout, head_dim=head_dim) for f, c in cal.items()}
    n = cal["kv"].train.n
    worst = 0.0
    for kind in KINDS:
        for t in cal["kv"].train.target_layers:
            (j_kv, m_kv), (j_hkv, m_hkv) = (_objective(cal[f].train, kind, fits[f].weights[kind][t], t, lam)
                                            for f in ("kv", "hidden_kv"))
            p = fits["hidden_kv"].weights[kind][t].weight.shape[0]
            # moments summed over n rows and J's dot products of length p, in fp64, on both sides
            allowed = eps(torch.float64) * (n + p + 4) * (m_kv + m_hkv)
            worst = max(worst, float(((j_hkv - j_kv).clamp_min(0) / allowed).max()))
    assert_within(worst, 0.0, atol=1.0, reason="J_hidden_kv <= J_kv exactly; the shortfall, in units of the fp64 "
                                               "rounding bound of the two objectives, is at most 1")
    # and the hidden_kv map is a real map: its held-out R² is reported like the ridge kind's
    assert set(fits["hidden_kv"].r2) == {"train", "heldout"}
    assert fits["hidden_kv"].r2["heldout"]["k"].shape == (len(cal["kv"].train.target_layers), 2)


def test_a_hidden_map_saves_loads_and_transfers_on_the_repo_pair(repo_pair, tmp_path):
    source, target, ids = repo_pair
    for features in ("hidden", "hidden_kv"):
        cal = collect_moments(source, target, ids, stride=2, batch_size=8, features=features)
        assert cal.train.source_width == 128 + (64 if features == "hidden_kv" else 0)  # H = 128, 2 KV heads x 32
        selected = select_topk(r2_matrix(cal.train, heldout=cal.heldout, head_dim=32)["train"], 2)
        fit = fit_ridge(cal.train, selected, heldout=cal.heldout, head_dim=32)
        mapper = HiddenMapper.from_ridge(fit, source, target, features=features, hidden_size=128)
        path = mapper.save(tmp_path / features)
        loaded = load_mapper(path, source, target)
        assert type(loaded) is HiddenMapper and loaded.features == features and loaded.hidden_size == 128
        assert torch.equal(loaded.weight, mapper.weight) and torch.equal(loaded.bias, mapper.bias)
        manifest = json.loads((path / "mapper.json").read_text())
        assert manifest["kind"] == "hidden" and manifest["features"] == features
        assert set(manifest["r2"]) == {"train", "heldout"}
        ctx = ids[:2, :40]
        cache, hidden = prefill_with_hidden(source, ctx, layers=used_layers(loaded.selected_layers))
        assert torch.equal(cache[0][0], prefill(source, ctx)[0][0])  # the hooks change nothing the prefill computes
        mapped = transfer(cache, loaded, source, target, source_hidden=hidden, as_layers=True)
        plain = map_layers_reference(cache, loaded, torch.arange(40), source_codec=codec_for(source),
                                     target_codec=codec_for(target), target_n_kv=2, source_hidden=hidden)
        assert len(mapped) == 8 and mapped[0][0].shape == (2, 2, 40, 32)
        p = loaded.weight.shape[2]
        # |sum_i x_i w_i| <= |x|_2 |w|_2 (Cauchy-Schwarz) bounds the GEMM's absolute sum; |x_row|_2 over a target
        # layer's blocks = its hidden states' and (hidden_kv) its K or V's norms (RoPE stripping is a rotation)
        sq = {kind: {s: hidden[s].double().pow(2).sum(-1) + (0 if features == "hidden" else
                                                          cache[s][i].double().pow(2).sum((1, 3)))
                     for s in used_layers(loaded.selected_layers)} for i, kind in enumerate(KINDS)}
        for t, ((k, v), (k_ref, v_ref)) in enumerate(zip(mapped, plain)):
            for i, (got, want) in enumerate(((k, k_ref), (v, v_ref))):
                x_norm = float(sum(sq[KINDS[i]][s] for s in loaded.selected_layers[t].tolist()).sqrt().max())
                w_norm = float(loaded.weight[t, i].double().norm(dim=0).max())
                assert_close(got, want, factor=2 * (p + 1) + 2 * (2 * 40 + 8), dtype=torch.float32,
                             magnitude=x_norm * w_norm + float(loaded.bias[t, i].abs().max()),
                             reason="two float32 paths, each a length-p GEMM + bias ((p + 1) eps |x|_2 |w|_2) and, for "
                                    "keys, RoPE stripped and re-applied at positions < 40 (angle pos * inv_freq: "
                                    "2 * 40 eps, products: 8 eps); rotations keep norms")


def test_a_mapper_that_needs_hidden_states_and_gets_none_names_the_fix(repo_pair, tmp_path):
    source, target, ids = repo_pair
    cal = collect_moments(source, target, ids[:12], stride=4, batch_size=8, features="hidden")
    mapper = HiddenMapper.from_ridge(fit_ridge(cal.train, [[0]] * 8, force=True, head_dim=32), source, target,
                                     features="hidden", hidden_size=128)
    cache = prefill(source, ids[:1, :16])
    with pytest.raises(ValueError, match=r"hidden states, and none were given.*prefill_with_hidden.*source_hidden="):
        transfer(cache, mapper, source, target)
    with pytest.raises(ValueError, match=r"lacks source layers \[0\]"):
        transfer(cache, mapper, source, target, source_hidden={1: torch.zeros(1, 16, 128)})
    from kvtransfer.serve.mapping import ServeMap

    with pytest.raises(ValueError, match="stores only the source's K/V"):  # the vLLM connector: not implemented
        ServeMap(mapper.save(tmp_path / "m"), source.config, target.config)


# -- the runner --------------------------------------------------------------------------------------------------------
def _tiny_cfg(tmp_path, *extra):
    return compose_config("pair=tiny", "mapper=hidden", "calib.n_sequences=24", "calib.seq_len=64",
                          "calib.batch_size=8", "report.variance_k=[1]",
                          f"cache_dir={tmp_path / 'artifacts'}", "progress=false", *extra)


def test_mapper_hidden_through_the_runner(tmp_path):
    """python run.py mapper=hidden, small: calibrate (hidden states captured), fit, fidelity + lm-eval transfer (the
    adapter's source prefill gives the map its hidden states) + bench; the artifact keys follow mapper.features."""
    from kvtransfer.runner.pipeline import Run, execute

    stages = ("stage=[calibrate,fit,eval,bench]", "eval.tasks=[tiny_cloze]", "eval.limit=4", "eval.modes=[target,transfer]",
              "eval.ppl.enabled=false", "eval.coqa.enabled=false", "eval.fidelity.sequences=2",
              "eval.fidelity.continuation=8", "bench.tokens=[16]", "bench.warmup=0", "bench.repeats=1",
              "bench.native_tails=[4]")
    cfg = _tiny_cfg(tmp_path, "mapper.k=1", *stages)
    summary = execute(cfg, tmp_path / "run")
    m = summary["mapper"]
    assert m["kind"] == "hidden" and m["features"] == "hidden" and m["hidden_size"] == 128 and m["feature_width"] == 128
    assert summary["calibration"]["source_features"] == "hidden" and summary["calibration"]["features"] == 128
    mapper = load_mapper(m["path"])
    used = used_layers(mapper.selected_layers)
    cost = hidden_map_cost(8, 1, len(used), 128, 64, 64, "hidden")
    assert m["apply_flops_per_token"] == cost["apply_flops_per_token"] == mapper.apply_flops_per_token
    assert m["store_values_per_token"] == cost["store_values_per_token"] == len(used) * 128
    assert set(summary["r2"]["k"]) == {"train", "heldout"}
    assert len(summary["fidelity"]["per_layer"]["attn_cosine"]) == 8
    # a transfer score exists only if the adapter's source prefill handed the map its hidden states (it raises otherwise)
    assert summary["tasks"]["tiny_cloze"]["n"] == 4 and summary["tasks"]["tiny_cloze"]["transfer"] is not None
    assert summary["speed"][0]["tail4_ms"] > 0 and summary["speed"][0]["mapper_ms"] > 0
    run = Run(cfg, tmp_path / "keys")
    other = Run(_tiny_cfg(tmp_path, "mapper.k=1", "mapper.features=hidden_kv"), tmp_path / "keys2")
    ridge = Run(compose_config("pair=tiny", "calib.n_sequences=24", "calib.seq_len=64", "calib.batch_size=8",
                               "calib.mlp_samples=0", f"cache_dir={tmp_path / 'artifacts'}"), tmp_path / "keys3")
    assert len({r.key("calibration") for r in (run, other, ridge)}) == 3
    assert run.key("mapper") != other.key("mapper")
    assert run.features == "hidden" and other.features == "hidden_kv" and ridge.features == "kv"
    # the tiny calibration asks for an MLP feature sample (calib.mlp_samples); a hidden-state calibration keeps none
    assert cfg["calib"]["mlp_samples"] > 0 and (run.moments_dir("stripped") / "calibration.json").exists()
    assert not (run.moments_dir("stripped") / "mlp_sample.safetensors").exists()


def test_the_p_over_n_guard_names_the_fix(tmp_path):
    # 8 sequences -> 7 train x 16 positions (stride 4) = 112 observations; hidden at k = 1: p = 128 >= 56
    cfg = _tiny_cfg(tmp_path, "stage=fit", "mapper.k=1", "calib.n_sequences=8", "calib.stride=4")
    from kvtransfer.runner.pipeline import execute

    with pytest.raises(UnderdeterminedFit, match=r"fewer layers \(mapper\.k\).*more calibration text "
                                                  r"\(calib\.n_sequences.*mapper\.force=true"):
        execute(cfg, tmp_path / "refused")
    forced = execute(_tiny_cfg(tmp_path, "stage=fit", "mapper.k=1", "calib.n_sequences=8", "calib.stride=4",
                               "mapper.force=true"), tmp_path / "forced")
    assert forced["mapper"]["kind"] == "hidden"


# -- cost ----------------------------------------------------------------------------------------------------------------
def test_the_plan_counts_hidden_features():
    """At Qwen2.5-Coder 0.5B -> 1.5B: the calibration's source block is H = 896 (not 128) per layer, p = k * 896, and
    the plan's mapper parameters and p/n follow; hidden_kv adds the K/V width."""
    from run_configs import FIXED_RATES

    from kvtransfer import plan as P

    h200 = P.Node(**P.NODES["h200"])
    cfgs = {f: compose_config("pair=qwen25coder_0.5b_1.5b", "mapper=hidden", f"mapper.features={f}")
            for f in ("hidden", "hidden_kv")}
    cfgs["kv"] = compose_config("pair=qwen25coder_0.5b_1.5b", "mapper.k=2")
    plans = {f: P.make_plan(cfg, h200, rates=FIXED_RATES, knobs=False) for f, cfg in cfgs.items()}
    for f, width in (("hidden", 896), ("hidden_kv", 896 + 128), ("kv", 128)):
        proto = plans[f]["protocol"]
        assert proto["feature_width"] == width and proto["dx"] == 24 * width and proto["p"] == 2 * width
        assert proto["mapper_params"] == hidden_map_cost(28, 2, 24, 896, 128, 256, f)["n_parameters"]
        dtype = getattr(torch, cfgs[f]["calib"].get("dtype", "float64"))
        assert_rounded(proto["moments_split_gib"], Moments.nbytes_at(24 * width, 28 * 256, dtype) / P.GiB, decimals=2,
                       reason="the plan reports the train moments' GiB to 2 decimals")
    assert plans["hidden"]["stages"]["calibrate"]["host_gib"] > plans["kv"]["stages"]["calibrate"]["host_gib"]


def test_stated_costs_at_the_real_pairs():
    """The figures conf/mapper/hidden.yaml states, from shapes alone."""
    coder = {k: hidden_map_cost(28, k, 24, 896, 128, 256, "hidden") for k in (1, 2, 4)}
    assert [c["apply_flops_per_token"] for c in coder.values()] == [25_704_448, 51_394_560, 102_774_784]
    assert coder[1]["store_values_per_token"] * 2 == 43_008
    assert hidden_map_cost(28, 8, 24, 896, 128, 256, "kv")["apply_flops_per_token"] == 29_374_464  # the paper map
    assert hidden_map_cost(28, 2, 24, 896, 128, 256, "hidden_kv")["store_values_per_token"] * 2 == 55_296
    qwen3 = hidden_map_cost(64, 1, 40, 5120, 1024, 1024, "hidden")
    assert qwen3["apply_flops_per_token"] == 1_342_308_352 and qwen3["store_values_per_token"] * 2 == 409_600
    assert hidden_map_cost(64, 8, 40, 5120, 1024, 1024, "kv")["apply_flops_per_token"] == 2_147_614_720
    conf, readme = (ROOT / "conf/mapper/hidden.yaml").read_text(), (ROOT / "docs/maps.md").read_text()
    for figure in ("25.7 MFLOP", "51.4", "102.8", "43,008 B/token", "55,296 B/token", "1.34 GFLOP", "409,600 B/token",
                   "29.4 MFLOP", "2.15 GFLOP"):
        assert figure in conf
    for figure in ("| 29.4 M | 25.7 M | 51.4 M | 58.7 M |", "| 2.15 G | 1.34 G | 2.68 G | 3.22 G |",
                   "| 12,288 B (the KV) | 43,008 B | 43,008 B | 55,296 B |",
                   "| 163,840 B (the KV) | 409,600 B | 409,600 B | 573,440 B |"):
        assert figure in readme
    assert [round(hidden_map_cost(64, k, 40, 5120, 1024, 1024, f)["apply_flops_per_token"] / 1e9, 2)
            for f, k in (("hidden", 2), ("hidden_kv", 2))] == [2.68, 3.22]
    assert hidden_map_cost(28, 2, 24, 896, 128, 256, "hidden_kv")["apply_flops_per_token"] == 58_734_592
    assert hidden_map_cost(64, 2, 40, 5120, 1024, 1024, "hidden_kv")["store_values_per_token"] * 2 == 573_440
    assert mapper_class("hidden") is HiddenMapper and "hidden" in FEATURES and issubclass(HiddenMapper, Mapper)


def test_the_dry_run_sizes_its_calibration_by_the_feature_width():
    """dry_run=true keeps p/n <= dry.p_over_n for mapper=hidden too: p = k * (H + n_kv * d) on the stand-ins."""
    from kvtransfer.dryrun.run import calib_sequences

    def n_seq(*overrides):
        cfg = compose_config("pair=qwen3_14b_32b", "mapper.k=2", *overrides)
        return calib_sequences(cfg, cfg["dry"], 256), cfg["dry"]

    (kv, dry), (hkv, _) = n_seq(), n_seq("mapper=hidden", "mapper.features=hidden_kv")
    calib = compose_config("pair=qwen3_14b_32b")["calib"]
    per_seq = len(range(0, 256, int(calib["stride"])))
    width = int(dry["hidden_size"]) + 8 * int(dry["head_dim"])  # stand-in H + Qwen3-14B's 8 KV heads x dry head_dim
    n_train = math.ceil(2 * width / float(dry["p_over_n"]) / per_seq)
    assert hkv == max(10, math.ceil(n_train / (1 - float(calib["heldout_fraction"]))) + 1) and hkv > kv
