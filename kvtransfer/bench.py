"""Mapper vs target re-prefill speed (the paper's Table 5), with FLOP/byte counts and device floors.

Mapper side: a source cache already on the device -> a ready target `DynamicCache` (strip source RoPE,
map, re-apply target RoPE, build the cache) via `transfer.map_layers`, with the mapper in float32 by
default (the dtype evaluation maps with; `--mapper-dtype bfloat16` times a bf16 mapper too). Prefill side: the target's
decoder body (no LM head, sdpa attention) on the same number of tokens, appending to a fresh cache.

"shapes-only" mode builds random-weight models from the REAL configs of the paper's pairs (below),
optionally with fewer layers (CPU), and a random mapper of the real per-layer size. Its times say
nothing about quality, only about cost. Each time is shown next to its floor: max(FLOPs / measured
matmul rate, minimal bytes / measured copy bandwidth), both rates measured once per run.

CLI:  python -m kvtransfer.bench --pair qwen3_14b_32b --tokens 64,256,1024 --layers 2 --out DIR
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from .cache import layers_to_cache, prefill
from .mapper import Mapper
from .models import kv_shape
from .rope import RopeCodec
from .transfer import map_layers

DEFAULT_TOKENS = (64, 256, 1024, 4096, 8192, 16384, 32768)

# ---------------------------------------------------------------------------------------------
# Real text configs of the paper's models (public config.json values; see ASSUMPTIONS).
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6,
              max_position_embeddings=40960, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
_LLAMA31 = dict(model_type="llama", vocab_size=128256, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-5,
                max_position_embeddings=131072, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
_MINISTRAL3 = dict(model_type="ministral3", vocab_size=131072, head_dim=128, num_key_value_heads=8,
                   rms_norm_eps=1e-5, max_position_embeddings=262144, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                    "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                    "llama_4_scaling_beta": 0.1})


def _m(base, layers, hidden, heads, inter, **kw):
    return dict(base, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                intermediate_size=inter, **kw)


MODELS = {
    "qwen3_8b": _m(_QWEN3, 36, 4096, 32, 12288),
    "qwen3_14b": _m(_QWEN3, 40, 5120, 40, 17408),
    "qwen3_32b": _m(_QWEN3, 64, 5120, 64, 25600),
    "llama31_8b": _m(_LLAMA31, 32, 4096, 32, 14336),
    "llama31_70b": _m(_LLAMA31, 80, 8192, 64, 28672),
    "ministral3_3b": _m(_MINISTRAL3, 26, 3072, 32, 9216, tie_word_embeddings=True),
    "ministral3_8b": _m(_MINISTRAL3, 34, 4096, 32, 14336),
    "ministral3_14b": _m(_MINISTRAL3, 40, 5120, 32, 16384),
}
ASSUMPTIONS = {
    "ministral3_3b": "26 layers/3072/9216 from public config.json copies; vocab 131072 assumed",
    "ministral3_8b": "= transformers Ministral3Config defaults (4096/34/14336/131072)",
    "ministral3_14b": "5120 hidden, 40 layers, 32 heads from a public test config; intermediate 16384 and "
                      "vocab 131072 are ASSUMPTIONS (not verified)",
}
# pair -> (source, target, k)   (k = the paper's chosen number of source layers per target layer)
PAIRS = {
    "qwen3_14b_32b": ("qwen3_14b", "qwen3_32b", 8),
    "qwen3_8b_32b": ("qwen3_8b", "qwen3_32b", 12),
    "llama31_8b_70b": ("llama31_8b", "llama31_70b", 20),
    "ministral3_3b_8b": ("ministral3_3b", "ministral3_8b", 26),
    "ministral3_3b_14b": ("ministral3_3b", "ministral3_14b", 20),
    "ministral3_8b_14b": ("ministral3_8b", "ministral3_14b", 12),
}
ROPE_STRIP_FLOPS, ROPE_APPLY_FLOPS = 4, 3  # per element: 2 mul + 1 add (+1 div to strip)


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
    (`base_model_prefix`, `.config`, `.dtype`): works with `prefill`, `RopeCodec`, `kv_features`."""

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


