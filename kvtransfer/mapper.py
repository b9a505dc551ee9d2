"""The mapper artifact: per-target-layer affine K/V maps, saved as safetensors + a JSON manifest.

Tensors (float32 on disk):
    weight  [L_t, 2, p, q]   p = k * n_kv_s * d_s (source features), q = n_kv_t * d_t; [:, 0] K, [:, 1] V
    bias    [L_t, 2, q]
    selected_layers [L_t, k] source layers feeding each target layer, in feature order
Parameter count = L_t * 2 * p * q (+ biases), as in the paper.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .io import atomic_save_tensors, atomic_write_json, load_tensors, sha256_file
from .models import model_identity
from .ridge import RidgeFit

FORMAT_VERSION = 1
_WEIGHTS, _MANIFEST = "mapper.safetensors", "mapper.json"


@dataclass
class Mapper:
    """Affine maps from stacked source KV features to each target layer's K and V.

    `source` / `target` are `model_identity` dicts; `key_space` is "stripped" (content space, the
    paper) or "rotated" (keys mapped as cached, an ablation). `r2` holds per-head R² lists
    {split: {kind: [L_t][n_kv_t]}}; `calibration` the provenance of the moments.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    selected_layers: torch.Tensor
    source: dict
    target: dict
    key_space: str = "stripped"
    lam: float = 0.01
    kind: str = "ridge"
    calibration: dict = field(default_factory=dict)
    r2: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        """Source layers per target layer."""
        return self.selected_layers.shape[1]

    @property
    def n_parameters(self) -> int:
        """Weights + biases."""
        return self.weight.numel() + self.bias.numel()

    @classmethod
    def from_ridge(cls, fit: RidgeFit, source_model, target_model, *, key_space: str = "stripped",
                   calibration: dict | None = None) -> "Mapper":
        """Pack a `RidgeFit` (all target layers) into a Mapper for the given models."""
        n_t = len(fit.selected_layers)
        weight = torch.stack([torch.stack([fit.weights[kind][t].weight for kind in ("k", "v")]) for t in range(n_t)])
        bias = torch.stack([torch.stack([fit.weights[kind][t].bias for kind in ("k", "v")]) for t in range(n_t)])
        r2 = {split: {kind: v.tolist() for kind, v in per.items()} for split, per in fit.r2.items()}
        calibration = dict(calibration or {}, observations=fit.observations)
        return cls(weight.float(), bias.float(), torch.tensor(fit.selected_layers, dtype=torch.long),
                   model_identity(source_model), model_identity(target_model), key_space, fit.lam, "ridge",
                   calibration, r2)

    def to(self, device=None, dtype=None) -> "Mapper":
        """Move weights (not layer indices) to `device` / `dtype`; returns self."""
        self.weight = self.weight.to(device=device, dtype=dtype)
        self.bias = self.bias.to(device=device, dtype=dtype)
        return self

    def check_pair(self, source_model, target_model) -> None:
        """Raise ValueError unless this mapper was fitted for exactly these two architectures."""
        for side, model in (("source", source_model), ("target", target_model)):
            have = model_identity(model)
            want = getattr(self, side)
            if have["config_hash"] != want["config_hash"]:
                raise ValueError(
                    f"mapper was fitted for {side} {want['model_id'] or '?'} (config {want['config_hash']}, "
                    f"{want['n_layers']} layers x {want['n_kv']} kv heads x {want['head_dim']}), but the {side} "
                    f"given is {have['model_id'] or '?'} (config {have['config_hash']}, {have['n_layers']} x "
                    f"{have['n_kv']} x {have['head_dim']}). Fit a mapper for this pair.")

    def manifest(self) -> dict:
        """JSON description of the artifact (everything but the tensors)."""
        return {"format": "kvtransfer.mapper", "version": FORMAT_VERSION, "kind": self.kind,
                "source": self.source, "target": self.target, "key_space": self.key_space, "k": self.k,
                "lambda": self.lam, "selected_layers": self.selected_layers.tolist(),
                "shapes": {"weight": list(self.weight.shape), "bias": list(self.bias.shape)},
                "n_parameters": self.n_parameters, "calibration": self.calibration, "r2": self.r2}

    def save(self, directory: str | Path) -> Path:
        """Write mapper.safetensors + mapper.json into `directory` (refuses to overwrite)."""
        directory = Path(directory)
        if (directory / _MANIFEST).exists() or (directory / _WEIGHTS).exists():
            raise FileExistsError(f"{directory} already holds a mapper; save to a new directory")
        atomic_save_tensors(directory / _WEIGHTS, {"weight": self.weight.float(), "bias": self.bias.float(),
                                                   "selected_layers": self.selected_layers},
                            {"manifest": _MANIFEST})
        manifest = self.manifest() | {"sha256": sha256_file(directory / _WEIGHTS)}
        atomic_write_json(directory / _MANIFEST, manifest)
        return directory

    @classmethod
    def load(cls, directory: str | Path, source_model=None, target_model=None) -> "Mapper":
        """Read a saved mapper, verify its checksum and shapes, and (given models) its pair."""
        directory = Path(directory)
        manifest_path, weights_path = directory / _MANIFEST, directory / _WEIGHTS
        for path in (manifest_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: {directory} is not a saved mapper")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{manifest_path} is not valid JSON (truncated?): {err}") from err
        if manifest.get("format") != "kvtransfer.mapper":
            raise ValueError(f"{manifest_path} is not a kvtransfer mapper manifest")
        if manifest.get("version") != FORMAT_VERSION:
            raise ValueError(f"mapper format version {manifest.get('version')} is not supported "
                             f"(this kvtransfer reads version {FORMAT_VERSION}); refit the mapper")
        digest = sha256_file(weights_path)
        if digest != manifest["sha256"]:
            raise ValueError(f"{weights_path} does not match its manifest checksum (corrupt or truncated "
                             "file); copy it again or refit")
        tensors, _ = load_tensors(weights_path)
        for name, shape in manifest["shapes"].items():
            if list(tensors[name].shape) != shape:
                raise ValueError(f"{weights_path}: {name} has shape {list(tensors[name].shape)}, manifest says {shape}")
        mapper = cls(tensors["weight"], tensors["bias"], tensors["selected_layers"], manifest["source"],
                     manifest["target"], manifest["key_space"], manifest["lambda"], manifest["kind"],
                     manifest.get("calibration", {}), manifest.get("r2", {}))
        if source_model is not None and target_model is not None:
            mapper.check_pair(source_model, target_model)
        return mapper
