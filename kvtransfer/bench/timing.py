"""Timing: warm-up, synchronisation and the median of repeated runs, and the device rates floors use.

`time_fn` rotates distinct inputs (never all-zero ones) and reports median / quartiles / extremes in
ms (CUDA events on a GPU, perf_counter + synchronize elsewhere); `measure_device` measures the matmul
rate and copy bandwidth once per run, `gemm_rate` the rate of a workload's own GEMM shape right before
it runs (what its floor uses); `available_bytes` and `load_average` describe the machine.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import torch


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def time_fn(fn: Callable, inputs: Sequence, *, warmup: int = 3, repeats: int = 10, device="cpu") -> dict:
    """Run fn(inputs[i % len(inputs)]) `warmup` times, then time `repeats` runs (ms).

    CUDA: events around each call; otherwise perf_counter (+ synchronize). Inputs rotate; an input
    holding an all-zero tensor is rejected (ValueError). Returns median/min/max/q1/q3 ms, n, times.
    """
    if not inputs:
        raise ValueError("time_fn needs at least one input")
    for i, inp in enumerate(inputs):
        for t in _tensors(inp):
            if t.numel() and not bool(t.any()):
                raise ValueError(f"input {i} holds an all-zero tensor {tuple(t.shape)}: use random inputs")
    cuda = torch.device(device).type == "cuda"
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    _sync(device)
    times = []
    for i in range(repeats):
        inp = inputs[i % len(inputs)]
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(inp)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(inp)
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
    qs = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "q1_ms": qs[0], "q3_ms": qs[2], "n": len(times), "times_ms": times}


def measure_device(device="cpu", dtype=torch.float32, *, n: int | None = None, copy_mib: int | None = None) -> dict:
    """Measured once per run: matmul rate (FLOP/s, best of 5 n x n x n torch.matmul in `dtype`) and
    copy bandwidth (bytes/s, read + write of one large tensor copy, best of 5)."""
    cuda = torch.device(device).type == "cuda"
    n = n or (8192 if cuda else 2048)
    copy_mib = copy_mib or (2048 if cuda else 256)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    mm = time_fn(lambda x: torch.matmul(x, b), [a], warmup=2, repeats=5, device=device)
    src = torch.randn(copy_mib << 18, device=device).to(dtype)
    dst = torch.empty_like(src)
    cp = time_fn(lambda x: dst.copy_(x), [src], warmup=2, repeats=5, device=device)
    # best of the repeats: a floor must use the highest rate the device showed
    return {"device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "matmul_flops_per_s": 2 * n ** 3 / (mm["min_ms"] / 1e3),
            "copy_bytes_per_s": 2 * src.numel() * src.element_size() / (cp["min_ms"] / 1e3),
            "matmul_n": n, "copy_mib": copy_mib}


def gemm_rate(m: int, k: int, n: int, *, device="cpu", dtype=torch.float32, repeats: int = 5) -> float:
    """FLOP/s of torch.matmul on the workload's own GEMM shape [m, k] @ [k, n] (best of `repeats` after 1
    warm-up), measured right before that workload runs.

    A floor must use the rate the workload can reach: a square n x n matmul measured once per run
    (`measure_device`) can be slower than the prefill's tall-skinny MLP GEMMs, or measured under another
    load, and a floor from it is then beaten by the very workload it bounds."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    r = time_fn(lambda x: torch.matmul(x, b), [a], warmup=1, repeats=repeats, device=device)
    return 2 * m * k * n / (r["min_ms"] / 1e3)


def workload_caps(caps: dict, rate: float) -> dict:
    """`caps` with the matmul rate raised to `rate` where that is higher (a floor uses the best rate seen)."""
    return dict(caps, matmul_flops_per_s=max(caps["matmul_flops_per_s"], rate))


def available_bytes(device="cpu") -> int:
    """Free memory on `device` in bytes (CUDA: mem_get_info; CPU: MemAvailable)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load_average() -> str:
    """`uptime`-style 1/5/15-minute load averages and the CPU count, e.g. '1.53 0.93 0.40 (2 cpus)'."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} cpus)"
    except OSError:
        return "n/a"
