"""Mapper vs target re-prefill speed (the paper's Table 5), with FLOP/byte counts and device floors.

Mapper side: a source cache already on the device -> a ready target `DynamicCache` (strip source RoPE,
map, re-apply target RoPE, build the cache) via `transfer.map_layers`, with the mapper in float32 by
default (the dtype evaluation maps with; `--mapper-dtype bfloat16` times a bf16 mapper too). Prefill side: the target's
decoder body (no LM head, sdpa attention) on the same number of tokens, appending to a fresh cache.

"shapes-only" mode builds random-weight models from the REAL configs of the paper's pairs,
optionally with fewer layers (CPU), and a random mapper of the real per-layer size. Its times say
nothing about quality, only about cost. Each time is shown next to its floor: max(FLOPs / measured
matmul rate, minimal bytes / measured copy bandwidth), both rates measured once per run.

    shapes.py    the pairs' real configs, shapes-only builders, random mapper; the cost model (FLOPs,
                 minimal bytes, floors)
    timing.py    warm-up, sync, median of repeats; device rates, free memory, load average
    measure.py   the benchmark: shapes-only Table-5 rows (`bench_pair`), calibration throughput
    cli.py       Markdown / CSV tables, the speedup plot, never-overwrite writers, the command line

CLI:  python -m kvtransfer.bench --pair qwen3_14b_32b --tokens 64,256,1024 --layers 2 --out DIR

The names below are re-exported for `from kvtransfer import bench; bench.bench_pair(...)`; to replace
one in a test, patch it where it is defined (e.g. `bench.timing.measure_device`).
"""
from .cli import TABLE_COLUMNS, main, output_paths, plot_speedup, table_csv, table_markdown, write_outputs
from .measure import DEFAULT_TOKENS, bench_pair, calibration_throughput
from .shapes import (ASSUMPTIONS, MODELS, PAIRS, ROPE_APPLY_FLOPS, ROPE_STRIP_FLOPS, ShapesOnlyLM, body_params,
                     build_shapes_only, dtype_size, floor_ms, mapper_cost, prefill_cost, random_mapper, real_config,
                     rope_only)
from .timing import available_bytes, load_average, measure_device, time_fn

__all__ = [
    "ASSUMPTIONS", "MODELS", "PAIRS", "ROPE_STRIP_FLOPS", "ROPE_APPLY_FLOPS", "ShapesOnlyLM", "real_config",
    "build_shapes_only", "rope_only", "random_mapper", "dtype_size", "mapper_cost", "body_params", "prefill_cost",
    "floor_ms", "time_fn", "measure_device", "available_bytes", "load_average", "DEFAULT_TOKENS", "bench_pair",
    "calibration_throughput", "TABLE_COLUMNS", "table_markdown", "table_csv", "plot_speedup", "output_paths",
    "write_outputs", "main",
]
