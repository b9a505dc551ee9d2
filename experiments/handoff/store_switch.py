"""The switch on the real pair (Qwen2.5-Coder 0.5B -> 1.5B) with the Redis store against the directory store, in
interleaved rounds (serving environment).

    PYTHONPATH=$PWD .venv-serve/bin/python experiments/handoff/store_switch.py OUT_DIR --mapper MAPPER_DIR \
        [--tokens 2048 --rounds 4 --per-round 5 --dtype bfloat16]
        -> OUT_DIR/store_switch.json (written once, atomically)
    # a smoke run on the tiny family (one model as both ends, its identity map):
    python -c "from transformers import AutoConfig; from kvtransfer.serve.mapping import identity_mapper; \
        identity_mapper(AutoConfig.from_pretrained('models/tiny/qwen3-tiny-3m'), model_id='models/tiny/qwen3-tiny-3m', \
        start_ids=[0]).save('/tmp/tiny-map')"
    PYTHONPATH=$PWD .venv-serve/bin/python experiments/handoff/store_switch.py /tmp/switch-tiny --mapper /tmp/tiny-map \
        --source models/tiny/qwen3-tiny-3m --target models/tiny/qwen3-tiny-3m --tokens 256 --rounds 2 --per-round 2 --dtype float32

Each round starts the deployment as experiments/handoff/real_pair.py does (the 0.5B producer, the 1.5B consumer
with the mapper, the proxy; prefix caching on) on one store -- a fresh directory, or a private loopback
redis-server (persistence off) -- and stops it at the round's end. The rounds run in the order dir, redis, redis,
dir, dir, redis, ... so a drift in the machine's load falls on both stores alike. In each round, `--per-round + 1`
sessions, each on a fresh WikiText-2 window of `--tokens` tokens: the source answers a first question through the
proxy (16 greedy tokens, written through), then the switch prompt (that turn, the answer and a new 30-60-token
question) goes to the target through the proxy with max_tokens = 1, timed request to response. A round's first
switch is a warm-up and is not counted. Reported per store: every switch's seconds, their median and mean ± SE, the
tokens mapped and prefilled, and the difference of means redis - directory ± its (Welch) SE, against the goal:
the Redis switch no slower than the directory's by more than that SE plus 10 % of the directory's mean.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "experiments" / "serve"))
from load_tiny import kill, machine, wait_up  # noqa: E402
from real_pair import KEY, PY, QUESTIONS, engine, kv, timed, tokens, write_once  # noqa: E402
from redis_io import start_server  # noqa: E402


def order(rounds: int) -> list[str]:
    """The stores of `rounds` rounds: dir, redis, redis, dir, dir, redis, ... (each adjacent pair ABBA-balanced)."""
    return [("dir", "redis")[(r + 1) // 2 % 2] for r in range(rounds)]


def mean_se(xs: list[float]) -> tuple[float, float | None]:
    """(mean, standard error of the mean) of `xs`."""
    from kvtransfer.eval.stats import mean_se as core

    return core(xs)


def compare(by_store: dict[str, list[float]]) -> dict:
    """Per store: n, median, mean ± SE of its switch seconds; redis - dir mean difference ± Welch SE; the goal."""
    out = {}
    for store, xs in by_store.items():
        m, se = mean_se(xs)
        out[store] = {"n": len(xs), "median_s": statistics.median(xs), "mean_s": m, "se_s": se}
    d, r = out["dir"], out["redis"]
    diff_se = (d["se_s"] ** 2 + r["se_s"] ** 2) ** 0.5
    out["redis_minus_dir_s"] = r["mean_s"] - d["mean_s"]
    out["redis_minus_dir_se_s"] = diff_se
    out["goal"] = "redis - dir <= SE + 10 % of the directory's mean"
    out["goal_met"] = out["redis_minus_dir_s"] <= diff_se + 0.1 * d["mean_s"]
    return out


def deployment(store_url: str, out: Path, tag: str, args, src: Path, tgt: Path, max_len: int,
               stats: Path | None = None) -> dict:
    """Start producer, consumer and proxy on `store_url` (logs under out/<tag>.*; `stats`: the consumer's stats
    file, its worker's per-load timings beside it); {name: Popen} once all answer."""
    extra = {"stats": stats} if stats else {}
    procs = {"producer": engine(src, 8201, kv("kv_producer", store_url), out / f"{tag}.producer.log", max_len, 1,
                                args.dtype),
             "consumer": engine(tgt, 8202, kv("kv_consumer", store_url, mapper=Path(args.mapper).resolve(),
                                               source_model=src, sink_dir=out / "sinks", **extra),
                                out / f"{tag}.consumer.log", max_len, 1, args.dtype)}
    procs["proxy"] = subprocess.Popen([PY, "-m", "kvtransfer.serve.proxy", "--source", "http://127.0.0.1:8201",
                                       "--target", "http://127.0.0.1:8202", "--mapper", str(Path(args.mapper).resolve()),
                                       "--store", store_url, "--port", "8200", "--switch-wait", "30"],
                                      stdout=(out / f"{tag}.proxy.log").open("w"), stderr=subprocess.STDOUT,
                                      env=os.environ | {"PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        for url, name in (("http://127.0.0.1:8201", "producer"), ("http://127.0.0.1:8202", "consumer"),
                          ("http://127.0.0.1:8200", "proxy")):
            wait_up(url, procs[name], timeout=1800)
    except BaseException:
        for p in procs.values():
            kill(p)
        raise
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--real", default=str(Path.home() / ".cache/kvtransfer-real"))
    ap.add_argument("--source", help="the producer's model directory (default: the real pair's 0.5B under --real)")
    ap.add_argument("--target", help="the consumer's model directory (default: the real pair's 1.5B under --real)")
    ap.add_argument("--mapper", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", help="both engines' dtype (bfloat16 halves their memory)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "store_switch.json").exists():
        raise SystemExit(f"{out / 'store_switch.json'} exists: results are never overwritten, pick a new OUT_DIR")
    from kvtransfer.serve.proxy import mapper_start_ids

    start_id = mapper_start_ids(args.mapper)[0]
    src = Path(args.source or Path(args.real) / "hf/qwen25coder-0.5b")
    tgt = Path(args.target or Path(args.real) / "hf/qwen25coder-1.5b")
    provenance = machine()
    from transformers import AutoTokenizer

    from kvtransfer.eval.perplexity import load_pages
    tok = AutoTokenizer.from_pretrained(tgt)
    wiki = [i for page in load_pages(ROOT / "data/benchmarks/wikitext2.jsonl")
            for i in tok.encode(page, add_special_tokens=False)]
    n, max_len = args.tokens, args.tokens + 256
    one = {"max_tokens": 1, "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True}
    q1 = tok.encode("\n\nQuestion: what is the passage above about?\nAnswer:", add_special_tokens=False)
    rows, window = [], 0
    for r, store in enumerate(order(args.rounds)):
        redis = None
        if store == "redis":
            redis, url = start_server()
            store_url = url.replace("/0", "/0?deployment=switch")
        else:
            store_url = str(out / f"store-{r}")
        t0 = time.time()
        procs = deployment(store_url, out, f"round{r}", args, src, tgt, max_len)
        startup_s = time.time() - t0
        try:
            c = httpx.Client(timeout=3600)
            for i in range(args.per_round + 1):
                if (window + 1) * n > len(wiki):
                    raise SystemExit(f"WikiText-2 holds {len(wiki)} tokens: fewer rounds or sessions")
                context = [start_id] + wiki[window * n:window * n + n - 1]
                window += 1
                session = {**KEY, "x-kvtransfer-session": f"switch-{r}-{i}-{uuid.uuid4().hex[:8]}"}
                _, turn1 = timed(c, "http://127.0.0.1:8200/v1/completions",
                                 {**one, "max_tokens": 16, "model": "source", "prompt": context + q1}, session)
                q2 = tok.encode(f"\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:", add_special_tokens=False)
                ids = context + q1 + tokens(turn1) + q2
                seconds, hand = timed(c, "http://127.0.0.1:8200/v1/completions",
                                      {**one, "model": "target", "prompt": ids}, session)
                row = {"round": r, "store": store, "session": i, "warmup": i == 0, "prompt": len(ids),
                       "switch_s": seconds, "kvtransfer": hand.get("kvtransfer"), "startup_s": startup_s}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for p in procs.values():
                kill(p)
            if redis is not None:
                redis.kill()
                redis.wait()
    counted = [row for row in rows if not row["warmup"]]
    by_store = {s: [row["switch_s"] for row in counted if row["store"] == s] for s in ("dir", "redis")}
    mapped = {s: [int(row["kvtransfer"]["mapped"]) for row in counted if row["store"] == s and row["kvtransfer"]]
              for s in by_store}
    write_once(out / "store_switch.json", {
        "tokens": n, "dtype": args.dtype, "rounds": order(args.rounds), "per_round": args.per_round,
        "summary": compare(by_store), "mapped_median": {s: statistics.median(v) if v else None
                                                         for s, v in mapped.items()},
        "rows": rows, "loadavg_end": os.getloadavg(), "provenance": provenance})
    print(json.dumps(compare(by_store), indent=1))


if __name__ == "__main__":
    main()
