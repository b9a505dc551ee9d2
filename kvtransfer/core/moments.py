"""Streaming centred cross-layer moments between source and target KV features.

For each kind ("k" = keys, "v" = values) one observation is a token: its source features
x = concat over all source layers of the layer's KV heads flattened, width L_s * n_kv_s * d_s
(order: layer, head, dim), and its target features y over the target layers of this shard
(order: layer, head, dim). Per kind we keep

    mean_x [Dx], mean_y [Dy], cxx = sum (x - mean_x)(x - mean_x)^T [Dx, Dx],
    cxy = sum (x - mean_x)(y - mean_y)^T [Dx, Dy], cyy = sum (y - mean_y)^2 [Dy] (diagonal only),

all about the running mean. Batches are merged with Chan et al.'s pairwise update, so shards of
the data (or of the target layers' columns) merge exactly, and large offsets never cancel.

Two ways to add a batch:
* `add` (calib.accumulate=host): the batch's centred products are formed in `compute_dtype` on the
  batch's device, then shipped to the moments' store and merged there (today's fp64-on-host path).
* two-level (calib.accumulate=twolevel, the default): `accumulate` into a float32 buffer on the target's device
  (the GPU, or the CPU on a CPU-only run) for at most `calib.flush_batches` batches, then `absorb` it into
  float64 masters on the host. The rounding of a flush's float32 sums is bounded by the flush's rows, not the
  run's, and the schedule (which batches share a flush) depends on the config only, never on the node, the
  checkpoint cadence or a resume, so the same command gives the same moments everywhere up to the GEMM kernels'
  own rounding order.
* `accumulate` (calib.accumulate=device): the moments live on the batch's device (e.g. the GPU, in
  float32) and each batch is merged in place by ONE GEMM per matrix, with no [Dx, Dx] / [Dx, Dy]
  temporary: C += [xc; e_x; d_x]^T [yc; -m e_y; w d_y], where xc = x - c are the rows centred at c (the
  batch mean rounded to the accumulator dtype), e = batch mean - c (turns sums about c into sums about the
  batch mean), d = batch mean - running mean and w = n_a m / (n_a + m) (Chan's merge term). Means, the
  centring corrections and cyy are kept in float64 ("wide" moments): they are tiny, and the Chan term and
  the running mean are where cancellation between large offsets (attention-sink outliers, value biases)
  would otherwise cost digits; the [Dx, Dx] / [Dx, Dy] sums themselves are sums of centred products, which
  float32 holds to ~1e-7 relative, and the ridge solve is float64 on the host (`ridge.solve_spd`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .io import atomic_save_tensors, load_tensors

KINDS = ("k", "v")


@contextlib.contextmanager
def full_precision_matmul():
    """float32 GEMMs in true float32 while accumulating: a process that enabled TF32 (e.g.
    torch.set_float32_matmul_precision("high")) would otherwise round every product to ~1e-3.

    Uses the backend's own setting, `torch.backends.cuda.matmul.fp32_precision` (torch >= 2.9): it
    reads back whichever API the process used to enable TF32 and is restored exactly (the legacy
    `allow_tf32` cannot be read once the new API was used, and writing it back does not restore
    "none"). Older torch has only `allow_tf32`. Works the same on a CPU-only build.
    """
    cuda = torch.backends.cuda.matmul
    name, off = ("fp32_precision", "ieee") if hasattr(cuda, "fp32_precision") else ("allow_tf32", False)
    prev = getattr(cuda, name)
    setattr(cuda, name, off)
    try:
        yield
    finally:
        setattr(cuda, name, prev)
_STATS = ("mean_x", "mean_y", "cxx", "cxy", "cyy")
_FEATURES = ("x", "y")


class FeatureLayout:
    """Column layout shared by moments and held-out features: x concatenates the source layers'
    features (source_width each), y this shard's target layers' (target_width each)."""

    @property
    def dx(self) -> int:
        """Width of the source feature vector x."""
        return len(self.source_layers) * self.source_width

    @property
    def dy(self) -> int:
        """Width of the target feature vector y (this shard's target layers only)."""
        return len(self.target_layers) * self.target_width

    def source_columns(self, layers) -> torch.Tensor:
        """Column indices into x of the given source layers, in the given order."""
        return _block_columns(self.source_layers, layers, self.source_width)

    def target_columns(self, layer: int) -> slice:
        """Column slice into y of one target layer."""
        i = self.target_layers.index(layer)
        return slice(i * self.target_width, (i + 1) * self.target_width)


@dataclass
class Moments(FeatureLayout):
    """Centred moments of (source, target) KV features for kinds "k" and "v".

    `source_layers` / `target_layers` name the model layers whose features occupy consecutive
    blocks of `source_width` / `target_width` (= n_kv * head_dim) columns of x / y.
    `stats[kind][name]` holds the tensors listed in the module docstring, in `dtype` on `device`.
    """

    source_layers: list[int]
    target_layers: list[int]
    source_width: int
    target_width: int
    dtype: torch.dtype = torch.float64
    device: str | torch.device = "cpu"
    n: int = 0
    info: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    wide: bool = False   # mean_x, mean_y, cyy in float64 whatever `dtype` (see the module docstring)

    def __post_init__(self):
        if not self.stats:
            dx, dy = self.dx, self.dy
            z = lambda *s: torch.zeros(*s, dtype=self.dtype, device=self.device)  # noqa: E731
            v = (lambda *s: torch.zeros(*s, dtype=torch.float64, device=self.device)) if self.wide else z  # noqa: E731
            self.stats = {kind: {"mean_x": v(dx), "mean_y": v(dy), "cxx": z(dx, dx), "cxy": z(dx, dy),
                                 "cyy": v(dy)} for kind in KINDS}

    @staticmethod
    def nbytes_at(dx: int, dy: int, dtype, *, wide: bool = False) -> int:
        """Bytes of the statistics a `Moments` of widths (dx, dy) holds in `dtype` (a torch dtype), K and V:
        cxx [Dx, Dx] + cxy [Dx, Dy] in dtype, mean_x [Dx] + mean_y [Dy] + cyy [Dy] in float64 when `wide`
        (else in dtype). The resource plan sizes the moments with this, so a layout change moves the plan."""
        size = torch.empty((), dtype=dtype, device="meta").element_size()  # meta: a size, no allocation
        small = 8 if wide else size
        return len(KINDS) * ((dx * dx + dx * dy) * size + (dx + 2 * dy) * small)

    @property
    def nbytes(self) -> int:
        """Bytes of the statistics held now (every tensor of `stats`)."""
        return sum(t.numel() * t.element_size() for st in self.stats.values() for t in st.values())

    def to(self, device) -> "Moments":
        """Move every statistic to `device` (in place); returns self."""
        self.stats = {kind: {name: t.to(device) for name, t in st.items()} for kind, st in self.stats.items()}
        self.device = device
        return self

    @torch.no_grad()
    def add(self, x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], compute_dtype=None) -> None:
        """Accumulate a batch: x[kind] [m, dx], y[kind] [m, dy] (any float dtype, any device).

        The batch's own centred products are formed in `compute_dtype` (default: this object's
        dtype) on the batch's device, then merged into the running moments.
        """
        m = next(iter(x.values())).shape[0]
        if m == 0:
            return
        cdt = compute_dtype or self.dtype
        batch = {}
        for kind in KINDS:
            xb, yb = x[kind].to(cdt), y[kind].to(cdt)
            if xb.shape != (m, self.dx) or yb.shape != (m, self.dy):
                raise ValueError(f"batch {kind}: x {tuple(xb.shape)}, y {tuple(yb.shape)}; "
                                 f"expected ({m}, {self.dx}) and ({m}, {self.dy})")
            mx, my = xb.mean(0), yb.mean(0)
            xc, yc = xb - mx, yb - my
            with full_precision_matmul():
                batch[kind] = {"mean_x": mx, "mean_y": my, "cxx": xc.T @ xc, "cxy": xc.T @ yc,
                               "cyy": (yc * yc).sum(0)}
        self._merge(batch, m)

    @torch.no_grad()
    def accumulate(self, x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> None:
        """Merge a batch in place on the moments' device (x[kind] [m, dx], y[kind] [m, dy], any float dtype):
        one GEMM per matrix, no batch-product temporaries (formula in the module docstring)."""
        m = next(iter(x.values())).shape[0]
        if m == 0:
            return
        n_a = self.n
        n = n_a + m
        w = n_a * m / n
        with full_precision_matmul():
            self._accumulate(x, y, m, n, w)
        self.n = n

    def _accumulate(self, x, y, m: int, n: int, w: float) -> None:
        for kind in KINDS:
            a = self.stats[kind]
            dt = a["cxx"].dtype
            xb, yb = x[kind].to(device=self.device, dtype=dt), y[kind].to(device=self.device, dtype=dt)
            if xb.shape != (m, self.dx) or yb.shape != (m, self.dy):
                raise ValueError(f"batch {kind}: x {tuple(xb.shape)}, y {tuple(yb.shape)}; "
                                 f"expected ({m}, {self.dx}) and ({m}, {self.dy})")
            mx, my = xb.sum(0, dtype=torch.float64) / m, yb.sum(0, dtype=torch.float64) / m
            cx, cy = mx.to(dt), my.to(dt)                        # centring points (exact in dt)
            ex, ey = mx - cx.double(), my - cy.double()          # batch mean - centring point
            dx, dy = mx - a["mean_x"].double(), my - a["mean_y"].double()   # batch mean - running mean
            xc, yc = xb - cx, yb - cy
            lx = torch.cat([xc, ex[None].to(dt), dx[None].to(dt)])
            rx = torch.cat([xc, (-m * ex)[None].to(dt), (w * dx)[None].to(dt)])
            ry = torch.cat([yc, (-m * ey)[None].to(dt), (w * dy)[None].to(dt)])
            a["cxx"].addmm_(lx.T, rx)
            a["cxy"].addmm_(lx.T, ry)
            sq = (yc * yc).sum(0, dtype=torch.float64) - m * ey * ey + w * dy * dy
            a["cyy"] += sq.to(a["cyy"].dtype)
            a["mean_x"] += (dx * (m / n)).to(a["mean_x"].dtype)
            a["mean_y"] += (dy * (m / n)).to(a["mean_y"].dtype)

    @torch.no_grad()
    def absorb(self, buffer: "Moments", chunk_bytes: int = 256 << 20) -> None:
        """Two-level accumulation's flush (calib.accumulate=twolevel): fold `buffer` (a float32 `Moments` with
        float64 means, `wide`, filled by `accumulate` on the device for a bounded number of batches) into these
        master moments (float64, on the host) by Chan's merge, then zero the buffer in place. The [Dx, Dx] /
        [Dx, Dy] blocks travel in row chunks of <= `chunk_bytes` (as float64), so the host never holds a second
        copy of the buffer; the master's own running mean is used for the merge term."""
        if buffer.n == 0:
            return
        n_a, n_b = self.n, buffer.n
        n = n_a + n_b
        w = n_a * n_b / n
        for kind in KINDS:
            a, b = self.stats[kind], buffer.stats[kind]
            dt = a["cxx"].dtype
            dx = b["mean_x"].to(device=self.device, dtype=torch.float64) - a["mean_x"].double()
            dy = b["mean_y"].to(device=self.device, dtype=torch.float64) - a["mean_y"].double()
            for name, right in (("cxx", dx), ("cxy", dy)):
                rows = max(1, chunk_bytes // max(1, a[name].shape[1] * 8))
                for r0 in range(0, a[name].shape[0], rows):
                    r1 = min(a[name].shape[0], r0 + rows)
                    block = a[name][r0:r1]
                    block += b[name][r0:r1].to(device=self.device, dtype=dt)
                    block.addr_(dx[r0:r1].to(dt), right.to(dt), alpha=w)
            a["cyy"] += (b["cyy"].to(device=self.device, dtype=torch.float64) + w * dy * dy).to(a["cyy"].dtype)
            a["mean_x"] += (dx * (n_b / n)).to(a["mean_x"].dtype)
            a["mean_y"] += (dy * (n_b / n)).to(a["mean_y"].dtype)
            for t in b.values():
                t.zero_()
        self.n = n
        buffer.n = 0

    def _merge(self, other_stats: dict, n_other: int) -> None:
        n_a, n_b = self.n, n_other
        n = n_a + n_b
        for kind in KINDS:
            a, b = self.stats[kind], other_stats[kind]
            b = {name: t.to(device=self.device, dtype=a[name].dtype) for name, t in b.items()}
            dx, dy = b["mean_x"] - a["mean_x"], b["mean_y"] - a["mean_y"]
            w = n_a * n_b / n
            dt = a["cxx"].dtype
            a["cxx"] += b["cxx"]
            a["cxx"].addr_(dx.to(dt), dx.to(dt), alpha=w)
            a["cxy"] += b["cxy"]
            a["cxy"].addr_(dx.to(dt), dy.to(dt), alpha=w)
            a["cyy"] += b["cyy"] + w * dy * dy
            a["mean_x"] += dx * (n_b / n)
            a["mean_y"] += dy * (n_b / n)
        self.n = n

    def merge(self, other: "Moments") -> "Moments":
        """Fold another shard's moments (same layers and widths) into this one; returns self."""
        same = (self.source_layers, self.target_layers, self.source_width, self.target_width)
        if same != (other.source_layers, other.target_layers, other.source_width, other.target_width):
            raise ValueError("cannot merge moments over different layers or widths; merge shards of the "
                             "same calibration, or use Moments.concat_targets for target-layer shards")
        if other.n:
            self._merge(other.stats, other.n)
        return self

    @classmethod
    def concat_targets(cls, shards: list["Moments"]) -> "Moments":
        """Join moments that cover disjoint target layers of the same data into one object."""
        first = shards[0]
        for s in shards[1:]:
            if s.n != first.n or s.source_layers != first.source_layers:
                raise ValueError("target-layer shards must come from the same tokens and source layers")
            if not torch.equal(s.stats["k"]["mean_x"], first.stats["k"]["mean_x"]):
                raise ValueError("target-layer shards saw different source features (different data?)")
        stats = {kind: {"mean_x": first.stats[kind]["mean_x"], "cxx": first.stats[kind]["cxx"],
                        "mean_y": torch.cat([s.stats[kind]["mean_y"] for s in shards]),
                        "cxy": torch.cat([s.stats[kind]["cxy"] for s in shards], dim=1),
                        "cyy": torch.cat([s.stats[kind]["cyy"] for s in shards])} for kind in KINDS}
        return cls(first.source_layers, [t for s in shards for t in s.target_layers], first.source_width,
                   first.target_width, first.dtype, first.device, first.n, dict(first.info), stats, first.wide)

    # -- views used by the solvers ------------------------------------------------------------
    def cov_xx(self, kind: str, columns: torch.Tensor) -> torch.Tensor:
        """Centred sum of squares [p, p] of the selected x columns."""
        return self.stats[kind]["cxx"][columns][:, columns]

    def cov_xy(self, kind: str, columns: torch.Tensor, target_layer: int) -> torch.Tensor:
        """Centred cross products [p, target_width] of selected x columns with one target layer."""
        return self.stats[kind]["cxy"][columns, self.target_columns(target_layer)]

    # -- persistence --------------------------------------------------------------------------
    def state(self, prefix: str = "") -> tuple[dict, dict]:
        """(tensors, metadata) describing this object; names carry `prefix`."""
        tensors = {f"{prefix}{kind}.{name}": t for kind in KINDS for name, t in self.stats[kind].items()}
        meta = {"source_layers": self.source_layers, "target_layers": self.target_layers,
                "source_width": self.source_width, "target_width": self.target_width,
                "dtype": str(self.dtype).removeprefix("torch."), "n": self.n, "info": self.info, "wide": self.wide}
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict, meta: dict, prefix: str = "", device="cpu") -> "Moments":
        """Inverse of `state`."""
        dtype = getattr(torch, meta["dtype"])
        stats = {kind: {name: tensors[f"{prefix}{kind}.{name}"].to(device) for name in _STATS} for kind in KINDS}
        return cls(meta["source_layers"], meta["target_layers"], meta["source_width"], meta["target_width"],
                   dtype, device, meta["n"], meta.get("info", {}), stats, bool(meta.get("wide", False)))

    def save(self, path) -> None:
        """Write to one safetensors file (atomic)."""
        tensors, meta = self.state()
        atomic_save_tensors(path, tensors, {"moments": meta})

    @classmethod
    def load(cls, path, device="cpu") -> "Moments":
        """Read a file written by `save`."""
        tensors, meta = load_tensors(path)
        if "moments" not in meta:
            raise ValueError(f"{path} is not a kvtransfer moments file")
        return cls.from_state(tensors, meta["moments"], device=device)


def _block_columns(all_layers: list[int], layers, width: int) -> torch.Tensor:
    """Indices of the `width`-wide column blocks of `layers` within a concat over `all_layers`."""
    missing = [layer for layer in layers if layer not in all_layers]
    if missing:
        raise ValueError(f"layers {missing} are not in these moments (have {all_layers})")
    return torch.cat([torch.arange(width) + all_layers.index(layer) * width for layer in layers])  # device: host-side columns, moved where used


@dataclass
class HeldOut(FeatureLayout):
    """Raw held-out features: a seeded uniform subsample of at most `capacity` held-out observations.

    Held-out R² needs no held-out moments (a second [Dx, Dx] + [Dx, Dy] per kind): the residuals of a
    fitted map are evaluated on these rows directly (`ridge.head_r2`), which is the same quantity up to
    fp64 rounding when every held-out observation is kept. Columns follow the `Moments` layout:
    x[kind] [rows, Dx] over `source_layers` (layer, head, dim), y[kind] [rows, Dy] over `target_layers`.

    `select` are the sorted global indices (in the order observations are offered to `add`) of the rows
    kept, fixed before the first batch, so a resumed calibration keeps exactly the same rows. `seen` counts
    the observations offered so far, `n` the rows kept so far.
    """

    source_layers: list[int]
    target_layers: list[int]
    source_width: int
    target_width: int
    select: torch.Tensor
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    n: int = 0
    seen: int = 0
    info: dict = field(default_factory=dict)
    features: dict = field(default_factory=dict)

    def __post_init__(self):
        self.select = torch.as_tensor(self.select, dtype=torch.long).cpu()  # device: host-side row selection
        if not self.features:
            rows = self.capacity
            z = lambda *s: torch.zeros(*s, dtype=self.dtype, device=self.device)  # noqa: E731
            self.features = {kind: {"x": z(rows, self.dx), "y": z(rows, self.dy)} for kind in KINDS}

    @classmethod
    def sampled(cls, source_layers, target_layers, source_width: int, target_width: int, *, total: int,
                capacity: int | None, seed: int = 0, **kw) -> "HeldOut":
        """Keep min(capacity, total) of `total` observations, chosen uniformly with `seed` (all of them when
        capacity is None or >= total)."""
        if capacity is None or capacity >= total:
            select = torch.arange(total)  # device: host-side row selection
        else:
            if capacity < 0:
                raise ValueError(f"heldout observations must be >= 0, got {capacity}")
            gen = torch.Generator().manual_seed(seed + 7919)  # device: draws the host-side row selection
            select = torch.randperm(total, generator=gen)[:capacity].sort().values  # device: host-side row selection
        return cls(list(source_layers), list(target_layers), source_width, target_width, select, **kw)

    @staticmethod
    def nbytes_at(rows: int, dx: int, dy: int, dtype=torch.float32) -> int:
        """Bytes of a `HeldOut` keeping `rows` rows of widths (dx, dy): x [rows, Dx] and y [rows, Dy] per kind in
        `dtype`, plus the int64 row selection (`select`)."""
        return len(KINDS) * rows * (dx + dy) * torch.empty((), dtype=dtype, device="meta").element_size() + rows * 8

    @property
    def nbytes(self) -> int:
        """Bytes held now: every feature tensor + `select`."""
        feats = sum(t.numel() * t.element_size() for per in self.features.values() for t in per.values())
        return feats + self.select.numel() * self.select.element_size()

    @property
    def capacity(self) -> int:
        return int(self.select.numel())

    def x(self, kind: str) -> torch.Tensor:
        """Kept source features [n, Dx]."""
        return self.features[kind]["x"][:self.n]

    def y(self, kind: str) -> torch.Tensor:
        """Kept target features [n, Dy]."""
        return self.features[kind]["y"][:self.n]

    @torch.no_grad()
    def add(self, x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> None:
        """Offer the next batch of observations (x[kind] [m, Dx], y[kind] [m, Dy]); keeps the selected rows."""
        m = next(iter(x.values())).shape[0]
        lo, hi = torch.searchsorted(self.select, torch.tensor([self.seen, self.seen + m], device=self.select.device)).tolist()
        rows = self.select[lo:hi] - self.seen
        for kind in KINDS:
            if x[kind].shape != (m, self.dx) or y[kind].shape != (m, self.dy):
                raise ValueError(f"batch {kind}: x {tuple(x[kind].shape)}, y {tuple(y[kind].shape)}; "
                                 f"expected ({m}, {self.dx}) and ({m}, {self.dy})")
            if hi > lo:
                for name, t in (("x", x[kind]), ("y", y[kind])):
                    self.features[kind][name][self.n:self.n + hi - lo] = t[rows.to(t.device)].to(
                        device=self.device, dtype=self.dtype)
        self.n += hi - lo
        self.seen += m

    @classmethod
    def concat(cls, parts: list["HeldOut"]) -> "HeldOut":
        """The rows of several complete held-out samples of disjoint text (same layers and widths) as one sample:
        each part's observations follow the previous parts' (`select` and `seen` offset accordingly)."""
        first = parts[0]
        layout = (first.source_layers, first.target_layers, first.source_width, first.target_width)
        for p in parts[1:]:
            if (p.source_layers, p.target_layers, p.source_width, p.target_width) != layout:
                raise ValueError("cannot join held-out features over different layers or widths")
        offsets = [sum(p.seen for p in parts[:i]) for i in range(len(parts))]
        select = torch.cat([p.select[:p.n] + off for p, off in zip(parts, offsets)])
        features = {kind: {name: torch.cat([p.features[kind][name][:p.n].to(first.device) for p in parts])
                           for name in _FEATURES} for kind in KINDS}
        return cls(*layout, select, first.dtype, first.device, n=sum(p.n for p in parts),
                   seen=sum(p.seen for p in parts), info=dict(first.info), features=features)

    # -- persistence (the rows kept so far; the buffer is re-allocated at full capacity on load) --------
    def state(self, prefix: str = "") -> tuple[dict, dict]:
        tensors = {f"{prefix}{kind}.{name}": self.features[kind][name][:self.n] for kind in KINDS for name in _FEATURES}
        tensors[f"{prefix}select"] = self.select
        meta = {"source_layers": self.source_layers, "target_layers": self.target_layers,
                "source_width": self.source_width, "target_width": self.target_width,
                "dtype": str(self.dtype).removeprefix("torch."), "n": self.n, "seen": self.seen, "info": self.info,
                "heldout": True}
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict, meta: dict, prefix: str = "", device="cpu") -> "HeldOut":
        out = cls(meta["source_layers"], meta["target_layers"], meta["source_width"], meta["target_width"],
                  tensors[f"{prefix}select"], getattr(torch, meta["dtype"]), device, info=meta.get("info", {}))
        n = meta["n"]
        for kind in KINDS:
            for name in _FEATURES:
                out.features[kind][name][:n] = tensors[f"{prefix}{kind}.{name}"].to(device)
        out.n, out.seen = n, meta["seen"]
        return out

    def save(self, path) -> None:
        """Write to one safetensors file (atomic)."""
        tensors, meta = self.state()
        atomic_save_tensors(path, tensors, {"heldout": meta})

    @classmethod
    def load(cls, path, device="cpu") -> "HeldOut":
        tensors, meta = load_tensors(path)
        if "heldout" not in meta:
            raise ValueError(f"{path} is not a kvtransfer held-out features file")
        return cls.from_state(tensors, meta["heldout"], device=device)
