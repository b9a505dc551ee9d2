"""A model of what each mode of the equal-cost tables would cost on one H200 (bf16, batch 1, one context at a time):
not a measurement of the real pair on a GPU (none was at hand), but its FLOPs priced at the rates the harness's bench
measured there (h200_bench.yaml, Qwen3-14B -> 32B shapes).

- A prefill of n tokens with F FLOPs takes max(F / R_prefill(n), W / B): R_prefill(n) is the bench's achieved prefill
  rate (its FLOPs over its milliseconds) at n tokens, interpolated in log n and held at the nearest measured size
  outside 1,024-32,768 tokens; W / B is one read of the target's weights (bf16, 2 bytes per parameter, one parameter
  per 2 FLOPs of a token) at the measured copy rate -- below ~120 tokens the 1.5B's prefill is bound by it.
- The map of a P-token context with F_map FLOPs takes F_map / R_map(P), the bench's achieved bf16 map rate at P.
- A mode costs its map (mapped modes) plus its target prefill (the native-sink token, a recompute's share, a
  truncation's tokens), over the target's re-prefill of the whole context. The source's prefill is not counted.
  Each mode's prefill is its own forward, as the CPU timing protocol measures it, so the native-sink token alone pays
  a weight read; a server that folds it into the new turn's prefill pays the map alone (the FLOPs columns' view).

The rates of a 32B model's GEMMs flatter a 1.5B's prefill (smaller matrices run further below the matmul peak), which
favours truncation; the weight-read floor charges a short prefill what a GPU pays for it, which favours the map.
"""
from __future__ import annotations

import math
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().with_name("h200_bench.yaml")


def load(path: Path = BENCH) -> dict:
    """The bench table: {"rows": [{"tokens", "prefill_ms", "prefill_floor_ms", "map_ms", "map_floor_ms"}], the
    ceilings "matmul_bf16_flops_per_s" and "copy_bytes_per_s", "device"}."""
    return yaml.safe_load(path.read_text())


def rate(bench: dict, kind: str, tokens: float) -> float:
    """FLOPs per second the bench achieved for `kind` ("prefill" or "map") at `tokens`: the matmul rate x floor / ms,
    linear in log tokens between measured sizes, held at the first / last size outside them."""
    rows = sorted(bench["rows"], key=lambda r: r["tokens"])
    peak = bench["matmul_bf16_flops_per_s"]
    pts = [(math.log(r["tokens"]), peak * r[f"{kind}_floor_ms"] / r[f"{kind}_ms"]) for r in rows]
    x = math.log(max(tokens, 1.0))
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable: x lies between the first and last size")


def prefill_seconds(bench: dict, flops: float, tokens: float, flops_per_token: float) -> float:
    """Seconds of a target prefill of `tokens` tokens costing `flops`: the bench's prefill rate at that size, and at
    least one read of the weights (bf16: `flops_per_token` bytes, 2 bytes per parameter, 2 FLOPs per parameter)."""
    if flops <= 0:
        return 0.0
    return max(flops / rate(bench, "prefill", tokens), flops_per_token / bench["copy_bytes_per_s"])


def mode_cost(bench: dict, *, flops_rel: float, map_flops_rel: float, prefix_tokens: float,
              reference_flops: float) -> float:
    """A mode's modelled seconds over the target's re-prefill of the `prefix_tokens`-token context: its map
    (`map_flops_rel` of a re-prefill's FLOPs, 0 for an unmapped mode) at the map rate at P, plus its target prefill
    (the rest of `flops_rel`) at the prefill rate at its own size, floored at one weight read."""
    per_token = reference_flops / prefix_tokens
    target_rel = max(flops_rel - map_flops_rel, 0.0)
    whole = prefill_seconds(bench, reference_flops, prefix_tokens, per_token)
    mapped = map_flops_rel * reference_flops / rate(bench, "map", prefix_tokens) if map_flops_rel else 0.0
    own = prefill_seconds(bench, target_rel * reference_flops, target_rel * prefix_tokens, per_token)
    return (mapped + own) / whole
