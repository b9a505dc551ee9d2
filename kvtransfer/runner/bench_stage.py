"""The bench stage of a run: mapper vs target re-prefill on the run's own models (or shapes only).

With the pair's real loaded models, the source cache is a real source prefill (random tokens, a
few distinct inputs rotated), the mapper is the run's fitted mapper, and the prefill side is the
target's decoder body. `bench.shapes_only=true` instead times random-weight models with the real
configs of a paper pair (see kvtransfer.bench). Rows are cached by config and device.

The mapper is timed in the dtype the evaluation applies it in (`eval.map_dtype`, kvtransfer.core.map_dtype; the
saved mapper is float32) on the target's cache dtype. `bench.mapper_dtypes` lists the mapper dtypes to time
(default: [eval.map_dtype]); each row says its `mapper_dtype`, and `eval_dtype` whether that is the dtype the
evaluation uses (set when the rows are read, so it follows eval.map_dtype).
"""
from __future__ import annotations

import copy
import json

import torch

from ..bench import shapes, timing
from ..bench.measure import bench_pair
from ..core.cache import cache_to_layers, forward_on_cache, layers_to_cache, prefill
from ..core.hidden import prefill_with_hidden, used_layers
from ..core.io import atomic_write_json
from ..core.map_dtype import DEFAULT_MAP_DTYPE, map_dtype
from ..core.models import kv_shape
from ..core.transfer import codec_for, map_layers




def _dtype(name: str, device: str) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)


def bench_loaded(source, target, mapper, tokens, *, mapper_dtype: torch.dtype | None = None, warmup: int = 3,
                 repeats: int = 10, n_inputs: int = 3, native_tails=(), eval_map_dtype=None,
                 log=print) -> list[dict]:
    """Table-5 rows for loaded models: mapper ms vs target body prefill ms per token count.

    native_tails: for each m, also the target's forward over the last m tokens on the mapped cache of the
    first n - m (`tail{m}_ms`; eval.native_tail=m), and the speedup of mapper + that forward over re-prefill
    (`tail{m}_speedup`; the mapper timed at n tokens, so a slight overestimate of the transfer's cost).

    The mapper computes in `mapper_dtype` (default: its own dtype) on a copy; `mapper` itself is left as it is.
    `eval_map_dtype`: the dtype the evaluation applies the map in (default: the mapper's own), which each row's
    `eval_dtype` compares with. Token counts beyond the target's max_position_embeddings are
    skipped. Times in ms (median and spread over `repeats`), FLOPs/bytes of both sides and their
    floors on this device.
    """
    device, dtype = target.device, target.dtype
    caps = timing.measure_device(device, dtype)
    eval_dtype = mapper.dtype if eval_map_dtype is None else map_dtype(eval_map_dtype)
    mapper = copy.copy(mapper).to(device, mapper_dtype)  # shallow copy: .to rebinds its tensors only
    s_shape, t_shape = kv_shape(source), kv_shape(target)
    used = len(set(mapper.selected_layers.flatten().tolist()))
    limit = getattr(target.config, "max_position_embeddings", None) or 10**9
    rows = []
    for n_tok in tokens:
        row = {"tokens": n_tok, "mode": "loaded", "device": str(device), "dtype": str(dtype).replace("torch.", ""),
               "mapper_dtype": str(mapper.dtype).replace("torch.", ""), "eval_dtype": mapper.dtype == eval_dtype,
               "k": mapper.k, "load_avg": timing.load_average()}
        if n_tok > limit:
            rows.append(dict(row, skipped=f"beyond max_position_embeddings={limit}"))
            continue
        g = torch.Generator().manual_seed(n_tok)  # device: seeded CPU draw (the same numbers on every device), moved to `device` after
        ids = [torch.randint(1, source.config.vocab_size, (1, n_tok), generator=g).to(device) for _ in range(n_inputs)]  # device: seeded CPU draw, moved
        # (cache, hidden states or None): a hidden-state map (kvtransfer.core.hidden) also reads the source's normed
        # layer inputs, captured from the same prefill
        caches = [prefill_with_hidden(source, i, layers=used_layers(mapper.selected_layers)) if mapper.needs_hidden
                  else (prefill(source, i), None) for i in ids]
        pos = torch.arange(n_tok, device=device)
        s_codec, t_codec = codec_for(source), codec_for(target)

        def run_mapper(item, positions=pos):
            layers, hidden = item
            mapped = map_layers(layers, mapper, positions, source_codec=s_codec, target_codec=t_codec,
                                target_n_kv=t_shape.n_kv, out_dtype=dtype, source_hidden=hidden)
            return layers_to_cache(mapped, target.config)

        m = timing.time_fn(run_mapper, caches, warmup=warmup, repeats=repeats, device=device)
        p = timing.time_fn(lambda i: prefill(target, i), ids, warmup=warmup, repeats=repeats, device=device)
        es = shapes.dtype_size(dtype)
        mc = shapes.mapper_cost(source.config, target.config, mapper.k, n_tok, n_target_layers=t_shape.n_layers,
                               n_source_used=used, weight_bytes=shapes.dtype_size(mapper.dtype),
                               cache_bytes=es, out_bytes=es, features=mapper.features)
        for tail in (t for t in native_tails if 0 < t < n_tok):
            head = n_tok - tail
            heads = [cache_to_layers(run_mapper(([(k[:, :, :head], v[:, :, :head]) for k, v in c],
                                                 None if h is None else {s: x[:, :head] for s, x in h.items()}), pos[:head]))
                     for c, h in caches]
            tf = timing.time_fn(lambda pair: forward_on_cache(target, pair[0], None, pair[1][:, head:]),
                                list(zip(heads, ids)), warmup=warmup, repeats=repeats, device=device)
            row[f"tail{tail}_ms"] = tf["median_ms"]
            row[f"tail{tail}_speedup"] = p["median_ms"] / (m["median_ms"] + tf["median_ms"])
        pc = shapes.prefill_cost(target.config, n_tok, dtype_bytes=es)
        row.update(mapper_ms=m["median_ms"], mapper_ms_min=m["min_ms"], mapper_ms_max=m["max_ms"],
                   prefill_ms=p["median_ms"], prefill_ms_min=p["min_ms"], prefill_ms_max=p["max_ms"],
                   speedup=p["median_ms"] / m["median_ms"], mapper_flops=mc["flops"], prefill_flops=pc["flops"],
                   flop_ratio=pc["flops"] / mc["flops"],
                   mapper_floor_ms=shapes.floor_ms(mc["flops"], mc["bytes"], caps),
                   # the prefill floor's rate: its dominant GEMM's shape, timed now (kvtransfer.bench.timing.gemm_rate)
                   prefill_floor_ms=shapes.floor_ms(pc["flops"], pc["bytes"], timing.workload_caps(caps, timing.gemm_rate(
                       n_tok, target.config.hidden_size, target.config.intermediate_size, device=device, dtype=dtype))),
                   repeats=m["n"],
                   source_kv=[s_shape.n_layers, s_shape.n_kv, s_shape.head_dim])
        log(f"[bench] {n_tok} tokens, {row['mapper_dtype']} mapper: mapper {m['median_ms']:.2f} ms, prefill "
            f"{p['median_ms']:.2f} ms, speedup {row['speedup']:.1f}x (FLOP ratio {row['flop_ratio']:.1f}x)")
        rows.append(row)
    return rows


