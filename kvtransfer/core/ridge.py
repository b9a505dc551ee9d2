"""Closed-form per-head ridge maps and their R², straight from centred moments.

For one target layer and kind, with x restricted to the selected source columns I:
    W = (Cxx[I, I] + lam * I)^-1 Cxy[I, t],   b = mean_y[t] - mean_x[I] W      (fp64, `solve_spd`)
`solve_spd` uses Cholesky, or a rank-revealing eigendecomposition (minimum-norm solution, with a
warning) when the system is numerically singular (e.g. lam = 0). Every target head of the layer
shares X, so one solve with n_kv_t * d_t right-hand sides fits all of them; the per-head maps are
the column blocks of W. `lam` multiplies the identity added to the centred *sum* of squares, as in
the paper's formula.

R² per head is 1 - SSE / SST with SSE and SST summed over the head's dims:
    SSE = sum_cols [Cyy - 2 (W * Cxy) + W * (Cxx W)] + n * (mean_y - mean_x W - b)^2
evaluated with the train moments (in-sample), or out-of-sample on held-out data: either held-out
moments (the same formula) or held-out raw features (`moments.HeldOut`, what `collect_moments` keeps):
then SSE = sum_rows (y - x W - b)^2 and SST = sum_rows (y - mean_y)^2 directly, in fp64, in row chunks.
Both give the same number up to fp64 rounding on the same observations.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .moments import KINDS, HeldOut, Moments

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


class IllConditionedWarning(UserWarning):
    """A ridge system was (numerically) singular and was solved on its well-determined subspace."""


def solve_spd(a: torch.Tensor, b: torch.Tensor, *, rcond: float | None = None) -> torch.Tensor:
    """Solve a X = b for symmetric positive (semi)definite `a`, in fp64.

    Cholesky when `a` is safely positive definite; otherwise (Cholesky fails, or its diagonal shows
    cond(a) >= (max L_ii / min L_ii)^2 > 1 / rcond) a rank-revealing eigendecomposition: directions
    with eigenvalue <= rcond * largest are dropped, which gives the minimum-norm least-squares
    solution on the rest (= pinv(a) @ b), with an IllConditionedWarning that reports the condition
    number. rcond defaults to p * eps of the dtype `a` comes in (fp32 moments: ~p * 1.2e-7), the
    level below which an eigenvalue is indistinguishable from rounding in a's entries.
    """
    p = a.shape[-1]
    rcond = p * torch.finfo(a.dtype).eps if rcond is None else rcond
    a, b = a.double(), b.double()
    factor, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        diag = factor.diagonal()
        if float(diag.min()) ** 2 > rcond * float(diag.max()) ** 2:
            return torch.cholesky_solve(b, factor)
    evals, evecs = torch.linalg.eigh(a)
    top = float(evals[-1])
    keep = evals > rcond * top if top > 0 else torch.zeros_like(evals, dtype=torch.bool)
    cond = top / float(evals[0]) if float(evals[0]) > 0 else float("inf")
    warnings.warn(f"ridge system of size {p} is ill-conditioned (condition number {cond:.3g}): solved on its "
                  f"{int(keep.sum())} directions with eigenvalue > {rcond:.2g} x the largest (minimum-norm "
                  "solution); raise lambda, lower k, or accumulate moments in float64",
                  IllConditionedWarning, stacklevel=2)
    v = evecs[:, keep]
    return v @ ((v.T @ b) / evals[keep, None])


def moments_eps(moments: Moments) -> float:
    """Relative precision of the moments' entries: the coarser of their storage dtype and the dtype
    each batch's products were formed in (`info["compute_dtype"]`, as `collect_moments` records it).
    float64 moments built from float32 batch products are only float32-accurate."""
    eps = torch.finfo(moments.dtype).eps
    compute = getattr(torch, str(moments.info.get("compute_dtype") or "").removeprefix("torch."), None)
    if isinstance(compute, torch.dtype) and compute.is_floating_point:
        eps = max(eps, torch.finfo(compute).eps)
    return eps


def reduced_rank(weight: torch.Tensor, cxy: torch.Tensor, rank: int, *, metric_sqrt: torch.Tensor | None = None,
                 metric_inv_sqrt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rank-`rank` ridge map as factors (down [p, r], up [r, q]), fp64.

    weight = (Cxx + lam I)^-1 Cxy [p, q] is the full-rank ridge solution and cxy = Cxy [p, q]. With
    output metric Gamma (given as Gamma^1/2 and Gamma^-1/2, default I) this minimises
        |(Y - X W) Gamma^1/2|^2 + lam |W Gamma^1/2|^2   subject to rank(W) <= r
    (ridge as least squares on data augmented with sqrt(lam) I, then reduced-rank regression): with
    M = Gamma^1/2 Cxy^T weight Gamma^1/2 (= the augmented fitted values' Gram matrix) and V_r its top-r
    eigenvectors, W_r = weight Gamma^1/2 V_r V_r^T Gamma^-1/2 = down @ up. Not a truncated SVD of W.
    """
    w = weight.double()
    m = cxy.double().T @ w
    if metric_sqrt is not None:
        m = metric_sqrt @ m @ metric_sqrt
    m = (m + m.T) / 2
    _, evecs = torch.linalg.eigh(m)
    v = evecs[:, -rank:].flip(-1)  # top-r, largest first
    if metric_sqrt is None:
        return w @ v, v.T.contiguous()
    return w @ metric_sqrt @ v, v.T @ metric_inv_sqrt


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
    w = solve_spd(a, moments.cov_xy(kind, cols, target_layer), rcond=a.shape[0] * moments_eps(moments))
    mean_x = moments.stats[kind]["mean_x"][cols].double()
    mean_y = moments.stats[kind]["mean_y"][moments.target_columns(target_layer)].double()
    return LayerFit(w, mean_y - mean_x @ w, cols)


