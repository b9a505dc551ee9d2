"""Map families (kvtransfer.maps.families): head-local support, exact reduced-rank ridge, attention metric,
the factored mapper kind, cost accounting, and the native sink carried by the artifact."""
import pytest
import torch

import kvtransfer as kt
from kvtransfer.maps.families import (attention_mass, effective_observations, fit_family, head_groups, key_metric,
                                 map_cost, query_energy, support_columns, value_metric, weighted_moments)
from kvtransfer.core.mapper import FactoredMapper, Mapper, load_mapper
from kvtransfer.core.moments import HeldOut, Moments
from kvtransfer.core.ridge import UnderdeterminedFit, fit_ridge, reduced_rank
from kvtransfer.core.transfer import codec_for, map_layers, map_layers_reference
from tiny_models import random_ids, tiny_model
from tolerance import FORWARD, assert_close, assert_far, forward_factor

N_S, D_S, N_T, D_T = 2, 4, 2, 6  # source 2 kv x 4, target 2 kv x 6
W_S, Q = N_S * D_S, N_T * D_T


def _synthetic(n=900, seed=0):
    """Correlated source features of 3 layers and targets of 2 layers that depend on them (plus noise)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(3 * W_S, 3 * W_S, generator=g, dtype=torch.float64) / 3
    x = {kind: torch.randn(n, 3 * W_S, generator=g, dtype=torch.float64) @ mix for kind in ("k", "v")}
    y = {kind: torch.cat([x[kind] @ torch.randn(3 * W_S, Q, generator=g, dtype=torch.float64) / 4 + 0.5
                          + 0.3 * torch.randn(n, Q, generator=g, dtype=torch.float64) for _ in range(2)], 1)
         for kind in ("k", "v")}
    return x, y


@pytest.fixture(scope="module")
def moments():
    x, y = _synthetic()
    train = Moments([0, 1, 2], [0, 1], W_S, Q)
    train.add({k: v[:700] for k, v in x.items()}, {k: v[:700] for k, v in y.items()})
    held = HeldOut([0, 1, 2], [0, 1], W_S, Q, select=torch.arange(200))
    held.add({k: v[700:].float() for k, v in x.items()}, {k: v[700:].float() for k, v in y.items()})
    return train, held, x, y


SELECTED = [[2, 0], [1, 2]]
SUMS = ("float64 means and centred sums over the rows in another grouping (weights of 1, rows repeated vs "
        "weighted): worst case n eps of the statistic's scale")
WEIGHTED_FACTOR = 2 * 100
WEIGHTED = ("the weighted fit reads the float32 feature sample, the reference float64 rows: features rounded to "
            "float32 move Cxx and Cxy by <= ~2 eps32 relative, and the ridge solve amplifies that by "
            "kappa(Cxx + lam I) <= ~100 on the SELECTED blocks of these synthetic features (36 to 101 measured)")


def solve_factor(a: torch.Tensor) -> float:
    """n kappa(a): a backward-stable solve of the n x n system a errs by ~n eps kappa relative."""
    return a.shape[0] * float(torch.linalg.cond(a))


def test_head_groups_follow_head_axis_shares():
    assert head_groups(8, 8) == [[i] for i in range(8)]
    assert head_groups(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert head_groups(2, 8) == [[0], [0], [0], [0], [1], [1], [1], [1]]
    assert head_groups(3, 2) == [[0, 1], [1, 2]]   # the middle source head straddles both halves
    assert head_groups(2, 3) == [[0], [0, 1], [1]]
    cols = support_columns("head_local", 2, 2, 4, 2)
    # target head 1 reads source head 1 (dims 4..7) of both stacked layers (offset 8 per layer)
    assert cols[1].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def _augmented_rrr(x, y, lam, rank, gamma):
    """Reduced-rank ridge by brute force on explicit data: ridge = least squares on [X; sqrt(lam) I],
    metric by whitening the outputs, rank by the SVD of the fitted values."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    evals, evecs = torch.linalg.eigh(gamma)
    s, s_inv = (evecs * evals.sqrt()) @ evecs.T, (evecs * evals.rsqrt()) @ evecs.T
    xa = torch.cat([xc, lam ** 0.5 * torch.eye(x.shape[1], dtype=x.dtype)])
    ya = torch.cat([yc @ s, torch.zeros(x.shape[1], y.shape[1], dtype=x.dtype)])
    w = torch.linalg.lstsq(xa, ya).solution
    _, _, vh = torch.linalg.svd(xa @ w, full_matrices=False)
    v = vh[:rank].T
    return w @ v @ v.T @ s_inv


