"""Mapper artifacts: per-target-layer maps from stacked source KV features to target K and V.

Every mapper kind holds `selected_layers` [L_t, k] (source layers feeding each target layer, in
feature order) and maps, for target layer t, x [2, rows, p] -> y [2, rows, q] with [0] = keys,
[1] = values, p = k * n_kv_s * d_s and q = n_kv_t * d_t (`map_features`; `map_blocks` takes x as
column blocks, which lets a kind skip the gather copy). Kinds are named in the manifest and
resolved by `mapper_class`; both live here, so every artifact loads after a plain `import kvtransfer`
(the fits that produce them: kvtransfer.core.ridge -> `Mapper.from_ridge`, kvtransfer.maps.mlp -> `fit_mlp`,
kvtransfer.maps.train_map -> `TrainedMapper.from_ridge_mapper`).
On disk: `mapper.safetensors` + a JSON manifest `mapper.json` (pair identity, k, lambda, selection,
calibration provenance, R², sha256).

The ridge kind (the paper's) stores
    weight  [L_t, 2, p, q]   bias [L_t, 2, q]        y = x @ weight[t] + bias[t]
with L_t * 2 * p * q (+ biases) parameters, as counted in the paper. The MLP kind (the paper's
fallback) stores per (target layer, K/V, head) a 3-layer MLP with standardised inputs and outputs.
The trained kind (kvtransfer.maps.train_map) is the ridge kind with weights trained for the target's attention
output: same tensors, same apply path. The hidden kind (kvtransfer.core.hidden) is the ridge kind fitted on the
source's normed layer inputs (alone, or beside its K/V): same tensors, wider p, and applying it needs the
source's hidden states. The factored kind holds the map families of kvtransfer.maps.families (head-local support, reduced rank,
attention-weighted fits). Every artifact carries `native_sink`, the number of leading context
positions the target computes itself when the map is applied, so the map and its sink travel together.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from .io import atomic_save_tensors, atomic_write_json, load_tensors, sha256_file
from .models import model_identity
from .ridge import RidgeFit

FORMAT_VERSION = 1
_WEIGHTS, _MANIFEST = "mapper.safetensors", "mapper.json"


@dataclass(kw_only=True)
class MapperBase:
    """What every mapper kind shares: pair identity, selected layers, provenance, save/load.

    `source` / `target` are `model_identity` dicts; `key_space` is "stripped" (content space, the
    paper) or "rotated" (keys mapped as cached, an ablation). `r2` holds per-head R² lists
    {split: {kind: [L_t][n_kv_t]}}; `calibration` the provenance of the moments.
    """

    selected_layers: torch.Tensor
    source: dict
    target: dict
    key_space: str = "stripped"
    lam: float = 0.01
    calibration: dict = field(default_factory=dict)
    r2: dict = field(default_factory=dict)
    native_sink: int = 0  # first N context positions the target computes itself when this map is applied
    produced_by: dict = field(default_factory=dict)  # commit, dirty flag, time, code version of the fit (the runner's)
    kind = "base"
    features = "kv"  # what the map reads of the source per selected layer (kvtransfer.core.hidden.FEATURES)
    _FLOAT_TENSORS: ClassVar[tuple[str, ...]] = ()  # per kind: its floating-point tensor attributes

    @property
    def k(self) -> int:
        """Source layers per target layer."""
        return self.selected_layers.shape[1]

    @property
    def needs_hidden(self) -> bool:
        """Whether applying the map needs the source's hidden states (`transfer(..., source_hidden=...)`)."""
        return self.features != "kv"

    @property
    def n_parameters(self) -> int:
        """Number of trainable values in the mapper."""
        return sum(t.numel() for name, t in self.tensors().items() if t.is_floating_point())

    @property
    def apply_flops_per_token(self) -> int:
        """FLOPs (2 per multiply-add) to map one token's K and V for every target layer."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Device of the mapper's weights."""
        return getattr(self, self._FLOAT_TENSORS[0]).device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the mapper's weights (the dtype `map_layers` computes in)."""
        return getattr(self, self._FLOAT_TENSORS[0]).dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        """All tensors to save (float32 weights, int64 selected_layers)."""
        return {name: getattr(self, name).float() for name in self._FLOAT_TENSORS} | {
            "selected_layers": self.selected_layers}

    def to(self, device=None, dtype=None) -> "MapperBase":
        """Move floating-point weights to `device` / `dtype`; returns self."""
        for name in self._FLOAT_TENSORS:
            setattr(self, name, getattr(self, name).to(device=device, dtype=dtype))
        return self

    # -- per kind -----------------------------------------------------------------------------
    def map_features(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Map stacked source features x [2, rows, p] to target layer `layer`'s [2, rows, q]."""
        raise NotImplementedError

    def map_blocks(self, layer: int, blocks: list[tuple[int, torch.Tensor]], gather=None) -> torch.Tensor:
        """`map_features` of x given as column blocks [(first column j, x[:, :, j:j + w])] in column
        order, covering all p columns (strided views, e.g. of a buffer of source layers). A kind
        that needs x whole calls `gather(blocks)` (default: torch.cat) -- this default does."""
        x = blocks[0][1] if len(blocks) == 1 else (gather or _cat)(blocks)
        return self.map_features(layer, x)

    def extra_manifest(self) -> dict:
        """Kind-specific manifest fields (hyper-parameters needed to rebuild the mapper)."""
        return {}

    @classmethod
    def from_tensors(cls, tensors: dict, common: dict, manifest: dict) -> "MapperBase":
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------
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
        return {"format": "kvtransfer.core.mapper", "version": FORMAT_VERSION, "kind": self.kind,
                "source": self.source, "target": self.target, "key_space": self.key_space, "k": self.k,
                "lambda": self.lam, "selected_layers": self.selected_layers.tolist(),
                "shapes": {name: list(t.shape) for name, t in self.tensors().items()},
                "n_parameters": self.n_parameters, "apply_flops_per_token": self.apply_flops_per_token,
                "native_sink": self.native_sink, "calibration": self.calibration, "r2": self.r2,
                "produced_by": self.produced_by, **self.extra_manifest()}

    def save(self, directory: str | Path) -> Path:
        """Write mapper.safetensors + mapper.json into `directory` (refuses to overwrite)."""
        directory = Path(directory)
        if (directory / _MANIFEST).exists() or (directory / _WEIGHTS).exists():
            raise FileExistsError(f"{directory} already holds a mapper; save to a new directory")
        atomic_save_tensors(directory / _WEIGHTS, self.tensors(), {"manifest": _MANIFEST})
        atomic_write_json(directory / _MANIFEST, self.manifest() | {"sha256": sha256_file(directory / _WEIGHTS)})
        return directory

    @classmethod
    def load(cls, directory: str | Path, source_model=None, target_model=None) -> "MapperBase":
        """Read a saved mapper of any kind, verify checksum and shapes, and (given models) its pair."""
        directory = Path(directory)
        manifest_path, weights_path = directory / _MANIFEST, directory / _WEIGHTS
        for path in (manifest_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: {directory} is not a saved mapper")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{manifest_path} is not valid JSON (truncated?): {err}") from err
        if manifest.get("format") != "kvtransfer.core.mapper":
            raise ValueError(f"{manifest_path} is not a kvtransfer mapper manifest")
        if manifest.get("version") != FORMAT_VERSION:
            raise ValueError(f"mapper format version {manifest.get('version')} is not supported "
                             f"(this kvtransfer reads version {FORMAT_VERSION}); refit the mapper")
        if sha256_file(weights_path) != manifest["sha256"]:
            raise ValueError(f"{weights_path} does not match its manifest checksum (corrupt or truncated "
                             "file); copy it again or refit")
        tensors, _ = load_tensors(weights_path)
        for name, shape in manifest["shapes"].items():
            if name not in tensors or list(tensors[name].shape) != shape:
                raise ValueError(f"{weights_path}: tensor {name} missing or not of shape {shape}")
        kind = mapper_class(manifest["kind"])
        common = dict(selected_layers=tensors["selected_layers"], source=manifest["source"],
                      target=manifest["target"], key_space=manifest["key_space"], lam=manifest["lambda"],
                      calibration=manifest.get("calibration", {}), r2=manifest.get("r2", {}),
                      native_sink=int(manifest.get("native_sink", 0)), produced_by=manifest.get("produced_by") or {})
        mapper = kind.from_tensors(tensors, common, manifest)
        if source_model is not None and target_model is not None:
            mapper.check_pair(source_model, target_model)
        return mapper


@dataclass(kw_only=True)
class Mapper(MapperBase):
    """The paper's closed-form ridge mapper: y = x @ weight[t] + bias[t] per target layer t."""

    weight: torch.Tensor
    bias: torch.Tensor
    kind = "ridge"
    _FLOAT_TENSORS = ("weight", "bias")

    @classmethod
    def from_ridge(cls, fit: RidgeFit, source_model, target_model, *, key_space: str = "stripped",
                   calibration: dict | None = None) -> "Mapper":
        """Pack a `RidgeFit` (all target layers) into a Mapper for the given models."""
        n_t = len(fit.selected_layers)
        weight = torch.stack([torch.stack([fit.weights[kind][t].weight for kind in ("k", "v")]) for t in range(n_t)])
        bias = torch.stack([torch.stack([fit.weights[kind][t].bias for kind in ("k", "v")]) for t in range(n_t)])
        r2 = {split: {kind: v.tolist() for kind, v in per.items()} for split, per in fit.r2.items()}
        return cls(weight=weight.float(), bias=bias.float(),
                   selected_layers=torch.tensor(fit.selected_layers, dtype=torch.long),  # device: host-side layer indices (a map keeps them on the CPU)
                   source=model_identity(source_model), target=model_identity(target_model), key_space=key_space,
                   lam=fit.lam, calibration=dict(calibration or {}, observations=fit.observations), r2=r2)

    @staticmethod
    def params_at(n_target_layers: int, p: int, q: int) -> int:
        """Parameters (= float32 values stored) of a ridge mapper at these shapes: weight [L_t, 2, p, q] +
        bias [L_t, 2, q]; p = k * source width, q = target width (n_kv_t * d_t)."""
        return n_target_layers * 2 * (p * q + q)

    @property
    def apply_flops_per_token(self) -> int:
        L, kinds, p, q = self.weight.shape
        return L * kinds * (2 * p * q + q)

    def map_features(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [2, rows, p] -> x @ weight[layer] + bias[layer], [2, rows, q]."""
        return torch.baddbmm(self.bias[layer][:, None, :], x, self.weight[layer])

    def map_blocks(self, layer, blocks, gather=None) -> torch.Tensor:
        """Per kind (K, V) 2-D addmm straight on the strided views, into one output [2, rows, q]
        (`gather.output`'s reused buffer when given). 2-D, not a batched baddbmm over the kinds: on CPU a
        batched bf16 GEMM clones strided operands (x and the weight slice); a 2-D one reads them in place.

        float32 (and wider): one addmm per block accumulated in place, for any selection: no gather copy;
        the sums run in another order than one GEMM over the gathered x (a few eps32).
        Reduced precision (bf16, fp16) with several blocks: gathered into one buffer and mapped by one GEMM.
        Accumulating blocks there rounds the running sum to bf16 at each block (measured at k = 12: 3.1u
        against the fp32 reference, vs 1.4u for one GEMM), and on a CPU with avx512_bf16 it was no faster
        (8 blocks of 1,024 per target and kind, interleaved medians under load 5-8: 553 vs 575 ms with the
        copy at 4,096 tokens, 320 vs 298 ms at 2,048, about half a same-shape matmul's rate at 256), so
        precision decides: the copy stays for it (issue 48)."""
        w, b = self.weight[layer], self.bias[layer]
        if len(blocks) > 1 and w.element_size() < 4:
            j0, x = 0, (gather or _cat)(blocks)
            blocks = [(j0, x)]
        rows = blocks[0][1].shape[1]
        out = getattr(gather, "output", None)
        y = out((2, rows, w.shape[-1]), w.dtype) if out else torch.empty(2, rows, w.shape[-1], device=w.device,
                                                                          dtype=w.dtype)
        for kind in range(2):
            for i, (j, x) in enumerate(blocks):
                wj = w[kind, j:j + x.shape[-1]]  # contiguous rows of W
                if i == 0:
                    torch.addmm(b[kind], x[kind], wj, out=y[kind])
                else:
                    y[kind].addmm_(x[kind], wj)
        return y

    @classmethod
    def from_tensors(cls, tensors, common, manifest) -> "Mapper":
        return cls(weight=tensors["weight"], bias=tensors["bias"], **common)


@dataclass(kw_only=True)
class TrainedMapper(Mapper):
    """The paper's map with weights trained for the target's attention output (kvtransfer.maps.train_map, layer by
    layer) or its next-token KL (kvtransfer.maps.train_e2e, all layers jointly): the ridge kind's tensors, shapes and
    apply path (so the same apply FLOPs), plus the record of its training (`training`: objective, the sequences
    it trained and stopped on, stop-split losses at the ridge start and at the end, which layers kept their
    ridge weights because training made them worse)."""

    training: dict = field(default_factory=dict)
    kind = "trained"

    def extra_manifest(self) -> dict:
        return {"training": self.training}

    @classmethod
    def from_ridge_mapper(cls, ridge: Mapper, weight: torch.Tensor, bias: torch.Tensor, *, training: dict,
                          r2: dict | None = None) -> "TrainedMapper":
        """`ridge` with its weight [L_t, 2, p, q] and bias [L_t, 2, q] replaced (same shapes; ValueError
        otherwise) and `r2` (default: the ridge's) -- everything else (pair, selection, sink) is the ridge's."""
        if weight.shape != ridge.weight.shape or bias.shape != ridge.bias.shape:
            raise ValueError(f"trained weights {tuple(weight.shape)} / bias {tuple(bias.shape)} do not have the ridge "
                             f"map's shapes {tuple(ridge.weight.shape)} / {tuple(ridge.bias.shape)}")
        return cls(weight=weight.float(), bias=bias.float(), selected_layers=ridge.selected_layers,
                   source=ridge.source, target=ridge.target, key_space=ridge.key_space, lam=ridge.lam,
                   calibration=dict(ridge.calibration), r2=ridge.r2 if r2 is None else r2,
                   native_sink=ridge.native_sink, training=training)

    @classmethod
    def from_tensors(cls, tensors, common, manifest) -> "TrainedMapper":
        return cls(weight=tensors["weight"], bias=tensors["bias"], training=manifest.get("training", {}), **common)


@dataclass(kw_only=True)
class HiddenMapper(Mapper):
    """A closed-form ridge map from the source's hidden states (issue 23 §2, kvtransfer.core.hidden): per target layer
    y = x @ weight[t] + bias[t] as the ridge kind, where x concatenates, over the k selected source layers, the
    normed layer input [H] ("hidden") or [normed input | K or V] [H + n_kv_s * d_s] ("hidden_kv").
    Applying it needs those hidden states: `transfer` / `map_layers` take them as `source_hidden`."""

    features: str = "hidden"   # an instance field here (the other kinds read the class default "kv")
    hidden_size: int = 0       # H of the source
    kind = "hidden"

    @property
    def feature_width(self) -> int:
        """Columns per selected source layer: H or H + n_kv_s * d_s."""
        from .hidden import feature_width

        return feature_width(self.features, self.hidden_size, int(self.source["n_kv"]) * int(self.source["head_dim"]))

    @property
    def store_values_per_token(self) -> int:
        """Values per token a serving engine must keep to apply this map: the hidden states of every used source
        layer (+ their K and V for hidden_kv). Times the dtype's size for bytes."""
        from .hidden import used_layers

        kv = 2 * int(self.source["n_kv"]) * int(self.source["head_dim"]) if self.features == "hidden_kv" else 0
        return len(used_layers(self.selected_layers)) * (self.hidden_size + kv)

    def extra_manifest(self) -> dict:
        return {"features": self.features, "hidden_size": self.hidden_size, "feature_width": self.feature_width,
                "store_values_per_token": self.store_values_per_token}

    @classmethod
    def from_ridge(cls, fit: RidgeFit, source_model, target_model, *, features: str, hidden_size: int,
                   key_space: str = "stripped", calibration: dict | None = None) -> "HiddenMapper":
        """Pack a `RidgeFit` on hidden-state moments (source_width = the feature width) into a HiddenMapper."""
        from .hidden import check_features

        if check_features(features) == "kv":
            raise ValueError("features='kv' is the ridge kind (Mapper.from_ridge)")
        ridge = Mapper.from_ridge(fit, source_model, target_model, key_space=key_space, calibration=calibration)
        mapper = cls(weight=ridge.weight, bias=ridge.bias, selected_layers=ridge.selected_layers, source=ridge.source,
                     target=ridge.target, key_space=key_space, lam=ridge.lam, calibration=ridge.calibration,
                     r2=ridge.r2, features=features, hidden_size=int(hidden_size))
        if mapper.weight.shape[2] != mapper.k * mapper.feature_width:
            raise ValueError(f"the fit has {mapper.weight.shape[2]} features per target layer, not k * feature width "
                             f"= {mapper.k} * {mapper.feature_width} ({features}, H = {hidden_size})")
        return mapper

    @classmethod
    def from_tensors(cls, tensors, common, manifest) -> "HiddenMapper":
        return cls(weight=tensors["weight"], bias=tensors["bias"], features=manifest["features"],
                   hidden_size=int(manifest["hidden_size"]), **common)


@dataclass(kw_only=True)
class MLPMapper(MapperBase):
    """Per-head MLPs; tensors stacked [L_t, 2, n_kv_t, ...] (K heads at [:, 0], V heads at [:, 1])."""

    w1: torch.Tensor  # [L_t, 2, H, p, hidden]
    b1: torch.Tensor  # [L_t, 2, H, hidden]
    w2: torch.Tensor  # [L_t, 2, H, hidden, hidden]
    b2: torch.Tensor
    w3: torch.Tensor  # [L_t, 2, H, hidden, d_t]
    b3: torch.Tensor  # [L_t, 2, H, d_t]
    x_mean: torch.Tensor  # [L_t, 2, p]
    x_std: torch.Tensor
    y_mean: torch.Tensor  # [L_t, 2, q]
    y_std: torch.Tensor
    kind = "mlp"

    _NAMES = ("w1", "b1", "w2", "b2", "w3", "b3", "x_mean", "x_std", "y_mean", "y_std")
    _FLOAT_TENSORS = _NAMES

    def map_features(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [2, rows, p] -> [2, rows, q] through this layer's per-head MLPs."""
        return mlp_forward(self.layer_params(layer), x)

    def layer_params(self, layer: int) -> dict[str, torch.Tensor]:
        """The tensors of one target layer (views)."""
        return {name: getattr(self, name)[layer] for name in self._NAMES}

    @property
    def n_parameters(self) -> int:
        return sum(getattr(self, n).numel() for n in ("w1", "b1", "w2", "b2", "w3", "b3"))

    @staticmethod
    def params_at(n_target_layers: int, heads: int, p: int, hidden: int, d: int) -> int:
        """`n_parameters` at these shapes: per target layer, kind and head w1 [p, hidden] + b1, w2 [hidden,
        hidden] + b2, w3 [hidden, d] + b3."""
        return n_target_layers * 2 * heads * (p * hidden + hidden + hidden * hidden + hidden + hidden * d + d)

    @staticmethod
    def values_at(n_target_layers: int, heads: int, p: int, hidden: int, d: int) -> int:
        """Float32 values stored at these shapes: the parameters + the input/output normalisers (x_mean,
        x_std [L_t, 2, p], y_mean, y_std [L_t, 2, heads * d])."""
        norms = n_target_layers * 2 * 2 * (p + heads * d)
        return MLPMapper.params_at(n_target_layers, heads, p, hidden, d) + norms

    @property
    def apply_flops_per_token(self) -> int:
        L, kinds, heads, p, hidden = self.w1.shape
        d = self.w3.shape[-1]
        per_head = 2 * (p * hidden + hidden * hidden + hidden * d) + 2 * p + 2 * hidden + d  # GEMMs, norm, biases
        return L * kinds * heads * per_head

    def extra_manifest(self) -> dict:
        return {"hidden": self.w1.shape[-1]}

    @classmethod
    def from_tensors(cls, tensors, common, manifest) -> "MLPMapper":
        return cls(**{name: tensors[name] for name in cls._NAMES}, **common)


@dataclass(kw_only=True)
class FactoredMapper(MapperBase):
    """Linear maps with a restricted support and/or rank (kvtransfer.maps.families): per target layer and
    K/V, output group g (all q columns, or one target KV head) reads feature columns columns[g] and
        y_g = x[:, columns[g]] @ down[t, :, g] (@ up[t, :, g]) + bias[t, :, g]
    down [L_t, 2, G, p_g, r] and up [L_t, 2, G, r, q_g] for rank r; at full rank up is absent and
    down [L_t, 2, G, p_g, q_g] is the map. columns [G, p_g] int64.
    """

    columns: torch.Tensor
    down: torch.Tensor
    bias: torch.Tensor
    up: torch.Tensor | None = None
    support: str = "full"
    weighting: str = "none"
    kind = "factored"

    @property
    def _FLOAT_TENSORS(self) -> tuple[str, ...]:  # noqa: N802 (the base class's per-kind attribute)
        return ("down", "bias") if self.up is None else ("down", "up", "bias")

    @property
    def rank(self) -> int | None:
        """The maps' rank (None: full rank)."""
        return None if self.up is None else self.up.shape[-2]

    def tensors(self) -> dict[str, torch.Tensor]:
        return super().tensors() | {"columns": self.columns}

    @property
    def apply_flops_per_token(self) -> int:
        L, kinds, groups, p_g, r = self.down.shape
        per_group = 2 * p_g * r + (0 if self.up is None else 2 * r * self.up.shape[-1])
        return L * kinds * (groups * per_group + self.bias.shape[-1])

    def map_features(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [2, rows, p] -> [2, rows, q] through this layer's grouped (low-rank) maps."""
        groups = self.columns.shape[0]
        if groups == 1 and self.columns.shape[1] == x.shape[-1]:
            xg = x[:, None]  # full support: no gather
        else:
            xg = x[:, :, self.columns.to(x.device)].permute(0, 2, 1, 3)  # [2, G, rows, p_g]
        y = xg @ self.down[layer]
        if self.up is not None:
            y = y @ self.up[layer]
        y = y.permute(0, 2, 1, 3).flatten(2)  # [2, rows, G * q_g]
        return y + self.bias[layer][:, None, :]

    def extra_manifest(self) -> dict:
        return {"support": self.support, "rank": self.rank, "weighting": self.weighting}

    @classmethod
    def from_family(cls, fit, source_model, target_model, *, key_space: str = "stripped",
                    calibration: dict | None = None) -> "FactoredMapper":
        """Pack a `families.FamilyFit` into a mapper for the given models (or model_identity dicts)."""
        def stack(per_kind):
            return torch.stack([torch.stack([per_kind[kind][t] for kind in ("k", "v")])
                                for t in range(len(fit.selected_layers))]).float()
        up = None if fit.rank is None else stack(fit.up)
        return cls(columns=fit.columns.long(), down=stack(fit.down), up=up, bias=stack(fit.bias),
                   support=fit.support, weighting=fit.weighting,
                   selected_layers=torch.tensor(fit.selected_layers, dtype=torch.long),  # device: host-side layer indices (a map keeps them on the CPU)
                   source=model_identity(source_model), target=model_identity(target_model), key_space=key_space,
                   lam=fit.lam, calibration=dict(calibration or {}, observations=fit.observations, **fit.info),
                   r2={split: {kind: v.tolist() for kind, v in per.items()} for split, per in fit.r2.items()})

    @classmethod
    def from_tensors(cls, tensors, common, manifest) -> "FactoredMapper":
        return cls(columns=tensors["columns"], down=tensors["down"], up=tensors.get("up"), bias=tensors["bias"],
                   support=manifest.get("support", "full"), weighting=manifest.get("weighting", "none"), **common)


def mlp_forward(p: dict, x: torch.Tensor, denormalise: bool = True) -> torch.Tensor:
    """Batched per-head MLP: x [2, rows, p] -> [2, rows, H * d] (standardised if not `denormalise`)."""
    z = (x - p["x_mean"][:, None]) / p["x_std"][:, None]
    h = torch.relu(torch.einsum("krp,khpo->khro", z, p["w1"]) + p["b1"][:, :, None])
    h = torch.relu(h @ p["w2"] + p["b2"][:, :, None])
    out = h @ p["w3"] + p["b3"][:, :, None]  # [2, H, rows, d]
    out = out.permute(0, 2, 1, 3).flatten(2)  # [2, rows, H * d]
    return out * p["y_std"][:, None] + p["y_mean"][:, None] if denormalise else out


def _cat(blocks: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([x for _, x in blocks], dim=-1)


def mapper_class(kind: str) -> type:
    """The class of mapper kind `kind` ("ridge", "trained", "hidden", "mlp", "factored"); ValueError for an unknown kind."""
    kinds = {cls.kind: cls for cls in (Mapper, TrainedMapper, HiddenMapper, MLPMapper, FactoredMapper)}  # kind name, as written in manifests -> class
    if kind not in kinds:
        raise ValueError(f"unknown mapper kind {kind!r} (known: {sorted(kinds)})")
    return kinds[kind]


def load_mapper(directory: str | Path, source_model=None, target_model=None) -> MapperBase:
    """Load a saved mapper of any kind (ridge or mlp); see `MapperBase.load`."""
    return MapperBase.load(directory, source_model, target_model)
