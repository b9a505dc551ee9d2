"""Model shapes (from real transformers configs, never weights) and the sizes the plan sums.

The sizes of the run's own data structures are asked of those structures (`Moments.nbytes_at`,
`HeldOut.nbytes_at`, `FeatureSampler.nbytes_at`, the mapper kinds' `params_at`), so a layout change in
the code moves the plan with it; what only the plan models (weights, activations, FLOPs) is here.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float64": 8, "double": 8, "float32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
               "fp16": 2, "fp32": 4, "half": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model's text stack (from a real transformers config)."""

    name: str
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie: bool
    load_extra_params: int = 0   # loaded with the checkpoint, then dropped (a VLM's vision tower)

    @property
    def width(self) -> int:
        """K (or V) features per token per layer: n_kv * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q,k,v,o (+ q/k/v biases for qwen2, q/k norms for qwen3),
        gated MLP, two RMSNorms."""
        h, qd = self.hidden, self.heads * self.head_dim
        n = 2 * h * qd + 2 * h * self.width + 3 * h * self.intermediate + 2 * h
        if self.model_type == "qwen2":
            n += qd + 2 * self.width
        if self.model_type == "qwen3":
            n += 2 * self.head_dim
        return n

    @property
    def body_params(self) -> int:
        """Decoder layers + final norm (what `prefill` runs; no embeddings)."""
        return self.layers * self.layer_params + self.hidden

    @property
    def params(self) -> int:
        """All parameters of the causal LM: embeddings + body + LM head (0 when tied)."""
        return self.body_params + self.vocab * self.hidden * (1 if self.tie else 2)


def shape_from_config(config, name: str = "", load_extra_params: int = 0) -> ModelShape:
    """ModelShape of a transformers config (its text config for VLMs)."""
    from ..core.models import kv_shape, text_config

    cfg = text_config(config)
    kv = kv_shape(cfg)
    return ModelShape(name or str(getattr(cfg, "_name_or_path", "")), cfg.model_type, kv.n_layers, cfg.hidden_size,
                      cfg.intermediate_size, cfg.num_attention_heads, kv.n_kv, kv.head_dim, cfg.vocab_size,
                      bool(getattr(cfg, "tie_word_embeddings", False)), load_extra_params)