def _objective(x, y, w, lam, gamma):
    xc, yc = x - x.mean(0), y - y.mean(0)
    r = yc - xc @ w
    return float(((r @ gamma) * r).sum() + lam * ((w @ gamma) * w).sum())


@pytest.mark.parametrize("weighted", [False, True])
def test_reduced_rank_is_the_exact_constrained_optimum(weighted):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 10, generator=g, dtype=torch.float64) @ torch.randn(10, 10, generator=g, dtype=torch.float64)
    y = x @ torch.randn(10, 7, generator=g, dtype=torch.float64) + torch.randn(300, 7, generator=g, dtype=torch.float64)
    a = torch.randn(7, 7, generator=g, dtype=torch.float64)
    gamma = a @ a.T + 0.5 * torch.eye(7, dtype=torch.float64) if weighted else torch.eye(7, dtype=torch.float64)
    lam, rank = 3.0, 3
    xc, yc = x - x.mean(0), y - y.mean(0)
    cxx, cxy = xc.T @ xc, xc.T @ yc
    w_full = torch.linalg.solve(cxx + lam * torch.eye(10, dtype=torch.float64), cxy)
    evals, evecs = torch.linalg.eigh(gamma)
    s, s_inv = (evecs * evals.sqrt()) @ evecs.T, (evecs * evals.rsqrt()) @ evecs.T
    down, up = reduced_rank(w_full, cxy, rank, metric_sqrt=s if weighted else None,
                            metric_inv_sqrt=s_inv if weighted else None)
    assert down.shape == (10, rank) and up.shape == (rank, 7)
    w_r = down @ up
    assert torch.linalg.matrix_rank(w_r) == rank
    brute = _augmented_rrr(x, y, lam, rank, gamma)
    assert_close(w_r, brute, factor=solve_factor(cxx + lam * torch.eye(10, dtype=torch.float64)), reason=(
        "two float64 routes to the same reduced-rank map (closed form vs the augmented least squares' SVD): "
        "each backward stable, n eps kappa(Cxx + lam I) of |W|"))
    best = _objective(x, y, w_r, lam, gamma)
    u, sv, vh = torch.linalg.svd(w_full)  # the naive alternative: truncate W's SVD in the raw metric
    naive = (u[:, :rank] * sv[:rank]) @ vh[:rank]
    assert best < _objective(x, y, naive, lam, gamma)
    for i in range(5):  # and no rank-r neighbour does better
        e = torch.randn(10, 1, generator=g, dtype=torch.float64) @ torch.randn(1, rank, generator=g, dtype=torch.float64)
        assert best <= _objective(x, y, (down + 1e-3 * e) @ up, lam, gamma) + 1e-9
    full_down, full_up = reduced_rank(w_full, cxy, 7)  # full rank: the ridge map itself
    assert_close(full_down @ full_up, w_full, factor=10 * 7, reason=(
        "at full rank the projection is the identity up to an orthonormal basis' rounding: a length-7 "
        "product twice, ~7 eps each, x10 a short chain near its worst case"))


def test_full_support_full_rank_is_the_papers_ridge(moments):
    train, held, *_ = moments
    ridge = fit_ridge(train, SELECTED, lam=0.5, heldout=held, head_dim=D_T)
    fam = fit_family(train, SELECTED, n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, lam=0.5, heldout=held)
    for kind in ("k", "v"):
        for t in range(2):
            assert torch.equal(fam.down[kind][t][0], ridge.weights[kind][t].weight)  # the same solve, same shapes
            assert_close(fam.bias[kind][t], ridge.weights[kind][t].bias, factor=10 * 2 * W_S, reason=(
                "b = mean_y - mean_x W through another product order: a length-p (16) dot, ~p eps of the bias "
                "scale (the terms are O(1), like b); x10 a short reduction near its worst case"))
        for split in ("train", "heldout"):
            assert_close(fam.r2[split][kind], ridge.r2[split][kind], factor=64, magnitude=1.0, reason=(
                "R^2 = 1 - SSE / SST via the moment expansion, in another order: fp64 rounding of a handful of "
                "cancelling terms of size ~SST, i.e. of R^2's scale 1"))


