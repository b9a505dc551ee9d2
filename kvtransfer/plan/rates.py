"""Sustained rates the plan's time estimates divide by, each with its source (datasheet, assumption or a
measurement on this machine). Times are estimates to an order of magnitude; the plan says which rates it used."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# Peak dense rates (FLOP/s) and memory bandwidth (bytes/s) from NVIDIA's SXM datasheets: H100 SXM5
# 80 GB: BF16/FP16 tensor 989 TFLOP/s (dense), FP32 67, FP64 tensor core 67, HBM3 3.35 TB/s; H200 SXM:
# the same compute, HBM3e 4.8 TB/s, 141 GB; A100 SXM 80 GB: BF16 312, FP32 19.5, FP64 tensor 19.5,
# 2.04 TB/s. torch runs FP32 matmuls without TF32 by default, hence the plain FP32 rate.
DEVICES = {
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float64": 67e12, "bw": 3.35e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float64": 67e12, "bw": 4.8e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12, "float64": 19.5e12, "bw": 2.04e12},
}
EFFICIENCY = {"matmul": 0.6, "bandwidth": 0.8}
DEVICE_SOURCE = ("NVIDIA H100/H200/A100 SXM datasheets (dense peaks) x efficiency "
                 "{matmul: 0.6, bandwidth: 0.8} (assumed)")
# Host side of a GPU node (the fit's float64 solves, the moments merge, checkpoints) -- ASSUMPTIONS for a
# typical 2-socket server, used when the plan is made for a node other than the one it runs on:
HOST_ASSUMED = {"float64": 0.5e12, "float32": 1.0e12, "bw": 50e9,   # sustained CPU GEMM, memory traffic
                "link": 10e9,                                       # device <-> pageable host copies
                "disk": 2e9, "load": 2e9}                           # local NVMe write/read, weight loading
HOST_SOURCE = ("ASSUMED host: 0.5 TFLOP/s fp64 / 1 TFLOP/s fp32 CPU GEMM, 50 GB/s memory traffic, "
               "10 GB/s device<->host, 2 GB/s disk and weight loading")
CPU_SOURCE = ("micro-benchmark on this CPU: matmul fp64 384^3 / fp32 512^3, 32 MiB copy; bf16 = fp32/2 (assumed); "
              "disk and weight loading 1 GB/s (assumed)")


@dataclass
class Rates:
    """Sustained rates the time estimates use (FLOP/s, bytes/s); `sources` names where each comes from."""

    name: str
    source: str
    flops: dict          # on the compute device, by dtype
    bw: float            # compute device memory bandwidth
    host_flops: dict     # host CPU, by dtype
    host_bw: float
    link: float | None   # device <-> host copies (None: the compute device is the host)
    disk: float
    load: float
    sources: dict = field(default_factory=dict)   # {"device", "host", "link", "disk", "load"}: where from

    def describe(self) -> dict:
        """{rate: {"value", "source"}} for plan.json (values in FLOP/s or bytes/s)."""
        src = lambda key: self.sources.get(key, self.source)  # noqa: E731
        out = {f"device {k} FLOP/s": {"value": v, "source": src("device")} for k, v in self.flops.items()}
        out["device bytes/s"] = {"value": self.bw, "source": src("device")}
        out.update({f"host {k} FLOP/s": {"value": v, "source": src("host")} for k, v in self.host_flops.items()})
        out["host bytes/s"] = {"value": self.host_bw, "source": src("host")}
        if self.link:
            out["device<->host bytes/s"] = {"value": self.link, "source": src("link")}
        out["disk bytes/s"] = {"value": self.disk, "source": src("disk")}
        out["weight loading bytes/s"] = {"value": self.load, "source": src("load")}
        return out


_MEASURED: dict = {}


def _best_seconds(fn, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu() -> dict:
    """This CPU's sustained fp64/fp32 matmul rate and copy bandwidth (best of 3; ~0.2 s; cached)."""
    if "cpu" in _MEASURED:
        return _MEASURED["cpu"]
    import torch

    out = {}
    for name, dtype, n in (("float64", torch.float64, 384), ("float32", torch.float32, 512)):
        a, b = torch.randn(n, n, dtype=dtype, device="cpu"), torch.randn(n, n, dtype=dtype, device="cpu")
        out[name] = 2 * n ** 3 / _best_seconds(lambda: a @ b)
    src = torch.randn(8 << 20, device="cpu")
    dst = torch.empty_like(src)
    out["bw"] = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src))
    _MEASURED["cpu"] = out
    return out


def _cpu_rates() -> Rates:
    m = measure_cpu()
    flops = {"float64": m["float64"], "float32": m["float32"], "bfloat16": m["float32"] / 2,
             "float16": m["float32"] / 2}
    return Rates("cpu (measured here)", CPU_SOURCE, flops, m["bw"], flops, m["bw"], None, 1e9, 1e9,
                 {k: CPU_SOURCE for k in ("device", "host", "disk", "load")})


def rates_for(node, device: str, *, local: bool = False) -> Rates:
    """Rates for `device` ("cpu" / "cuda") on `node` (a plan.node.Node). local=True: the plan runs on that
    node, so its CPU is measured; otherwise a GPU node's host side uses HOST_ASSUMED."""
    if device == "cpu":
        return _cpu_rates()
    spec = DEVICES.get(node.gpu or "")
    if spec is None:
        spec, gpu_src = _measure_gpu(), "measured on this GPU (matmul 4096^3 per dtype, 1 GiB copy)"
    else:
        gpu_src = DEVICE_SOURCE
    flops = {k: v * EFFICIENCY["matmul"] for k, v in spec.items() if k != "bw"}
    if local:
        m = measure_cpu()
        host, host_bw, host_src = {"float64": m["float64"], "float32": m["float32"]}, m["bw"], CPU_SOURCE
    else:
        host, host_bw = {k: HOST_ASSUMED[k] for k in ("float64", "float32")}, HOST_ASSUMED["bw"]
        host_src = HOST_SOURCE
    sources = {"device": gpu_src, "host": host_src, "link": HOST_SOURCE, "disk": HOST_SOURCE, "load": HOST_SOURCE}
    return Rates(node.gpu or "cuda (measured)", f"{gpu_src}; {host_src}", flops,
                 spec["bw"] * EFFICIENCY["bandwidth"], host, host_bw, HOST_ASSUMED["link"], HOST_ASSUMED["disk"],
                 HOST_ASSUMED["load"], sources)


def _measure_gpu() -> dict:
    """This GPU's matmul rate per dtype and copy bandwidth, divided by EFFICIENCY (so they read as peaks)."""
    import torch

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    out = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("float64", torch.float64)):
        a = torch.randn(4096, 4096, device="cuda", dtype=dtype)
        out[name] = 2 * 4096 ** 3 / timed(lambda: a @ a) / EFFICIENCY["matmul"]
    out["float16"] = out["bfloat16"]
    src = torch.empty(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    out["bw"] = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src)) / EFFICIENCY["bandwidth"]
    return out
