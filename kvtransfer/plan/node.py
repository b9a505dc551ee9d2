"""The machine a plan is made for: GPUs, host memory, local disk (a preset, given flags, or this machine)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .rates import DEVICES

GiB = 1 << 30
TB = 1e12 / GiB   # a decimal terabyte, in GiB
# GPU memory per device as nvidia-smi reports it (H200: 143,771 MiB = 140.4 GiB; H100-80GB: 81,559 MiB = 79.6 GiB).
# Host memory and local disk from each system's public spec sheet (`source`); "TB" there is decimal (1e12 bytes),
# "GiB" / "TiB" binary. The local disk is the one the run's cache_dir (artifacts, checkpoints) lives on.
NODES = {
    # a one-GPU workstation with a small local disk (the shape a single lent H200 has)
    "h200": dict(name="1xH200", gpus=1, gpu_gib=140.4, host_gib=128.0, disk_gib=64.0, gpu="H200",
                 source="a 1 x H200 machine with 128 GiB host memory and a 64 GiB local disk"),
    # an 8 x H100 server with half a DGX's host memory and a 1 TB local disk
    "8xh100": dict(name="8xH100-80GB", gpus=8, gpu_gib=79.6, host_gib=1024.0, disk_gib=1 * TB, gpu="H100",
                   source="an 8 x H100-80GB server with 1 TiB host memory and a 1 TB local disk"),
    # NVIDIA DGX H100 datasheet: 8 x H100 80 GB, 2 TB system memory, internal storage 8 x 3.84 TB NVMe U.2 (30 TB)
    "dgx-h100": dict(name="DGX H100", gpus=8, gpu_gib=79.6, host_gib=2048.0, disk_gib=8 * 3.84 * TB, gpu="H100",
                     source="NVIDIA DGX H100 datasheet (nvidia.com/en-us/data-center/dgx-h100): 8 x H100 80 GB, "
                            "2 TB system memory, 30 TB internal NVMe (8 x 3.84 TB U.2)"),
    # NVIDIA DGX H200 datasheet: 8 x H200 141 GB, 2 TB system memory, internal storage 8 x 3.84 TB NVMe U.2 (30 TB)
    "dgx-h200": dict(name="DGX H200", gpus=8, gpu_gib=140.4, host_gib=2048.0, disk_gib=8 * 3.84 * TB, gpu="H200",
                     source="NVIDIA DGX H200 datasheet (nvidia.com/en-us/data-center/dgx-h200): 8 x H200 141 GB, "
                            "2 TB system memory, 30 TB internal NVMe (8 x 3.84 TB U.2)"),
    # DigitalOcean GPU Droplet sizes (docs.digitalocean.com/products/droplets/details/features, GPU Droplets):
    # H100x1 = 1 x H100 80 GB, 20 vCPU, 240 GiB RAM, 720 GiB boot + 5 TiB scratch NVMe; H200x1 = 1 x H200 141 GB,
    # 24 vCPU, 240 GiB RAM, 720 GiB boot + 5 TiB scratch NVMe. cache_dir on the scratch disk.
    "1xh100-cloud": dict(name="1xH100 cloud (H100x1)", gpus=1, gpu_gib=79.6, host_gib=240.0, disk_gib=5 * 1024.0,
                         gpu="H100", source="DigitalOcean GPU Droplet H100x1 (docs.digitalocean.com, Droplet sizes): "
                         "1 x H100 80 GB, 240 GiB RAM, 5 TiB NVMe scratch disk (+ 720 GiB boot)"),
    "1xh200-cloud": dict(name="1xH200 cloud (H200x1)", gpus=1, gpu_gib=140.4, host_gib=240.0, disk_gib=5 * 1024.0,
                         gpu="H200", source="DigitalOcean GPU Droplet H200x1 (docs.digitalocean.com, Droplet sizes): "
                         "1 x H200 141 GB, 240 GiB RAM, 5 TiB NVMe scratch disk (+ 720 GiB boot)"),
}


def node_preset(name: str) -> "Node":
    """The `Node` of a preset of NODES (its `source` stays in NODES)."""
    return Node(**NODES[name])


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
    source: str = ""         # where a preset's figures come from (its spec sheet)

    def capacity(self) -> dict:
        """{"gpu", "host", "disk"}: bytes per GPU, of host memory, of disk."""
        return {"gpu": self.gpu_gib * GiB, "host": self.host_gib * GiB, "disk": self.disk_gib * GiB}

    def describe(self) -> dict:
        return {"name": self.name, "gpus": self.gpus, "gpu_gib": self.gpu_gib, "host_gib": self.host_gib,
                "disk_gib": round(self.disk_gib, 1), "gpu": self.gpu, "weights_on_disk": self.weights_on_disk,
                **({"source": self.source} if self.source else {})}


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


def node_from_spec(spec, cfg: dict) -> Node:
    """The node `dry.node` names: None (this machine: detect_node), a preset name of NODES, or a mapping
    {gpus, gpu_gib, host_gib, disk_gib, gpu}; an unknown name raises, naming the presets."""
    if spec is None:
        return detect_node(cfg)
    if isinstance(spec, str):
        if spec not in NODES:
            raise ValueError(f"node {spec!r} is no node preset ({', '.join(sorted(NODES))}); or give "
                             "dry.node={gpus: 1, gpu_gib: 80, host_gib: 256, disk_gib: 500, gpu: H100}")
        return node_preset(spec)
    fields = dict(spec)
    fields.setdefault("name", f"{fields.get('gpus', 0)} x GPU {fields.get('gpu_gib', 0):g} GiB (dry.node)")
    return Node(**fields)
