"""The paper's pairs as shapes, and what mapping and prefilling them costs.

Shapes: the REAL text configs of the paper's models (rows of kvtransfer.resources.model_configs), the
pairs with their k, and "shapes-only" builders: random-weight decoder bodies of those configs
(optionally fewer layers) and a random mapper of the real per-layer size. Timing them says nothing
about quality, only about cost.

Cost model: FLOPs and minimal bytes of the mapper (GEMMs, bias, RoPE strip/apply) and of a target
prefill, and the floor a time is shown next to: max(FLOPs / matmul rate, bytes / copy bandwidth).
"""
from __future__ import annotations

import math

import torch

from ..core.mapper import Mapper
from ..core.models import kv_shape
from ..resources.model_configs import ASSUMED, MODEL_CONFIGS

# ---------------------------------------------------------------------------------------------
# The paper's models: rows of the one model table (kvtransfer.resources.model_configs, each value with its
# source; its ASSUMED entries are the unverified ones), under short names.
_IDS = {
    "qwen3_8b": "Qwen/Qwen3-8B", "qwen3_14b": "Qwen/Qwen3-14B", "qwen3_32b": "Qwen/Qwen3-32B",
    "llama31_8b": "meta-llama/Llama-3.1-8B", "llama31_70b": "meta-llama/Llama-3.1-70B",
    "ministral3_3b": "mistralai/Ministral-3-3B-Reasoning-2512",
    "ministral3_8b": "mistralai/Ministral-3-8B-Reasoning-2512",
    "ministral3_14b": "mistralai/Ministral-3-14B-Reasoning-2512",
}
MODELS = {name: {k: v for k, v in MODEL_CONFIGS[hub_id].items() if k != "load_extra_params"}
          for name, hub_id in _IDS.items()}
ASSUMPTIONS = {name: "; ".join(f"{field}: {why}" for (i, field), why in ASSUMED.items() if i == hub_id)
               for name, hub_id in _IDS.items() if any(i == hub_id for i, _ in ASSUMED)}
# pair -> (source, target, k)   (k = the paper's chosen number of source layers per target layer)
PAIRS = {
    "qwen3_14b_32b": ("qwen3_14b", "qwen3_32b", 8),
    "qwen3_8b_32b": ("qwen3_8b", "qwen3_32b", 12),
    "llama31_8b_70b": ("llama31_8b", "llama31_70b", 20),
    "ministral3_3b_8b": ("ministral3_3b", "ministral3_8b", 26),
    "ministral3_3b_14b": ("ministral3_3b", "ministral3_14b", 20),
    "ministral3_8b_14b": ("ministral3_8b", "ministral3_14b", 12),
}


def real_config(name: str, layers: int | None = None, attn: str = "sdpa"):
    """The transformers config object (Qwen3Config / LlamaConfig / Ministral3Config) of model `name`,
    with `num_hidden_layers` replaced by `layers` when given."""
    from transformers import AutoConfig

    spec = dict(MODELS[name])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = attn
    return config


class ShapesOnlyLM(torch.nn.Module):
    """A decoder body (`.model`, no LM head) behind the causal-LM surface `kvtransfer` uses
    (`base_model_prefix`, `.config`, `.dtype`, `.device`): works with `prefill`, `RopeCodec`, `kv_features` and
    `collect_moments`."""

    base_model_prefix = "model"

    def __init__(self, body: torch.nn.Module):
        super().__init__()
        self.model = body
        self.config = body.config
        self.name_or_path = "shapes-only"

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype of the body."""
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Device of the body's parameters."""
        return self.model.device


