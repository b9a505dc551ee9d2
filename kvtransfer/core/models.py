"""Load causal LMs and tokenizers (HF id or local dir) and describe them for pair checks.

Ministral 3 checkpoints are `mistral3` vision-language models; only their text stack (the decoder
under the conditional-generation model plus its LM head) is used here.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

# Config fields that define the shapes and numerics of the KV cache and the token space. A mapper is
# valid for a pair exactly when these agree.
_ARCH_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "intermediate_size", "rope_parameters", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings",
)


def text_config(config):
    """The decoder (text) config of `config`: itself for text models, `text_config` for VLMs."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    try:
        return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of auto, bfloat16, float16, float32") from None


def load_model(name_or_path: str, *, dtype="auto", device: str | None = None, device_map=None,
               max_memory: dict | None = None, offload_folder: str | None = None,
               trust_remote_code: bool = False, attn_implementation: str | None = None):
    """Load `(model, tokenizer)`: a causal LM in eval mode and its tokenizer.

    `name_or_path` is an HF hub id or a local directory. `dtype` is a torch dtype or one of
    "auto", "bfloat16", "float16", "float32". `device_map` ("auto", "balanced", "sequential" or an
    explicit {module name: device} dict, as transformers takes it; needs `accelerate`) spreads a model
    that does not fit one GPU over several, layer by layer (`layer_devices` then says where each
    layer's cache must live); otherwise the model is moved to `device` (default: CUDA if available,
    else CPU). `max_memory` ({gpu index | "cpu": size}, as transformers takes it) caps what each device
    holds: the layers past the GPU budget stay in host memory and accelerate streams them to the GPU on
    every forward (weight offload; implies device_map="auto" when none is given). `offload_folder`
    is where layers past the host budget go (disk offload), passed through as transformers takes it.
    For `mistral3` checkpoints the returned model is the text stack as a `*ForCausalLM`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    kwargs = {"dtype": _dtype(dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if max_memory is not None and device_map is None:
        device_map = "auto"
    if device_map is not None:
        kwargs["device_map"] = device_map
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    if offload_folder is not None:
        kwargs["offload_folder"] = str(offload_folder)
    if config.model_type == "mistral3":
        model = _load_text_stack(name_or_path, kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if device_map is None:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    model.name_or_path = str(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _load_text_stack(name_or_path, kwargs):
    """Load a mistral3 VLM and return its decoder + LM head as a `*ForCausalLM` (vision tower dropped)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vlm = AutoModelForImageTextToText.from_pretrained(name_or_path, **kwargs)
    text_cfg = vlm.config.text_config
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(text_cfg)
    lm.model = vlm.model.language_model
    lm.lm_head = vlm.lm_head
    lm.config = text_cfg
    lm.generation_config = vlm.generation_config
    del vlm
    return lm


def decoder(model):
    """The decoder body of a causal LM (embeddings + layers + final norm, no LM head)."""
    return getattr(model, model.base_model_prefix)


def _config_side(cfg: dict, side: str) -> str:
    """The `pair.<key>` written for the model playing `side`: the other key under `pair.direction=reverse`."""
    if side not in ("source", "target"):
        raise ValueError(f"side must be source or target, got {side!r}")
    if (cfg.get("pair") or {}).get("direction", "forward") == "reverse":
        return {"source": "target", "target": "source"}[side]
    return side


def device_map_for(cfg: dict, side: str):
    """The `device_map` for the model playing `side` ("source" | "target") in a plain run config.

    Its own `pair.<side>.device_map` when set -- the key follows the model, so under
    `pair.direction=reverse` the map written next to a model still loads that model -- else the
    run-wide `device_map` (both models). None means: load whole and move to the run's device.
    """
    side = _config_side(cfg, side)
    spec = (cfg.get("pair") or {}).get(side) or {}
    own = spec.get("device_map")
    if own is None and cfg.get("device_map") is None and spec.get("max_memory") is not None:
        return "auto"   # a memory cap places layers, so it implies device_map=auto (as load_model does)
    return own if own is not None else cfg.get("device_map")


