"""Store throughput: writing and reading (with verification) a prompt's KV through kvtransfer.serve.store, against
writing and reading the same bytes as one plain file on the same disk.

    python experiments/handoff/store_io.py OUT.json [--tokens 1024 4096 8192 32768] [--dir /tmp/store-io]

Shape: Qwen2.5-Coder-1.5B's KV (28 layers x 2 KV heads x 128) in bfloat16, 16-token blocks; each size written to a
fresh store (fsync'd before the clock stops, as the plain file is) and read back with checksums and token ids
verified; the store and the plain file alternate within each repeat (interleaved), 5 repeats: per mode the median
seconds ± SE, and the store / plain ratios as the median ± SE of the per-repeat ratios; the load average before and
after. Results are written once (never overwritten)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvtransfer.serve.store import KVStore  # noqa: E402

IDENT = {"key": "feedfacefeedface", "n_layers": 28, "n_kv": 2, "head_dim": 128, "model_id": "bench",
         "config_hash": "bench"}


def sync_dir(root: Path) -> None:
    os.sync()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    ap.add_argument("--dir", default="/tmp/kvtransfer-store-io")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if Path(args.out).exists():
        raise SystemExit(f"{args.out} exists: pick a new name")
    root = Path(args.dir)
    from kvtransfer.config.provenance import json_provenance
    from kvtransfer.core.timing import load_average, median_se

    provenance = json_provenance()  # the tree measured, before anything can change it
    load_before = load_average()
    rows = []
    for n in args.tokens:
        ids = list(range(n))
        layers = [(torch.randn(2, n, 128).to(torch.bfloat16), torch.randn(2, n, 128).to(torch.bfloat16))
                  for _ in range(28)]
        nbytes = sum(t.numel() * 2 for kv in layers for t in kv)
        times = {"store_write": [], "store_read": [], "plain_write": [], "plain_read": []}
        for _ in range(args.repeats):
            shutil.rmtree(root, ignore_errors=True)
            store = KVStore(root / "store", block_size=16)
            t0 = time.perf_counter()
            store.write(ids, layers, IDENT)
            sync_dir(root)
            times["store_write"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            prefix = store.lookup(ids, IDENT["key"])
            store.read(prefix, ids, 0, n)
            times["store_read"].append(time.perf_counter() - t0)
            blob = torch.cat([torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])])
            t0 = time.perf_counter()
            with open(root / "plain.bin", "wb") as f:
                f.write(blob.view(torch.uint8).numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())
            times["plain_write"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = torch.frombuffer(bytearray((root / "plain.bin").read_bytes()), dtype=torch.bfloat16)
            times["plain_read"].append(time.perf_counter() - t0)
            assert back.numel() * 2 == nbytes
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = {kind: median_se([a / b for a, b in zip(times[f"store_{kind}"], times[f"plain_{kind}"])])
                 for kind in ("write", "read")}
        row = {"tokens": n, "mb": nbytes / 1e6, "repeats": args.repeats, **{f"{k}_s": v for k, v in med.items()},
               **{f"{k}_se_s": median_se(v)[1] for k, v in times.items()},
               **{f"{k}_mb_s": nbytes / 1e6 / v for k, v in med.items()},
               "write_vs_plain": ratio["write"][0], "write_vs_plain_se": ratio["write"][1],
               "read_vs_plain": ratio["read"][0], "read_vs_plain_se": ratio["read"][1], "seconds": times}
        rows.append(row)
        print(json.dumps(row), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    from kvtransfer.config.provenance import cpu_model, json_provenance
    from kvtransfer.core.io import atomic_write_json

    atomic_write_json(Path(args.out), {"rows": rows, "repeats": args.repeats, "shape": IDENT, "dtype": "bfloat16",
                                       "load_avg": {"before": load_before, "after": load_average()},
                                       "provenance": {**provenance, "cpus": os.cpu_count(), "cpu": cpu_model()}})


if __name__ == "__main__":
    main()
