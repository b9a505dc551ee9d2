"""Cross-layer source selection: source x target R² matrices, top-k and greedy forward selection.

The paper's rule: for each target layer, rank source layers by single-source OLS R² (averaged over
heads, then over stripped-K and V) and keep the top k; the same layers serve K and V.
"""
from __future__ import annotations

import torch

from .moments import KINDS, HeldOut, Moments
from .ridge import LayerFit, _per_head, feature_sse, fit_layer, head_r2, solve_spd

OLS_LAMBDA = 1e-6  # a whisker of ridge so rank-deficient single-layer blocks still solve


def r2_matrix(moments: Moments, *, heldout: Moments | HeldOut | None = None, head_dim: int | None = None,
              lam: float = OLS_LAMBDA, progress=None) -> dict:
    """Single-source R² for every (target layer, source layer), averaged over target heads.

    Returns {"train": {"k": [L_t, L_s], "v": [L_t, L_s]}, "heldout": {...}} (float64; the
    held-out entry only when `heldout` is given: held-out raw features (`HeldOut`, one [n_held, W_s] x
    [W_s, Dy] product per source layer) or held-out moments). Rows follow moments.target_layers,
    columns moments.source_layers.
    """
    head_dim = head_dim or moments.target_width
    wrap = progress or (lambda it, **_: it)
    out = {"train": {}, "heldout": {}}
    for kind in KINDS:
        train = torch.zeros(len(moments.target_layers), len(moments.source_layers), dtype=torch.float64)  # device: host-side table of scalars
        held = torch.zeros_like(train)
        for j, s in enumerate(wrap(moments.source_layers, desc=f"R² matrix ({kind})")):
            # one factorisation of this source layer's block serves every target layer
            cols = moments.source_columns([s])
            a = moments.cov_xx(kind, cols)
            a = a + lam * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
            w_all = solve_spd(a, moments.stats[kind]["cxy"][cols])
            b_all = moments.stats[kind]["mean_y"].double() - moments.stats[kind]["mean_x"][cols].double() @ w_all
            raw = isinstance(heldout, HeldOut) and heldout.n > 0
            if raw:  # every target layer's residuals from one pass over the held-out rows
                if heldout.target_layers != moments.target_layers:
                    raise ValueError("held-out features and moments cover different target layers")
                sse, sst = feature_sse(heldout, kind, heldout.source_columns([s]), w_all, b_all, slice(0, heldout.dy))
            for i, t in enumerate(moments.target_layers):
                tc = moments.target_columns(t)
                fit = LayerFit(w_all[:, tc], b_all[tc], cols)
                train[i, j] = head_r2(moments, kind, fit, t, head_dim).mean()
                if raw:
                    held[i, j] = _per_head(sse[tc], sst[tc], head_dim).mean()
                elif heldout is not None and heldout.n > 0:
                    held[i, j] = head_r2(heldout, kind, fit, t, head_dim).mean()
        out["train"][kind] = train
        if heldout is not None and heldout.n > 0:
            out["heldout"][kind] = held
    return {split: v for split, v in out.items() if v}


def select_topk(r2: dict, k: int | str) -> list[list[int]]:
    """Per target layer, the k source layers with the highest (R²_K + R²_V) / 2, ascending order.

    r2 is one split of `r2_matrix` ({"k": [L_t, L_s], "v": [L_t, L_s]}); k may be "all".
    Returned indices are column positions of the matrix (= source layer ids for full moments).
    """
    score = (r2["k"] + r2["v"]) / 2
    n_src = score.shape[1]
    k = n_src if k == "all" else int(k)
    if not 1 <= k <= n_src:
        raise ValueError(f"k must be in 1..{n_src} or 'all', got {k}")
    top = score.topk(k, dim=1).indices
    return [sorted(row.tolist()) for row in top]


def select_greedy(moments: Moments, k: int | str, *, lam: float = 0.01, head_dim: int | None = None,
                  progress=None) -> list[list[int]]:
    """Greedy forward selection: per target layer add the source layer that most raises the joint
    ridge R² (mean over heads and K/V, in-sample) until k are chosen. Costs O(k * L_s) solves per
    target layer, so it is an analysis tool; top-k is the paper's default.
    """
    head_dim = head_dim or moments.target_width
    n_src = len(moments.source_layers)
    k = n_src if k == "all" else int(k)
    wrap = progress or (lambda it, **_: it)
    chosen_all = []
    for t in wrap(moments.target_layers, desc="greedy selection"):
        chosen: list[int] = []
        for _ in range(k):
            best, best_score = None, -float("inf")
            for s in moments.source_layers:
                if s in chosen:
                    continue
                layers = sorted(chosen + [s])
                score = sum(head_r2(moments, kind, fit_layer(moments, kind, layers, t, lam), t, head_dim).mean()
                            for kind in KINDS) / len(KINDS)
                if score > best_score:
                    best, best_score = s, float(score)
            chosen.append(best)
        chosen_all.append(sorted(chosen))
    return chosen_all
