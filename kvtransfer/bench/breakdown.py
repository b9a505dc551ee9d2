"""Where one apply row's time goes: the map against the same GEMMs alone, RoPE and the finiteness check left
out, and the bytes it moves beyond the floor counted and priced at a copy rate measured in the same loop.

    python -m kvtransfer.bench.breakdown --pair qwen3_14b_32b --layers 2 --tokens 4096 --dtype bfloat16 \
        --selection random --out results/bench_cpu/breakdown.json

Every mode runs interleaved (`core.timing.interleaved`: ABAB rounds after a warm-up, so load drifts hit every
mode alike) and reports median, p95 and max; the load average before and after is kept with the row. Measures
that do not depend on load: the GEMM share is `gemm` / `full` from the same rounds, the GEMM rate is a fraction
of `matmul` (one contiguous GEMM of the same shape) timed in the same rounds, and the bytes are counted.
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from ..config.provenance import json_provenance
from ..core.io import atomic_write_json
from ..core.models import kv_shape
from ..core.rope import RopeCodec
from ..core.transfer import Workspace, _runs, map_layers
from ..core.timing import interleaved
from .shapes import PAIRS, dtype_size, floor_ms, mapper_cost, random_mapper, real_config, rope_only


def machine() -> dict:
    """The CPU's instruction set as torch dispatches it, whether it computes bf16 natively (AMX or
    AVX512-BF16 in /proc/cpuinfo), and the MALLOC_* environment glibc's allocator reads."""
    flags = set()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    bf16 = sorted(f for f in flags if f.startswith("amx") or f == "avx512_bf16")
    return {"cpu": model, "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "bf16_flags": bf16,
            "bf16": " ".join(bf16) if bf16 else "no native bf16",
            # glibc's allocator settings: they decide whether a call's large buffers are fresh pages (see breakdown.md)
            "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}}


def extra_bytes(*, tokens: int, n_used: int, width_s: int, n_target: int, q: int, n_kv_t: int, map_bytes: int,
                gathered_features: int = 0, check: bool = True) -> dict:
    """Bytes the apply moves that the floor (source read once, weights, output written once) does not count, by
    construction of `map_layers` (per kind K and V): the used-layer buffer written (the GEMMs read it: inside
    their rate), each target's GEMM output written and read back by the store, the sampled check (one 64-byte
    line per row and target head), and for a reduced-precision map of several blocks the gather (read and
    written: `gathered_features` = the summed p of the targets that gather). RoPE tiles and their float32
    scratch stay in cache: not counted."""
    buffer = 2 * n_used * tokens * width_s * map_bytes
    gemm_out = n_target * 2 * tokens * q * map_bytes * 2
    sample = n_target * 2 * tokens * n_kv_t * 64 if check else 0
    gather = 2 * tokens * gathered_features * map_bytes * 2
    return {"buffer": buffer, "gemm_out": gemm_out, "check": sample, "gather": gather,
            "total": buffer + gemm_out + sample + gather}


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def peak_bytes(*, tokens: int, chunk: int, n_used: int, width_s: int, n_target: int, q: int, map_bytes: int,
               out_bytes: int) -> int:
    """Peak bytes the apply allocates beside its input, by construction (RSS does not show it: the allocator
    reuses pages it already holds): the output, the used-layer buffer and one GEMM output of a chunk, and the
    RoPE scratch (512 KiB)."""
    rows = min(tokens, chunk)
    return (n_target * 2 * tokens * q * out_bytes + 2 * rows * n_used * width_s * map_bytes
            + 2 * rows * q * map_bytes + (1 << 19) * 4)


def _old_apply(ref: str):
    """map_layers and the ridge map_blocks as of git `ref` (the gather path), to time before and after in one
    loop: (map_layers, a function making a mapper use the old map_blocks)."""
    import subprocess
    import sys
    import types

    from ..core import mapper as mapper_mod

    src = subprocess.run(["git", "show", f"{ref}:kvtransfer/core/transfer.py"], capture_output=True, text=True,
                         check=True).stdout
    mod = types.ModuleType("kvtransfer.core._transfer_before")
    mod.__package__ = "kvtransfer.core"
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"{ref}:kvtransfer/core/transfer.py", "exec"), mod.__dict__)

    class Before(mapper_mod.Mapper):  # the old ridge map_blocks: views for <= 2 runs, else gather + one GEMM
        def map_blocks(self, layer, blocks, gather=None):
            if len(blocks) > 2:
                return mapper_mod.MapperBase.map_blocks(self, layer, blocks, gather)
            w, y = self.weight[layer], None
            for j, x in blocks:
                wj = w[:, j:j + x.shape[-1]]
                y = torch.baddbmm(self.bias[layer][:, None, :], x, wj) if y is None else y.baddbmm_(x, wj)
            return y

    def convert(m):
        return Before(weight=m.weight, bias=m.bias, selected_layers=m.selected_layers, source=m.source,
                      target=m.target)
    return mod.map_layers, convert