def test_head_local_fits_each_head_on_its_own_source_heads(moments):
    train, held, x, y = moments
    fam = fit_family(train, SELECTED, n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, lam=0.5, support="head_local", heldout=held)
    assert fam.columns.shape == (N_T, 2 * D_S)
    # independent check: ridge on exactly those columns of the raw features, target head h's outputs only
    for t, layers in enumerate(SELECTED):
        for kind in ("k", "v"):
            xs = torch.cat([x[kind][:700, s * W_S:(s + 1) * W_S] for s in layers], 1)
            for h in range(N_T):
                xh = xs[:, fam.columns[h]]
                yh = y[kind][:700, t * Q + h * D_T:t * Q + (h + 1) * D_T]
                xc, yc = xh - xh.mean(0), yh - yh.mean(0)
                w = torch.linalg.solve(xc.T @ xc + 0.5 * torch.eye(xh.shape[1], dtype=torch.float64), xc.T @ yc)
                assert_close(fam.down[kind][t][h], w, factor=solve_factor(xc.T @ xc), reason=(
                    "the family's moments route vs this direct float64 solve: n eps kappa(Cxx) of |W| "
                    "(lam = 0.5 only helps)"))
    full = fit_family(train, SELECTED, n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, lam=0.5)
    # fewer features cannot fit the training data better than all of them
    assert (fam.r2["train"]["k"] <= full.r2["train"]["k"] + 1e-12).all()


def test_weighting_needs_rank_and_lowers_the_weighted_error(moments):
    train, held, x, y = moments
    g = torch.Generator().manual_seed(5)
    metrics = {}
    for kind in ("k", "v"):
        a = torch.randn(2, N_T, D_T, D_T, generator=g, dtype=torch.float64)
        metrics[kind] = a @ a.transpose(-1, -2) + 0.1 * torch.eye(D_T, dtype=torch.float64)
    with pytest.raises(ValueError, match="set mapper.rank"):
        fit_family(train, SELECTED, n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, weighting="attention", metrics=metrics)
    with pytest.raises(ValueError, match="mapper.rank=99"):
        fit_family(train, SELECTED, n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, rank=99)
    plain = fit_family(train, SELECTED, n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, lam=1e-6, rank=3)
    weighted = fit_family(train, SELECTED, n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, lam=1e-6, rank=3, weighting="attention",
                          metrics=metrics)
    for t, layers in enumerate(SELECTED):
        xs = torch.cat([x["k"][:700, s * W_S:(s + 1) * W_S] for s in layers], 1)
        ys = y["k"][:700, t * Q:(t + 1) * Q]
        gamma = torch.block_diag(*metrics["k"][t])
        err = {name: _objective(xs, ys, f.down["k"][t][0] @ f.up["k"][t][0], 0.0, gamma)
               for name, f in (("plain", plain), ("weighted", weighted))}
        assert err["weighted"] < err["plain"]


def test_attention_mass_is_the_late_queries_mean_attention(pair):
    """By hand from the model's own eager attention probabilities: for key t, the mean over heads and over
    the queries i >= max(t, S - S // 4) of a[i, t]."""
    _, target = pair
    ids = random_ids(3, 16, seed=4)
    positions = torch.arange(0, 16, 2)
    before = target.config._attn_implementation
    mass = attention_mass(target, ids, positions, batch_size=2)  # two batches: rows land where they belong
    assert target.config._attn_implementation == before and mass.shape == (3, 2, 8)
    target.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            probs = target(input_ids=ids, output_attentions=True, use_cache=False).attentions
    finally:
        target.set_attn_implementation(before)
    lo = 16 - 4
    for layer, a in enumerate(probs):
        head_mean = a.double().mean(1)  # [3, S, S]
        for j, t in enumerate(positions.tolist()):
            queries = range(max(t, lo), 16)
            expect = sum(head_mean[:, i, t] for i in queries) / len(queries)
            assert_close(mass[:, layer, j], expect, dtype=torch.float32, factor=forward_factor(target, 16),
                         magnitude=1.0, reason=FORWARD + "; attention probabilities are <= 1")
    # a late key is read by fewer window queries than an early one, and the means stay probabilities
    assert (mass >= 0).all() and (mass <= 1 + 1e-6).all()