def load_shape(spec: dict, trust_remote_code: bool = False) -> ModelShape:
    """Shape of a pair side {"id", "path"}: the local directory's config.json when `path` is set,
    else the shipped table (kvtransfer.resources.model_configs), else a config already in the local HF cache.
    Never downloads and never reads weights; ValueError naming the fix when there is no config."""
    from transformers import AutoConfig

    from ..resources.model_configs import MODEL_CONFIGS

    path, hub_id = spec.get("path"), spec.get("id")
    if path:
        return shape_from_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), str(path))
    if hub_id in MODEL_CONFIGS:
        fields = dict(MODEL_CONFIGS[hub_id])
        extra = fields.pop("load_extra_params", 0)
        return shape_from_config(AutoConfig.for_model(fields.pop("model_type"), **fields), hub_id, extra)
    try:
        cfg = AutoConfig.from_pretrained(hub_id, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:   # not in the local cache (OSError), or not a config (ValueError)
        raise ValueError(f"no config for {hub_id!r}: set pair.<side>.path to a local model directory, or add its "
                         "fields to kvtransfer/resources/model_configs.py") from err
    return shape_from_config(cfg, hub_id)


def dtype_bytes(name) -> int:
    """Bytes per element of a dtype name ("float64", "bfloat16", torch.float32, ...)."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}")
    return DTYPE_BYTES[key]


def torch_dtype(nbytes: int):
    """The floating torch dtype of `nbytes` bytes per element (8, 4, 2 -> float64, float32, bfloat16)."""
    import torch

    return {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}[nbytes]


# -- the run's data structures, sized by themselves ---------------------------------------------------
def moments_bytes(dx: int, dy: int, nbytes: int, *, wide: bool = False) -> int:
    """One set of calibration moments (K and V) in a dtype of `nbytes` bytes: `Moments.nbytes_at`."""
    from ..core.moments import Moments

    return Moments.nbytes_at(dx, dy, torch_dtype(nbytes), wide=wide)


def moments_kind_bytes(dx: int, dy: int, nbytes: int) -> int:
    """One kind (K or V) of a `Moments` (the batch products of one kind, or the merge of one kind)."""
    return moments_bytes(dx, dy, nbytes) // 2


def heldout_bytes(rows: int, dx: int, dy: int) -> int:
    """Held-out raw features of `rows` rows (float32 + the int64 selection): `HeldOut.nbytes_at`."""
    from ..core.moments import HeldOut

    return HeldOut.nbytes_at(rows, dx, dy)


def sample_bytes(rows: int, dx: int, dy: int) -> int:
    """The calibration's feature sample of `rows` rows: `FeatureSampler.nbytes_at`."""
    from ..maps.mlp import FeatureSampler

    return FeatureSampler.nbytes_at(rows, dx, dy)


def mapper_params(ls_width: int, target: ModelShape, k: int) -> int:
    """Ridge mapper parameters (`Mapper.params_at`): L_t * 2 * (p * q + q), p = k * n_kv_s * d_s,
    q = n_kv_t * d_t (the paper's count + biases)."""
    from ..core.mapper import Mapper

    return Mapper.params_at(target.layers, k * ls_width, target.width)


# -- what only the plan models: weights, activations, FLOPs -------------------------------------------
def prefill_flops(m: ModelShape, tokens: int, seq: int, lm_head: bool = False) -> float:
    """FLOPs of running `tokens` tokens in sequences of length `seq` through the body (+ LM head):
    2 * params * tokens + causal attention 2 * L * seq * (heads * d) per token."""
    attn = 2 * m.layers * seq * m.heads * m.head_dim * tokens
    return 2 * m.body_params * tokens + attn + (2 * m.vocab * m.hidden * tokens if lm_head else 0)


def forward_bytes(m: ModelShape, batch: int, seq: int, w: int, *, math_attention: bool, cache: bool = True) -> int:
    """Device bytes of one `prefill` of [batch, seq]: the KV cache of every layer (kept) + one layer's
    activations (residual and norms ~4 h, gated MLP 3 I, q/attention output 2 * heads * d) + the
    boolean 4D mask; the math/eager attention path (CPU) also materialises scores [batch, heads, seq, seq] fp32 x2."""
    t = batch * seq
    kv = m.layers * 2 * t * m.width * w if cache else 0
    act = t * (4 * m.hidden + 3 * m.intermediate + 2 * m.heads * m.head_dim) * w
    mask = batch * seq * seq
    scores = 2 * batch * m.heads * seq * seq * 4 if math_attention else 0
    return kv + act + mask + scores


def weight_bytes(m: ModelShape, w: int, *, with_extra: bool = False) -> int:
    """Bytes of the model's weights in dtype size `w` (with_extra: as loaded, incl. a dropped vision tower)."""
    return (m.params + (m.load_extra_params if with_extra else 0)) * w


def offloaded_bytes(m: ModelShape, w: int, max_memory: dict | None, gpus: int) -> int:
    """Weights that `max_memory` keeps off the GPUs (on the host, streamed to the GPU on every forward).

    Follows accelerate's `infer_auto_device_map`: modules fill the GPU budgets in order, and once
    something must be offloaded the first GPU keeps room for the largest offloaded layer (which is
    copied there to run). GPU keys past the node's `gpus` count for nothing."""
    if not max_memory:
        return 0
    from ..core.models import size_bytes

    total = weight_bytes(m, w)
    budget = sum(size_bytes(v) for k, v in max_memory.items() if isinstance(k, int) and k < max(1, gpus))
    if total <= budget:
        return 0
    return total - max(0, budget - m.layer_params * w)
