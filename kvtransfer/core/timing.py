"""The timing protocol behind a "seconds" number: modes timed in one process, interleaved, repeated, with an SE.

    t = interleaved({"transfer": run_map, "truncate_tokens_16": run_trunc, "target": run_prefill},
                    repeats=5, warmup=1, reference="target", sync=torch.cuda.synchronize)
    t["median"]["transfer"], t["median_se"]["transfer"]       # seconds per call, its SE over the repeats
    t["relative"]["transfer"]                                  # {"median", "se"} of transfer / target per round

Each round calls every mode once in a fixed order (A B C A B C ...), after `warmup` untimed rounds, so a change of
the machine's load during the measurement falls on every mode alike instead of on whichever ran last. The ratio
to `reference` is taken within each round (the two calls ran seconds apart, under one load) and summarised like a
timing: the median of the per-round ratios and its SE (`median_se`). The 1/5/15-minute load
average before and after and the machine are recorded beside the numbers: a timing taken under another load or on
another machine is not the same measurement and is never merged into a table without saying so.

Pure Python (time, os, platform); a GPU caller passes `sync` (e.g. torch.cuda.synchronize), called before the
clock starts and before it stops, so queued kernels are inside the call they belong to.
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import time
from typing import Callable, Mapping, Sequence

from ..config.provenance import cpu_model

# fewer repeats give an SE of the median that is itself too noisy to print (its relative error is ~ 1 / sqrt(2 (n - 1)))
MIN_REPEATS = 5


# the large-sample SE of a median of normal noise is this factor times the mean's, sd / sqrt(n)
MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)


def median_se(seconds: Sequence[float]) -> tuple[float, float | None]:
    """(median, sqrt(pi / 2) * sd(ddof 1) / sqrt(n)) of repeated timings; SE None for fewer than 2 repeats."""
    n = len(seconds)
    if n == 0:
        raise ValueError("median_se needs at least one timing")
    med = statistics.median(seconds)
    if n < 2:
        return med, None
    return med, MEDIAN_SE_FACTOR * statistics.stdev(seconds) / math.sqrt(n)


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages now (os.getloadavg), rounded to 0.01; None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def describe_machine() -> dict:
    """This machine in words: CPU model, logical CPUs, platform and Python (no torch: a GPU caller adds its device)."""
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def interleaved(fns: Mapping[str, Callable[[], object]], *, repeats: int = MIN_REPEATS, warmup: int = 1,
                reference: str | None = None, sync: Callable[[], object] | None = None,
                clock: Callable[[], float] = time.perf_counter, machine: Mapping | None = None,
                note: str | None = None) -> dict:
    """Time every callable `repeats` (>= 5) times in interleaved rounds after `warmup` untimed rounds: per mode the
    seconds of each call, their median and its SE; with `reference`, each mode's per-round ratio to it (median, SE);
    the load average before and after and the machine beside them.

    fns: {mode: a call with no arguments} (bind the inputs; the same work every call), timed in this order each
    round. sync: called before the clock starts and stops (a GPU's queue). clock: seconds (tests inject one).
    machine: extra description merged into describe_machine() (a GPU's name). note: what was timed (e.g. "a fixed
    subsample of 8 of the 62 windows"), kept with the numbers.

    Returns {"protocol": "interleaved", "order", "repeats", "warmup", "seconds": {mode: [s per call]}, "median",
    "median_se", "reference", "relative": {mode: {"median", "se", "ratios"}} (reference given), "load_avg":
    {"before", "after"}, "machine", "note"}."""
    if repeats < MIN_REPEATS:
        raise ValueError(f"interleaved timing needs at least {MIN_REPEATS} repeats (got {repeats}): the SE of a "
                         "median of fewer is not worth printing")
    if warmup < 0 or not fns:
        raise ValueError("interleaved timing needs at least one callable and warmup >= 0")
    if reference is not None and reference not in fns:
        raise KeyError(f"reference {reference!r} is not one of the timed modes {list(fns)}")
    order = list(fns)
    sync = sync or (lambda: None)
    before = load_average()
    for _ in range(warmup):   # first calls pay for lazy initialisation, caches and allocator growth: untimed
        for mode in order:
            fns[mode]()
    sync()
    seconds: dict[str, list[float]] = {mode: [] for mode in order}
    for _ in range(repeats):
        for mode in order:
            sync()
            t0 = clock()
            fns[mode]()
            sync()
            seconds[mode].append(clock() - t0)
    after = load_average()
    med = {mode: median_se(s) for mode, s in seconds.items()}
    out = {"protocol": "interleaved", "order": order, "repeats": repeats, "warmup": warmup, "seconds": seconds,
           "median": {m: v[0] for m, v in med.items()}, "median_se": {m: v[1] for m, v in med.items()},
           "reference": reference, "load_avg": {"before": before, "after": after},
           "machine": {**describe_machine(), **dict(machine or {})}, "note": note}
    if reference is not None:
        rel = {}
        for mode in order:
            ratios = [a / b for a, b in zip(seconds[mode], seconds[reference])]
            m, se = median_se(ratios)
            rel[mode] = {"median": m, "se": se, "ratios": ratios}
        out["relative"] = rel
    return out
