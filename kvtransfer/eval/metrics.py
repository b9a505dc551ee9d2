"""The metric vocabulary of every summary, table, figure and README (one definition per name).

    gap_closed           = (transfer - floor) / (target - floor)     floor: the `no_context` mode
    retention            = transfer / target
    gap_closed_vs_source = (transfer - source) / (target - source)
    retention_vs_chance  = (transfer - chance) / (target - chance)   (the paper's "floor-normalised")
    content_share        = (transfer - transfer_wrong) / (target - target_wrong)
                           the share of the target's own benefit from the right context over a wrong one
                           (another item's context of the same length, kvtransfer.maps.controls) that the map carries
    gap_closed_above_<c> = (transfer - c) / (target - c)   for each content control c (target_wrong,
                           transfer_wrong, mean_map, random_map): gap closed with the control as the floor

On accuracy (or F1) the scores are per-item means; on perplexity `gap_closed` is taken on the
log-perplexity, i.e. the mean NLL in nats/token (log(ppl) = mean NLL), which is what the model loses,
not on raw perplexity. The formula is the same in both directions (higher-is-better accuracy,
lower-is-better NLL): (x - f) / (t - f) is the share of the floor -> target distance covered.

Every number gets a paired bootstrap SE over items (or windows): one resample of item indices is applied
to every mode at once, so the shared per-item difficulty cancels. Two maps evaluated on the same items
are compared through the SE of their paired difference (`paired_difference`), never by each one's own SE.

A map against the target reading only part of the context: `native_token_worth` (the tokens it is worth on the
truncation curve) and `equal_cost` (the curve at the map's own cost, `frontier` its usable points). SEs that are
not over items -- clustered by conversation, over timing repeats -- are kvtransfer.eval.stats.

Pure numpy; no lm-eval or torch.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

# version of the summary.json layout. 1 (no field): `gap_closed` was source-based, `context_gap_closed` the
# floor-based one, `floor_normalized` the chance-based retention and a ppl row's `transfer_gap_closed` was on raw
# perplexity. 2: the names above (`upgrade_summary` maps 1 -> 2).
SCHEMA_VERSION = 2


def _ratio(num, den):
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1.0), np.nan)


def gap_closed(transfer, target, floor):
    """(transfer - floor) / (target - floor), elementwise on floats or arrays (NaN where target == floor).

    Units: any, as long as all three share them (accuracy, F1, or NLL in nats/token)."""
    return _ratio(np.asarray(transfer, dtype=np.float64) - floor, np.asarray(target, dtype=np.float64) - floor)


def retention(transfer, target):
    """transfer / target, elementwise (NaN where target == 0)."""
    return _ratio(transfer, target)


def gap_closed_vs_source(transfer, target, source):
    """(transfer - source) / (target - source): the share of the source -> target gap (not the floor's)."""
    return gap_closed(transfer, target, source)


def retention_vs_chance(transfer, target, chance: float):
    """(transfer - chance) / (target - chance): the paper's "floor-normalised" retention (chance, not no_context)."""
    return gap_closed(transfer, target, chance)


def content_share(transfer, transfer_wrong, target, target_wrong):
    """(transfer - transfer_wrong) / (target - target_wrong), elementwise (NaN where target == target_wrong).

    1: the map carries all of the target's own gain from this context over a wrong one; 0: the map's gain is
    what any context of that length and genre gives (none of it is content). Same formula on accuracy and
    on NLL (nats/token; both differences are negative when the right context helps)."""
    return _ratio(np.asarray(transfer, dtype=np.float64) - transfer_wrong,
                  np.asarray(target, dtype=np.float64) - target_wrong)


CONTROL_MODES = ("target_wrong", "transfer_wrong", "mean_map", "random_map")


def control_statistics(per_item: Mapping[str, Sequence[float]], *, n_boot: int = 1000, seed: int = 0) -> dict:
    """Content-control numbers of one task or perplexity prefix, each with a paired bootstrap SE over items.

    per_item: {mode: per-item scores [n]} (accuracy / F1, or per-window mean NLL), the same items in one order,
    with "target" and "transfer" and any of CONTROL_MODES. Returns (keys present only when their modes ran):
      content_share (+ _se)                       content_share(transfer, transfer_wrong, target, target_wrong)
      target_content_gain, transfer_content_gain   target - target_wrong, transfer - transfer_wrong (+ _se: the
                                                   SE of the paired mean difference)
      gap_closed_above_<c> (+ _se)                 gap_closed(transfer, target, c) for each control c that ran
    and for each bootstrapped ratio <name>_se_dropped: its non-finite replicates (SE None past MAX_DROPPED).
    """
    have = {m: v for m, v in per_item.items() if v is not None}
    for need in ("target", "transfer"):
        if need not in have:
            raise KeyError(f"control statistics need per-item scores of {need!r}")
    out: dict = {}
    if "target_wrong" in have and "transfer_wrong" in have:
        items = {m: have[m] for m in ("target", "transfer", "target_wrong", "transfer_wrong")}
        out["content_share"], out["content_share_se"], out["content_share_se_dropped"] = paired_bootstrap(
            items, lambda m: content_share(m["transfer"], m["transfer_wrong"], m["target"], m["target_wrong"]),
            n_boot=n_boot, seed=seed, return_dropped=True)
    for mode, wrong in (("target", "target_wrong"), ("transfer", "transfer_wrong")):
        if wrong in have:
            d = paired_difference(have[mode], have[wrong])
            out[f"{mode}_content_gain"], out[f"{mode}_content_gain_se"] = d["difference"], d["se"]
    for control in CONTROL_MODES:
        if control in have:
            items = {"target": have["target"], "transfer": have["transfer"], "control": have[control]}
            key = f"gap_closed_above_{control}"
            out[key], out[f"{key}_se"], out[f"{key}_se_dropped"] = paired_bootstrap(
                items, lambda m: gap_closed(m["transfer"], m["target"], m["control"]), n_boot=n_boot, seed=seed,
                return_dropped=True)
    return out


def log_ppl_gap_closed(ppl_transfer, ppl_target, ppl_floor):
    """`gap_closed` on log-perplexity (mean NLL, nats/token) from perplexities; NaN where target == floor."""
    return gap_closed(np.log(ppl_transfer), np.log(ppl_target), np.log(ppl_floor))


def as_float(x) -> float | None:
    """A finite float, or None (NaN / inf / None): summaries are strict JSON."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


# a bootstrap SE is withheld (None) when more than this share of its replicates is non-finite (a ratio whose
# denominator resamples to 0): the finite rest is a conditional distribution, not the statistic's
MAX_DROPPED = 0.01


def bootstrap_se(values) -> tuple[float | None, int]:
    """(SE, dropped) of bootstrap replicates [n_boot]: the standard deviation (ddof 1) of the finite ones and the
    count of non-finite ones dropped; SE None when more than MAX_DROPPED of them were dropped or < 2 are left."""
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = v[np.isfinite(v)]
    dropped = int(v.size - finite.size)
    if finite.size < 2 or dropped > MAX_DROPPED * v.size:
        return None, dropped
    return float(finite.std(ddof=1)), dropped


def paired_bootstrap(per_item: Mapping[str, Sequence[float]], statistic: Callable[[dict], np.ndarray], *,
                     n_boot: int = 1000, seed: int = 0, return_dropped: bool = False):
    """(point, SE) of statistic({mode: mean}) with one shared resample of the items for every mode
    ((point, SE, dropped) with return_dropped: how many of the n_boot replicates were non-finite).

    per_item: {mode: per-item scores [n]} over the same items in the same order (n >= 2).
    statistic: maps {mode: mean} to a value; it is called once on the point means (floats) and once
    on the bootstrap means (arrays [n_boot]), so it must be elementwise (the functions above are).
    The SE is `bootstrap_se` of the replicates: None when more than MAX_DROPPED of them are non-finite, when
    fewer than two are finite, or when the point itself is undefined (None).
    """
    arrays = {m: np.asarray(v, dtype=np.float64) for m, v in per_item.items()}
    lengths = {len(v) for v in arrays.values()}
    if len(lengths) != 1:
        raise ValueError(f"modes have different item counts { {m: len(v) for m, v in arrays.items()} }: "
                         "a paired bootstrap needs the same items in every mode")
    n = lengths.pop()
    if n < 2:
        raise ValueError(f"a bootstrap SE needs >= 2 items, got {n}")
    point = as_float(statistic({m: v.mean() for m, v in arrays.items()}))
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boot = np.asarray(statistic({m: v[idx].mean(-1) for m, v in arrays.items()}), dtype=np.float64)
    se, dropped = bootstrap_se(boot)
    if point is None:
        se = None
    return (point, se, dropped) if return_dropped else (point, se)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """Mean of a - b over the same items and its standard error std(a - b, ddof=1) / sqrt(n).

    The SE that decides whether two maps differ: per-item difficulty is shared, so it is far smaller
    than combining each map's own SE. Returns {"difference", "se", "n", "z"} (z = difference / se; None
    when se is 0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError(f"paired_difference needs two 1-D score lists of one length >= 2, got {a.shape} and {b.shape}")
    d = a - b
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    return {"difference": float(d.mean()), "se": se, "n": int(d.size), "z": float(d.mean()) / se if se > 0 else None}


def gap_closed_difference(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]], *,
                          n_boot: int = 1000, seed: int = 0) -> dict:
    """gap_closed(a) - gap_closed(b) for two maps scored on the same items, with a paired bootstrap SE.

    a, b: {"target", "transfer", "no_context": per-item scores}, the same items in one order (the baselines
    of the two runs must be the same numbers: they are the same modes on the same items). Returns
    {"difference", "se", "se_dropped" (non-finite bootstrap replicates; SE None past MAX_DROPPED)}."""
    for name in ("target", "no_context"):
        if not np.array_equal(np.asarray(a[name], dtype=float), np.asarray(b[name], dtype=float)):
            raise ValueError(f"the two runs' {name} scores differ: they were not evaluated on the same items")
    items = {"target": a["target"], "no_context": a["no_context"], "a": a["transfer"], "b": b["transfer"]}
    point, se, dropped = paired_bootstrap(
        items, lambda m: gap_closed(m["a"], m["target"], m["no_context"]) - gap_closed(m["b"], m["target"], m["no_context"]),
        n_boot=n_boot, seed=seed, return_dropped=True)
    return {"difference": point, "se": se, "se_dropped": dropped}


