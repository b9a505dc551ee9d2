"""The machine a plan is made for: GPUs, host memory, local disk (a preset, given flags, or this machine)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .rates import DEVICES

GiB = 1 << 30
# Node shapes of issue 10. GPU memory per device as nvidia-smi reports it (H200: 143,771 MiB,
# H100-80GB: 81,559 MiB); "1 TB" disk = 1e12 bytes.
NODES = {
    "h200": dict(name="1xH200", gpus=1, gpu_gib=140.4, host_gib=128.0, disk_gib=64.0, gpu="H200"),
    "8xh100": dict(name="8xH100-80GB", gpus=8, gpu_gib=79.6, host_gib=1024.0, disk_gib=1e12 / GiB, gpu="H100"),
}


@dataclass
class Node:
    """What the run has: `gpus` devices of `gpu_gib` each (0 = CPU only), host memory, local disk (GiB)."""

    name: str = "this machine"
    gpus: int = 0
    gpu_gib: float = 0.0
    host_gib: float = 0.0
    disk_gib: float = 0.0
    gpu: str | None = None   # key of rates.DEVICES, or None (CPU, or an unknown GPU: rates measured)
    weights_on_disk: bool = False

    def capacity(self) -> dict:
        """{"gpu", "host", "disk"}: bytes per GPU, of host memory, of disk."""
        return {"gpu": self.gpu_gib * GiB, "host": self.host_gib * GiB, "disk": self.disk_gib * GiB}

    def describe(self) -> dict:
        return {"name": self.name, "gpus": self.gpus, "gpu_gib": self.gpu_gib, "host_gib": self.host_gib,
                "disk_gib": round(self.disk_gib, 1), "gpu": self.gpu, "weights_on_disk": self.weights_on_disk}


def _host_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return float("inf")


def detect_node(cfg: dict) -> Node:
    """The machine this process runs on: free GPU memory, total host memory (the node's capacity, as the
    node presets give it; other jobs running now are not subtracted), free disk at cache_dir."""
    import torch

    device = str(cfg.get("device", "auto"))
    gpus, gpu_gib, gpu = 0, 0.0, None
    if device != "cpu" and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        gpu_gib = torch.cuda.mem_get_info(0)[0] / GiB
        name = torch.cuda.get_device_name(0)
        gpu = next((k for k in DEVICES if k in name), None)
    where = Path(cfg.get("cache_dir", "artifacts")).resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    disk = shutil.disk_usage(where).free / GiB
    weights_on_disk = bool((cfg.get("plan") or {}).get("weights_on_disk", False))
    return Node("this machine", gpus, gpu_gib, _host_gib(), disk, gpu, weights_on_disk)
