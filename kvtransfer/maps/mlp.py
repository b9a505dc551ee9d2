"""Training the paper's MLP fallback mapper on a bounded sample of calibration features.

Per (target layer, head, K/V): Linear(p, hidden) - ReLU - Linear(hidden, hidden) - ReLU -
Linear(hidden, d_t), Adam (lr 1e-3), 20 epochs, batches of 4,096 tokens, MSE. All heads of a
target layer (K and V) train together as one batched network with disjoint weights, which is the
same as training them separately on the same batches. Inputs and outputs are standardised with
the sample's per-feature mean and std (stored with the mapper), so one learning rate suits keys
and values alike. The artifact (`MLPMapper`, its forward pass) is a mapper kind in kvtransfer.core.mapper,
so loading and applying an MLP mapper never needs this module.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..core.io import atomic_save_tensors, load_tensors
from ..core.mapper import MLPMapper, mlp_forward
from ..core.models import model_identity


class FeatureSampler:
    """Keeps ~`max_rows` random train rows of calibration features, as a `collect_moments` sink.

    Call as sink(split, batch_index, x, y) with x/y {"k", "v"} -> [rows, width]. `n_batches` is the
    number of train batches, so each keeps ceil(max_rows / n_batches) rows (seeded per batch). With
    `state_path`, `checkpoint()` (called by `collect_moments` before each moments checkpoint) writes the
    rows kept so far and a new sampler on the same path starts from them, so a resumed calibration ends
    with the same sample; a batch offered twice is kept once. `complete` says whether every train batch
    was seen.
    """

    def __init__(self, max_rows: int, n_batches: int, seed: int = 0, state_path=None):
        self.per_batch = math.ceil(max_rows / max(1, n_batches))
        self.n_batches = n_batches
        self.seed = seed
        self.state_path = state_path
        self.parts: dict[str, list[torch.Tensor]] = {"xk": [], "xv": [], "yk": [], "yv": []}
        self.batches: list[int] = []
        if state_path is not None and Path(state_path).exists():
            tensors, meta = load_tensors(state_path)
            self.batches = json.loads(meta["batches"])
            counts = json.loads(meta["rows"])
            for name in self.parts:
                self.parts[name] = list(tensors[name].split(counts)) if counts else []

    def __call__(self, split: str, batch_index: int, x: dict, y: dict) -> None:
        if split != "train" or batch_index in self.batches:
            return
        keep = self.kept_rows(batch_index, x["k"].shape[0])
        for name, t in (("xk", x["k"]), ("xv", x["v"]), ("yk", y["k"]), ("yv", y["v"])):
            self.parts[name].append(t[keep.to(t.device)].float().cpu())
        self.batches.append(batch_index)

    def kept_rows(self, batch_index: int, rows: int) -> torch.Tensor:
        """Indices (sorted) of the rows this sampler keeps of train batch `batch_index` with `rows` rows."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_index)  # device: draws host-side rows
        return torch.randperm(rows, generator=g)[: self.per_batch].sort().values  # device: host-side rows, moved where used

    @staticmethod
    def rows_at(max_rows: int, batch_rows: list[int]) -> int:
        """Rows a sampler of `max_rows` keeps over train batches of `batch_rows` rows each (per batch
        ceil(max_rows / n_batches), at most the batch)."""
        per_batch = math.ceil(max_rows / max(1, len(batch_rows)))
        return sum(min(per_batch, r) for r in batch_rows) if max_rows > 0 else 0

    @staticmethod
    def nbytes_at(rows: int, dx: int, dy: int) -> int:
        """Bytes of a sample of `rows` rows: float32 xk, xv [rows, dx] and yk, yv [rows, dy]."""
        return 2 * rows * (dx + dy) * 4

    @property
    def complete(self) -> bool:
        """Whether all `n_batches` train batches contributed their rows."""
        return len(self.batches) == self.n_batches

    def checkpoint(self) -> None:
        """Write the rows kept so far to `state_path` (atomic); no-op without a path."""
        if self.state_path is None or not self.batches:
            return
        counts = [t.shape[0] for t in self.parts["xk"]]
        atomic_save_tensors(self.state_path, self.tensors(), {"batches": json.dumps(self.batches),
                                                              "rows": json.dumps(counts)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """{"xk", "xv": [n, dx], "yk", "yv": [n, dy]} float32."""
        if not self.parts["xk"]:
            raise ValueError("no calibration features were sampled (mlp_samples=0 or no train batches)")
        return {name: torch.cat(parts) for name, parts in self.parts.items()}

    def save(self, path, meta: dict | None = None) -> None:
        """Store the sample as safetensors (atomic); `meta` (JSON-able, e.g. produced_by) joins its metadata."""
        atomic_save_tensors(path, self.tensors(), {"feature_sample": True, "batches": json.dumps(self.batches),
                                                   "rows": json.dumps([t.shape[0] for t in self.parts["xk"]]),
                                                   **{k: json.dumps(v) for k, v in (meta or {}).items()}})

    @staticmethod
    def load(path) -> dict[str, torch.Tensor]:
        """Read a sample written by `save`."""
        return load_tensors(path)[0]


def fit_mlp(sample: dict[str, torch.Tensor], selected_layers: list[list[int]], source_model, target_model, *,
            source_width: int, target_heads: int, hidden: int = 1024, lr: float = 1e-3, epochs: int = 20,
            batch_tokens: int = 4096, device: str = "cpu", seed: int = 0, key_space: str = "stripped",
            calibration: dict | None = None, progress=None) -> MLPMapper:
    """Train per-head MLPs for every target layer on a `FeatureSampler` sample.

    sample: {"xk", "xv": [n, L_s * source_width], "yk", "yv": [n, L_t * target_heads * d_t]}.
    Returns an MLPMapper (float32) with train R² per head in `r2["train"]`.
    """
    torch.manual_seed(seed)
    n = sample["xk"].shape[0]
    n_t = len(selected_layers)
    q = sample["yk"].shape[1] // n_t
    d_t = q // target_heads
    wrap = progress or (lambda it, **_: it)
    layers, r2 = [], {"k": [], "v": []}
    for t in wrap(range(n_t), desc="mlp fit"):
        cols = torch.cat([torch.arange(source_width) + s * source_width for s in selected_layers[t]])  # device: indexes the host-side sample
        x = torch.stack([sample["xk"][:, cols], sample["xv"][:, cols]]).to(device)  # [2, n, p]
        y = torch.stack([sample["yk"][:, t * q:(t + 1) * q], sample["yv"][:, t * q:(t + 1) * q]]).to(device)
        params = _init(x, y, target_heads, d_t, hidden, device)
        trainable = [params[name] for name in ("w1", "b1", "w2", "b2", "w3", "b3")]
        opt = torch.optim.Adam(trainable, lr=lr)
        g = torch.Generator().manual_seed(seed + t)  # device: seeded CPU draw of the batch order, moved after
        y_norm = (y - params["y_mean"][:, None]) / params["y_std"][:, None]
        for _ in range(epochs):
            for idx in torch.randperm(n, generator=g).split(batch_tokens):  # device: seeded CPU draw, moved below
                idx = idx.to(device)
                pred = mlp_forward(params, x[:, idx], denormalise=False)
                loss = torch.mean((pred - y_norm[:, idx]) ** 2)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        with torch.no_grad():
            pred = mlp_forward(params, x)
            for i, kind in enumerate(("k", "v")):
                sse = ((pred[i] - y[i]) ** 2).view(n, target_heads, d_t).sum((0, 2))
                sst = ((y[i] - y[i].mean(0)) ** 2).view(n, target_heads, d_t).sum((0, 2))
                r2[kind].append((1 - sse / sst).tolist())
        layers.append({name: t_.detach().cpu() for name, t_ in params.items()})
    stacked = {name: torch.stack([layer[name] for layer in layers]) for name in MLPMapper._NAMES}
    return MLPMapper(**stacked, selected_layers=torch.tensor(selected_layers, dtype=torch.long),  # device: host-side layer indices (a map keeps them on the CPU)
                     source=model_identity(source_model), target=model_identity(target_model), key_space=key_space,
                     calibration=dict(calibration or {}, observations=n), r2={"train": r2})


def _init(x: torch.Tensor, y: torch.Tensor, heads: int, d_t: int, hidden: int, device) -> dict:
    """PyTorch-Linear-style uniform init, plus standardisation statistics of x and y."""
    p = x.shape[-1]

    def linear(fan_in, fan_out):
        bound = 1 / math.sqrt(fan_in)
        w = torch.empty(2, heads, fan_in, fan_out, device=device).uniform_(-bound, bound).requires_grad_()
        b = torch.empty(2, heads, fan_out, device=device).uniform_(-bound, bound).requires_grad_()
        return w, b

    w1, b1 = linear(p, hidden)
    w2, b2 = linear(hidden, hidden)
    w3, b3 = linear(hidden, d_t)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3,
            "x_mean": x.mean(1), "x_std": x.std(1).clamp_min(1e-6),
            "y_mean": y.mean(1), "y_std": y.std(1).clamp_min(1e-6)}
