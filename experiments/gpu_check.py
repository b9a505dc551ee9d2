"""The GPU check, one script for the day a GPU is lent (~6 minutes on one H200; reaches no hub; needs only torch,
transformers and safetensors besides this repository):

1. the bench at the real shapes of Qwen3 14B -> 32B and 8B -> 32B with random weights (experiments/gpu_bench.py:
   the map vs the target's prefill at 1K-32K tokens, warm-up, synchronised, median; the paper's Table 5 protocol);
2. the tiny family's calibrate -> fit (models/tiny 1m -> 7m, the default two-level moments) on CUDA against the
   same on the CPU: selected layers equal, held-out R² within the bound results/precision derives from the two
   calibrations' moment difference and the ridge systems' smallest eigenvalue, the moments' relative difference
   within float32 forward + accumulation rounding; with the measured GPU peak and time beside the plan's.

    python experiments/gpu_check.py --out $OUT/gpu_check           # on the GPU machine
    python experiments/gpu_check.py --smoke --out /tmp/gpu_check   # here: CPU only, tiny token counts

Writes <out>/gpu_check.json (+ the bench's own files under <out>/bench); exit 1 when a check fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvtransfer as kt  # noqa: E402
from kvtransfer.core.data import read_documents, token_sequences  # noqa: E402
from kvtransfer.core.ridge import DEFAULT_LAMBDA  # noqa: E402


def _load(rel: str):
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_calibrate_fit(device: str, n_sequences: int) -> dict:
    """Calibrate (two-level) -> select -> fit on `device`; the fit itself is float64 on the host either way."""
    src, tok = kt.load_model(str(ROOT / "models/tiny/qwen3-tiny-1m"), dtype="float32", device=device)
    tgt, _ = kt.load_model(str(ROOT / "models/tiny/qwen3-tiny-7m"), dtype="float32", device=device)
    ids = token_sequences(read_documents([str(ROOT / "data/tiny/calib.jsonl")]), tok, n_sequences=n_sequences,
                          seq_len=128)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    calib = kt.collect_moments(src, tgt, ids, stride=2, batch_size=16, heldout_fraction=0.1, accumulate="twolevel",
                               flush_batches=8)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    head_dim = kt.kv_shape(tgt).head_dim
    r2 = kt.r2_matrix(calib.train, heldout=calib.heldout, head_dim=head_dim)
    selected = kt.select_topk(r2["train"], 4)
    fit = kt.fit_ridge(calib.train, selected, heldout=calib.heldout, head_dim=head_dim)
    return {"calib": calib, "fit": fit, "selected": selected, "r2": r2, "seconds": seconds,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}


def check_tiny(device: str, n_sequences: int) -> dict:
    prec = _load("results/precision/make.py")
    ref = tiny_calibrate_fit("cpu", n_sequences)
    run = tiny_calibrate_fit(device, n_sequences)
    rel = max(float((run["calib"].train.stats[k][s].double() - ref["calib"].train.stats[k][s].double()).abs().max()
                    / ref["calib"].train.stats[k][s].double().abs().max()) for k in ("k", "v") for s in ("cxx", "cxy"))
    cr = prec._condition_and_rho(run["calib"], ref["calib"], run["fit"], ref["fit"], ref["selected"], DEFAULT_LAMBDA)
    out = {"device": device, "n_sequences": n_sequences, "moments_rel_diff": rel, "cond": cr,
           "same_selection": run["selected"] == ref["selected"], "seconds": {"cpu": ref["seconds"], device: run["seconds"]},
           "peak_gpu_bytes": run["peak_gpu_bytes"]}
    ok = out["same_selection"]
    for k in ("k", "v"):
        a, b = float(run["fit"].r2["heldout"][k].double().mean()), float(ref["fit"].r2["heldout"][k].double().mean())
        r2_min = float(ref["fit"].r2["heldout"][k].double().min())
        tol = 2 * math.sqrt(max(0.0, 1 - r2_min) * cr[k]["rho_max"]) + cr[k]["rho_max"]
        out[f"heldout_r2_{k}"] = {"cpu": b, device: a, "diff": abs(a - b), "tolerance": tol}
        ok = ok and abs(a - b) <= tol
    # the features themselves come from float32 forwards on two devices: a few hundred eps32 of the entries' scale
    # (tests/tolerance.py FORWARD's first-order model over these 4 / 8 layers), then float32 sums per flush
    out["moments_bound"] = 1024 * torch.finfo(torch.float32).eps
    ok = ok and rel <= out["moments_bound"]
    out["ok"] = ok
    plan = _plan_at_tiny_shapes(device, n_sequences)
    out["plan"] = plan
    return out


def _plan_at_tiny_shapes(device: str, n_sequences: int) -> dict | None:
    """The plan's calibrate figures for the same tiny calibration on this machine (None without Hydra: the device
    image has none; the plan is then made here, on the development machine, from the same command)."""
    try:
        from kvtransfer import plan as P
        from kvtransfer.plan.cli import compose_config
    except ImportError:
        return None
    try:
        cfg = compose_config([f"calib.n_sequences={n_sequences}", f"device={'cuda' if device == 'cuda' else 'cpu'}",
                              "stage=calibrate"])
    except Exception as err:   # noqa: BLE001 -- Hydra absent on the device image
        return {"error": f"{type(err).__name__}: {err}"}
    plan = P.make_plan(cfg, P.detect_node(cfg), local=True, stages=["calibrate"])
    st = plan["stages"]["calibrate"]
    return {k: st[k] for k in ("gpu_gib", "host_gib", "disk_gib", "seconds")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU only: the bench at 16/32 tokens, the tiny check CPU vs CPU")
    ap.add_argument("--bench-budget-s", type=float, default=240)
    ap.add_argument("--tiny-sequences", type=int, default=160)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    bench_args = ["--out", str(out / "bench"), "--pairs", "qwen3_14b_32b,qwen3_8b_32b", "--budget-s",
                  str(a.bench_budget_s)] + (["--smoke"] if a.smoke else ["--repeats", "5", "--warmup", "2",
                                                                         "--tokens", "1024,4096,8192,16384,32768"])
    try:
        _load("experiments/gpu_bench.py").main(bench_args)
        result["bench"] = json.loads((out / "bench" / "bench.json").read_text()) if (out / "bench" / "bench.json").exists() \
            else sorted(p.name for p in (out / "bench").iterdir())
    except Exception as err:   # noqa: BLE001 -- record and go on to the second check
        result["bench_error"] = f"{type(err).__name__}: {err}"
    result["bench_seconds"] = round(time.time() - t0, 1)
    if device == "cuda":
        torch.cuda.empty_cache()
    t1 = time.time()
    result["tiny"] = check_tiny(device, 48 if a.smoke else a.tiny_sequences)
    result["tiny_seconds"] = round(time.time() - t1, 1)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "bench"}, indent=1, default=str))
    return 0 if result["tiny"]["ok"] and "bench_error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