def benchmark(run) -> list[dict]:
    """Speed rows for a pipeline `Run` (cached under cache_dir/bench/)."""
    bcfg = run.cfg["bench"]
    device = run.device
    shapes_only = bool(bcfg.get("shapes_only"))
    tails = list(bcfg.get("native_tails") or [])
    name = "bench_shapes" if shapes_only else "bench"
    path = run.cache_dir / "bench" / f"{run.key(name)}.json"
    if path.exists():
        return _read_bench(run, name, path)
    dtype = _dtype(bcfg.get("dtype"), device)
    eval_map = _eval_map_dtype(run)
    mapper_dtypes = [map_dtype(name) for name in (bcfg.get("mapper_dtypes") or [eval_map])]
    rows = []
    for mapper_dtype in mapper_dtypes:
        if shapes_only:
            name = run.cfg["pair"]["name"]
            if name not in shapes.PAIRS:
                raise ValueError(f"bench.shapes_only knows the paper pairs {sorted(shapes.PAIRS)}, not {name!r}")
            rows += [dict(r, eval_dtype=r["mapper_dtype"] == eval_map) for r in bench_pair(
                name, bcfg["tokens"], layers=bcfg.get("layers"), device=device, dtype=dtype,
                mapper_dtype=mapper_dtype, warmup=bcfg["warmup"], repeats=bcfg["repeats"])]
        else:
            source, target = run.model("source")[0], run.model("target")[0]
            rows += bench_loaded(source, target, run.mapper(), bcfg["tokens"], mapper_dtype=mapper_dtype,
                                 warmup=bcfg["warmup"], repeats=bcfg["repeats"], native_tails=tails,
                                 eval_map_dtype=eval_map)
    atomic_write_json(path, {"rows": rows, "produced_by": run.stamp(name)})
    return _read_bench(run, name, path)


def _eval_map_dtype(run) -> str:
    """The name of the dtype this run's evaluation applies the map in (eval.map_dtype)."""
    name = (run.cfg.get("eval") or {}).get("map_dtype") or DEFAULT_MAP_DTYPE
    return str(map_dtype(name)).removeprefix("torch.")


def _read_bench(run, name: str, path) -> list[dict]:
    """The bench rows at `path`, noting their producer (a bare list: written before bench files carried one);
    each row's `eval_dtype` says whether its mapper dtype is this run's eval.map_dtype (rows are keyed by the
    dtypes timed, not by which of them the evaluation uses)."""
    data = json.loads(path.read_text())
    if isinstance(data, list):
        run.note(name, path, None)
        rows = data
    else:
        run.note(name, path, data.get("produced_by"))
        rows = data["rows"]
    eval_map = _eval_map_dtype(run)
    return [dict(r, eval_dtype=r["mapper_dtype"] == eval_map) if "mapper_dtype" in r else r for r in rows]
