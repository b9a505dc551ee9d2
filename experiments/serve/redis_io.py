"""Redis store throughput: a prompt's KV written and read back (lookup, then read with every checksum and token id
verified) through kvtransfer.serve.redis_store.RedisStore, against plain SET / GET of the same bytes (the same
per-block values, pipelined the same way) through the same client.

    python experiments/serve/redis_io.py [--tokens 1024 4096 16384] [--repeats 5] [--url redis://...]
        [--out results/serve/redis_io_<stamp>.json]

torch runs on --threads intra-op threads (default 1). Shape: Qwen2.5-0.5B's KV (24 layers x 2 KV heads x 64, bfloat16: 12,288 bytes per token), 16-token blocks. Without
--url a private redis-server (persistence off) is started on a free loopback port and stopped at the end. The four
measurements of one size run interleaved, their order alternating between repeats, so drifting load affects each
alike; each row has the median and the standard error of the mean, and the ratios store / plain are taken per repeat
(the median of those, ± the SE of their mean). The result is written atomically, never over an existing file."""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvtransfer.serve.redis_store import RedisStore  # noqa: E402

IDENT = {"key": "feedfacefeedface", "n_layers": 24, "n_kv": 2, "head_dim": 64, "model_id": "bench-0.5b",
         "config_hash": "bench"}
BLOCK = 16


def start_server() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed: apt-get install -y redis-server, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"redis://127.0.0.1:{port}/0"


def blobs_of(store: RedisStore, ids: list[int], layers) -> list[bytes]:
    """The values the store writes for this prompt (built once, outside any clock): plain SET sends these bytes."""
    from kvtransfer.serve.blockformat import plan_write

    plan = plan_write(ids, layers, IDENT, 0, "", BLOCK)
    rows, _ = plan.encode(0, len(plan.hashes))
    return [bytes(row.numpy()) for row in rows]


def plain_write(r, keys: list[str], blobs: list[bytes], chunk_bytes: int) -> None:
    pipe, size = r.pipeline(transaction=False), 0
    for k, b in zip(keys, blobs):
        pipe.set(k, b)
        size += len(b)
        if size >= chunk_bytes:
            pipe.execute()
            pipe, size = r.pipeline(transaction=False), 0
    pipe.execute()


def plain_read(r, keys: list[str], chunk_blocks: int) -> int:
    n = 0
    for c in range(0, len(keys), chunk_blocks):
        pipe = r.pipeline(transaction=False)
        for k in keys[c:c + chunk_blocks]:
            pipe.get(k)
        n += sum(len(v) for v in pipe.execute())
    return n


def summary(times: list[float]) -> dict:
    se = statistics.stdev(times) / len(times) ** 0.5 if len(times) > 1 else None
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times), "se_s": se, "runs": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--url", help="an existing Redis (default: a private redis-server)")
    ap.add_argument("--out", help="default results/serve/redis_io_<UTC stamp>.json")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads (default 1: on a small shared machine, OpenMP threads spinning "
                         "for busy cores made a 48 MB torch.cat take 2-4 s instead of 0.03 s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out or Path(__file__).resolve().parents[2] / "results" / "serve" / f"redis_io_{stamp}.json")
    if out.exists():
        raise SystemExit(f"{out} exists: pick a new name")
    from kvtransfer.config.provenance import json_provenance

    provenance = json_provenance()  # the tree measured, before anything can change it
    proc, url = (None, args.url) if args.url else start_server()
    load_before = os.getloadavg()
    rows = []
    try:
        store = RedisStore(url, block_size=BLOCK, deployment="bench", timeout_s=60.0)
        r = store.r
        time.sleep(0.2)
        server_version = r.info("server")["redis_version"]
        for n in args.tokens:
            g = torch.Generator().manual_seed(n)
            ids = list(range(n))
            layers = [(torch.randn(2, n, 64, generator=g).to(torch.bfloat16),
                       torch.randn(2, n, 64, generator=g).to(torch.bfloat16)) for _ in range(24)]
            kv_bytes = sum(t.numel() * 2 for kv in layers for t in kv)
            blobs = blobs_of(store, ids, layers)
            keys = [f"plain:{j}" for j in range(len(blobs))]
            times = {"store_write": [], "store_read": [], "plain_write": [], "plain_read": []}
            for rep in range(args.repeats):
                r.flushdb()
                store = RedisStore(url, block_size=BLOCK, deployment="bench", timeout_s=60.0)
                order = ["store", "plain"] if rep % 2 == 0 else ["plain", "store"]
                for kind in order:
                    if kind == "store":
                        t0 = time.perf_counter()
                        assert store.write(ids, layers, IDENT) == n // BLOCK
                        times["store_write"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        prefix = store.lookup(ids, IDENT["key"])
                        got = store.read(prefix, ids, 0, prefix.n_tokens)  # every checksum and id verified
                        times["store_read"].append(time.perf_counter() - t0)
                        assert prefix.n_tokens == n and torch.equal(got[-1][1], layers[-1][1])
                        del got
                    else:
                        t0 = time.perf_counter()
                        plain_write(r, keys, blobs, store.write_chunk_bytes)
                        times["plain_write"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        assert plain_read(r, keys, store.read_chunk_blocks) == sum(map(len, blobs))
                        times["plain_read"].append(time.perf_counter() - t0)
            row = {"tokens": n, "kv_bytes": kv_bytes, "value_bytes": sum(map(len, blobs)), "blocks": len(blobs),
                   **{k: summary(v) for k, v in times.items()}}
            # each repeat's store / plain ratio (the two ran back to back, so a load swing falls on both): the
            # median of those ratios, and the SE of their mean
            for kind in ("write", "read"):
                ratios = [a / b for a, b in zip(times[f"store_{kind}"], times[f"plain_{kind}"])]
                row[f"{kind}_ratio"] = statistics.median(ratios)
                row[f"{kind}_ratio_se"] = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
                row[f"{kind}_ratios"] = ratios
            rows.append(row)
            print(f"{n:6d} tokens ({kv_bytes / 2**20:6.1f} MiB): write store {row['store_write']['median_s']:.3f} s "
                  f"plain {row['plain_write']['median_s']:.3f} s (x{row['write_ratio']:.2f} ± {row['write_ratio_se']:.2f}); "
                  f"read+verify store "
                  f"{row['store_read']['median_s']:.3f} s plain {row['plain_read']['median_s']:.3f} s "
                  f"(x{row['read_ratio']:.2f} ± {row['read_ratio_se']:.2f})", flush=True)
            del layers, blobs
            r.flushdb()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    from kvtransfer.core.io import atomic_write_json

    atomic_write_json(out, {"rows": rows, "repeats": args.repeats, "shape": IDENT, "dtype": "bfloat16",
                            "block_size": BLOCK, "bytes_per_token": 12288, "torch_threads": args.threads, "redis_version": server_version,
                            "redis": "private loopback redis-server, persistence off" if proc else "given URL",
                            "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                                        "loadavg_after": os.getloadavg()},
                            "goal": "store within 1.5x of plain SET/GET of the same bytes",
                            "provenance": provenance})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
