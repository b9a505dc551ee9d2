"""The handoff proxy's counters: what it did with each request (by outcome, fallback reason, handoff event, error)
and the tokens it mapped, found cached and prefilled; served as JSON (`/kvtransfer/stats`) and in Prometheus' text
format (`/metrics`)."""
from __future__ import annotations

from collections import Counter

from .proxy_state import Outcome


class Stats:
    """The proxy's counters (requests, routes, mapped, fallbacks by reason, errors), served as JSON."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.errors: Counter = Counter()
        self.mapped_tokens = 0
        self.cached_tokens = 0
        self.prefilled_tokens = 0
        self.handoff: Counter = Counter()  # switches, write-through, partial maps, rewritten histories, waits

    def outcome(self, out: Outcome) -> None:
        """Count one request's outcome (its status, its fallback reason, its mapped and prefilled tokens)."""
        self.counts[out.status] += 1
        self.cached_tokens += out.cached or 0
        if out.status.startswith("fallback"):
            self.fallbacks[f"{out.status}:{out.code}"] += 1
        self.mapped_tokens += out.mapped or 0
        self.prefilled_tokens += out.prefilled or 0

    def as_dict(self) -> dict:
        """The counters as JSON-ready dicts (what `/kvtransfer/stats` serves)."""
        return {"counts": dict(self.counts), "fallbacks": dict(self.fallbacks), "errors": dict(self.errors),
                "handoff": dict(self.handoff), "mapped_tokens": self.mapped_tokens,
                "cached_tokens": self.cached_tokens, "prefilled_tokens": self.prefilled_tokens}


def prometheus_text(stats: dict) -> str:
    """The proxy's counters in Prometheus' text format (every name prefixed kvtransfer_proxy_)."""
    lines = []
    for group in ("counts", "fallbacks", "errors", "handoff"):
        name = f"kvtransfer_proxy_{group}_total"
        lines.append(f"# TYPE {name} counter")
        for label, value in sorted(stats.get(group, {}).items()):
            escaped = str(label).replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{name}{{kind="{escaped}"}} {value}')
    for key in ("mapped_tokens", "cached_tokens", "prefilled_tokens"):
        lines += [f"# TYPE kvtransfer_proxy_{key}_total counter", f"kvtransfer_proxy_{key}_total {stats.get(key, 0)}"]
    if stats.get("sessions") is not None:  # a table shared in Redis is not counted by one proxy
        lines += ["# TYPE kvtransfer_proxy_sessions gauge", f"kvtransfer_proxy_sessions {stats['sessions']}"]
    lines += _store_lines(stats.get("store") or {})
    return "\n".join(lines) + "\n"


def _label(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"')


def _store_lines(store: dict) -> list[str]:
    """The proxy's own store calls (a Redis store's tier counters: BlockStore.tier_stats), by operation: calls,
    hits, misses, errors by kind, and latency as a Prometheus summary's sum and count."""
    if not store:
        return []
    lines = []
    for group, name in (("hits", "hits"), ("misses", "misses"), ("errors", "errors")):
        metric = f"kvtransfer_proxy_store_{name}_total"
        lines.append(f"# TYPE {metric} counter")
        label = "kind" if group == "errors" else "op"
        for key, value in sorted((store.get(group) or {}).items()):
            lines.append(f'{metric}{{{label}="{_label(key)}"}} {value}')
    lines.append("# TYPE kvtransfer_proxy_store_latency_seconds summary")
    for op, count in sorted((store.get("calls") or {}).items()):
        total = (store.get("latency_s_sum") or {}).get(op, 0.0)
        lines += [f'kvtransfer_proxy_store_latency_seconds_sum{{op="{_label(op)}"}} {total}',
                  f'kvtransfer_proxy_store_latency_seconds_count{{op="{_label(op)}"}} {count}']
    return lines