def max_memory_for(cfg: dict, side: str) -> dict | None:
    """`pair.<side>.max_memory` of the model playing `side`, normalised for transformers: keys are GPU
    indices (int; "0", "cuda:0" accepted) or "cpu" / "disk", values sizes ("84GiB", "90GB") or bytes.

    Follows the model under `pair.direction=reverse`, like `device_map_for`. None: no cap.
    """
    side = _config_side(cfg, side)
    raw = ((cfg.get("pair") or {}).get(side) or {}).get("max_memory")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"pair.{side}.max_memory must be a mapping such as {{0: 84GiB, cpu: 100GiB}}, got {raw!r}")
    out = {}
    for key, value in raw.items():
        name = str(key).strip().lower()
        if name.startswith("cuda:"):
            name = name[5:]
        if name.isdigit():
            out[int(name)] = value
        elif name in ("cpu", "disk"):
            out[name] = value
        else:
            raise ValueError(f"pair.{side}.max_memory: unknown device {key!r}; use GPU indices (0, 1, ...), cpu or disk")
        size_bytes(value)   # a size that does not parse fails here, before any weights load
    return out


_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def size_bytes(value) -> int:
    """Bytes of a memory size as transformers' max_memory takes it: an int (bytes) or "84GiB" / "90GB" / "512MiB"."""
    if isinstance(value, bool):
        raise ValueError(f"not a memory size: {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"not a memory size: {value!r} (use e.g. 84GiB, 90GB or a byte count)")
    return int(float(num) * _UNITS[unit])


def layer_devices(model) -> list[torch.device]:
    """Per decoder layer, the device its attention reads the KV cache on.

    With a `device_map` the layers of one model sit on several devices; a cache handed to the model
    must hold each layer's keys and values on that layer's device: where `self_attn.k_proj` runs. An
    offloaded layer (its weights on the host or disk, `meta` in the module) runs on its accelerate
    hook's `execution_device`; any other layer where its k_proj weight lives. Layers without a
    `self_attn.k_proj` fall back to their first parameter (or hook).
    """
    devices = []
    for layer in decoder(model).layers:
        k_proj = getattr(getattr(layer, "self_attn", None), "k_proj", None)
        module = k_proj if k_proj is not None else layer
        hook_device = next((_execution_device(m) for m in (module, layer) if _execution_device(m) is not None), None)
        weight = getattr(k_proj, "weight", None)
        if hook_device is not None:
            devices.append(hook_device)
        else:
            devices.append(weight.device if weight is not None else next(layer.parameters()).device)
    return devices


def _execution_device(module) -> torch.device | None:
    """The device an accelerate hook runs `module` on (None without a hook that names one)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or [hook]   # accelerate's SequentialHook holds several
    device = next((h.execution_device for h in hooks if getattr(h, "execution_device", None) is not None), None)
    if device is None:
        return None
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


@dataclass(frozen=True)
class KVShape:
    """What a model's KV cache looks like: `n_layers` x [batch, n_kv, seq, head_dim]."""

    n_layers: int
    n_kv: int
    head_dim: int

    @property
    def width(self) -> int:
        """Features per token per layer for K (or V): n_kv * head_dim."""
        return self.n_kv * self.head_dim


def kv_shape(model_or_config) -> KVShape:
    """KV-cache geometry of a model or config."""
    cfg = text_config(getattr(model_or_config, "config", model_or_config))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return KVShape(cfg.num_hidden_layers, n_kv, head_dim)


def rope_type(model_or_config) -> str:
    """The RoPE variant of a model ("default", "llama3", "yarn", ...)."""
    cfg = text_config(getattr(model_or_config, "config", model_or_config))
    params = getattr(cfg, "rope_parameters", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def config_hash(model_or_config) -> str:
    """sha256 (hex, 16 chars) of the architecture fields that fix cache shapes, RoPE and vocabulary."""
    cfg = text_config(getattr(model_or_config, "config", model_or_config)).to_dict()
    arch = {k: cfg.get(k) for k in _ARCH_FIELDS}
    return hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(model) -> dict:
    """JSON-ready identity of a model: id, config hash, layer/head geometry and RoPE type."""
    shape = kv_shape(model)
    return {
        "model_id": str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")),
        "config_hash": config_hash(model),
        "n_layers": shape.n_layers, "n_kv": shape.n_kv, "head_dim": shape.head_dim,
        "rope_type": rope_type(model),
    }


def check_same_tokenizer(source_tokenizer, target_tokenizer) -> None:
    """Raise ValueError unless both tokenizers map the same strings to the same ids.

    Cross-model transfer maps caches position by position, so both models must see the same tokens.
    """
    vs, vt = source_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if vs == vt:
        return
    only_s = len(vs.keys() - vt.keys())
    only_t = len(vt.keys() - vs.keys())
    moved = sum(1 for tok in vs.keys() & vt.keys() if vs[tok] != vt[tok])
    raise ValueError(
        f"source and target tokenizers differ (source vocab {len(vs)}, target vocab {len(vt)}; "
        f"{only_s} tokens only in source, {only_t} only in target, {moved} with different ids). "
        "KV transfer needs one tokenization: pick a pair from the same model family.")
