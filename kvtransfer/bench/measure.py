"""The benchmark: shapes-only Table-5 rows (mapper vs target re-prefill) and calibration throughput.

Mapper side: a source cache already on the device -> a ready target `DynamicCache` (strip source RoPE,
map, re-apply target RoPE, build the cache) via `transfer.map_layers`, with the mapper in float32 by
default (the dtype evaluation maps with). Prefill side: the target's decoder body (no LM head, sdpa
attention) on the same number of tokens, appending to a fresh cache. Models and mapper come from
`shapes`, FLOPs/bytes and floors from its cost model, times from `timing`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..core.cache import layers_to_cache, prefill
from ..core.calibrate import kv_features
from ..core.models import kv_shape
from ..core.moments import Moments
from ..core.rope import RopeCodec
from ..core.transfer import map_layers
from . import timing
from .shapes import (PAIRS, build_shapes_only, dtype_size, floor_ms, mapper_cost, prefill_cost, random_mapper,
                     real_config, rope_only)

DEFAULT_TOKENS = (64, 256, 1024, 4096, 8192, 16384, 32768)


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
    caps = caps or timing.measure_device(device, dtype)
    mapper_dtype = mapper_dtype or dtype
    es, mes = dtype_size(dtype), dtype_size(mapper_dtype)
    s_shape = kv_shape(src_cfg)
    base = {"pair": pair, "source": src_name, "target": tgt_name, "k": k, "mode": "shapes_only",
            "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "mapper_dtype": str(mapper_dtype).replace("torch.", ""), "layers_run": n_run,
            "layers_full": n_full, "selection": selection, "load_avg": timing.load_average()}
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
        row.update(mapper_flops=cost["flops"], mapper_gemm_flops=cost["gemm_flops"], mapper_bytes=cost["bytes"])
        if need > memory_fraction * timing.available_bytes(device):
            row["skipped"] = f"mapper needs ~{need / 2**30:.1f} GiB > {memory_fraction:.0%} of free memory"
            log(f"[{pair}] {T} tokens: {row['skipped']}")
            continue
        inputs = _rand_source(s_shape, used, T, n_inputs, device, dtype, seed=T)
        pos = torch.arange(T, device=device)

        def run_mapper(src):
            mapped = map_layers(src, mapper, pos, source_codec=s_codec, target_codec=t_codec, target_n_kv=t_shape.n_kv,
                                out_dtype=dtype, chunk_tokens=chunk_tokens)
            return layers_to_cache(mapped, tgt_cfg)

        r = timing.time_fn(run_mapper, inputs, warmup=warmup, repeats=repeats, device=device)
        # the mapper's GEMMs alone, same shapes, plain torch.matmul (rate reference for the 50 % target)
        x = torch.randn(2, T, k * s_shape.width, device=device, dtype=mapper_dtype)
        w = mapper.weight[0]
        mm = timing.time_fn(lambda a: torch.matmul(a, w), [x], warmup=1, repeats=max(3, repeats // 2),
                            device=device)
        mm_rate = 2 * 2 * T * w.shape[1] * w.shape[2] / (mm["median_ms"] / 1e3)
        del inputs, x, w  # w views the mapper: drop it so the mapper is freed before the prefill side
        eff_rate = cost["gemm_flops"] / (r["median_ms"] / 1e3)
        # the floor's rate: the best the mapper's own GEMM shape reached, next to it (not the square matmul's)
        best = 2 * 2 * T * mapper.weight.shape[1] * mapper.weight.shape[2] / (mm["min_ms"] / 1e3)
        wcaps = timing.workload_caps(caps, best)
        row.update(mapper_floor_ms=floor_ms(cost["flops"], cost["bytes"], wcaps),
                   mapper_floor_rate_flops_per_s=wcaps["matmul_flops_per_s"])
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
        if model_bytes > memory_fraction * timing.available_bytes(device):
            for row in rows.values():
                row.setdefault("skipped", f"target body needs ~{model_bytes / 2**30:.1f} GiB")
        else:
            model = build_shapes_only(tgt_cfg, device=device, dtype=dtype)
            for T in tokens:
                row = rows[T]
                pc = prefill_cost(tgt_cfg, T, dtype_bytes=es)
                # the floor's rate: the prefill's dominant GEMM ([T, hidden] @ [hidden, intermediate], the MLP's)
                # timed right before it, so floor and workload see the same shapes and the same machine load
                pcaps = timing.workload_caps(caps, timing.gemm_rate(T, tgt_cfg.hidden_size, tgt_cfg.intermediate_size,
                                                                    device=device, dtype=dtype))
                row.update(prefill_flops=pc["flops"], prefill_bytes=pc["bytes"],
                           prefill_floor_ms=floor_ms(pc["flops"], pc["bytes"], pcaps),
                           prefill_floor_rate_flops_per_s=pcaps["matmul_flops_per_s"])
                act = T * (4 * tgt_cfg.intermediate_size + 8 * tgt_cfg.hidden_size) * es + pc["bytes"] - pc["params"] * es
                if "skipped" in row or act > memory_fraction * timing.available_bytes(device):
                    row.setdefault("skipped", f"prefill activations ~{act / 2**30:.1f} GiB")
                    continue
                g = torch.Generator().manual_seed(T)  # device: seeded CPU draw (the same numbers on every device), moved to `device` after
                ids = [torch.randint(1, tgt_cfg.vocab_size, (1, T), generator=g).to(device) for _ in range(n_inputs)]  # device: seeded CPU draw, moved
                r = timing.time_fn(lambda i: prefill(model, i), ids, warmup=warmup, repeats=repeats, device=device)
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
        for side in ("mapper", "prefill"):  # a median below its floor means the floor's rate is wrong: say so
            if row.get(f"{side}_ms") is not None and row.get(f"{side}_floor_ms") is not None:
                row[f"{side}_floor_beaten"] = bool(row[f"{side}_ms"] < row[f"{side}_floor_ms"])
                if row[f"{side}_floor_beaten"]:
                    log(f"[{pair}] {T} tokens: {side} median {row[f'{side}_ms']:.1f} ms is below its floor "
                        f"{row[f'{side}_floor_ms']:.1f} ms: the floor's rate underestimates this machine (an estimate, "
                        "not a bound, at this load)")
        out.append(row)
    return out


def time_mapper(mapper, source_config, target_config, tokens: int = 1024, *, device="cpu", dtype=torch.float32,
                warmup: int = 2, repeats: int = 7, n_inputs: int = 2) -> dict:
    """Apply time (ms, `timing.time_fn` stats) of a fitted mapper of any kind on random source caches of
    `tokens` tokens (batch 1): strip, map, re-rotate, build the target cache, as `map_layers` does in
    evaluation; mapper in its own dtype, caches in `dtype`."""
    s_shape, t_shape = kv_shape(source_config), kv_shape(target_config)
    used = sorted(set(mapper.selected_layers.flatten().tolist()))
    inputs = _rand_source(s_shape, used, tokens, n_inputs, device, dtype, seed=tokens)
    s_codec = RopeCodec(rope_only(source_config, device), initial_positions=tokens)
    t_codec = RopeCodec(rope_only(target_config, device), initial_positions=tokens)
    pos = torch.arange(tokens, device=device)

    def run_mapper(src):
        return layers_to_cache(map_layers(src, mapper, pos, source_codec=s_codec, target_codec=t_codec,
                                          target_n_kv=t_shape.n_kv, out_dtype=dtype), target_config)

    return timing.time_fn(run_mapper, inputs, warmup=warmup, repeats=repeats, device=device)


def _free(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def calibration_throughput(pair: str = "qwen3_14b_32b", *, layers: int = 1, batch: int = 2, seq: int = 256,
                           stride: int = 4, device="cpu", dtype=torch.float32, warmup: int = 1, repeats: int = 3) -> dict:
    """Tokens/s through both shapes-only models (forward only) vs forward + moment accumulation
    (`calibrate.kv_features` on both + `Moments.add`), on `layers`-deep models; overhead in %."""
    src_name, tgt_name, _ = PAIRS[pair]
    src = build_shapes_only(real_config(src_name, layers), device=device, dtype=dtype, seed=1)
    tgt = build_shapes_only(real_config(tgt_name, layers), device=device, dtype=dtype, seed=2)
    s, t = kv_shape(src), kv_shape(tgt)
    g = torch.Generator().manual_seed(0)  # device: seeded CPU draw (the same numbers on every device), moved to `device` after
    vocab = min(src.config.vocab_size, tgt.config.vocab_size)
    ids = [torch.randint(1, vocab, (batch, seq), generator=g).to(device) for _ in range(2)]  # device: seeded CPU draw, moved
    sc, tc = RopeCodec(src, initial_positions=seq), RopeCodec(tgt, initial_positions=seq)
    moments = Moments(list(range(layers)), list(range(layers)), s.width, t.width, device=device)

    def fwd(i):
        prefill(src, i)
        prefill(tgt, i)

    def fwd_moments(i):
        moments.add(kv_features(src, i, stride=stride, codec=sc), kv_features(tgt, i, stride=stride, codec=tc))

    a = timing.time_fn(fwd, ids, warmup=warmup, repeats=repeats, device=device)
    b = timing.time_fn(fwd_moments, ids, warmup=warmup, repeats=repeats, device=device)
    n_tok = batch * seq
    return {"pair": pair, "mode": "shapes_only", "layers": layers, "batch": batch, "seq": seq, "stride": stride,
            "moments_dtype": str(moments.dtype).replace("torch.", ""), "device": str(device),
            "forward_tokens_per_s": n_tok / (a["median_ms"] / 1e3),
            "with_moments_tokens_per_s": n_tok / (b["median_ms"] / 1e3),
            "overhead_pct": 100 * (b["median_ms"] / a["median_ms"] - 1), "load_avg": timing.load_average()}