@torch.no_grad()
def build_shapes_only(config, *, device="cpu", dtype=torch.float32, seed: int = 0) -> ShapesOnlyLM:
    """Random-weight decoder body of `config` on `device`: matrices filled from a 16M-value N(0, 0.02)
    pool at random offsets (fast, never zero), norm weights 1. For timing only."""
    from transformers import AutoModel
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        body = AutoModel.from_config(config, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = (torch.randn(1 << 24, generator=g) * 0.02).to(device, dtype)
    for param in body.parameters():
        if param.dim() < 2:
            continue
        flat, n = param.view(-1), param.numel()
        offset = int(torch.randint(0, pool.numel(), (1,), generator=g))
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
    g = torch.Generator().manual_seed(seed)
    if selection == "random":
        sel = torch.stack([torch.randperm(s.n_layers, generator=g)[:k] for _ in range(n_t)])
    elif selection == "band":
        centre = [round(i * (s.n_layers - 1) / max(1, t.n_layers - 1)) for i in range(n_t)]
        sel = torch.tensor([[min(max(0, c - k // 2), s.n_layers - k) + j for j in range(k)] for c in centre])
    else:
        raise ValueError(f"selection must be 'random' or 'band', got {selection!r}")
    p, q = k * s.width, t.width
    gd = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(n_t, 2, p, q, generator=gd, device=device, dtype=dtype) / math.sqrt(p)
    bias = torch.randn(n_t, 2, q, generator=gd, device=device, dtype=dtype) * 0.1
    ident = lambda sh: {"model_id": "shapes-only", "config_hash": "", "n_layers": sh.n_layers,  # noqa: E731
                        "n_kv": sh.n_kv, "head_dim": sh.head_dim}
    return Mapper(weight=weight, bias=bias, selected_layers=sel.long(), source=ident(s), target=ident(t),
                  calibration={"shapes_only": True})


# ---------------------------------------------------------------------------------------------
# FLOPs and minimal bytes.
def _dsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def mapper_cost(source_config, target_config, k: int, tokens: int, *, n_target_layers: int,
                n_source_used: int, weight_bytes: int = 4, cache_bytes: int = 4, out_bytes: int = 4) -> dict:
    """FLOPs and minimal bytes of mapping `tokens` tokens into `n_target_layers` layers.

    gemm_flops = L_t * 2 (K,V) * 2*tokens*p*q; flops adds bias (L_t*2*tokens*q) and RoPE
    (strip: 4/elem on n_source_used layers' keys, apply: 3/elem on target keys). bytes = mapper
    weights+biases + source K,V of the used layers read + target K,V written.
    """
    s, t = kv_shape(source_config), kv_shape(target_config)
    p, q = k * s.width, t.width
    gemm = n_target_layers * 2 * 2 * tokens * p * q
    rope = n_source_used * tokens * s.width * ROPE_STRIP_FLOPS + n_target_layers * tokens * q * ROPE_APPLY_FLOPS
    flops = gemm + n_target_layers * 2 * tokens * q + rope
    nbytes = (n_target_layers * 2 * (p * q + q) * weight_bytes + n_source_used * 2 * tokens * s.width * cache_bytes
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


# ---------------------------------------------------------------------------------------------
# Timing.
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def time_fn(fn: Callable, inputs: Sequence, *, warmup: int = 3, repeats: int = 10, device="cpu") -> dict:
    """Run fn(inputs[i % len(inputs)]) `warmup` times, then time `repeats` runs (ms).

    CUDA: events around each call; otherwise perf_counter (+ synchronize). Inputs rotate; an input
    holding an all-zero tensor is rejected (ValueError). Returns median/min/max/q1/q3 ms, n, times.
    """
    if not inputs:
        raise ValueError("time_fn needs at least one input")
    for i, inp in enumerate(inputs):
        for t in _tensors(inp):
            if t.numel() and not bool(t.any()):
                raise ValueError(f"input {i} holds an all-zero tensor {tuple(t.shape)}: use random inputs")
    cuda = torch.device(device).type == "cuda"
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    _sync(device)
    times = []
    for i in range(repeats):
        inp = inputs[i % len(inputs)]
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(inp)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(inp)
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
    qs = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "q1_ms": qs[0], "q3_ms": qs[2], "n": len(times), "times_ms": times}


def measure_device(device="cpu", dtype=torch.float32, *, n: int | None = None, copy_mib: int | None = None) -> dict:
    """Measured once per run: matmul rate (FLOP/s, best of 5 n x n x n torch.matmul in `dtype`) and
    copy bandwidth (bytes/s, read + write of one large tensor copy, best of 5)."""
    cuda = torch.device(device).type == "cuda"
    n = n or (8192 if cuda else 2048)
    copy_mib = copy_mib or (2048 if cuda else 256)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    mm = time_fn(lambda x: torch.matmul(x, b), [a], warmup=2, repeats=5, device=device)
    src = torch.randn(copy_mib << 18, device=device).to(dtype)
    dst = torch.empty_like(src)
    cp = time_fn(lambda x: dst.copy_(x), [src], warmup=2, repeats=5, device=device)
    # best of the repeats: a floor must use the highest rate the device showed
    return {"device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "matmul_flops_per_s": 2 * n ** 3 / (mm["min_ms"] / 1e3),
            "copy_bytes_per_s": 2 * src.numel() * src.element_size() / (cp["min_ms"] / 1e3),
            "matmul_n": n, "copy_mib": copy_mib}


def available_bytes(device="cpu") -> int:
    """Free memory on `device` in bytes (CUDA: mem_get_info; CPU: MemAvailable)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load_average() -> str:
    """`uptime`-style 1/5/15-minute load averages and the CPU count, e.g. '1.53 0.93 0.40 (2 cpus)'."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} cpus)"
    except OSError:
        return "n/a"


# ---------------------------------------------------------------------------------------------
# The benchmark.
def _rand_source(shape, used, tokens, n_inputs, device, dtype, seed):
    """n_inputs distinct random source caches: list over L_s layers of (K, V) [1, n_kv, tokens, d];
    layers no target reads share the first used layer's tensors (never read by map_layers)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n_inputs):
        real = {s: tuple(torch.randn(1, shape.n_kv, tokens, shape.head_dim, generator=g, device=device,
                                     dtype=dtype) for _ in range(2)) for s in used}
        out.append([real.get(s, real[used[0]]) for s in range(shape.n_layers)])
    return out


def bench_pair(pair: str, tokens: Sequence[int] = DEFAULT_TOKENS, *, layers: int | None = None, device="cpu",
               dtype=torch.float32, mapper_dtype: torch.dtype | None = torch.float32, warmup: int = 3, repeats: int = 10, n_inputs: int = 3, selection: str = "random",
               chunk_tokens: int = 8192, run_prefill: bool = True, caps: dict | None = None,
               memory_fraction: float = 0.8, log: Callable = print) -> list[dict]:
    """Shapes-only Table-5 rows for `pair` (see PAIRS) at each token count (batch 1).

    dtype: models and caches; mapper_dtype: the mapper's weights and GEMMs (default float32, the
    dtype evaluation maps with; None = `dtype`). layers: target (and mapper) depth actually run;
    None = full depth. Times are ms; *_full_est
    scale per-layer times to the real depth. A token count whose estimated bytes exceed
    memory_fraction * free memory gives a row with `skipped` set instead of times.
    """
    src_name, tgt_name, k = PAIRS[pair]
    src_cfg, tgt_full = real_config(src_name), real_config(tgt_name)
    n_full = tgt_full.num_hidden_layers
    n_run = min(layers or n_full, n_full)
    tgt_cfg = real_config(tgt_name, n_run)
    caps = caps or measure_device(device, dtype)
    mapper_dtype = mapper_dtype or dtype
    es, mes = _dsize(dtype), _dsize(mapper_dtype)
    s_shape = kv_shape(src_cfg)
    base = {"pair": pair, "source": src_name, "target": tgt_name, "k": k, "mode": "shapes_only",
            "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "mapper_dtype": str(mapper_dtype).replace("torch.", ""), "layers_run": n_run,
            "layers_full": n_full, "selection": selection, "load_avg": load_average()}
    rows = {T: dict(base, tokens=T) for T in tokens}
    torch.manual_seed(0)

    # --- mapper side (source cache on device -> target DynamicCache) ---
    mapper = random_mapper(src_cfg, tgt_cfg, k, n_target_layers=n_run, selection=selection, device=device,
                           dtype=mapper_dtype)
    used = sorted(set(mapper.selected_layers.flatten().tolist()))
    s_codec = RopeCodec(rope_only(src_cfg, device), initial_positions=max(tokens))
    t_codec = RopeCodec(rope_only(tgt_cfg, device), initial_positions=max(tokens))
    t_shape = kv_shape(tgt_cfg)
    for T in tokens:
        row = rows[T]
        cost = mapper_cost(src_cfg, tgt_cfg, k, T, n_target_layers=n_run, n_source_used=len(used),
                           weight_bytes=mes, cache_bytes=es, out_bytes=es)
        need = (mapper.weight.numel() * mes + n_inputs * len(used) * 2 * T * s_shape.width * es
                + 2 * n_run * 2 * T * t_shape.width * es + 2 * 2 * min(T, chunk_tokens) * (len(used) + k) * s_shape.width * mes)
        row.update(mapper_flops=cost["flops"], mapper_gemm_flops=cost["gemm_flops"], mapper_bytes=cost["bytes"],
                   mapper_floor_ms=floor_ms(cost["flops"], cost["bytes"], caps))
        if need > memory_fraction * available_bytes(device):
            row["skipped"] = f"mapper needs ~{need / 2**30:.1f} GiB > {memory_fraction:.0%} of free memory"
            log(f"[{pair}] {T} tokens: {row['skipped']}")
            continue
        inputs = _rand_source(s_shape, used, T, n_inputs, device, dtype, seed=T)
        pos = torch.arange(T, device=device)

        def run_mapper(src):
            mapped = map_layers(src, mapper, pos, source_codec=s_codec, target_codec=t_codec, target_n_kv=t_shape.n_kv,
                                out_dtype=dtype, chunk_tokens=chunk_tokens)
            return layers_to_cache(mapped, tgt_cfg)

        r = time_fn(run_mapper, inputs, warmup=warmup, repeats=repeats, device=device)
        # the mapper's GEMMs alone, same shapes, plain torch.matmul (rate reference for the 50 % target)
        x = torch.randn(2, T, k * s_shape.width, device=device, dtype=mapper_dtype)
        w = mapper.weight[0]
        mm = time_fn(lambda a: torch.matmul(a, w), [x], warmup=1, repeats=max(3, repeats // 2), device=device)
        mm_rate = 2 * 2 * T * w.shape[1] * w.shape[2] / (mm["median_ms"] / 1e3)
        del inputs, x, w  # w views the mapper: drop it so the mapper is freed before the prefill side
        eff_rate = cost["gemm_flops"] / (r["median_ms"] / 1e3)
        row.update(mapper_ms=r["median_ms"], mapper_ms_min=r["min_ms"], mapper_ms_max=r["max_ms"],
                   mapper_ms_q1=r["q1_ms"], mapper_ms_q3=r["q3_ms"], repeats=r["n"],
                   matmul_same_shape_flops_per_s=mm_rate, mapper_gemm_flops_per_s=eff_rate,
                   mapper_gemm_frac=eff_rate / mm_rate)
        log(f"[{pair}] {T} tokens: mapper {r['median_ms']:.1f} ms ({eff_rate / mm_rate:.0%} of matmul rate)")
    del mapper
    _free(device)

    # --- prefill side (target body, sdpa, no LM head) ---
    if run_prefill:
        pc0 = prefill_cost(tgt_cfg, 1, dtype_bytes=es)
        model_bytes = (pc0["params"] + tgt_cfg.vocab_size * tgt_cfg.hidden_size) * es
        if model_bytes > memory_fraction * available_bytes(device):
            for row in rows.values():
                row.setdefault("skipped", f"target body needs ~{model_bytes / 2**30:.1f} GiB")
        else:
            model = build_shapes_only(tgt_cfg, device=device, dtype=dtype)
            for T in tokens:
                row = rows[T]
                pc = prefill_cost(tgt_cfg, T, dtype_bytes=es)
                row.update(prefill_flops=pc["flops"], prefill_bytes=pc["bytes"],
                           prefill_floor_ms=floor_ms(pc["flops"], pc["bytes"], caps))
                act = T * (4 * tgt_cfg.intermediate_size + 8 * tgt_cfg.hidden_size) * es + pc["bytes"] - pc["params"] * es
                if "skipped" in row or act > memory_fraction * available_bytes(device):
                    row.setdefault("skipped", f"prefill activations ~{act / 2**30:.1f} GiB")
                    continue
                g = torch.Generator().manual_seed(T)
                ids = [torch.randint(1, tgt_cfg.vocab_size, (1, T), generator=g).to(device) for _ in range(n_inputs)]
                r = time_fn(lambda i: prefill(model, i), ids, warmup=warmup, repeats=repeats, device=device)
                row.update(prefill_ms=r["median_ms"], prefill_ms_min=r["min_ms"], prefill_ms_max=r["max_ms"],
                           prefill_ms_q1=r["q1_ms"], prefill_ms_q3=r["q3_ms"])
                log(f"[{pair}] {T} tokens: prefill {r['median_ms']:.1f} ms")
            del model
            _free(device)
    out = []
    for T in tokens:
        row = rows[T]
        if "mapper_ms" in row and "prefill_ms" in row:
            scale = n_full / n_run
            row.update(speedup=row["prefill_ms"] / row["mapper_ms"], flop_ratio=row["prefill_flops"] / row["mapper_flops"],
                       mapper_ms_full_est=row["mapper_ms"] * scale, prefill_ms_full_est=row["prefill_ms"] * scale)
            row["speedup_vs_flop_ratio"] = row["speedup"] / row["flop_ratio"]
        out.append(row)
    return out


def _free(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Calibration throughput.
@torch.no_grad()
def calibration_throughput(pair: str = "qwen3_14b_32b", *, layers: int = 1, batch: int = 2, seq: int = 256,
                           stride: int = 4, device="cpu", dtype=torch.float32, warmup: int = 1, repeats: int = 3) -> dict:
    """Tokens/s through both shapes-only models (forward only) vs forward + moment accumulation
    (`calibrate.kv_features` on both + `Moments.add`), on `layers`-deep models; overhead in %."""
    from .calibrate import kv_features
    from .moments import Moments

    src_name, tgt_name, _ = PAIRS[pair]
    src = build_shapes_only(real_config(src_name, layers), device=device, dtype=dtype, seed=1)
    tgt = build_shapes_only(real_config(tgt_name, layers), device=device, dtype=dtype, seed=2)
    s, t = kv_shape(src), kv_shape(tgt)
    g = torch.Generator().manual_seed(0)
    vocab = min(src.config.vocab_size, tgt.config.vocab_size)
    ids = [torch.randint(1, vocab, (batch, seq), generator=g).to(device) for _ in range(2)]
    sc, tc = RopeCodec(src, initial_positions=seq), RopeCodec(tgt, initial_positions=seq)
    moments = Moments(list(range(layers)), list(range(layers)), s.width, t.width, device=device)

    def fwd(i):
        prefill(src, i)
        prefill(tgt, i)

    def fwd_moments(i):
        moments.add(kv_features(src, i, stride=stride, codec=sc), kv_features(tgt, i, stride=stride, codec=tc))

    a = time_fn(fwd, ids, warmup=warmup, repeats=repeats, device=device)
    b = time_fn(fwd_moments, ids, warmup=warmup, repeats=repeats, device=device)
    n_tok = batch * seq
    return {"pair": pair, "mode": "shapes_only", "layers": layers, "batch": batch, "seq": seq, "stride": stride,
            "moments_dtype": str(moments.dtype).replace("torch.", ""), "device": str(device),
            "forward_tokens_per_s": n_tok / (a["median_ms"] / 1e3),
            "with_moments_tokens_per_s": n_tok / (b["median_ms"] / 1e3),
            "overhead_pct": 100 * (b["median_ms"] / a["median_ms"] - 1), "load_avg": load_average()}


# ---------------------------------------------------------------------------------------------
# Writers.
TABLE_COLUMNS = ("tokens", "mapper_ms", "mapper_ms_min", "mapper_ms_max", "mapper_floor_ms", "prefill_ms",
                 "prefill_ms_min", "prefill_ms_max", "prefill_floor_ms", "speedup", "flop_ratio",
                 "mapper_gemm_frac", "mapper_ms_full_est", "prefill_ms_full_est", "skipped")


def _fmt(x, nd=1):
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def table_markdown(rows: list[dict], caps: dict | None = None) -> str:
    """Table-5 layout (tokens | mapper | re-prefill | speedup) with floors and FLOP ratio, Markdown."""
    if not rows:
        return ""
    r0 = rows[0]
    lines = [f"### {r0['source']} → {r0['target']} (k={r0['k']}) — SHAPES-ONLY: random weights, real configs, "
             f"{r0['layers_run']} of {r0['layers_full']} target layers run; {r0['dtype']} caches, "
             f"{r0.get('mapper_dtype', r0['dtype'])} mapper on {r0['device']}",
             ""]
    if caps:
        lines += [f"Device rates: matmul {caps['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s, copy "
                  f"{caps['copy_bytes_per_s'] / 1e9:,.1f} GB/s. Load average: {r0.get('load_avg', 'n/a')}.", ""]
    lines += ["Times are medians (min–max) in ms; floor = max(FLOPs / matmul rate, minimal bytes / copy bandwidth); "
              "FLOP ratio = prefill FLOPs / mapper FLOPs; GEMM % = mapper GEMM FLOPs / whole mapper time, relative to "
              "torch.matmul on the same shapes; full-depth estimates scale per-layer times by layers_full / layers_run.",
              ""]
    lines += ["| tokens | mapper ms (min–max) | floor | re-prefill ms (min–max) | floor | speedup | FLOP ratio "
              "| GEMM % of matmul | full-depth est. mapper / prefill ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r and "speedup" not in r:
            lines.append(f"| {r['tokens']:,} | skipped: {r['skipped']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['tokens']:,} | {_fmt(r.get('mapper_ms'))} ({_fmt(r.get('mapper_ms_min'))}–{_fmt(r.get('mapper_ms_max'))}) "
            f"| {_fmt(r.get('mapper_floor_ms'))} | {_fmt(r.get('prefill_ms'))} ({_fmt(r.get('prefill_ms_min'))}–"
            f"{_fmt(r.get('prefill_ms_max'))}) | {_fmt(r.get('prefill_floor_ms'))} | {_fmt(r.get('speedup'))}x "
            f"| {_fmt(r.get('flop_ratio'))} | {_fmt(100 * r['mapper_gemm_frac'] if 'mapper_gemm_frac' in r else None, 0)} "
            f"| {_fmt(r.get('mapper_ms_full_est'), 0)} / {_fmt(r.get('prefill_ms_full_est'), 0)} |")
    return "\n".join(lines) + "\n"


def table_csv(rows: list[dict]) -> str:
    """The same rows as CSV (columns TABLE_COLUMNS plus pair/device/dtype/layers)."""
    buf = io.StringIO()
    cols = ("pair", "device", "dtype", "mapper_dtype", "layers_run", "layers_full") + TABLE_COLUMNS
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


def plot_speedup(rows: list[dict], path: str | Path) -> Path:
    """Speedup (and FLOP ratio, dashed) vs tokens, log-x, one line per pair; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for pair, mdt in dict.fromkeys(_group(r) for r in rows):
        rs = [r for r in rows if _group(r) == (pair, mdt) and "speedup" in r]
        if not rs:
            continue
        name = f"{pair} ({mdt} mapper)"
        line, = ax.plot([r["tokens"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"{name} measured")
        ax.plot([r["tokens"] for r in rs], [r["flop_ratio"] for r in rs], "--", color=line.get_color(),
                label=f"{name} FLOP ratio")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("re-prefill time / mapper time")
    ax.set_title("shapes-only (random weights, real configs)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    _exclusive(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _group(row: dict) -> tuple[str, str]:
    """(pair, mapper dtype): the rows one table or curve shows."""
    return row["pair"], row.get("mapper_dtype", row["dtype"])


def _exclusive(path: Path) -> None:
    if path.exists():
        raise FileExistsError(f"{path} exists; write to a new directory")


def output_paths(out_dir: str | Path, stem: str = "bench") -> dict:
    """{kind: path} of the files `write_outputs` writes; FileExistsError if any exists already."""
    out = Path(out_dir)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "csv": out / f"{stem}.csv",
             "png": out / f"{stem}_speedup.png"}
    for p in paths.values():
        _exclusive(p)
    return paths


def write_outputs(rows: list[dict], out_dir: str | Path, *, caps: dict | None = None, extra: dict | None = None,
                  stem: str = "bench") -> dict:
    """Write {stem}.json (rows + caps + extra), {stem}.md, {stem}.csv, {stem}_speedup.png into out_dir.
    Never overwrites: raises FileExistsError if any of them exists. Returns {kind: path}."""
    paths = output_paths(out_dir, stem)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    clean = [{k: v for k, v in r.items() if k != "times_ms"} for r in rows]
    md = "".join(table_markdown([r for r in rows if _group(r) == group], caps)
                 for group in dict.fromkeys(_group(r) for r in rows))
    for key, text in (("json", json.dumps({"rows": clean, "caps": caps, "extra": extra or {}}, indent=1, default=str)),
                      ("md", md), ("csv", table_csv(rows))):
        with open(paths[key], "x") as f:
            f.write(text)
    plot_speedup(rows, paths["png"])
    return paths


# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry: benchmark one or more pairs (shapes-only) and write rows JSON + table + figure."""
    ap = argparse.ArgumentParser(prog="python -m kvtransfer.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen3_14b_32b", help=f"comma list of {', '.join(PAIRS)}")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    ap.add_argument("--layers", type=int, default=None, help="target layers to run (default: full depth)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="models and caches: float32 | bfloat16 (default: bf16 on cuda, "
                    "fp32 on cpu)")
    ap.add_argument("--mapper-dtype", default="float32", help="comma list of float32 | bfloat16: the mapper's "
                    "dtype(s) to time (default float32, the dtype evaluation maps with)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inputs", type=int, default=3, help="distinct random inputs to rotate among")
    ap.add_argument("--selection", default="random", choices=("random", "band"))
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--calibration", action="store_true", help="also measure calibration throughput")
    ap.add_argument("--out", required=True, help="output directory (existing files are never overwritten)")
    a = ap.parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[a.dtype] or (
        torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    tokens = [int(t.lower().replace("k", "")) * (1024 if "k" in t.lower() else 1) for t in a.tokens.split(",")]
    output_paths(a.out)  # refuse before measuring anything
    caps = measure_device(a.device, dtype)
    print(f"device {a.device} {dtype}: matmul {caps['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, "
          f"copy {caps['copy_bytes_per_s'] / 1e9:.1f} GB/s; load {load_average()}")
    rows = []
    for pair in a.pair.split(","):
        for mapper_dtype in a.mapper_dtype.split(","):
            rows += bench_pair(pair, tokens, layers=a.layers, device=a.device, dtype=dtype,
                               mapper_dtype=getattr(torch, mapper_dtype), warmup=a.warmup, repeats=a.repeats,
                               n_inputs=a.inputs, selection=a.selection, run_prefill=not a.no_prefill, caps=caps)
    extra = {"assumptions": ASSUMPTIONS, "argv": list(argv) if argv is not None else None}
    if a.calibration:
        extra["calibration"] = calibration_throughput(a.pair.split(",")[0], device=a.device, dtype=dtype)
        print("calibration:", extra["calibration"])
    paths = write_outputs(rows, a.out, caps=caps, extra=extra)
    print(Path(paths["md"]).read_text())
    return {k: str(v) for k, v in paths.items()}


if __name__ == "__main__":
    main()