def test_weighted_moments_are_moments_of_repeated_rows(moments):
    train, _, x, y = moments
    xs, ys = x["k"][:700], y["k"][:700]
    mean_x, mean_y, cxx, cxy = weighted_moments(xs, ys, torch.ones(700))
    for got, name in ((cxx, "cxx"), (cxy, "cxy"), (mean_x, "mean_x")):
        assert_close(got, train.stats["k"][name], factor=700, reason=SUMS)
    # integer weights == those rows repeated, up to the scale (weights are rescaled to sum n)
    w = torch.randint(0, 4, (700,), generator=torch.Generator().manual_seed(1)).double()
    rep = w.long()
    mx, my, c, cy = weighted_moments(xs, ys, w)
    xr, yr = xs.repeat_interleave(rep, 0), ys.repeat_interleave(rep, 0)
    for got, want in ((mx, xr.mean(0)), (my, yr.mean(0))):
        assert_close(got, want, factor=len(xr), reason=SUMS)
    scale = 700 / float(w.sum())
    assert_close(c, scale * (xr - xr.mean(0)).T @ (xr - xr.mean(0)), factor=len(xr), reason=SUMS)
    assert_close(cy, scale * (xr - xr.mean(0)).T @ (yr - yr.mean(0)), factor=len(xr), reason=SUMS)
    assert_close(effective_observations(torch.ones(10)), 10, dtype=torch.float32, factor=10 * 20,
                 reason="(sum w)^2 / sum w^2 of 10 float32 ones: two 10-term sums and a division, x10 (few ops)")
    assert effective_observations(torch.tensor([1.0, 0, 0, 0])) == 1  # 1^2 / 1^2: exact
    with pytest.raises(ValueError, match=">= 0"):
        weighted_moments(xs, ys, -torch.ones(700))


@pytest.mark.parametrize("support,rank", [("full", None), ("head_local", 3)])
def test_attention_mass_weighting_reweights_the_fit(moments, support, rank):
    train, held, x, y = moments
    sample = {f"{n}{kind}": t[kind][:700].float() for n, t in (("x", x), ("y", y)) for kind in ("k", "v")}
    kw = dict(n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, lam=0.5, support=support, rank=rank)
    plain = fit_family(train, SELECTED, **kw)
    with pytest.raises(ValueError, match="feature sample"):
        fit_family(train, SELECTED, weighting="attention_mass", **kw)
    with pytest.raises(ValueError, match="rows"):
        fit_family(train, SELECTED, weighting="attention_mass", sample=sample, row_weights=torch.ones(9, 2), **kw)
    # the p/n guard counts the rows the weighted fit sees (the sample's), not the moments' 700
    few = {name: t[:10] for name, t in sample.items()}  # p_g = 16 (full) or 8 (head_local): p/n >= 0.8
    with pytest.raises(UnderdeterminedFit):
        fit_family(train, SELECTED, weighting="attention_mass", sample=few, row_weights=torch.ones(10, 2), **kw)
    # uniform weights on every train row: the unweighted fit (float32 sample -> float32-level agreement)
    uniform = fit_family(train, SELECTED, weighting="attention_mass", sample=sample, row_weights=torch.ones(700, 2), **kw)
    # per-layer weights: layer t's map is the plain fit to the rows repeated w[:, t] times
    w = torch.randint(0, 3, (700, 2), generator=torch.Generator().manual_seed(2)).float()
    weighted = fit_family(train, SELECTED, weighting="attention_mass", sample=sample, row_weights=w, **kw)
    assert weighted.info["weighted_rows"] == 700 and weighted.info["effective_observations_min"] < 700
    for t in range(2):
        rep = w[:, t].long()
        dup = Moments([0, 1, 2], [0, 1], W_S, Q)
        dup.add({k: v[:700].repeat_interleave(rep, 0) for k, v in x.items()},
                {k: v[:700].repeat_interleave(rep, 0) for k, v in y.items()})
        # lambda is on the weight-rescaled sums: the repeated rows' fit with lambda scaled alike
        ref = fit_family(dup, SELECTED, **dict(kw, lam=0.5 * float(w[:, t].sum()) / 700))
        for kind in ("k", "v"):
            for f, r in ((uniform, plain), (weighted, ref)):
                got = f.down[kind][t] if rank is None else f.down[kind][t] @ f.up[kind][t]
                exp = r.down[kind][t] if rank is None else r.down[kind][t] @ r.up[kind][t]
                assert_close(got, exp, dtype=torch.float32, factor=WEIGHTED_FACTOR, reason=WEIGHTED)
                assert_close(f.bias[kind][t], r.bias[kind][t], dtype=torch.float32, factor=WEIGHTED_FACTOR,
                             reason=WEIGHTED)
        assert_far(weighted.down["k"][t], plain.down["k"][t], atol=1e-3, reason="the weights change the fit: O(0.1)")


