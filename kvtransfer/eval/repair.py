"""Names of the repair modes (selective recompute and the per-request gate, issue 30): `recompute_<r>` recomputes
a fraction r of the context tokens chosen by their first-layer deviation, `recompute_<rule>_<r>` by another
rule of kvtransfer.core.recompute.SELECTIONS, and `gated` lets the gate decide per request."""
from __future__ import annotations

REPAIR_PREFIX = "recompute_"  # recompute_<r> (deviation-chosen tokens) and recompute_<select>_<r>


def repair_modes(ecfg: dict) -> list[str]:
    """The selective-recompute modes of eval.recompute_fraction x eval.recompute_select, then `gated` when
    eval.gate.enabled (kvtransfer.core.recompute, kvtransfer.core.gate). ValueError naming the fix for a bad r or rule,
    and the valid names for a bad eval.gate.score or eval.gate.signals (kvtransfer.core.signals)."""
    from ..core.recompute import SELECTIONS

    fractions = list(ecfg.get("recompute_fraction") or [])
    selects = list(ecfg.get("recompute_select") or ["deviation"])
    bad = [f for f in fractions if not isinstance(f, (int, float)) or not 0 <= float(f) <= 1]
    if bad:
        raise ValueError(f"eval.recompute_fraction={fractions}: {bad} not in [0, 1]; e.g. [0,0.15,1]")
    unknown = [s for s in selects if s not in SELECTIONS]
    if unknown:
        raise ValueError(f"eval.recompute_select={selects}: unknown {unknown}; use a list of {list(SELECTIONS)}")
    modes = [repair_mode(float(f), s) for s in selects for f in fractions]
    if (ecfg.get("gate") or {}).get("enabled"):
        from ..core.signals import DEFAULT_SCORE, check_score, check_signals

        check_score(ecfg["gate"].get("score", DEFAULT_SCORE))  # ValueError naming the valid signals
        check_signals(ecfg["gate"].get("signals"))
        modes.append("gated")
    return list(dict.fromkeys(modes))


def repair_mode(fraction: float, select: str = "deviation") -> str:
    """Mode name of recomputing `fraction` of the tokens chosen by `select`: recompute_0.15, recompute_random_0.15."""
    return f"{REPAIR_PREFIX}{fraction:g}" if select == "deviation" else f"{REPAIR_PREFIX}{select}_{fraction:g}"


def parse_repair_mode(mode: str) -> tuple[float, str]:
    """(fraction, select) of a `repair_mode` name."""
    body = mode[len(REPAIR_PREFIX):]
    select, _, r = body.rpartition("_")
    return float(r), select or "deviation"


# Equal-cost baselines: the target reads a truncated prompt, nothing mapped (KVTransferLM mode `truncate`).
TRUNCATE_PREFIX = "truncate_"         # truncate_<r>: the twin of recompute_<rule>_<r> (the tokens recent at r recomputes)
TRUNCATE_TOKENS_PREFIX = "truncate_tokens_"   # truncate_tokens_<m>: the last m context tokens (the truncation curve)


def truncate_mode(fraction: float) -> str:
    """Mode name of the truncation twin of recompute fraction r: truncate_0.3."""
    return f"{TRUNCATE_PREFIX}{float(fraction):g}"


def truncate_tokens_mode(tokens: int) -> str:
    """Mode name of the truncation curve's point m: truncate_tokens_16."""
    return f"{TRUNCATE_TOKENS_PREFIX}{int(tokens)}"


def is_truncate_mode(mode: str) -> bool:
    """Whether `mode` is a truncation baseline (truncate_<r> or truncate_tokens_<m>)."""
    return mode.startswith(TRUNCATE_PREFIX)


def parse_truncate_mode(mode: str) -> dict:
    """{"truncate_tokens": m} or {"truncate_fraction": r} of a truncation mode name."""
    if mode.startswith(TRUNCATE_TOKENS_PREFIX):
        return {"truncate_tokens": int(mode[len(TRUNCATE_TOKENS_PREFIX):])}
    return {"truncate_fraction": float(mode[len(TRUNCATE_PREFIX):])}


def truncation_twins(ecfg: dict) -> list[str]:
    """truncate_<r> for each fraction r of eval.recompute_fraction (when eval.truncate.twins, default on):
    beside every recompute_<rule>_<r> the target reading the same count of most recent tokens, nothing mapped."""
    tcfg = ecfg.get("truncate") or {}
    if not tcfg.get("twins", True):
        return []
    return list(dict.fromkeys(truncate_mode(float(f)) for f in (ecfg.get("recompute_fraction") or [])))


def coqa_twins(ecfg: dict) -> list[str]:
    """truncate_tokens_<m> for each m of eval.coqa.truncate when CoQA runs: the conversation's equal-cost twins (the
    target reads only the last m tokens of each turn's prompt / of the story; kvtransfer.eval.coqa)."""
    ccfg = ecfg.get("coqa") or {}
    if not ccfg.get("enabled"):
        return []
    tokens = ccfg.get("truncate") or []
    bad = [m for m in tokens if not isinstance(m, int) or isinstance(m, bool) or m < 1]
    if bad:
        raise ValueError(f"eval.coqa.truncate={tokens}: {bad} are not token counts >= 1; e.g. [32, 128] or []")
    return [truncate_tokens_mode(m) for m in sorted(set(tokens))]


def truncation_curve(ecfg: dict, *, repair: bool) -> list[str]:
    """truncate_tokens_<m> for m of eval.truncate.curve below the largest perplexity prefix (m >= P is the target
    itself), run on the perplexity sets when repair modes run or eval.truncate.always; [] when perplexity is off."""
    tcfg = ecfg.get("truncate") or {}
    ppl = ecfg.get("ppl") or {}
    if not ppl.get("enabled") or not (repair or tcfg.get("always", False)):
        return []
    top = max(ppl.get("prefixes") or [0])
    bad = [m for m in tcfg.get("curve") or [] if not isinstance(m, int) or m < 1]
    if bad:
        raise ValueError(f"eval.truncate.curve={tcfg.get('curve')}: {bad} are not token counts >= 1; e.g. [1,4,16,64]")
    return [truncate_tokens_mode(m) for m in sorted(set(tcfg.get("curve") or [])) if m < top]