FEATURE_CHUNK = 2048  # held-out rows per GEMM when R² is evaluated on raw features


@torch.no_grad()
def feature_sse(held: HeldOut, kind: str, columns: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                tcols: slice, chunk: int = FEATURE_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(SSE, SST) per target column of tcols, of y ~ x[:, columns] @ weight + bias on the held-out rows (fp64).

    SST is about the held-out rows' own mean, as the centred held-out moments had it. Two passes over row
    chunks (mean, then sums of squares), so the working set is [chunk, p + q] whatever the row count."""
    n = held.n
    x_all, y_all = held.x(kind), held.y(kind)
    dev = x_all.device
    w, b = weight.to(dev, torch.float64), bias.to(dev, torch.float64)
    cols = columns.to(dev)
    mean = torch.zeros(w.shape[1], dtype=torch.float64, device=dev)
    for i in range(0, n, chunk):
        mean += y_all[i:i + chunk, tcols].double().sum(0)
    mean /= max(n, 1)
    sse, sst = torch.zeros_like(mean), torch.zeros_like(mean)
    for i in range(0, n, chunk):
        y = y_all[i:i + chunk, tcols].double()
        r = y - torch.addmm(b, x_all[i:i + chunk, cols].double(), w)
        sse += (r * r).sum(0)
        sst += ((y - mean) ** 2).sum(0)
    return sse.cpu(), sst.cpu()


def _per_head(sse: torch.Tensor, sst: torch.Tensor, head_dim: int) -> torch.Tensor:
    sse_h = sse.view(-1, head_dim).sum(-1)
    sst_h = sst.view(-1, head_dim).sum(-1)
    return 1 - sse_h / sst_h.clamp_min(torch.finfo(torch.float64).tiny)


def head_r2(moments: Moments | HeldOut, kind: str, fit: LayerFit, target_layer: int, head_dim: int) -> torch.Tensor:
    """R² per target head [n_kv_t] of `fit` evaluated on `moments` (train or held-out moments) or on held-out
    raw features (`HeldOut`)."""
    if isinstance(moments, HeldOut):
        sse, sst = feature_sse(moments, kind, fit.columns, fit.weight, fit.bias, moments.target_columns(target_layer))
        return _per_head(sse, sst, head_dim)
    st = moments.stats[kind]
    tcols = moments.target_columns(target_layer)
    cxx = moments.cov_xx(kind, fit.columns).double()
    cxy = moments.cov_xy(kind, fit.columns, target_layer).double()
    cyy = st["cyy"][tcols].double()
    offset = st["mean_y"][tcols].double() - st["mean_x"][fit.columns].double() @ fit.weight - fit.bias
    sse = cyy - 2 * (fit.weight * cxy).sum(0) + (fit.weight * (cxx @ fit.weight)).sum(0) + moments.n * offset ** 2
    return _per_head(sse, cyy, head_dim)


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
              heldout: Moments | HeldOut | None = None, head_dim: int | None = None, force: bool = False,
              stride: int | None = None, progress=None) -> RidgeFit:
    """Fit K and V maps for every target layer of `moments` from its `selected_layers[i]`.

    selected_layers[i] lists the source layers (feature order) feeding target layer
    moments.target_layers[i]. head_dim: the target's head size (to group R² per head; default:
    target_width when unknown, i.e. one "head"). heldout: held-out raw features (`HeldOut`, as
    `collect_moments` returns them) or held-out moments. Refuses under-determined fits (see
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
