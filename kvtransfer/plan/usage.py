"""Usage: one stage's peak GPU / host / disk bytes and estimated seconds, with the named parts behind each."""
from __future__ import annotations

from dataclasses import dataclass, field

from .setup import RUNTIME_GPU, Setup


@dataclass
class Usage:
    """Peak of one stage: bytes per GPU (the fullest one), host bytes, disk bytes, seconds (an estimate), and
    the named parts behind each peak (for plan.md)."""

    gpu: float = 0.0
    host: float = 0.0
    disk: float = 0.0
    seconds: float = 0.0
    parts: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    dev_parts: dict = field(default_factory=dict)    # before placement: what sits on the compute device
    host_parts: dict = field(default_factory=dict)   # ... and what sits on the host regardless

    def set_disk(self, parts: dict) -> None:
        self.parts["disk"] = parts
        self.disk = sum(parts.values())

    def set_seconds(self, parts: dict) -> None:
        self.parts["seconds"] = parts
        self.seconds = sum(parts.values())


def place(s: Setup, u: Usage, device_bytes: dict, host_bytes: dict, sides: tuple = ()) -> None:
    """Put 'device' parts on the GPU (or on the host for a CPU run) and sum the peaks; the offloaded
    weights of the loaded models `sides` sit on the host."""
    if s.offloaded(*sides):
        host_bytes = {**host_bytes, "offloaded weights (max_memory; streamed to the GPU per forward)":
                      s.offloaded(*sides)}
    u.dev_parts, u.host_parts = dict(device_bytes), dict(host_bytes)
    if s.device == "cuda":
        u.parts["gpu"] = {"CUDA context": RUNTIME_GPU, **device_bytes}
        u.parts["host"] = {"runtime": s.runtime_host(), **host_bytes}
    else:
        u.parts["gpu"] = {}
        u.parts["host"] = {"runtime": s.runtime_host(), **device_bytes, **host_bytes}
    u.gpu = sum(u.parts["gpu"].values())
    u.host = sum(u.parts["host"].values())