@torch.no_grad()
def breakdown_row(pair: str, *, layers: int = 2, tokens: int = 4096, dtype=torch.float32, selection: str = "random",
                  repeats: int = 5, warmup: int = 1, chunk_tokens: int = 8192, seed: int = 0,
                  before: str | None = None, workspace: bool = False) -> dict:
    """One row: the map (cache and mapper in `dtype`) on `layers` target layers of `pair` at `tokens` tokens,
    timed interleaved with its parts left out; times in ms. `workspace`: the map's calls share one
    `core.transfer.Workspace` (buffers kept across calls, as a serving worker keeps them) instead of fresh ones."""
    src_name, tgt_name, k = PAIRS[pair]
    s_cfg, t_cfg = real_config(src_name), real_config(tgt_name, layers)
    s, t = kv_shape(s_cfg), kv_shape(t_cfg)
    mapper = random_mapper(s_cfg, t_cfg, k, n_target_layers=layers, selection=selection, dtype=dtype, seed=seed)
    sel = mapper.selected_layers.tolist()
    used = sorted({x for row in sel for x in row})
    slot = {x: i for i, x in enumerate(used)}
    g = torch.Generator(device="cpu").manual_seed(seed)  # this tool times the CPU apply
    real = {x: tuple(torch.randn(1, s.n_kv, tokens, s.head_dim, generator=g, device="cpu").to(dtype)
                     for _ in range(2)) for x in used}
    src = [real.get(x, real[used[0]]) for x in range(s.n_layers)]
    sc, tc = (RopeCodec(rope_only(c), initial_positions=tokens) for c in (s_cfg, t_cfg))
    pos = torch.arange(tokens, device="cpu")
    kw = dict(source_codec=sc, target_codec=tc, target_n_kv=t.n_kv, out_dtype=dtype, chunk_tokens=chunk_tokens,
              workspace=Workspace() if workspace else None)
    # the same GEMMs alone: each target's blocks of one used-layer buffer of the chunk's shape, same calls
    rows = min(tokens, chunk_tokens)
    flat = torch.randn(2, rows, len(used) * s.width, generator=g, device="cpu").to(dtype)
    runs = [_runs([slot[x] for x in row]) for row in sel]
    n_chunks = -(-tokens // chunk_tokens)

    # (a reduced-precision map of several blocks gathers them first, `Mapper.map_blocks`: its GEMM alone reads an
    # already gathered x, so the gather counts outside the GEMMs)
    xg = torch.randn(2, rows, k * s.width, generator=g, device="cpu").to(dtype)
    alone = [[(0, xg)] if len(r) > 1 and dtype_size(dtype) < 4 else
             [(j * s.width, flat[:, :, a * s.width:(a + n) * s.width]) for a, j, n in r] for r in runs]

    def gemms():
        for _ in range(n_chunks):
            for i, blocks in enumerate(alone):
                mapper.map_blocks(i, blocks)

    x = torch.randn(rows, k * s.width, generator=g, device="cpu").to(dtype)
    w = mapper.weight[0, 0].contiguous()
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cpu")
    big2 = torch.empty_like(big)
    fns = {"full": lambda: map_layers(src, mapper, pos, **kw),
           "no_rope": lambda: map_layers(src, mapper, pos, rope_at_inference=False, **kw),
           "no_check": lambda: map_layers(src, mapper, pos, check_finite=False, **kw),
           "gemm": gemms,
           "matmul": lambda: [torch.matmul(x, w) for _ in range(2 * layers * n_chunks)],  # same FLOPs, contiguous
           "copy": lambda: big2.copy_(big)}
    if before:  # the apply as of git ref `before`, in the same rounds
        old_map, convert = _old_apply(before)
        old_mapper = convert(mapper)
        old_kw = {k: v for k, v in kw.items() if k != "workspace"}   # an older map_layers may not take one
        fns["before"] = lambda: old_map(src, old_mapper, pos, **old_kw)
    timed = interleaved(fns, repeats=repeats, warmup=warmup, note=f"{pair} {layers} layers {tokens} tokens {dtype}")
    ms = {m: [1e3 * v for v in timed["seconds"][m]] for m in fns}
    med = {m: statistics.median(v) for m, v in ms.items()}
    copy_rate = 2 * big.numel() / (med["copy"] / 1e3)  # bytes read + written per second
    es = dtype_size(dtype)
    cost = mapper_cost(s_cfg, t_cfg, k, tokens, n_target_layers=layers, n_source_used=len(used), weight_bytes=es,
                       cache_bytes=es, out_bytes=es)
    matmul_rate = cost["gemm_flops"] / (med["matmul"] / 1e3)
    floor = floor_ms(cost["flops"], cost["bytes"], {"matmul_flops_per_s": matmul_rate, "copy_bytes_per_s": copy_rate})
    gathered = sum(k * s.width for r in runs if len(r) > 1) if es < 4 else 0  # Mapper.map_blocks gathers these
    moved = extra_bytes(tokens=tokens, n_used=len(used), width_s=s.width, n_target=layers, q=t.width, n_kv_t=t.n_kv,
                        map_bytes=es, gathered_features=gathered)
    full = med["full"]
    return {"pair": pair, "layers": layers, "tokens": tokens, "dtype": str(dtype).replace("torch.", ""),
            "selection": selection, "k": k, "n_used": len(used), "workspace": workspace,
            "blocks_per_target": [len(r) for r in runs],
            "full_ms": {"median": full, "p95": _pct(ms["full"], 95), "max": max(ms["full"])},
            "gemm_ms": med["gemm"], "gemm_share": med["gemm"] / full,
            "gemm_rate_of_matmul": med["matmul"] / med["gemm"],  # same FLOPs: the map's GEMMs at this share of the rate
            "rope_ms": full - med["no_rope"], "check_ms": full - med["no_check"],
            "extra_bytes": moved, "data_ms_at_copy_rate": 1e3 * moved["total"] / copy_rate,
            "copy_bytes_per_s": copy_rate, "matmul_flops_per_s": matmul_rate,
            "floor_ms": floor, "floor_fraction": floor / full,
            "other_ms": full - med["gemm"], "other_share": 1 - med["gemm"] / full,
            "before_ms": med.get("before"), "before": before,
            "peak_bytes": peak_bytes(tokens=tokens, chunk=chunk_tokens, n_used=len(used), width_s=s.width,
                                     n_target=layers, q=t.width, map_bytes=es, out_bytes=es),
            "medians_ms": med, "load_avg": timed["load_avg"], "machine": machine()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvtransfer.bench.breakdown", description=__doc__.split("\n")[0])
    p.add_argument("--pair", default="qwen3_14b_32b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", default="4096", help="comma-separated")
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--selection", default="random,band", help="comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--before", default=None, help="a git ref: also time the apply as of it, in the same rounds")
    p.add_argument("--workspace", action="store_true",
                   help="the map's calls share one Workspace (buffers kept across calls, as a serving worker does)")
    p.add_argument("--out", type=Path, required=True, help="a new JSON file (refuses to overwrite)")
    a = p.parse_args(argv)
    if a.out.exists():
        raise SystemExit(f"{a.out} exists: write a new file")
    rows = []
    for tokens in [int(x) for x in a.tokens.split(",")]:
        for sel in a.selection.split(","):
            for dt in a.dtype.split(","):
                r = breakdown_row(a.pair, layers=a.layers, tokens=tokens, dtype=getattr(torch, dt), selection=sel,
                                  repeats=a.repeats, before=a.before, workspace=a.workspace)
                rows.append(r)
                print(f"{a.pair} L={a.layers} T={tokens} {sel} {dt}: {r['full_ms']['median']:.0f} ms (p95 "
                      f"{r['full_ms']['p95']:.0f}), GEMMs {r['gemm_share']:.0%} at {r['gemm_rate_of_matmul']:.0%} of "
                      f"matmul, floor {r['floor_fraction']:.0%}, before {r['before_ms'] or 0:.0f} ms, load {r['load_avg']}", flush=True)
                prov = json_provenance()  # rewritten after each row (atomically): an interrupted run keeps its rows
                atomic_write_json(a.out, {"rows": rows, "commit": prov["commit"], "provenance": prov})


if __name__ == "__main__":
    main()
