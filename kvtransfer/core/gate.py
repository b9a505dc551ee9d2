"""A per-request quality gate for a mapped cache: a score from what a handoff already has, and a decision.

Score (`tail_score`): at the last `tail` positions of the mapped prefix the target also computes the K/V
itself, on top of the mapped cache of the tokens before them (what a native tail of that length computes
anyway). Per layer, the squared error of the map's K (and V) at those positions relative to the target's
own energy there, K and V weighted equally; the score is the mean over layers (0 = the map predicts the
target's own tail exactly; 1 = an error as large as the signal). Cost: `tail` tokens of target forward on
the mapped cache, i.e. about tail / P of a re-prefill of a P-token context.

Decision (`decide`): score <= thresholds["recompute"] -> map; <= thresholds["full"] -> recompute a fraction
thresholds["fraction"] of the tokens (kvtransfer.core.recompute); above, or any score or thresholds that cannot be
read -> full prefill, with the reason. `decide` never raises.

Thresholds (`fit_thresholds`) are quantiles of the score on calibration text (never evaluation items) for
stated rates: a fraction `full_rate` of calibration requests would fall back to a full prefill, a further
`recompute_rate` would be partly recomputed.

A numerical core module: no Hydra, lm-eval or W&B.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cache import KVLayers, forward_on_cache

ACTIONS = ("map", "recompute", "full")


@dataclass(frozen=True)
class Decision:
    """What the gate did for one request: action in ACTIONS, the fraction of context tokens the target
    recomputes (0 map, thresholds' fraction recompute, 1 full prefill), the score and a reason."""
    action: str
    fraction: float
    score: float | None
    reason: str

    def as_dict(self) -> dict:
        """A JSON-able record of the decision."""
        return {"action": self.action, "fraction": self.fraction, "score": self.score, "reason": self.reason}


def layer_errors(mapped: KVLayers, native: KVLayers) -> torch.Tensor:
    """[batch, L] float64: per layer, (|K_m - K_n|^2 / |K_n|^2 + |V_m - V_n|^2 / |V_n|^2) / 2 over the
    (heads, positions, dims) of each row; mapped/native per-layer (K, V) [batch, n_kv, m, d] at the same
    positions."""
    if len(mapped) != len(native):
        raise ValueError(f"{len(mapped)} mapped layers vs {len(native)} native layers")
    out = []
    for (mk, mv), (nk, nv) in zip(mapped, native):
        per = []
        for m, n in ((mk, nk), (mv, nv)):
            m, n = m.double(), n.double().to(m.device)
            per.append((m - n).pow(2).sum(dim=(1, 2, 3)) / n.pow(2).sum(dim=(1, 2, 3)).clamp_min(1e-30))
        out.append((per[0] + per[1]) / 2)
    return torch.stack(out, dim=1).cpu()


def tail_score_kv(mapped: KVLayers, native: KVLayers) -> torch.Tensor:
    """[batch] float64: the tail score from the map's and the target's own per-layer (K, V) [batch, n_kv, m, d] at the
    same tail positions (mean over layers of `layer_errors`); what `tail_score` and the vLLM connector both use."""
    return layer_errors(mapped, native).mean(dim=1)


@torch.no_grad()
def tail_score(target_model, mapped: KVLayers, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor | None,
               tail: int, *, return_logits: bool = False) -> tuple[torch.Tensor, ...]:
    """(score [batch], per-layer errors [batch, L]) float64 of a mapped prefix cache.

    mapped: per-layer (K, V) [batch, n_kv, P, d] of the left-padded prefix `prefix_ids` [batch, P]
    (`prefix_mask` 0/1). The target runs the last `tail` prefix tokens on the mapped cache of the first
    P - tail and its K/V there are compared with the mapped ones (`layer_errors`); score = mean over layers.
    A row with fewer than tail + 1 real tokens gets NaN (the gate then falls back: `decide`).
    With `return_logits`, also the target's logits [batch, tail, vocab] (model dtype) of that same forward
    (position j predicts the token after tail token j; kvtransfer.core.signals reads them), None when P <= tail."""
    batch, seq = prefix_ids.shape
    tail = int(tail)
    if tail < 1:
        raise ValueError(f"gate tail={tail}: the score needs at least one tail token (eval.gate.tail >= 1)")
    nan = torch.full((batch,), math.nan, dtype=torch.float64)  # device: scores are host-side, as layer_errors returns them
    if seq <= tail:
        out = nan, torch.full((batch, len(mapped)), math.nan, dtype=torch.float64)  # device: host-side, as above
        return (*out, None) if return_logits else out
    mask = torch.ones_like(prefix_ids) if prefix_mask is None else prefix_mask
    head = [(k[:, :, :-tail], v[:, :, :-tail]) for k, v in mapped]
    dev = target_model.device
    logits, cache = forward_on_cache(target_model, head, mask[:, :-tail].to(dev), prefix_ids[:, -tail:].to(dev),
                                mask[:, -tail:].to(dev), return_cache=True)
    native = [(layer.keys[:, :, -tail:], layer.values[:, :, -tail:]) for layer in cache.layers]
    tail_mapped = [(k[:, :, -tail:], v[:, :, -tail:]) for k, v in mapped]
    errors = layer_errors(tail_mapped, native)
    score = errors.mean(dim=1)  # = tail_score_kv(tail_mapped, native)
    short = mask.long().sum(-1).cpu() <= tail
    score[short] = math.nan
    errors[short] = math.nan
    return (score, errors, logits) if return_logits else (score, errors)


def check_thresholds(thresholds) -> dict:
    """The thresholds as {"recompute": float, "full": float, "fraction": float} or ValueError naming what is
    wrong (missing key, non-finite value, recompute > full, fraction outside (0, 1])."""
    if not isinstance(thresholds, dict):
        raise ValueError(f"gate thresholds must be a dict with recompute, full, fraction; got {type(thresholds).__name__}")
    missing = [k for k in ("recompute", "full", "fraction") if k not in thresholds]
    if missing:
        raise ValueError(f"gate thresholds lack {missing} (fit them with kvtransfer.core.gate.fit_thresholds)")
    t = {k: float(thresholds[k]) for k in ("recompute", "full", "fraction")}
    if not all(math.isfinite(v) for v in t.values()):
        raise ValueError(f"gate thresholds {t} are not finite")
    if t["recompute"] > t["full"]:
        raise ValueError(f"gate thresholds: recompute {t['recompute']} above full {t['full']}")
    if not 0.0 < t["fraction"] <= 1.0:
        raise ValueError(f"gate recompute fraction {t['fraction']} must be in (0, 1]")
    return t


def decide(score, thresholds) -> Decision:
    """map / recompute(fraction) / full prefill for one request's score (see module doc). Never raises: a
    score that is not a finite number, or thresholds `check_thresholds` refuses, give a full prefill with the
    reason."""
    try:
        t = check_thresholds(thresholds)
    except (ValueError, TypeError) as err:
        return Decision("full", 1.0, None, f"bad thresholds: {err}")
    try:
        s = float(score)
    except (TypeError, ValueError):
        return Decision("full", 1.0, None, f"score {score!r} is not a number")
    if not math.isfinite(s):
        return Decision("full", 1.0, None, "no score (context too short for the gate tail, or non-finite)")
    if s <= t["recompute"]:
        return Decision("map", 0.0, s, f"score {s:.4g} <= {t['recompute']:.4g}")
    if s <= t["full"]:
        return Decision("recompute", t["fraction"], s, f"{t['recompute']:.4g} < score {s:.4g} <= {t['full']:.4g}")
    return Decision("full", 1.0, s, f"score {s:.4g} > {t['full']:.4g}")


def fit_thresholds(scores, *, recompute_rate: float, full_rate: float, fraction: float) -> dict:
    """{"recompute", "full", "fraction", "rates", "n"} from calibration-text scores: "full" is the (1 -
    full_rate) quantile of the finite scores, "recompute" the (1 - full_rate - recompute_rate) quantile (so
    about those shares of calibration requests land above each). Rates >= 0 summing to <= 1; ValueError naming
    the fix for bad rates or no finite score."""
    r, f = float(recompute_rate), float(full_rate)
    if r < 0 or f < 0 or r + f > 1:
        raise ValueError(f"gate rates recompute_rate={r}, full_rate={f}: each >= 0 and together <= 1")
    s = torch.as_tensor([float(x) for x in scores], dtype=torch.float64)  # device: host-side scores (Python floats)
    s = s[torch.isfinite(s)]
    if s.numel() == 0:
        raise ValueError("no finite gate score on the calibration text: use longer calibration sequences than "
                         "eval.gate.tail")
    full = float(torch.quantile(s, 1 - f)) if f > 0 else float(s.max())
    rec = float(torch.quantile(s, 1 - f - r)) if f + r > 0 else float(s.max())
    out = {"recompute": rec, "full": full, "fraction": float(fraction), "rates": {"recompute": r, "full": f},
           "n": int(s.numel())}
    check_thresholds(out)
    return out


def action_counts(decisions: list[Decision | dict]) -> dict:
    """{"map", "recompute", "full": counts, "requests", "recompute_rate": mean fraction of context tokens the
    target recomputed (full prefill = 1), "fallbacks": decisions without a score}."""
    rows = [d.as_dict() if isinstance(d, Decision) else d for d in decisions]
    out = {a: sum(1 for d in rows if d["action"] == a) for a in ACTIONS}
    out["requests"] = len(rows)
    out["recompute_rate"] = float(sum(d["fraction"] for d in rows) / len(rows)) if rows else 0.0
    out["fallbacks"] = sum(1 for d in rows if d["score"] is None)
    return out


def roc_auc(scores, positives) -> float:
    """ROC AUC of `scores` (higher = more likely positive) for boolean `positives`: the probability that a
    random positive outscores a random negative (ties count half). NaN with no positive or no negative."""
    s = [float(x) for x in scores]
    y = [bool(p) for p in positives]
    pos = [a for a, p in zip(s, y) if p]
    neg = [a for a, p in zip(s, y) if not p]
    if not pos or not neg:
        return math.nan
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def bootstrap_auc(scores, positives, *, n_boot: int = 1000, seed: int = 0) -> dict:
    """{"auc", "se", "n", "positives"}: ROC AUC and its bootstrap SE over items (resamples lacking a class are
    skipped)."""
    import random

    s, y = list(scores), [bool(p) for p in positives]
    auc = roc_auc(s, y)
    rng = random.Random(seed)
    boots = []
    for _ in range(n_boot):
        idx = [rng.randrange(len(s)) for _ in s]
        a = roc_auc([s[i] for i in idx], [y[i] for i in idx])
        if not math.isnan(a):
            boots.append(a)
    se = (sum((b - sum(boots) / len(boots)) ** 2 for b in boots) / (len(boots) - 1)) ** 0.5 if len(boots) > 1 \
        else math.nan
    return {"auc": auc, "se": se, "n": len(s), "positives": sum(y)}


def save_gate(path, thresholds: dict, meta: dict) -> None:
    """Write the gate artifact (JSON: thresholds + how they were chosen) atomically."""
    from .io import atomic_write_json

    atomic_write_json(path, {"format": "kvtransfer-gate/1", "thresholds": check_thresholds(thresholds) | {
        k: v for k, v in thresholds.items() if k not in ("recompute", "full", "fraction")}, **meta})


def load_gate(path) -> dict:
    """The gate artifact written by `save_gate`; ValueError when it is not one."""
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    if data.get("format") != "kvtransfer-gate/1":
        raise ValueError(f"{path} is not a kvtransfer gate artifact (format {data.get('format')!r})")
    check_thresholds(data["thresholds"])
    return data
