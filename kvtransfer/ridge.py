"""Closed-form per-head ridge maps and their R², straight from centred moments.

For one target layer and kind, with x restricted to the selected source columns I:
    W = (Cxx[I, I] + lam * I)^-1 Cxy[I, t],   b = mean_y[t] - mean_x[I] W      (fp64, Cholesky)
Every target head of the layer shares X, so one solve with n_kv_t * d_t right-hand sides fits all
of them; the per-head maps are the column blocks of W. `lam` multiplies the identity added to the
centred *sum* of squares, as in the paper's formula.

R² per head is 1 - SSE / SST with SSE and SST summed over the head's dims:
    SSE = sum_cols [Cyy - 2 (W * Cxy) + W * (Cxx W)] + n * (mean_y - mean_x W - b)^2
evaluated with the train moments (in-sample) or the held-out moments (out-of-sample).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .moments import KINDS, Moments

DEFAULT_LAMBDA = 0.01
WARN_RATIO = 0.1
REFUSE_RATIO = 0.5


class UnderdeterminedFit(ValueError):
    """Raised when features p are too many for the observations n (p / n >= 0.5)."""


def check_observations(p: int, n: int, *, stride: int | None = None, force: bool = False) -> float:
    """Guard against fits that look perfect in-sample and collapse held-out; returns p / n.

    Raises UnderdeterminedFit if p / n >= 0.5 (unless `force`), warns above 0.1; both messages say
    how many more observations (and, given `stride`, calibration tokens) reach p / n = 0.1.
    """
    ratio = p / max(n, 1)
    if ratio <= WARN_RATIO:
        return ratio
    more = 10 * p - n
    tokens = f" (~{more * stride:,} more calibration tokens at stride {stride})" if stride else ""
    msg = (f"ridge fit with p={p:,} features on n={n:,} observations (p/n={ratio:.2f}); "
           f"add {more:,} observations{tokens} to reach p/n=0.1, or lower k")
    if ratio >= REFUSE_RATIO and not force:
        raise UnderdeterminedFit(msg + "; pass force=True to fit anyway (held-out R² will likely collapse)")
    warnings.warn(msg, stacklevel=2)
    return ratio


def solve_spd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve a X = b for symmetric positive (semi)definite `a` in fp64: Cholesky, else lstsq."""
    a, b = a.double(), b.double()
    factor, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(b, factor)
    return torch.linalg.lstsq(a, b, driver="gelsd" if a.device.type == "cpu" else None).solution


@dataclass
class LayerFit:
    """Affine map for one target layer and kind: y = x[:, columns] @ weight + bias.

    weight [p, n_kv_t * d_t] and bias [n_kv_t * d_t] in float64; `columns` index the source x.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    columns: torch.Tensor


def fit_layer(moments: Moments, kind: str, source_layers: list[int], target_layer: int,
              lam: float = DEFAULT_LAMBDA) -> LayerFit:
    """Ridge-fit one target layer's K or V from the given source layers (in that feature order)."""
    cols = moments.source_columns(source_layers).to(moments.stats[kind]["cxx"].device)
    a = moments.cov_xx(kind, cols)
    a = a + lam * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    w = solve_spd(a, moments.cov_xy(kind, cols, target_layer))
    mean_x = moments.stats[kind]["mean_x"][cols].double()
    mean_y = moments.stats[kind]["mean_y"][moments.target_columns(target_layer)].double()
    return LayerFit(w, mean_y - mean_x @ w, cols)


def head_r2(moments: Moments, kind: str, fit: LayerFit, target_layer: int, head_dim: int) -> torch.Tensor:
    """R² per target head [n_kv_t] of `fit` evaluated on `moments` (train or held-out)."""
    st = moments.stats[kind]
    tcols = moments.target_columns(target_layer)
    cxx = moments.cov_xx(kind, fit.columns).double()
    cxy = moments.cov_xy(kind, fit.columns, target_layer).double()
    cyy = st["cyy"][tcols].double()
    offset = st["mean_y"][tcols].double() - st["mean_x"][fit.columns].double() @ fit.weight - fit.bias
    sse = cyy - 2 * (fit.weight * cxy).sum(0) + (fit.weight * (cxx @ fit.weight)).sum(0) + moments.n * offset ** 2
    sse_h = sse.view(-1, head_dim).sum(-1)
    sst_h = cyy.view(-1, head_dim).sum(-1)
    return 1 - sse_h / sst_h.clamp_min(torch.finfo(torch.float64).tiny)


@dataclass
class RidgeFit:
    """Ridge maps for every target layer: weights[kind][layer] -> LayerFit, plus R² per head.

    r2[split][kind] is [n_target_layers, n_kv_t] for split in ("train", "heldout").
    """

    selected_layers: list[list[int]]
    weights: dict
    r2: dict
    lam: float
    observations: int


def fit_ridge(moments: Moments, selected_layers: list[list[int]], *, lam: float = DEFAULT_LAMBDA,
              heldout: Moments | None = None, head_dim: int | None = None, force: bool = False,
              stride: int | None = None, progress=None) -> RidgeFit:
    """Fit K and V maps for every target layer of `moments` from its `selected_layers[i]`.

    selected_layers[i] lists the source layers (feature order) feeding target layer
    moments.target_layers[i]. head_dim: the target's head size (to group R² per head; default:
    target_width when unknown, i.e. one "head"). Refuses under-determined fits (see
    `check_observations`). Returns a RidgeFit with train and, if given, held-out R².
    """
    if len(selected_layers) != len(moments.target_layers):
        raise ValueError(f"selected_layers has {len(selected_layers)} entries for "
                         f"{len(moments.target_layers)} target layers")
    p = max(len(s) for s in selected_layers) * moments.source_width
    check_observations(p, moments.n, stride=stride or moments.info.get("stride"), force=force)
    head_dim = head_dim or moments.target_width
    wrap = progress or (lambda it, **_: it)
    weights = {kind: [] for kind in KINDS}
    r2 = {"train": {kind: [] for kind in KINDS}, "heldout": {kind: [] for kind in KINDS}}
    for t, layers in wrap(list(zip(moments.target_layers, selected_layers)), desc="ridge fit"):
        for kind in KINDS:
            fit = fit_layer(moments, kind, list(layers), t, lam)
            weights[kind].append(fit)
            r2["train"][kind].append(head_r2(moments, kind, fit, t, head_dim))
            if heldout is not None and heldout.n > 0:
                r2["heldout"][kind].append(head_r2(heldout, kind, fit, t, head_dim))
    r2 = {split: {kind: torch.stack(v) for kind, v in per.items() if v} for split, per in r2.items()}
    return RidgeFit([list(s) for s in selected_layers], weights, {s: v for s, v in r2.items() if v}, lam, moments.n)
