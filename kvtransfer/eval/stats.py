"""Standard errors that are not a paired bootstrap over items: the one set of estimators every collect script uses.

    mean_se(xs)                          mean and sample sd / sqrt(n): independent items (accuracy over items)
    binomial_se(share, n)                a share of n independent yes/no outcomes (a gate's action rates)
    clustered_mean(values, clusters)     pooled mean of observations grouped in clusters (CoQA turns by
                                         conversation), SE from the cluster totals, a Student-t interval with
                                         clusters - 1 degrees of freedom
    clustered_ratio(num, den, clusters)  sum(num) / sum(den) with the same clustered SE (retention = transfer / target)
    t_quantile(p, df)                    Student t quantile (pure Python: no scipy)
    median_se(seconds)                   a timing: the median of repeats and its SE over the repeats

Why clustered: turns of one conversation share a story and a history, so they are not independent; an SE over
turns understates the spread. Why analytic and t-based: a bootstrap over 5 clusters sees at most 126 distinct
resamples and its SE is sqrt((C - 1) / C) = 0.89x the unbiased one at C = 5, and a normal interval at 4
degrees of freedom is 1.42x too narrow (t = 2.78, not 1.96).

The clustered SE is the linearised (sandwich) SE of a ratio of sums, with the small-sample factor C / (C - 1):
for value = sum(num) / sum(den) over all observations and per-cluster totals Y_c = sum of num, N_c = sum of den,

    SE^2 = C / (C - 1) * sum_c ((Y_c - value * N_c) / sum(den))^2.

With den = 1 (a mean) and clusters of equal size this is exactly sd(cluster means, ddof 1) / sqrt(C).

The timing SE: the median of n repeats (robust to one load spike) with SE sqrt(pi / 2) * sd(ddof 1) / sqrt(n),
the large-sample SE of a median of normal noise. Chosen over a bootstrap of the median because at n = 5 that
bootstrap takes a handful of distinct values and is itself noisy; chosen over a MAD-based SE because that one is
0 when 3 of 5 repeats coincide. A load spike inflates the sd, so under skewed noise this SE errs large, not small.

Pure Python (no numpy needed); statistics / math only.
"""
from __future__ import annotations

import math
import statistics
from typing import Hashable, Sequence

from ..core.timing import MEDIAN_SE_FACTOR, median_se  # noqa: F401,E402 -- the timing protocol's, re-exported here


def mean_se(xs: Sequence[float]) -> tuple[float, float | None]:
    """(mean, sample sd (ddof 1) / sqrt(n)) of independent observations; SE None for fewer than 2."""
    n = len(xs)
    if n == 0:
        raise ValueError("mean_se needs at least one value")
    m = sum(xs) / n
    if n < 2:
        return m, None
    return m, (sum((x - m) ** 2 for x in xs) / (n - 1) / n) ** 0.5


def binomial_se(share: float, n: int) -> float:
    """sqrt(share (1 - share) / n): the SE of a share of n independent yes/no outcomes."""
    return math.sqrt(share * (1 - share) / n)


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta (modified Lentz; Numerical Recipes 6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta I_x(a, b) for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):   # the fraction converges fast on this side; use the symmetry on the other
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df > 0 degrees of freedom (df = inf: the standard normal)."""
    if math.isinf(df):
        return statistics.NormalDist().cdf(t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with df > 0 degrees of freedom (df = inf: the normal's), to ~1e-12."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if math.isinf(df):
        return statistics.NormalDist().inv_cdf(p)
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):   # bisection: the CDF is monotone; 200 halvings reach float resolution
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def t_interval(value: float, se: float | None, df: float, level: float = 0.95) -> tuple[float | None, float | None]:
    """(lo, hi) = value -/+ t_quantile((1 + level) / 2, df) * se; (None, None) without an SE or df."""
    if se is None or value is None or not df or df <= 0:
        return None, None
    half = t_quantile((1.0 + level) / 2.0, df) * se
    return value - half, value + half


def clustered_ratio(num: Sequence[float], den: Sequence[float], clusters: Sequence[Hashable], *,
                    level: float = 0.95) -> dict:
    """sum(num) / sum(den) over all observations with its SE clustered by `clusters` (one id per observation).

    Returns {"value", "se", "clusters" (C), "n" (observations), "df" (C - 1), "lo", "hi" (the Student-t interval
    at `level`)}; value None where sum(den) is 0, SE (and interval) None for fewer than 2 clusters."""
    if not len(num) == len(den) == len(clusters) or not len(num):
        raise ValueError(f"clustered_ratio needs one cluster id per observation and at least one observation, got "
                         f"{len(num)} numerators, {len(den)} denominators, {len(clusters)} ids")
    tot_num: dict = {}
    tot_den: dict = {}
    for y, d, c in zip(num, den, clusters):
        tot_num[c] = tot_num.get(c, 0.0) + float(y)
        tot_den[c] = tot_den.get(c, 0.0) + float(d)
    n_c = len(tot_num)
    all_num, all_den = sum(tot_num.values()), sum(tot_den.values())
    out = {"value": None, "se": None, "clusters": n_c, "n": len(num), "df": n_c - 1, "lo": None, "hi": None}
    if all_den == 0:
        return out
    value = all_num / all_den
    out["value"] = value
    if n_c < 2:
        return out
    resid = sum(((tot_num[c] - value * tot_den[c]) / all_den) ** 2 for c in tot_num)
    out["se"] = math.sqrt(n_c / (n_c - 1) * resid)
    out["lo"], out["hi"] = t_interval(value, out["se"], n_c - 1, level)
    return out


def clustered_mean(values: Sequence[float], clusters: Sequence[Hashable], *, level: float = 0.95) -> dict:
    """The pooled mean of `values` with its SE clustered by `clusters`: clustered_ratio(values, 1 each, clusters)."""
    return clustered_ratio(values, [1.0] * len(values), clusters, level=level)