def ppl_gap_closed(window_nll: Mapping[str, Sequence[float]], *, n_boot: int = 1000, seed: int = 0) -> dict:
    """`gap_closed` on log-perplexity from per-window mean NLLs (nats/token), with a paired bootstrap SE.

    window_nll: {"target", "transfer", "no_context": [W] mean NLL of each window}, one window order; every
    window scores the same number of tokens, so the mean over windows is the run's NLL and log(ppl).
    Returns {"gap_closed", "gap_closed_se", "windows", "gap_closed_se_dropped" (non-finite bootstrap replicates)}."""
    x = {m: np.asarray(window_nll[m], dtype=np.float64) for m in ("target", "transfer", "no_context")}
    if any(v.ndim != 1 or v.size < 2 for v in x.values()):
        raise ValueError("ppl_gap_closed needs >= 2 windows per mode, in the same order for every mode")
    point, se, dropped = paired_bootstrap(x, lambda m: gap_closed(m["transfer"], m["target"], m["no_context"]),
                                          n_boot=n_boot, seed=seed, return_dropped=True)
    return {"gap_closed": point, "gap_closed_se": se, "windows": int(x["target"].size), "gap_closed_se_dropped": dropped}


def crossing(tokens: Sequence[float], curve, level):
    """The token count at which a truncation curve (gap closed at each of `tokens`, ascending; arrays [..., len(tokens)]
    or floats) first reaches `level` (array [...] or float), linearly interpolated in log(tokens) between the two
    points around its first upward crossing; -inf where `level` is below the curve's first point, +inf where the
    curve never reaches it, NaN where level or the curve is undefined."""
    m = np.log(np.asarray(tokens, dtype=np.float64))
    g = np.asarray(curve, dtype=np.float64)
    lv = np.asarray(level, dtype=np.float64)
    g, lv = np.broadcast_arrays(g, lv[..., None])
    lv = lv[..., 0]
    out = np.full(lv.shape, np.inf)
    done = np.zeros(lv.shape, dtype=bool)
    bad = np.isnan(lv) | np.isnan(g).any(-1)
    below = lv < g[..., 0]
    out[below], done[below] = -np.inf, True
    for i in range(g.shape[-1] - 1):
        lo, hi = g[..., i], g[..., i + 1]
        hit = ~done & (lo <= lv) & (lv <= hi)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(hi > lo, (lv - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)
        out = np.where(hit, np.exp(m[i] + t * (m[i + 1] - m[i])), out)
        done |= hit
    out[bad] = np.nan
    return float(out) if out.ndim == 0 else out


def native_token_worth(window_nll: Mapping[str, Sequence[float]], curve: Mapping[int, Sequence[float]], *,
                       mode: str = "transfer", n_boot: int = 1000, seed: int = 0) -> dict:
    """The map's worth in native tokens: the m at which the target reading only the last m context tokens
    (truncation, nothing mapped; `curve` {m: [mean NLL per window]}) closes as much of the log-perplexity gap as
    `mode` does (`window_nll` {"target", "no_context", mode: [...]}, the same windows in one order), interpolated in
    log m on the curve (`crossing`), with a paired bootstrap over windows (one shared resample for every mode and m).

    Returns {"tokens": point m (None where undefined), "lo", "hi": the 2.5 / 97.5 % bootstrap percentiles,
    "below": the point is below the curve's first m, "above": beyond its last (a bound, not a value), "curve":
    {m: gap closed}, "gap_closed": the mode's, "windows", "boot_above": share of replicates beyond the last m}."""
    ms = sorted(int(m) for m in curve)
    if not ms:
        raise ValueError("native_token_worth needs a truncation curve (eval.truncate.curve)")
    arrays = {k: np.asarray(window_nll[k], dtype=np.float64) for k in ("target", "no_context", mode)}
    arrays.update({f"m{m}": np.asarray(curve[m], dtype=np.float64) for m in ms})
    n = {len(v) for v in arrays.values()}
    if len(n) != 1 or min(n) < 2:
        raise ValueError(f"native_token_worth needs >= 2 windows, the same in every mode: { {k: len(v) for k, v in arrays.items()} }")
    n = n.pop()

    def stat(means):
        level = gap_closed(means[mode], means["target"], means["no_context"])
        pts = np.stack([np.asarray(gap_closed(means[f"m{m}"], means["target"], means["no_context"])) for m in ms], -1)
        return level, pts

    level, pts = stat({k: v.mean() for k, v in arrays.items()})
    point = crossing(ms, pts, level)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    b_level, b_pts = stat({k: v[idx].mean(-1) for k, v in arrays.items()})
    boot = crossing(ms, b_pts, b_level)
    finite = boot[~np.isnan(boot)]
    lo, hi = (np.percentile(finite, [2.5, 97.5], method="inverted_cdf") if finite.size else (np.nan, np.nan))
    clean = lambda x: None if x is None or not np.isfinite(x) else float(x)  # noqa: E731
    return {"tokens": clean(point), "lo": clean(lo), "hi": clean(hi), "below": bool(point == -np.inf),
            "above": bool(point == np.inf), "hi_above": bool(hi == np.inf), "lo_below": bool(lo == -np.inf),
            "curve": {m: as_float(g) for m, g in zip(ms, pts)}, "gap_closed": as_float(level), "windows": int(n),
            "boot_above": float(np.mean(boot == np.inf)) if boot.size else None}


def frontier(nll: Mapping[str, Sequence[float]], pts: Sequence[tuple]) -> list[tuple]:
    """The points (cost, label, mode), sorted by cost, that close more of the log-perplexity gap (`nll` {"target",
    "no_context", mode: per-window NLL}) than every cheaper one: what the money buys at best."""
    # a measured cost need not rise with the tokens read (a CPU forward's time is mostly reading the weights, and
    # the first timed batches carry warm-up), so a dearer point that closes less is dropped
    out, best = [], -math.inf
    for pt in pts:
        g = float(gap_closed(np.mean(nll[pt[2]]), np.mean(nll["target"]), np.mean(nll["no_context"])))
        if g > best:
            out.append(pt)
            best = g
    return out


def equal_cost(nll: Mapping[str, Sequence[float]], costs: Mapping[str, float], mode: str,
               curve: Sequence[tuple[str, object]], *, n_boot: int = 1000, seed: int = 0,
               cost_se: Mapping[str, float] | None = None) -> dict | None:
    """`mode`'s gap closed minus the `curve`'s interpolated linearly in cost at `mode`'s cost, ± a paired bootstrap
    SE over windows with the costs held fixed; with `cost_se` also the SE the costs' own timing error adds.

    nll: {"target", "no_context", mode, each curve mode: [per-window mean NLL]}, one window order; costs: {mode: cost}
    (measured seconds or FLOPs as a fraction of a re-prefill); curve: [(mode, label)] (the truncation curve: label m;
    a fixed rule: label r), interpolated only between its `frontier` points. None when `mode` has no cost, the
    curve has fewer than two priced points, or `mode` costs more than the curve's dearest point. Where `mode` costs
    less than the curve's cheapest point it is compared with that (dearer) point: below_curve, curve_cost, curve_m.

    Returns {"cost", "between": (label, label), "truncation": the curve's gap closed at that cost, "difference",
    "difference_se" (windows), "below_curve", "curve_cost", "curve_m"}; with cost_se ({mode: SE of its cost}, e.g.
    kvtransfer.core.timing's SE of a median ratio) also "difference_se_timing" and "difference_se_total".

    The timing term is the delta method on the interpolation, the frontier held where the point costs put it: with
    slope s = (g1 - g0) / (c1 - c0) and w = (x - c0) / (c1 - c0), SE_timing = |s| sqrt(se_x^2 + (1 - w)^2 se_c0^2 +
    w^2 se_c1^2), the three timings taken as independent; a mode below the curve is compared with a fixed point
    (SE_timing 0). Windows and timings are independent sources of error: the total is their quadrature sum.
    """
    x = costs.get(mode)
    pts = frontier(nll, sorted((costs[c], label, c) for c, label in curve if costs.get(c) is not None and c in nll))
    if x is None or len(pts) < 2 or x > pts[-1][0]:
        return None
    below = x < pts[0][0]  # the mode costs less than the curve's first point: compared with that (dearer) point
    j = 0 if below else next(i for i in range(len(pts) - 1) if pts[i][0] <= x <= pts[i + 1][0])
    (c0, m0, k0), (c1, m1, k1) = pts[j], pts[j + 1]
    w = 0.0 if below or c1 == c0 else (x - c0) / (c1 - c0)
    items = {"t": nll["target"], "f": nll["no_context"], "a": nll[mode], "m0": nll[k0], "m1": nll[k1]}

    def stat(mu):
        trunc = (1 - w) * gap_closed(mu["m0"], mu["t"], mu["f"]) + w * gap_closed(mu["m1"], mu["t"], mu["f"])
        return np.stack([np.asarray(gap_closed(mu["a"], mu["t"], mu["f"]) - trunc), np.asarray(trunc)])

    point = stat({k: np.mean(v) for k, v in items.items()})
    n = len(nll["target"])
    # the resample of every equal-cost comparison since it was first published: keep this stream
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boot = stat({k: np.asarray(v)[idx].mean(-1) for k, v in items.items()})
    out = {"cost": x, "between": (m0, m1), "truncation": float(point[1]), "difference": float(point[0]),
           "difference_se": float(np.nanstd(boot[0], ddof=1)), "below_curve": below,
           "curve_cost": c0 if below else None, "curve_m": m0 if below else None}
    if cost_se is not None:
        if below or c1 == c0:
            timing = 0.0
        else:
            g0, g1 = (float(gap_closed(np.mean(nll[k]), np.mean(nll["target"]), np.mean(nll["no_context"])))
                      for k in (k0, k1))
            missing = [k for k in (mode, k0, k1) if cost_se.get(k) is None]
            if missing:  # an unknown timing error is not a zero one
                raise KeyError(f"equal_cost: cost_se has no SE for {missing} (give 0.0 for an exact cost)")
            se_x, se_0, se_1 = (float(cost_se[k]) for k in (mode, k0, k1))
            timing = abs((g1 - g0) / (c1 - c0)) * math.sqrt(se_x ** 2 + (1 - w) ** 2 * se_0 ** 2 + w ** 2 * se_1 ** 2)
        out["difference_se_timing"] = timing
        out["difference_se_total"] = math.hypot(out["difference_se"], timing)
    return out


# task-row fields of schema 1 -> their schema-2 names (the SE of each is stderr_<name>)
_RENAMED_V1 = (("gap_closed", "gap_closed_vs_source"), ("context_gap_closed", "gap_closed"),
               ("floor_normalized", "retention_vs_chance"))


def _rename_row(row: dict) -> dict:
    out = dict(row)
    for key in [k for old, _ in _RENAMED_V1 for k in (old, f"stderr_{old}")]:
        out.pop(key, None)
    for old, new in _RENAMED_V1:
        if old in row:
            out[new] = row[old]
        if f"stderr_{old}" in row:
            out[f"stderr_{new}"] = row[f"stderr_{old}"]
    return out


def upgrade_summary(summary: dict) -> dict:
    """A copy of a summary.json in the current schema (SCHEMA_VERSION); a current one is returned unchanged.

    Schema 1 -> 2: task rows rename gap_closed -> gap_closed_vs_source, context_gap_closed -> gap_closed,
    floor_normalized -> retention_vs_chance (and their stderr_*); a perplexity row's raw-perplexity
    `transfer_gap_closed` (+ `_se`) becomes `transfer_gap_closed_raw_ppl` and `transfer_gap_closed` is
    recomputed on log-perplexity from the row's perplexities, with SE None: its per-window NLLs were
    not kept with the summary, so its SE needs a rerun."""
    version = summary.get("schema_version", 1)
    if version == SCHEMA_VERSION:
        return summary
    if version != 1:
        raise ValueError(f"summary schema_version {version} is newer than this code's {SCHEMA_VERSION}: update kvtransfer")
    out = dict(summary, schema_version=SCHEMA_VERSION, upgraded_from_schema=1)
    if isinstance(summary.get("tasks"), dict):
        out["tasks"] = {t: _rename_row(r) for t, r in summary["tasks"].items()}
    if isinstance(summary.get("tasks_average"), dict):
        out["tasks_average"] = _rename_row(summary["tasks_average"])
    rows = []
    for r in summary.get("ppl") or []:
        r = dict(r)
        if "transfer_gap_closed" in r:
            r["transfer_gap_closed_raw_ppl"] = r.pop("transfer_gap_closed")
            r["transfer_gap_closed_raw_ppl_se"] = r.pop("transfer_gap_closed_se", None)
        if r.get("prefix", 0) > 0 and None not in (r.get("transfer"), r.get("target"), r.get("no_context")):
            r["transfer_gap_closed"] = as_float(log_ppl_gap_closed(r["transfer"], r["target"], r["no_context"]))
            r["transfer_gap_closed_se"] = None
        rows.append(r)
    if "ppl" in summary:
        out["ppl"] = rows
    return out


def significant_digits(se: float) -> int:
    """Decimal places that show an SE to two significant digits (at least 0, at most 6)."""
    if se is None or not math.isfinite(se) or se <= 0:
        return 3
    return int(min(6, max(0, 1 - math.floor(math.log10(se)))))


def format_with_se(value: float | None, se: float | None, *, scale: float = 1.0, unit: str = "",
                   places: int | None = None) -> str:
    """`value ± se` rounded to what the SE supports (the SE to two significant digits, the value to the
    same decimal place), e.g. 0.39666, 0.0283 -> "0.397 ± 0.028"; scale=100, unit=" %" for percentages.
    Without an SE: three decimals (or `places`); the caller says why there is none. None -> "–"."""
    if value is None:
        return "–"
    v = scale * value
    if se is None:
        p = 3 if places is None else places
        return f"{v:.{p}f}{unit}"
    s = scale * se
    if places is None:  # an SE of exactly 0 (every resample equal) supports the value's own precision only
        places = significant_digits(s) if s > 0 else (0 if scale == 100 else 2)
    p = places
    return f"{v:.{p}f} ± {s:.{p}f}{unit}"
