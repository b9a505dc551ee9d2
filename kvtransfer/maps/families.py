"""Map families beyond the paper's: which source features a target head reads, the rank of its map,
and the output metric the fit minimises. All fits are closed-form from the calibration moments.

support
    "full" (the paper): every target KV head reads all p = k * n_kv_s * d_s features of its k source layers.
    "head_local": target KV head h reads, in each of the k source layers, only the source heads whose
    share of the head axis overlaps h's share: source head s covers [s / n_s, (s + 1) / n_s), target
    head h covers [h / n_t, (h + 1) / n_t) (`head_groups`). Equal counts: h reads s = h; n_s = 2 n_t:
    h reads {2h, 2h + 1}; n_t = 2 n_s: h reads h // 2. The feature count per head drops by n_s / |group|.
rank
    None: full rank. r: the exact reduced-rank ridge solution (`ridge.reduced_rank`), stored as
    down [p_g, r] and up [r, q_g], so applying it costs r * (p_g + q_g) multiply-adds per token and group.
weighting (the output metric Gamma of the fit: minimise E |Gamma^1/2 (y - y_hat)|^2)
    "none": Gamma = I. "attention": what the target's attention does with an error --
    keys: a key error e changes the logit q . R e, so Gamma_K is the query second moment E[q q^T] of
    the head's GQA group in content space, averaged over each rotary pair (the relative rotation
    R mixes the two coordinates of a pair; across pairs it averages out), i.e. diagonal;
    values: a value error e reaches the residual stream through the o_proj columns of the group's
    query heads, so Gamma_V = sum_h W_o,h^T W_o,h. Both are normalised to mean eigenvalue 1 so lambda
    keeps its scale. A full-rank least-squares map is optimal in every output metric, so the metric
    changes a map only through its rank (and lambda's scale): `fit_family` refuses weighting without
    rank rather than fit something that silently equals the unweighted map.
    "attention_mass": weights observations, not outputs -- each calibration token's rows count in
    proportion to the attention the target's queries put on it in that target layer (`attention_mass`),
    so the fit spends its capacity on the tokens attention reads. This changes the full-rank solution
    too. The fit needs the tokens' raw features (the calibration's kept feature sample, `calib.mlp_samples`)
    because the moments have already summed over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.moments import KINDS, HeldOut, Moments
from ..core.ridge import (LayerFit, check_observations, head_r2, moments_eps, reduced_rank, solve_spd)

SUPPORTS = ("full", "head_local")
WEIGHTINGS = ("none", "attention", "attention_mass")


def head_groups(n_kv_s: int, n_kv_t: int) -> list[list[int]]:
    """Source KV heads read by each target KV head under support="head_local" (overlapping head-axis shares)."""
    groups = []
    for h in range(n_kv_t):
        # s overlaps h iff s / n_s < (h + 1) / n_t and h / n_t < (s + 1) / n_s (integers, no rounding)
        groups.append([s for s in range(n_kv_s) if s * n_kv_t < (h + 1) * n_kv_s and h * n_kv_s < (s + 1) * n_kv_t])
    return groups


def support_columns(support: str, k: int, n_kv_s: int, d_s: int, n_kv_t: int) -> list[torch.Tensor]:
    """Columns of the stacked features x [.., k * n_kv_s * d_s] (layer, head, dim) that each output
    group reads: one group (all columns) for "full", one per target KV head for "head_local"."""
    if support not in SUPPORTS:
        raise ValueError(f"mapper.support must be one of {SUPPORTS}, got {support!r}")
    width = n_kv_s * d_s
    if support == "full":
        return [torch.arange(k * width)]  # device: host-side columns, moved where used
    return [torch.cat([torch.arange(j * width + s * d_s, j * width + (s + 1) * d_s) for j in range(k) for s in group])  # device: host-side
            for group in head_groups(n_kv_s, n_kv_t)]


def map_cost(n_layers_t: int, k: int, n_kv_s: int, d_s: int, n_kv_t: int, d_t: int, *, support: str = "full",
             rank: int | None = None) -> dict:
    """{"n_parameters", "apply_flops_per_token"} of a linear map family at these shapes (no weights
    needed): K and V for every target layer, FLOPs = 2 per multiply-add, biases included."""
    groups = support_columns(support, k, n_kv_s, d_s, n_kv_t)
    q_g = n_kv_t * d_t // len(groups)
    params = 0
    for cols in groups:
        p_g = len(cols)
        params += p_g * q_g if rank is None else rank * (p_g + q_g)
    params = n_layers_t * 2 * (params + n_kv_t * d_t)
    flops = n_layers_t * 2 * 2 * sum(len(c) * q_g if rank is None else rank * (len(c) + q_g) for c in groups)
    return {"n_parameters": params, "apply_flops_per_token": flops + n_layers_t * 2 * n_kv_t * d_t}


# -- the attention metric ------------------------------------------------------------------------
def _attention(layer):
    return layer.self_attn


@torch.no_grad()
def query_energy(model, token_ids: torch.Tensor, *, batch_size: int = 8) -> torch.Tensor:
    """Mean squared content-space query [L, n_q, d] (float64) of `model` over unpadded ids [n, seq].

    Content space = before RoPE: the output of q_norm where the model has one (Qwen3), else of q_proj."""
    from ..core.models import decoder

    layers = decoder(model).layers
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_q = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    sums = torch.zeros(len(layers), n_q, d, dtype=torch.float64)  # device: host-side accumulator (the hook moves each sum)
    count = 0
    hooks = []
    for i, layer in enumerate(layers):
        attn = _attention(layer)
        module = getattr(attn, "q_norm", None) or attn.q_proj

        def hook(_m, _inp, out, i=i):
            q = out.reshape(-1, n_q, d).double()
            sums[i] += (q * q).sum(0).cpu()
        hooks.append(module.register_forward_hook(hook))
    try:
        device = next(model.parameters()).device
        for start in range(0, token_ids.shape[0], batch_size):
            batch = token_ids[start:start + batch_size].to(device)
            model(input_ids=batch, use_cache=False)
            count += batch.numel()
    finally:
        for h in hooks:
            h.remove()
    return sums / max(count, 1)


@torch.no_grad()
def attention_mass(model, token_ids: torch.Tensor, positions: torch.Tensor, *, batch_size: int = 4) -> torch.Tensor:
    """Attention each kept key position receives from `model`'s late queries: [n, L, len(positions)] float32.

    token_ids: unpadded [n, S]. For key position t, the mean over the query heads of every layer and over the
    queries i in the last quarter of the sequence that can see it (i >= max(t, S - S // 4)) of softmax
    weight a[i, t]. Late queries read the whole sequence, as a continuation reads a transferred context;
    the mean over the queries that can see t (not their sum) keeps the causal count of queries out of it.
    Runs the model with eager attention (restored afterwards) and reduces each layer's weights in a hook,
    so only one layer's [batch, heads, S, S] weights are alive at a time.
    """
    from ..core.models import decoder

    layers = decoder(model).layers
    n, seq = token_ids.shape
    lo = seq - seq // 4
    counts = (seq - torch.clamp(positions, min=lo)).double()  # queries in the window that see each position
    out = torch.zeros(n, len(layers), len(positions), dtype=torch.float32)  # device: host-side result (the hook moves each row)
    rows = slice(0, 0)
    hooks = []
    for i, layer in enumerate(layers):
        def hook(_m, _inp, output, i=i):
            weights = output[1]
            if weights is None:
                raise RuntimeError("attention weights unavailable: attention_mass needs eager attention")
            window = weights[:, :, lo:, :].double().mean(1).sum(1)  # [b, S]: summed over the window's queries
            out[rows, i] = (window[:, positions.to(window.device)].cpu() / counts).float()
            return (output[0], None) + tuple(output[2:])
        hooks.append(_attention(layer).register_forward_hook(hook))
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        device = next(model.parameters()).device
        for start in range(0, n, batch_size):
            rows = slice(start, min(start + batch_size, n))
            model(input_ids=token_ids[rows].to(device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
    return out


def weighted_moments(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mean_x [p], mean_y [q], cxx [p, p], cxy [p, q]) float64 of rows x [n, p], y [n, q] under weights
    w [n] >= 0, scaled to sum n so that lambda keeps the scale it has on unweighted sums (weights all 1
    give exactly the unweighted centred moments)."""
    w = w.double()
    if (w < 0).any() or not float(w.sum()) > 0:
        raise ValueError("observation weights must be >= 0 with a positive sum")
    w = w * (w.numel() / w.sum())
    mean_x = (w @ x.double()) / w.numel()
    mean_y = (w @ y.double()) / w.numel()
    xc = x.double() - mean_x
    xw = xc * w[:, None]
    return mean_x, mean_y, xw.T @ xc, xw.T @ (y.double() - mean_y)


def effective_observations(w: torch.Tensor) -> float:
    """Kish's effective sample size (sum w)^2 / sum w^2 of observation weights w [n]."""
    w = w.double()
    return float(w.sum() ** 2 / (w * w).sum())


def _normalised(gamma: torch.Tensor) -> torch.Tensor:
    """Scale each [.., d, d] metric to mean eigenvalue 1 (trace d)."""
    d = gamma.shape[-1]
    trace = gamma.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(gamma.dtype).tiny)
    return gamma * (d / trace)[..., None, None]


def key_metric(energy: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Gamma_K [L, n_kv, d, d] (diagonal) from `query_energy` [L, n_q, d]: summed over each KV head's
    query group, each coordinate replaced by its rotary pair's mean (rotate_half layout: i pairs i + d/2)."""
    L, n_q, d = energy.shape
    group = energy.view(L, n_kv, n_q // n_kv, d).sum(2)
    half = d // 2
    paired = (group[..., :half] + group[..., half:]) / 2
    diag = torch.cat([paired, paired], dim=-1)
    return _normalised(torch.diag_embed(diag))


def value_metric(model) -> torch.Tensor:
    """Gamma_V [L, n_kv, d, d] = sum over the KV head's query heads h of W_o,h^T W_o,h (o_proj columns)."""
    from ..core.models import decoder, kv_shape

    shape = kv_shape(model)
    out = []
    for layer in decoder(model).layers:
        w = _attention(layer).o_proj.weight.detach().double().cpu()  # [hidden, n_q * d]
        n_q = w.shape[1] // shape.head_dim
        per_head = w.view(w.shape[0], n_q, shape.head_dim).permute(1, 2, 0)  # [n_q, d, hidden]
        gram = per_head @ per_head.transpose(1, 2)  # [n_q, d, d]
        out.append(gram.view(shape.n_kv, n_q // shape.n_kv, shape.head_dim, shape.head_dim).sum(1))
    return _normalised(torch.stack(out))


# -- fitting ---------------------------------------------------------------------------------------
@dataclass
class FamilyFit:
    """Fitted maps of one family for every target layer.

    columns: [G, p_g] feature columns per output group (shared by all layers); per kind and layer
    down [G, p_g, r] and up [G, r, q_g] (up is None at full rank: down is the map itself), bias [q];
    r2[split][kind] [L_t, n_kv_t] as `ridge.RidgeFit`.
    """

    selected_layers: list[list[int]]
    columns: torch.Tensor
    down: dict
    up: dict
    bias: dict
    r2: dict
    lam: float
    observations: int
    support: str
    rank: int | None
    weighting: str
    info: dict = field(default_factory=dict)


def _sqrt_pair(gamma: torch.Tensor, floor: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(Gamma^1/2, Gamma^-1/2) of a symmetric PSD matrix, eigenvalues floored at floor * largest."""
    evals, evecs = torch.linalg.eigh(gamma.double())
    evals = evals.clamp_min(floor * float(evals[-1]))
    return (evecs * evals.sqrt()) @ evecs.T, (evecs * evals.rsqrt()) @ evecs.T


def fit_family(moments: Moments, selected_layers: list[list[int]], *, n_kv_s: int, d_s: int, n_kv_t: int,
               lam: float = 0.01, support: str = "full", rank: int | None = None, weighting: str = "none",
               metrics: dict | None = None, sample: dict | None = None, row_weights: torch.Tensor | None = None,
               heldout: Moments | HeldOut | None = None, force: bool = False, stride: int | None = None,
               progress=None) -> FamilyFit:
    """Fit K and V maps of one family for every target layer from its `selected_layers[i]`.

    metrics: {"k", "v": [L_t, n_kv_t, d_t, d_t]} output metrics (`key_metric`, `value_metric`) for
    weighting="attention". sample ({"xk", "xv": [n, Dx], "yk", "yv": [n, Dy]}, the moments' column layout)
    and row_weights ([n, model target layers], e.g. `attention_mass` at the sample's tokens) for
    weighting="attention_mass": each layer's fit then uses the sample's weighted moments instead of
    `moments`. R² is evaluated as for the paper's map (`ridge.head_r2`, unweighted, on `moments` and
    `heldout`) on the map expanded to [p, q] (zeros outside each group's support).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"mapper.weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if weighting == "attention" and rank is None:
        raise ValueError("mapper.weighting=attention changes only reduced-rank fits (a full-rank least-squares "
                         "map is already optimal in every output metric); set mapper.rank=r or weighting=none")
    if weighting == "attention" and metrics is None:
        raise ValueError("weighting=attention needs metrics={'k': key_metric(...), 'v': value_metric(...)}")
    if weighting == "attention_mass":
        if sample is None or row_weights is None:
            raise ValueError("weighting=attention_mass needs the calibration's feature sample and its row weights "
                             "(sample=..., row_weights=attention_mass(...) at the sample's tokens)")
        if row_weights.shape[0] != sample["xk"].shape[0]:
            raise ValueError(f"row_weights has {row_weights.shape[0]} rows, the sample {sample['xk'].shape[0]}")
    k = max(len(s) for s in selected_layers)
    d_t = moments.target_width // n_kv_t
    groups = support_columns(support, k, n_kv_s, d_s, n_kv_t)
    q_g = moments.target_width // len(groups)
    p_g = max(len(c) for c in groups)
    if rank is not None and not 0 < rank <= min(p_g, q_g):
        raise ValueError(f"mapper.rank={rank} must be in 1..{min(p_g, q_g)} (min of features {p_g} and outputs "
                         f"{q_g} per group); rank=null is the full-rank map")
    # an attention_mass fit sees only the sample's rows: guard p/n on those, not on the moments' count
    n_obs = sample["xk"].shape[0] if weighting == "attention_mass" else moments.n
    check_observations(p_g, n_obs, stride=stride or moments.info.get("stride"), force=force)
    if len({len(c) for c in groups}) != 1:
        raise ValueError(f"head_local groups of unequal size for n_kv {n_kv_s} -> {n_kv_t}; use support=full")
    columns = torch.stack(groups)
    wrap = progress or (lambda it, **_: it)
    down = {kind: [] for kind in KINDS}
    up = {kind: [] for kind in KINDS}
    bias = {kind: [] for kind in KINDS}
    r2 = {"train": {kind: [] for kind in KINDS}, "heldout": {kind: [] for kind in KINDS}}
    info = {}
    if weighting == "attention_mass":
        n_eff = [effective_observations(row_weights[:, t]) for t in moments.target_layers]
        info = {"weighted_rows": int(row_weights.shape[0]), "effective_observations_min": round(min(n_eff), 1),
                "effective_observations_mean": round(sum(n_eff) / len(n_eff), 1)}
    for t, layers in (wrap(list(zip(moments.target_layers, selected_layers)), desc="family fit")):
        for kind in KINDS:
            cols = moments.source_columns(list(layers)).to(moments.stats[kind]["cxx"].device)
            if weighting == "attention_mass":
                x = sample[f"x{kind}"][:, cols.cpu()]
                y = sample[f"y{kind}"][:, moments.target_columns(t)]
                mean_x, mean_y, cxx, cxy = weighted_moments(x, y, row_weights[:, t])
            else:
                cxx = moments.cov_xx(kind, cols).double()
                cxy = moments.cov_xy(kind, cols, t).double()
                mean_x = moments.stats[kind]["mean_x"][cols].double()
                mean_y = moments.stats[kind]["mean_y"][moments.target_columns(t)].double()
            eps = moments_eps(moments)
            full = torch.zeros(cxx.shape[0], moments.target_width, dtype=torch.float64, device=cxx.device)
            downs, ups = [], []
            for g, gcols in enumerate(groups):
                out = slice(g * q_g, (g + 1) * q_g)
                a = cxx[gcols][:, gcols] + lam * torch.eye(len(gcols), dtype=torch.float64, device=cxx.device)
                b = cxy[gcols, out]
                w = solve_spd(a, b, rcond=len(gcols) * eps)
                if rank is None:
                    downs.append(w)
                    full[gcols, out] = w
                    continue
                sqrt = inv = None
                if weighting == "attention":
                    gamma = metrics[kind][t]  # [n_kv_t, d_t, d_t], model layer t
                    heads = gamma[g * q_g // d_t:(g + 1) * q_g // d_t]
                    sqrt, inv = _sqrt_pair(torch.block_diag(*heads))  # the group's heads, one block each
                dn, upm = reduced_rank(w, b, rank, metric_sqrt=sqrt, metric_inv_sqrt=inv)
                downs.append(dn)
                ups.append(upm)
                full[gcols, out] = dn @ upm
            b_full = mean_y - mean_x @ full
            down[kind].append(torch.stack(downs))
            up[kind].append(torch.stack(ups) if ups else None)
            bias[kind].append(b_full)
            fit = LayerFit(full, b_full, cols)
            r2["train"][kind].append(head_r2(moments, kind, fit, t, d_t))
            if heldout is not None and heldout.n > 0:
                r2["heldout"][kind].append(head_r2(heldout, kind, fit, t, d_t))
    r2 = {split: {kind: torch.stack(v) for kind, v in per.items() if v} for split, per in r2.items()}
    return FamilyFit([list(s) for s in selected_layers], columns, down, up, bias,
                     {s: v for s, v in r2.items() if v}, lam, moments.n, support, rank, weighting, info)