@torch.no_grad()
def build_shapes_only(config, *, device="cpu", dtype=torch.float32, seed: int = 0) -> ShapesOnlyLM:
    """Random-weight decoder body of `config` on `device`: matrices filled from a 16M-value N(0, 0.02)
    pool at random offsets (fast, never zero), norm weights 1. For timing only."""
    from transformers import AutoModel
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        body = AutoModel.from_config(config, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = (torch.randn(1 << 24, generator=g) * 0.02).to(device, dtype)  # device: seeded CPU draw, moved
    for param in body.parameters():
        if param.dim() < 2:
            continue
        flat, n = param.view(-1), param.numel()
        offset = int(torch.randint(0, pool.numel(), (1,), generator=g))  # device: host-side draw, read as an int
        for start in range(0, n, pool.numel()):
            m = min(pool.numel(), n - start)
            src = torch.roll(pool, offset)[:m] if start == 0 else pool[:m]
            flat[start:start + m].copy_(src)
    return ShapesOnlyLM(body.eval().requires_grad_(False))


def rope_only(config, device="cpu") -> torch.nn.Module:
    """A module that `RopeCodec` accepts for `config` without building the model (rotary only)."""
    import importlib

    mt = config.model_type
    mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    rotary_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding") and n != "RotaryEmbedding")
    holder, body = torch.nn.Module(), torch.nn.Module()
    with torch.device(device):
        body.rotary_emb = rotary_cls(config=config)
    holder.model, holder.config, holder.base_model_prefix = body, config, "model"
    return holder


def random_mapper(source_config, target_config, k: int, *, n_target_layers: int | None = None,
                  selection: str = "random", device="cpu", dtype=torch.float32, seed: int = 0) -> Mapper:
    """Random Mapper of the real per-layer size: weight [L, 2, k*W_s, W_t], bias [L, 2, W_t],
    selected_layers [L, k] from the source's full depth. selection "random" (any order: gather path)
    or "band" (k consecutive layers around the proportional depth: zero-copy view path)."""
    s, t = kv_shape(source_config), kv_shape(target_config)
    n_t = n_target_layers or t.n_layers
    sel = bench_selection(s.n_layers, t.n_layers, k, n_t, selection, seed)
    p, q = k * s.width, t.width
    gd = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(n_t, 2, p, q, generator=gd, device=device, dtype=dtype) / math.sqrt(p)
    bias = torch.randn(n_t, 2, q, generator=gd, device=device, dtype=dtype) * 0.1
    ident = lambda sh: {"model_id": "shapes-only", "config_hash": "", "n_layers": sh.n_layers,  # noqa: E731
                        "n_kv": sh.n_kv, "head_dim": sh.head_dim}
    return Mapper(weight=weight, bias=bias, selected_layers=sel.long(), source=ident(s), target=ident(t),
                  calibration={"shapes_only": True})


def bench_selection(n_source: int, n_target_full: int, k: int, n_t: int, selection: str = "random",
                    seed: int = 0) -> torch.Tensor:
    """The bench's selected_layers [n_t, k] (int64): "random" (any order: k scattered layers per target) or "band"
    (k consecutive layers around the proportional depth of the full-depth target)."""
    g = torch.Generator().manual_seed(seed)  # device: draws host-side layer indices (selected_layers lives on the CPU)
    if selection == "random":
        return torch.stack([torch.randperm(n_source, generator=g)[:k] for _ in range(n_t)])  # device: host-side layer indices
    if selection == "band":
        centre = [round(i * (n_source - 1) / max(1, n_target_full - 1)) for i in range(n_t)]
        return torch.tensor([[min(max(0, c - k // 2), n_source - k) + j for j in range(k)] for c in centre])  # device: host-side layer indices
    raise ValueError(f"selection must be 'random' or 'band', got {selection!r}")


# ---------------------------------------------------------------------------------------------
# FLOPs and minimal bytes.
ROPE_STRIP_FLOPS, ROPE_APPLY_FLOPS = 4, 3  # per element: 2 mul + 1 add (+1 div to strip)


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype, device="meta").element_size()  # meta: a size, no allocation


def mapper_cost(source_config, target_config, k: int, tokens: int, *, n_target_layers: int,
                n_source_used: int, weight_bytes: int = 4, cache_bytes: int = 4, out_bytes: int = 4,
                features: str = "kv") -> dict:
    """FLOPs and minimal bytes of mapping `tokens` tokens into `n_target_layers` layers.

    gemm_flops = L_t * 2 (K,V) * 2*tokens*p*q; flops adds bias (L_t*2*tokens*q) and RoPE
    (strip: 4/elem on n_source_used layers' keys when the map reads them, apply: 3/elem on target keys).
    bytes = mapper weights+biases + the source features of the used layers read (K,V; or hidden states,
    `features` as in kvtransfer.core.hidden) + target K,V written. p = k * the feature width per source layer.
    """
    from ..core.hidden import feature_width

    s, t = kv_shape(source_config), kv_shape(target_config)
    hidden = int(getattr(source_config, "hidden_size", 0) or 0)
    p, q = k * feature_width(features, hidden, s.width), t.width
    read = (0 if features == "hidden" else 2 * s.width) + (0 if features == "kv" else hidden)  # values per token, layer
    gemm = n_target_layers * 2 * 2 * tokens * p * q
    strip = n_source_used * tokens * s.width * ROPE_STRIP_FLOPS if features != "hidden" else 0
    rope = strip + n_target_layers * tokens * q * ROPE_APPLY_FLOPS
    flops = gemm + n_target_layers * 2 * tokens * q + rope
    nbytes = (n_target_layers * 2 * (p * q + q) * weight_bytes + n_source_used * tokens * read * cache_bytes
              + n_target_layers * 2 * tokens * q * out_bytes)
    return {"gemm_flops": gemm, "flops": flops, "bytes": nbytes}


def body_params(config, layers: int | None = None) -> int:
    """Non-embedding parameters of the decoder body: per layer q,k,v,o + gated MLP + 2 norms
    (+ q/k norms for Qwen3), plus the final norm. No biases (none of the paper's models has any)."""
    h, i = config.hidden_size, config.intermediate_size
    shape, heads = kv_shape(config), config.num_attention_heads
    per_layer = (h * heads * shape.head_dim * 2 + 2 * h * shape.width + 3 * h * i + 2 * h
                 + (2 * shape.head_dim if config.model_type == "qwen3" else 0))
    return (layers if layers is not None else config.num_hidden_layers) * per_layer + h


def prefill_cost(config, tokens: int, *, dtype_bytes: int = 4) -> dict:
    """Standard transformer prefill cost of the body: flops = 2*params*tokens + attention
    4*layers*tokens^2*(heads*head_dim)/2 (causal); bytes = weights + embedding rows read + KV written."""
    shape, layers = kv_shape(config), config.num_hidden_layers
    params = body_params(config)
    attn = 4 * layers * tokens * tokens * (config.num_attention_heads * shape.head_dim) // 2
    nbytes = (params + tokens * config.hidden_size) * dtype_bytes + layers * 2 * tokens * shape.width * dtype_bytes
    return {"flops": 2 * params * tokens + attn, "bytes": nbytes, "params": params}


def floor_ms(flops: float, nbytes: float, caps: dict) -> float:
    """Lower bound in ms: max(flops / matmul rate, bytes / copy bandwidth)."""
    return 1e3 * max(flops / caps["matmul_flops_per_s"], nbytes / caps["copy_bytes_per_s"])