def _mapper(fam, model_s, model_t):
    return FactoredMapper.from_family(fam, model_s, model_t)


@pytest.fixture(scope="module")
def pair():
    source = tiny_model("qwen3", layers=3, hidden=16, heads=4, kv_heads=N_S, head_dim=D_S, name="fam-src")
    target = tiny_model("llama", layers=2, hidden=24, heads=4, kv_heads=N_T, head_dim=D_T, name="fam-tgt")
    return source, target


@pytest.mark.parametrize("support,rank", [("full", None), ("full", 4), ("head_local", None), ("head_local", 3)])
def test_factored_mapper_applies_saves_and_costs_what_it_says(moments, pair, tmp_path, support, rank):
    train, held, *_ = moments
    source, target = pair
    fam = fit_family(train, SELECTED, n_kv_s=N_S, d_s=D_S, n_kv_t=N_T, lam=0.5, support=support, rank=rank,
                     heldout=held)
    mapper = _mapper(fam, source, target)
    mapper.native_sink = 2
    # the map equals the expanded [p, q] matrix it stands for
    x = torch.randn(2, 5, 2 * W_S)
    for t in range(2):
        for i, kind in enumerate(("k", "v")):
            w = torch.zeros(2 * W_S, Q, dtype=torch.float64)
            for g, cols in enumerate(fam.columns):
                block = fam.down[kind][t][g] if rank is None else fam.down[kind][t][g] @ fam.up[kind][t][g]
                w[cols, g * (Q // len(fam.columns)):(g + 1) * (Q // len(fam.columns))] = block
            expected = x[i].double() @ w + fam.bias[kind][t]
            assert_close(mapper.map_features(t, x)[i], expected, dtype=torch.float32, factor=2 * W_S + 2, reason=(
                "float32 map of p = 2 x 8 features (GEMMs of length <= p, worst case p eps of the output scale; "
                "at low rank two chained products) + the float32 weights' rounding and the bias"))
    cost = map_cost(2, 2, N_S, D_S, N_T, D_T, support=support, rank=rank)
    assert cost == {"n_parameters": mapper.n_parameters, "apply_flops_per_token": mapper.apply_flops_per_token}
    mapper.save(tmp_path / "m")
    back = load_mapper(tmp_path / "m", source, target)
    assert isinstance(back, FactoredMapper) and back.native_sink == 2 and back.rank == rank
    assert back.support == support
    assert torch.equal(back.map_features(1, x), mapper.map_features(1, x))
    # and it goes through the transfer path like the paper's map
    ids = random_ids(2, 12, seed=4)
    layers = kt.prefill(source, ids)
    pos = torch.arange(12).expand(2, 12)
    args = dict(source_codec=codec_for(source), target_codec=codec_for(target), target_n_kv=N_T)
    fast, ref = map_layers(layers, back, pos, **args), map_layers_reference(layers, back, pos, **args)
    for (kf, vf), (kr, vr) in zip(fast, ref):
        for got, want in ((kf, kr), (vf, vr)):
            assert_close(got, want, factor=10 * (2 * W_S + 6), reason=(
                "the fused and the reference transfer path: both float32 maps of length p = 16 plus RoPE strip "
                "and apply (~6 roundings); x10 since the short GEMM lands near its worst case"))


def test_ridge_cost_matches_the_paper_count_and_head_local_is_8x_cheaper_at_14b_32b():
    # Qwen3-14B -> 32B: 64 target layers, k = 8, 8 kv x 128 on both sides
    full = map_cost(64, 8, 8, 128, 8, 128)
    assert full["n_parameters"] == 64 * 2 * (8 * 8 * 128 * 8 * 128 + 8 * 128)  # L_t * 2 * (p q + q), ~1.07 B
    assert full["apply_flops_per_token"] == 64 * 2 * (2 * 8192 * 1024 + 1024)
    local = map_cost(64, 8, 8, 128, 8, 128, support="head_local")
    # each of 8 target heads reads its k = 8 source layers' matching head (8 x 128 inputs), so 8x fewer GEMM
    # FLOPs; the 1024 bias adds per layer and kind stay: 8 (2 x 8192 x 1024 + 1024) / ... = 7.9966, integers
    assert local["apply_flops_per_token"] == 64 * 2 * (2 * 8 * (8 * 128) * 128 + 1024)
    assert 7.99 < full["apply_flops_per_token"] / local["apply_flops_per_token"] < 8
    low = map_cost(64, 8, 8, 128, 8, 128, rank=128)
    assert low["apply_flops_per_token"] < full["apply_flops_per_token"] / 4
    ridge = Mapper(weight=torch.zeros(2, 2, 16, 12), bias=torch.zeros(2, 2, 12), selected_layers=torch.zeros(2, 2),
                   source={}, target={})
    assert ridge.apply_flops_per_token == map_cost(2, 2, N_S, D_S, N_T, D_T)["apply_flops_per_token"]


def test_attention_metric_from_the_targets_queries_and_output_projection(pair):
    _, target = pair
    ids = random_ids(3, 10, seed=7)
    energy = query_energy(target, ids, batch_size=2)
    # independent: the q of layer 1 from its input hidden states through the layer's own modules
    out = target(input_ids=ids, output_hidden_states=True)
    layer = target.model.layers[1]
    h = layer.input_layernorm(out.hidden_states[1])
    q = layer.self_attn.q_proj(h).view(3, 10, 4, D_T).double()
    assert_close(energy[1], (q * q).mean((0, 1)), dtype=torch.float32, factor=forward_factor(target, 10), reason=(
        FORWARD + "; the q projection of layer 1 is a prefix of that chain, its square doubles the relative error"))
    gk = key_metric(energy, N_T)
    diag = gk[1].diagonal(dim1=-2, dim2=-1)
    assert torch.equal(diag[:, :D_T // 2], diag[:, D_T // 2:])          # rotary pairs share a weight: one value
    assert_close(gk[1].sum((-1, -2)), torch.full((N_T,), float(D_T), dtype=torch.float64), factor=10 * D_T, reason=(
        "trace d by normalisation: d x (x / sum x), summed: ~d roundings, x10 few ops"))  # trace d
    grouped = (q * q).mean((0, 1)).view(N_T, 2, D_T).sum(1)
    pair_mean = (grouped[:, :D_T // 2] + grouped[:, D_T // 2:]) / 2
    assert_close(diag[:, :D_T // 2] / diag[:, :D_T // 2].sum(-1, keepdim=True),
                 pair_mean / pair_mean.sum(-1, keepdim=True), dtype=torch.float32, factor=forward_factor(target, 10),
                 reason=FORWARD + "; the shares of q's squared energy per rotary pair, normalised to sum 1")
    gv = value_metric(target)
    wo = layer.self_attn.o_proj.weight.double()  # [hidden, 4 * D_T]; kv head 0 serves query heads 0, 1
    manual = wo[:, :D_T].T @ wo[:, :D_T] + wo[:, D_T:2 * D_T].T @ wo[:, D_T:2 * D_T]
    assert_close(gv[1, 0], manual * (D_T / manual.trace()), factor=10 * 24, reason=(
        "W_o^T W_o over hidden 24 in float64 (the same products, maybe summed in another order): 24 eps of the "
        "Gram's scale, x10 one short reduction near its worst case"))
