"""The real pair's served switch against its own floor (Qwen2.5-Coder 0.5B -> 1.5B, serving environment).

    PYTHONPATH=$PWD .venv-serve/bin/python experiments/handoff/switch_floor.py OUT_DIR --mapper MAPPER_DIR \
        [--sizes 1024 2048 4096 --per-size 5 --dtype bfloat16]
        -> OUT_DIR/switch_floor.json (written once, atomically)
    # a smoke run on the tiny family: one model as both ends, its identity map (made as in store_switch.py)
    PYTHONPATH=$PWD .venv-serve/bin/python experiments/handoff/switch_floor.py /tmp/floor-tiny --mapper /tmp/tiny-map \
        --source models/tiny/qwen3-tiny-3m --target models/tiny/qwen3-tiny-3m --sizes 256 --per-size 2 --dtype float32

The deployment of experiments/handoff/store_switch.py (the 0.5B producer, the 1.5B consumer with the mapper, the
proxy; a directory store, prefix caching on; logs OUT_DIR/floor.*), with the consumer's stats file on, so its worker records each load's
store read, map and scatter seconds. Per size, `--per-size + 1` sessions (the first a warm-up, not counted), each
on a fresh WikiText-2 window: the source answers a first question through the proxy (16 greedy tokens, written
through); the switch prompt (that turn, the answer and a new 30-60-token question) goes to the target through the
proxy (`max_tokens=1`: request to first token), then the session's next turn (the switch prompt, its answer token
and a short question), which the target serves from its own cache.

The switch's floor, per switch: the store read at the disk's rate (the bytes the switch read -- the source's K/V of
the mapped tokens, at the store's dtype -- over the rate of reading a plain file of that size, written and fsynced
just before; median of 5 reads) + the map at its floor (`kvtransfer.bench.shapes.mapper_cost` of this mapper at the
mapped tokens, over the rate of one matmul of the map's GEMM shape in the map's dtype and a copy rate, measured in
this process after the engines stop) + the new turn's prefill (that session's next turn, measured: the same path,
nothing mapped). Reported per size: the switch and each part (median ± SE over switches), the ratio switch / floor
per switch (median ± SE; the goal: within 1.5x), and where the switch's time beyond the floor goes (the worker's
read, map and scatter against their floors; the rest: the scheduler, the proxy and the forward around them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from load_tiny import kill, machine  # noqa: E402
from real_pair import KEY, QUESTIONS, timed, tokens, write_once  # noqa: E402
from store_switch import deployment  # noqa: E402

GOAL = 1.5
NEXT_QUESTION = "\n\nQuestion: and what follows from that?\nAnswer:"


def median_se(xs: list[float]) -> dict:
    """{"median", "se", "n"} of `xs`: the SE of the median from the spread of the values (core.timing.median_se)."""
    from kvtransfer.core.timing import median_se as core

    m, se = core(xs)
    return {"median": m, "se": se, "n": len(xs)}


def plain_read_rate(nbytes: int, folder: Path, repeats: int = 5) -> float:
    """Bytes per second reading one plain file of `nbytes` written and fsynced just before (median of `repeats`)."""
    path = folder / f"plain-{uuid.uuid4().hex[:8]}.bin"
    with path.open("wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass
        seconds.append(time.perf_counter() - t0)
    path.unlink()
    return nbytes / statistics.median(seconds)


def map_floor(mapper_dir: str, source_dir: Path, target_dir: Path, tokens_list: list[int], map_dtype: str,
              cache_bytes: int) -> dict:
    """{tokens: the map's floor in seconds} and the rates it used, for this mapper on `tokens_list` tokens: its
    FLOPs over the measured rate of one matmul of its GEMM shape, or its minimal bytes over a measured copy rate,
    whichever is slower."""
    import torch
    from transformers import AutoConfig

    from kvtransfer.bench.shapes import floor_ms, mapper_cost
    from kvtransfer.bench.timing import gemm_rate, measure_device
    from kvtransfer.core.mapper import load_mapper
    from kvtransfer.core.models import kv_shape

    mapper = load_mapper(mapper_dir)
    s_cfg, t_cfg = AutoConfig.from_pretrained(source_dir), AutoConfig.from_pretrained(target_dir)
    sel = mapper.selected_layers.tolist()
    k, used = len(sel[0]), len({x for row in sel for x in row})
    p, q = k * kv_shape(s_cfg).width, kv_shape(t_cfg).width
    dtype = getattr(torch, map_dtype)
    caps = measure_device("cpu", dtype)
    out = {"k": k, "n_source_used": used, "copy_bytes_per_s": caps["copy_bytes_per_s"], "per_tokens": {}}
    for n in tokens_list:
        cost = mapper_cost(s_cfg, t_cfg, k, n, n_target_layers=t_cfg.num_hidden_layers, n_source_used=used,
                           weight_bytes=dtype.itemsize, cache_bytes=cache_bytes, out_bytes=cache_bytes)
        rate = max(gemm_rate(n, p, q, dtype=dtype), caps["matmul_flops_per_s"])
        out["per_tokens"][n] = {"flops": cost["flops"], "bytes": cost["bytes"], "gemm_flops_per_s": rate,
                                "floor_s": floor_ms(cost["flops"], cost["bytes"], {**caps, "matmul_flops_per_s": rate})
                                / 1e3}
    return out


def match_loads(rows: list[dict], loads: list[dict]) -> int:
    """Give each switch row the worker's load that mapped it (`row["load"]`: the next recorded load, in order,
    whose token count is the switch's mapped count and which did not fail; None where there is none); returns how
    many rows got none. Loads of other requests (there should be none: a next turn hits the target's cache) are
    skipped."""
    it = iter(loads)
    missing = 0
    for row in rows:
        row["load"] = next((ld for ld in it if ld.get("tokens") == row["mapped"] and "failed" not in ld), None)
        missing += row["load"] is None
    return missing


def summarise(rows: list[dict], read_rate: dict, maps: dict) -> list[dict]:
    """Per size: the switch, its floor's parts, switch / floor, and the worker's parts against their floors."""
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        sel = [r for r in rows if r["tokens"] == n and not r["warmup"]]
        floor = []
        for r in sel:
            read = r["store_bytes"] / read_rate[n]
            r["floor"] = {"read_s": read, "map_s": maps["per_tokens"][r["mapped"]]["floor_s"],
                          "next_turn_s": r["next_turn_s"]}
            floor.append(sum(r["floor"].values()))
        ratios = [r["switch_s"] / f for r, f in zip(sel, floor)]
        loaded = [r for r in sel if r.get("load")]   # the worker's record of each switch's load, where matched
        worker = {part: median_se([r["load"][part] for r in loaded]) if loaded else None
                  for part in ("read_s", "map_s", "scatter_s")}
        rest = [r["switch_s"] - r["load"]["total_s"] - r["next_turn_s"] for r in loaded]
        out.append({"tokens": n, "n": len(sel), "switch_s": median_se([r["switch_s"] for r in sel]),
                    "floor_s": median_se(floor), "ratio": median_se(ratios), "goal": GOAL,
                    "goal_met": statistics.median(ratios) <= GOAL,
                    "floor_parts_s": {"read_s": statistics.median(r["floor"]["read_s"] for r in sel),
                                      "map_s": statistics.median(r["floor"]["map_s"] for r in sel),
                                      "next_turn_s": median_se([r["next_turn_s"] for r in sel])},
                    "worker_s": worker, "worker_matched": len(loaded),
                    "rest_beyond_next_turn_s": median_se(rest) if rest else None,
                    "prefilled": {"switch": statistics.median(r["switch_prefilled"] for r in sel),
                                  "next_turn": statistics.median(r["next_prefilled"] for r in sel)}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--real", default=str(Path.home() / ".cache/kvtransfer-real"))
    ap.add_argument("--source", help="the producer's model directory (default: the real pair's 0.5B under --real)")
    ap.add_argument("--target", help="the consumer's model directory (default: the real pair's 1.5B under --real)")
    ap.add_argument("--mapper", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--per-size", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", help="both engines' dtype (bfloat16 halves their memory)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "switch_floor.json").exists():
        raise SystemExit(f"{out / 'switch_floor.json'} exists: results are never overwritten, pick a new OUT_DIR")
    from transformers import AutoConfig, AutoTokenizer

    from kvtransfer.core.map_dtype import DEFAULT_MAP_DTYPE
    from kvtransfer.core.models import kv_shape
    from kvtransfer.eval.perplexity import load_pages
    from kvtransfer.serve.proxy import mapper_start_ids

    start_id = mapper_start_ids(args.mapper)[0]
    src = Path(args.source or Path(args.real) / "hf/qwen25coder-0.5b")
    tgt = Path(args.target or Path(args.real) / "hf/qwen25coder-1.5b")
    provenance = machine()
    tok = AutoTokenizer.from_pretrained(tgt)
    wiki = [i for page in load_pages(ROOT / "data/benchmarks/wikitext2.jsonl")
            for i in tok.encode(page, add_special_tokens=False)]
    s_cfg = AutoConfig.from_pretrained(src)
    cache_bytes = 2 if args.dtype in ("bfloat16", "float16") else 4
    kv_bytes_per_token = s_cfg.num_hidden_layers * 2 * kv_shape(s_cfg).width * cache_bytes
    store, stats = out / "store", out / "consumer_stats.json"
    max_len = max(args.sizes) + 256
    procs = deployment(str(store), out, "floor", args, src, tgt, max_len, stats=stats)
    proxy = "http://127.0.0.1:8200/v1/completions"
    one = {"max_tokens": 1, "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True}
    q1 = tok.encode("\n\nQuestion: what is the passage above about?\nAnswer:", add_special_tokens=False)
    q3 = tok.encode(NEXT_QUESTION, add_special_tokens=False)
    rows, window = [], 0
    try:
        c = httpx.Client(timeout=3600)
        for n in args.sizes:
            for i in range(args.per_size + 1):
                if (window + 1) * n > len(wiki):
                    raise SystemExit(f"WikiText-2 holds {len(wiki)} tokens: fewer sizes or sessions")
                context = [start_id] + wiki[window * n:window * n + n - 1]
                window += 1
                session = {**KEY, "x-kvtransfer-session": f"floor-{n}-{i}-{uuid.uuid4().hex[:8]}"}
                _, turn1 = timed(c, proxy, {**one, "max_tokens": 16, "model": "source", "prompt": context + q1},
                                 session)
                q2 = tok.encode(f"\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:", add_special_tokens=False)
                ids = context + q1 + tokens(turn1) + q2
                switch_s, hand = timed(c, proxy, {**one, "model": "target", "prompt": ids}, session)
                next_s, nxt = timed(c, proxy, {**one, "model": "target", "prompt": ids + tokens(hand) + q3}, session)
                field, nfield = hand.get("kvtransfer") or {}, nxt.get("kvtransfer") or {}
                row = {"tokens": n, "session": i, "warmup": i == 0, "prompt": len(ids), "switch_s": switch_s,
                       "next_turn_s": next_s, "kvtransfer": field, "next_kvtransfer": nfield,
                       "mapped": int(field.get("mapped", 0)), "switch_prefilled": int(field.get("prefilled", 0)),
                       "next_prefilled": int(nfield.get("prefilled", 0))}
                row["store_bytes"] = row["mapped"] * kv_bytes_per_token
                rows.append(row)
                print(json.dumps(row), flush=True)
        time.sleep(2)  # the worker's timings file is written on a 0.5 s timer
        worker_file = Path(f"{stats}.worker.json")
        loads = json.loads(worker_file.read_text())["loads"] if worker_file.exists() else []
    finally:
        for p in procs.values():
            kill(p)
    unmatched = match_loads(rows, loads)
    read_rate = {n: plain_read_rate(max(r["store_bytes"] for r in rows if r["tokens"] == n), out)
                 for n in args.sizes}
    maps = map_floor(args.mapper, src, tgt, sorted({r["mapped"] for r in rows}), DEFAULT_MAP_DTYPE, cache_bytes)
    result = {"sizes": args.sizes, "per_size": args.per_size, "dtype": args.dtype, "map_dtype": DEFAULT_MAP_DTYPE,
              "summary": summarise(rows, read_rate, maps), "read_bytes_per_s": read_rate, "map_floor": maps,
              "loads_unmatched": unmatched, "loads": loads,
              "rows": rows, "loadavg_end": os.getloadavg(), "provenance": provenance}
    write_once(out / "switch_floor.json", result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
