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
