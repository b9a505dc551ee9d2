"""The GPU check: what a user runs, on one GPU, each part judged against a bound derived from its dtype and its
computation, in one table (aimed at 5 minutes on one H200; reaches no hub: models, data and configs are the
repository's, the hub variables are set offline).

    python experiments/gpu_check.py --out results/gpu/<date>                # on the GPU node: every part
    python experiments/gpu_check.py --parts tiny,bench --out /tmp/gpu_check  # a subset
    python experiments/gpu_check.py --smoke --out /tmp/gpu_check            # every part on this CPU at tiny sizes

Parts (the four runs start together as subprocesses; paged and device_map run beside them; bench and calib time
the device alone, after the runs):
  tiny        `python run.py device=cuda eval.map_dtype=float32`, the default run on models/tiny with the map applied
              in float32 as results/tiny's was (on CUDA the default applies it in bfloat16), against its per-item and
              per-window scores: a window's NLL within two float32 forwards' rounding (tests/tolerance.py FORWARD)
              plus, in mapped modes, 2 phi of its log-gap to the target (results/precision: phi from the moments'
              perturbation, this device's calibration against a CPU calibration made as results/tiny's was); a
              multiple-choice item may change its answer only where its gold margin is within the same bounds.
              Generative scores (completion F1, CoQA) are reported, not held: greedy ties are not recorded.
              Also the held-out R² within its bound and the same selected layers.
  mlp         `python run.py mapper=mlp` (its fit, then transfer and its controls) finishes
  trained     `python run.py mapper=trained` finishes
  dryrun      `python run.py pair=qwen3_14b_32b dry_run=true dry.device=cuda` against an offline hub built from the
              repository's samples (tests/offline_hub.py): every stage on stand-ins of the real architecture
  paged       the connector's GPU paged layouts (FLASH_ATTN / FLASHINFER / TRITON_ATTN, kvtransfer/serve/paged.py)
              in NHD, HND and block-outer orders, bf16 / fp16 / fp32, at Qwen3-32B's KV shape: scatter and gather
              of device tensors round trip exactly and land where FlashAttention's own view puts them; no vLLM
  device_map  the tiny target spread by a device_map (over two GPUs, or with one GPU over the GPU and the host,
              which accelerate runs on the GPU): each layer's mapped cache lands where that layer reads it
              (place_on_layers) and the continuation's NLL equals the whole model's within rounding
  bench       experiments/gpu_bench.py at Qwen3 14B -> 32B shapes (random weights): the map in float32 and in
              bfloat16 against the target's prefill, 1K-32K tokens
  calib       calibration throughput at Qwen3 14B -> 32B widths (a few layers): collect_moments as the run
              calls it, against the forwards alone and against the resource plan's estimate

--smoke runs every part on the CPU at tiny sizes (CI). Writes <out>/gpu_check.json after every part (atomically)
and <out>/gpu_check.md (the table); exits 1 when a part failed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtransfer.core.io import atomic_write_bytes, atomic_write_json  # noqa: E402

RUN_PARTS = ("tiny", "mlp", "trained", "dryrun")     # subprocesses, started together
BESIDE = ("paged", "device_map")                     # in this process while the runs run
TIMED = ("bench", "calib")                           # alone on the device, after the runs
PARTS = RUN_PARTS + BESIDE + TIMED
PAIR = "qwen3_14b_32b"                                # the paper pair the dry run, the bench and calib use
TINY = ROOT / "models" / "tiny"
COMMITTED = ROOT / "results" / "tiny"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_MODE": "disabled"}


def _load(rel: str):
    """A module of this repository by path (experiments and tests are not packages)."""
    name = f"_gpu_check_{Path(rel).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / rel)
        sys.modules[name] = importlib.util.module_from_spec(spec)   # dataclasses look their module up there
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


class Check:
    """One invocation: device, sizes, where it writes, and the parts' records (written after each part)."""

    def __init__(self, out: Path, device: str, smoke: bool, parts: list[str], bench_budget_s: float):
        self.out, self.device, self.smoke, self.parts = out, device, smoke, parts
        self.bench_budget_s = bench_budget_s
        self.record = {"device": device, "smoke": smoke, "parts_requested": parts, "parts": {},
                       "machine": machine(device)}
        self.procs: dict[str, tuple] = {}
        self.reference = None   # the tiny part's CPU reference calibration (a Future), computed beside the runs
        # one thread per run where the CPU is shared (OpenMP spin-waits cost a tiny model 10x); a few on a GPU node
        threads = "1" if smoke else str(max(1, min(4, (os.cpu_count() or 4) // 4)))
        self.env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}

    def write(self) -> None:
        atomic_write_json(self.out / "gpu_check.json", self.record)

    def done(self, part: str, started: float, status: str, key: dict, details: dict | None = None,
             error: str | None = None) -> None:
        """Record one part and rewrite the JSON."""
        rec = {"status": status, "seconds": round(time.time() - started, 1), "key": key, "details": details or {}}
        if error:
            rec["error"] = error
        self.record["parts"][part] = rec
        self.write()
        print(f"[gpu_check] {part}: {status} in {rec['seconds']:.0f} s {json.dumps(key, default=str)}"
              + (f"\n{error}" if error else ""), flush=True)

    # ------------------------------------------------------------------ runs (`python run.py ...`)
    def start(self, part: str, overrides: list[str], env: dict | None = None) -> None:
        """Start `python run.py <overrides>` for `part`, its output in <out>/<part>/run/ and its log beside."""
        where = self.out / part
        where.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(ROOT / "run.py"), *overrides, "progress=false", f"hydra.run.dir={where / 'run'}"]
        log = open(where / "run.log", "w")
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        self.procs[part] = (proc, log, time.time(), cmd)

    def wait(self, part: str) -> tuple[int, Path, float]:
        """(exit code, the run's out_dir, start time) once `part`'s run has ended."""
        proc, log, started, _ = self.procs[part]
        rc = proc.wait()
        log.close()
        return rc, self.out / part / "run", started

    def tail(self, part: str, n: int = 3000) -> str:
        return (self.out / part / "run.log").read_text(errors="replace")[-n:]


def machine(device: str) -> dict:
    """The machine and the code: GPU, torch, CUDA, CPU, and the commit (with whether the tree was clean)."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "cpu_count": os.cpu_count(), "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    try:
        import transformers

        out["transformers"] = transformers.__version__
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip() or None
        out["clean"] = not subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                          text=True).stdout.strip()
    except Exception as err:  # noqa: BLE001 -- provenance is recorded where it can be read
        out["provenance_error"] = str(err)
    return out


# ---------------------------------------------------------------------------------------------------- tiny
def tiny_overrides(device: str, smoke: bool) -> list[str]:
    """The default run as typed on `device`; on --smoke the evaluation is cut to what a CPU does in a minute. The
    calibration, the map and the perplexity windows stay results/tiny's, so every score left is comparable."""
    # the map in float32, as results/tiny applied it (the CUDA default `auto` is bfloat16: the bounds below are
    # float32 forwards'; the bench part times both map dtypes)
    base = [f"device={device}", "eval.map_dtype=float32", f"cache_dir={{out}}/tiny/artifacts"]
    if not smoke:
        return base
    return base + ["eval.tasks=[tiny_cloze]", "eval.limit=8", "eval.ppl.prefixes=[0,256]", "eval.coqa.enabled=false",
                   "eval.controls=[random_map]", "eval.fidelity.sequences=1", "eval.time_contexts=false",
                   "report.rotated_heatmap=false", "bench.tokens=[64]", "bench.repeats=2", "bench.warmup=1",
                   "eval.bootstrap=50"]


def forward_bounds() -> dict:
    """Per-token NLL rounding of one float32 path (tests/tolerance.py: eps x forward_factor x ~log(vocab)): the
    source's forward then the target's over a perplexity window (max prefix + continuation + the start token)."""
    from transformers import AutoConfig

    tol = _load("tests/tolerance.py")
    cfg = json.loads((COMMITTED / "config.json").read_text())
    seq = max(cfg["eval"]["ppl"]["prefixes"]) + cfg["eval"]["ppl"]["continuation"] + 1
    factor = sum(tol.forward_factor(AutoConfig.from_pretrained(TINY / name), seq)
                 for name in ("qwen3-tiny-1m", "qwen3-tiny-7m"))
    per_token = tol.eps(torch.float32) * factor * 8
    return {"forward_factor": factor, "positions": seq, "per_token_nll": per_token, "reason": tol.FORWARD}


def reference_calibration(executor) -> "Future":
    """A Future of (calibration, head_dim, seconds): the tiny pair calibrated on the CPU as results/tiny's was (its
    config.json's calib settings). Independent of the run, so it computes beside it on `executor`; the models load
    here, in the calling thread (model loading patches module construction process-wide: one thread at a time)."""
    import kvtransfer as kt
    from kvtransfer.core.data import read_documents, token_sequences

    committed = json.loads((COMMITTED / "config.json").read_text())
    c = committed["calib"]
    src, tok = kt.load_model(str(ROOT / committed["pair"]["source"]["path"]), dtype="float32", device="cpu")
    tgt, _ = kt.load_model(str(ROOT / committed["pair"]["target"]["path"]), dtype="float32", device="cpu")
    ids = token_sequences(read_documents([str(ROOT / f) for f in c["files"]]), tok, c["n_sequences"], c["seq_len"],
                          context_start=c["context_start"])

    def compute():
        t0 = time.time()
        ref = kt.collect_moments(src, tgt, ids, stride=c["stride"], batch_size=c["batch_size"],
                                 heldout_fraction=c["heldout_fraction"], heldout_observations=c["heldout_observations"],
                                 accumulate=c["accumulate"], flush_batches=c.get("flush_batches") or 8,
                                 seed=committed["seed"])
        return ref, kt.kv_shape(tgt).head_dim, round(time.time() - t0, 1)
    return executor.submit(compute)


def reference_perturbation(run_cfg: dict, out_dir: Path, reference: tuple) -> dict:
    """phi and the R² bound of the run's map against the CPU `reference` calibration (results/precision/make.py's
    derivation): the run's moments and map are read from its cache."""
    import kvtransfer as kt
    from kvtransfer.runner.run import Run

    prec = _load("results/precision/make.py")
    committed = json.loads((COMMITTED / "config.json").read_text())
    lam = committed["mapper"]["lam"]
    ref, head_dim, seconds = reference
    run = Run(run_cfg, out_dir)   # reads the run's cached moments and map
    moments, _, _ = run.moments()
    selected = run.mapper().selected_layers.tolist()
    ref_fit = kt.fit_ridge(ref.train, selected, heldout=ref.heldout, head_dim=head_dim, lam=lam)
    cr = prec._condition_and_rho(SimpleNamespace(train=moments), ref, None, ref_fit, selected, lam)
    r2_min = min(float(ref_fit.r2["heldout"][k].double().min()) for k in ("k", "v"))
    rho = max(cr[k]["rho_max"] for k in ("k", "v"))
    phi = math.sqrt(rho / max(1e-12, 1 - r2_min))
    tol_r2 = {k: 2 * math.sqrt(max(0.0, 1 - float(ref_fit.r2["heldout"][k].double().min())) * cr[k]["rho_max"])
              + cr[k]["rho_max"] for k in ("k", "v")}
    # this CPU's reference and the CPU that made results/tiny differ by rounding of the same kind, taken here as
    # no larger than this device's against this CPU: phi doubles
    return {"rho": rho, "phi": 2 * phi, "cond": cr, "r2_tolerance": tol_r2, "reference_seconds": seconds,
            "reference_accumulate": committed["calib"]["accumulate"],
            "run_accumulate": run_cfg["calib"]["accumulate"]}


def _eval_records(run_cfg: dict, out_dir: Path, task: str, mode: str) -> list[dict]:
    """The run's per-item records of `task` in `mode` (its eval artifact: doc id, score, gold margin)."""
    from kvtransfer.runner.eval_stage import is_baseline, result_dirs
    from kvtransfer.runner.run import Run

    dirs = result_dirs(Run(run_cfg, out_dir), "tasks")
    kind = "native" if mode == "native_injected" else "baseline" if is_baseline(mode) else "mapped"
    return json.loads((dirs[kind] / f"{mode}.task.{task}.json").read_text()).get("items") or []


MAPPED = ("transfer", "transfer_wrong", "mean_map", "random_map")


def compare_windows(run_nll: dict, ref_nll: dict, *, per_token: float, phi: float) -> dict:
    """Per mode and prefix, the windows' NLL (run vs committed) against 2 x per_token (two float32 paths) plus, for a
    mapped mode, 2 phi x |its committed log-gap to the target| (results/precision). {mode@P: {max_ratio, windows}}."""
    out = {}
    for p, modes in run_nll.items():
        if p not in ref_nll:
            continue
        for mode, values in modes.items():
            if mode not in ref_nll[p]:
                continue
            ref, target = ref_nll[p][mode], ref_nll[p]["target"]
            if len(values) != len(ref):
                raise ValueError(f"{mode} at P = {p}: {len(values)} windows here, {len(ref)} committed: not the same "
                                 "draw (eval.ppl.windows / continuation / prefixes differ from results/tiny)")
            worst = 0.0
            for got, want, tgt in zip(values, ref, target):
                allowed = 2 * per_token + (2 * phi * abs(want - tgt) if mode in MAPPED else 0.0)
                worst = max(worst, abs(got - want) / allowed)
            out[f"{mode}@{p}"] = {"max_ratio": worst, "windows": len(values)}
    return out


def compare_items(records: dict, committed: dict, *, per_token: float, phi: float) -> dict:
    """Per mode of a multiple-choice task: items whose answer differs from results/tiny's, and those of them whose gold
    margin here is beyond the rounding bound (2 choices x 2 paths x per_token: acc_norm divides a choice's summed
    log-prob by its characters, at least its tokens) plus, mapped, 2 phi x |margin - the target's margin|."""
    out = {}
    target = {r["doc_id"]: r["margin"] for r in records.get("target", [])}
    for mode, recs in records.items():
        ref = committed.get(mode)
        if ref is None:
            continue
        changed = beyond = 0
        for r in recs:
            if r["score"] == ref[r["doc_id"]]:
                continue
            changed += 1
            allowed = 4 * per_token + (2 * phi * abs(r["margin"] - target.get(r["doc_id"], r["margin"]))
                                       if mode in MAPPED else 0.0)
            if not abs(r["margin"]) <= allowed:  # NaN margins (no rival choice) count as beyond
                beyond += 1
        out[mode] = {"items": len(recs), "changed": changed, "changed_beyond_bound": beyond}
    return out


def finish_tiny(ck: Check) -> None:
    rc, out_dir, started = ck.wait("tiny")
    if rc != 0:
        return ck.done("tiny", started, "error", {"exit": rc}, error=ck.tail("tiny"))
    run_cfg = json.loads((out_dir / "config.json").read_text())
    scores = json.loads((out_dir / "scores.json").read_text())
    summary = json.loads((out_dir / "summary.json").read_text())
    ref_scores = json.loads((COMMITTED / "scores.json").read_text())
    ref_summary = json.loads((COMMITTED / "summary.json").read_text())
    fb = forward_bounds()
    pert = reference_perturbation(run_cfg, out_dir, ck.reference.result())
    windows = compare_windows(scores["ppl_window_nll"], ref_scores["ppl_window_nll"], per_token=fb["per_token_nll"],
                              phi=pert["phi"])
    items = {}
    for task, modes in scores["tasks"].items():
        if task == "tiny_completion":
            continue
        records = {mode: _eval_records(run_cfg, out_dir, task, mode) for mode in modes}
        items[task] = compare_items(records, ref_scores["tasks"][task], per_token=fb["per_token_nll"], phi=pert["phi"])
    generative = {}
    for task in ("tiny_completion",):
        for mode, values in (scores["tasks"].get(task) or {}).items():
            ref = ref_scores["tasks"][task][mode][:len(values)]
            generative[f"{task}/{mode}"] = {"mean": sum(values) / len(values), "committed_mean": sum(ref) / len(ref)}
    for protocol, modes in (scores.get("coqa") or {}).items():   # per conversation and turn, as results/tiny
        for mode, values in modes.items():
            ref = ((ref_scores.get("coqa") or {}).get(protocol) or {}).get(mode)
            flat = [x for conv in values for x in (conv if isinstance(conv, list) else [conv])]
            flat_ref = [x for conv in ref or [] for x in (conv if isinstance(conv, list) else [conv])]
            if flat and flat_ref:   # turns of every conversation
                generative[f"coqa.{protocol}/{mode}"] = {"mean": sum(flat) / len(flat),
                                                         "committed_mean": sum(flat_ref) / len(flat_ref)}
    r2 = {k: {"run": summary["r2"][k]["heldout"], "committed": ref_summary["r2"][k]["heldout"],
              "tolerance": pert["r2_tolerance"][k]} for k in ("k", "v")}
    same_layers = summary["mapper"]["selected_layers"] == ref_summary["mapper"]["selected_layers"]
    worst = max((w["max_ratio"] for w in windows.values()), default=0.0)
    beyond = sum(m["changed_beyond_bound"] for t in items.values() for m in t.values())
    changed = sum(m["changed"] for t in items.values() for m in t.values())
    r2_ok = all(abs(v["run"] - v["committed"]) <= v["tolerance"] for v in r2.values())
    ok = worst <= 1 and beyond == 0 and r2_ok and same_layers and bool(windows)
    ppl = {r["prefix"]: r for r in summary["ppl"]}
    top = max(ppl) if ppl else None
    cloze = summary["tasks"].get("tiny_cloze", {})
    key = {"window_ratio_max": round(worst, 4), "items_changed": changed, "items_beyond_bound": beyond,
           "phi": f"{pert['phi']:.1e}", "cloze": [cloze.get(m) for m in ("target", "transfer", "no_context")],
           f"ppl@{top}": [round(ppl[top][m], 2) for m in ("target", "transfer", "no_context")] if top else None}
    ck.done("tiny", started, "ok" if ok else "failed", key, {
        "windows": windows, "items": items, "generative_not_held": generative, "heldout_r2": r2,
        "same_selected_layers": same_layers, "forward_bound": fb, "perturbation": pert,
        "tasks": summary["tasks"], "ppl": summary["ppl"]})


# ---------------------------------------------------------------------------------------------------- mlp / trained
def map_overrides(kind: str, device: str, smoke: bool) -> list[str]:
    """mapper=<kind> on `device`, scoring transfer and its controls (the baselines are the tiny part's), sharing the
    tiny part's cache (one calibration); on --smoke with a one-epoch / four-step fit and a few items."""
    out = [f"device={device}", f"mapper={kind}", "stage=[calibrate,fit,eval]", "eval.modes=[transfer]",
           "cache_dir={out}/tiny/artifacts", "eval.coqa.enabled=false"]
    if smoke:
        out += ["eval.tasks=[tiny_cloze]", "eval.limit=4", "eval.ppl.prefixes=[0,32]", "eval.ppl.windows=2",
                "eval.fidelity.sequences=1", "eval.time_contexts=false", "eval.bootstrap=20",
                "eval.controls=[random_map]"]
        out += (["mapper.epochs=1", "mapper.hidden=16"] if kind == "mlp" else
                ["mapper.steps=4", "mapper.eval_every=2", "mapper.train_sequences=4", "mapper.stop_sequences=2"])
    return out


def finish_map(ck: Check, part: str) -> None:
    rc, out_dir, started = ck.wait(part)
    if rc != 0:
        return ck.done(part, started, "error", {"exit": rc}, error=ck.tail(part))
    summary = json.loads((out_dir / "summary.json").read_text())
    scores = json.loads((out_dir / "scores.json").read_text())
    # a run of the mapped modes alone has no task rows (they need the baselines): its per-item scores are read
    tasks = {f"{t}/{m}": sum(v) / len(v) for t, modes in scores["tasks"].items() for m, v in modes.items() if v}
    ppl = {f"{r['prefix']}/{m}": r[m] for r in summary["ppl"] for m in r
           if m not in ("prefix", "set", "windows", "documents") and isinstance(r[m], (int, float))}
    values = list(tasks.values()) + list(ppl.values())
    ok = bool(tasks) and bool(ppl) and all(math.isfinite(v) for v in values) and "transfer" in {
        k.split("/")[1] for k in tasks}
    r2 = [((summary.get("r2") or {}).get(k) or {}).get("heldout") for k in ("k", "v")]   # None for the MLP
    key = {"kind": summary["mapper"]["kind"], "r2_heldout": [None if v is None else round(v, 4) for v in r2],
           **{k: round(v, 3) for k, v in tasks.items()}, **{f"ppl@{k}": round(v, 2) for k, v in ppl.items()}}
    ck.done(part, started, "ok" if ok else "failed", key, {"warnings": summary.get("warnings"), "ppl": summary["ppl"]})


# ---------------------------------------------------------------------------------------------------- dry run
def start_dryrun(ck: Check) -> None:
    hub = ck.out / "dryrun" / "hf_home"
    hub.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tests"))
    offline_hub = _load("tests/offline_hub.py")
    offline_hub.build_offline_hub(hub)
    overrides = [f"pair={PAIR}", "dry_run=true", f"dry.device={ck.device}", "dry.eval_limit=1",
                 f"cache_dir={ck.out / 'dryrun' / 'artifacts'}", "report.rotated_heatmap=false"]
    # --smoke: one task, no perplexity or CoQA, one source layer per target layer (a third of the calibration), and
    # the plan of the node a user books (this CPU's plan would make the dry run rehearse the sequential capture the
    # real run needs here, which is slower and not what the node runs)
    overrides += (["eval.tasks=[hellaswag]", "eval.coqa.enabled=false", "eval.ppl.enabled=false", "eval.controls=[]",
                   "stage=[calibrate,fit,eval]", "dry.node=dgx-h200", "pair.k=1"] if ck.smoke
                  else ["eval.tasks=[arc_challenge,hellaswag,winogrande]"])
    ck.start("dryrun", overrides, env=offline_hub.offline_env(hub))


def finish_dryrun(ck: Check) -> None:
    rc, out_dir, started = ck.wait("dryrun")
    if rc != 0:
        return ck.done("dryrun", started, "error", {"exit": rc}, error=ck.tail("dryrun"))
    record = json.loads((out_dir / "dry_run.json").read_text())
    summary = json.loads((out_dir / "summary.json").read_text())
    ok = all((row.get("transfer") is not None) for row in summary["tasks"].values()) and bool(summary["tasks"])
    ck.done("dryrun", started, "ok" if ok else "failed",
            {"pair": PAIR, "stages": summary["stages"], "tasks": sorted(summary["tasks"]),
             "dry_run_seconds": record["seconds"]}, {"standin_check": record.get("standin_check")})


# ---------------------------------------------------------------------------------------------------- paged
def check_paged(ck: Check) -> tuple[str, dict, dict]:
    """Every GPU paged layout, in each physical order vLLM allocates, round trips device tensors exactly and puts
    them where FlashAttention's own view (`kv_cache.transpose(1, 2).split(head_size, -1)`) reads them."""
    from kvtransfer.serve import paged

    dev = torch.device(ck.device)
    n_kv, d, bs = (2, 8, 4) if ck.smoke else (8, 128, 16)      # Qwen3-32B: 8 KV heads of 128, vLLM's block of 16
    n_tok, n_blocks, n_layers = (37, 16, 2) if ck.smoke else (8191, 1024, 2)
    g = torch.Generator().manual_seed(0)  # device: seeded CPU draw, moved to the device
    order = torch.randperm(n_blocks, generator=g)   # a request's blocks scattered over the cache
    need = -(-(n_tok + 1) // bs)
    block_ids = order[:need].to(dev)
    slots = paged.slot_mapping(block_ids, bs, 1, n_tok + 1)        # tokens 1..n_tok: a partial first block
    rows, seconds = [], 0.0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        keys = torch.randn(n_kv, n_tok, d, generator=g).to(dev, dtype)   # device: seeded CPU draw, moved
        values = torch.randn(n_kv, n_tok, d, generator=g).to(dev, dtype)  # device: seeded CPU draw, moved
        for physical in ("NHD", "HND", "block_outer"):
            for backend in paged.KV_SPLIT_BACKENDS:
                layout = paged.select_layout(backend)
                buf, view = _paged_buffer(physical, n_blocks, n_kv, bs, 2 * d, n_layers, dtype, dev)
                ref_buf, ref_view = _paged_buffer(physical, n_blocks, n_kv, bs, 2 * d, n_layers, dtype, dev)
                if ck.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                layout.scatter(view, keys, values, slots)
                if ck.device == "cuda":
                    torch.cuda.synchronize()
                seconds += time.perf_counter() - t0
                key_cache, value_cache = ref_view.transpose(1, 2).split(d, dim=-1)   # FlashAttention's view
                key_cache[slots // bs, slots % bs] = keys.transpose(0, 1)
                value_cache[slots // bs, slots % bs] = values.transpose(0, 1)
                k, v = layout.gather(view, slots)
                layout.check(view, n_kv, d, dtype)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "physical": physical, "backend": backend,
                             "same_bytes_as_flash_view": bool(torch.equal(buf, ref_buf)),
                             "round_trip": bool(torch.equal(k, keys.cpu()) and torch.equal(v, values.cpu())),
                             "device": str(view.device)})
    ok = all(r["same_bytes_as_flash_view"] and r["round_trip"] and r["device"].startswith(ck.device) for r in rows)
    moved = 2 * n_kv * n_tok * d * sum(2 if r["dtype"] != "float32" else 4 for r in rows)
    key = {"layouts": len(rows), "all_exact": ok, "shape": f"{n_kv}x{d}, block {bs}, {n_tok} tokens",
           "scatter_GB_per_s": round(moved / max(seconds, 1e-9) / 1e9, 2)}
    return ("ok" if ok else "failed"), key, {"rows": rows}


def _paged_buffer(physical: str, n_blocks: int, n_kv: int, bs: int, c: int, n_layers: int, dtype, dev):
    """(raw buffer, layer 1's logical [blocks, n_kv, block, 2d] view) as vLLM allocates one physical order."""
    if physical == "NHD":             # [layers, blocks, block, heads, 2d] in memory
        buf = torch.zeros(n_layers, n_blocks, bs, n_kv, c, dtype=dtype, device=dev)
        return buf, buf[1].permute(0, 2, 1, 3)
    if physical == "HND":             # [layers, blocks, heads, block, 2d]
        buf = torch.zeros(n_layers, n_blocks, n_kv, bs, c, dtype=dtype, device=dev)
        return buf, buf[1]
    buf = torch.zeros(n_blocks, n_layers, n_kv, bs, c, dtype=dtype, device=dev)   # block-outer
    return buf, buf[:, 1]


# ---------------------------------------------------------------------------------------------------- device_map
def check_device_map(ck: Check) -> tuple[str, dict, dict]:
    """The tiny target spread by a device_map against the same model whole: layer devices, where the mapped cache
    lands (place_on_layers), and the continuation's NLL after a mapped prefix."""
    import kvtransfer as kt
    from kvtransfer.core.cache import continuation_logprobs, forward_on_cache
    from kvtransfer.core.data import read_documents, token_sequences
    from kvtransfer.core.models import layer_devices

    tol = _load("tests/tolerance.py")
    dev = ck.device
    src, tok = kt.load_model(str(TINY / "qwen3-tiny-1m"), dtype="float32", device=dev)
    whole, _ = kt.load_model(str(TINY / "qwen3-tiny-7m"), dtype="float32", device=dev)
    n_layers = whole.config.num_hidden_layers
    if dev == "cuda":
        second = 1 if torch.cuda.device_count() > 1 else "cpu"   # one GPU: the host, run on the GPU by accelerate
        spread_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0,
                      **{f"model.layers.{i}": (0 if i < n_layers // 2 else second) for i in range(n_layers)}}
    else:
        second, spread_map = "cpu", "auto"                          # the CPU: one device, the loader's path
    spread, _ = kt.load_model(str(TINY / "qwen3-tiny-7m"), dtype="float32", device_map=spread_map)
    docs = read_documents([str(ROOT / "data/tiny/heldout.jsonl")])
    ids = token_sequences(docs, tok, 4 if ck.smoke else 16, 96).to(dev)
    calib = kt.collect_moments(src, whole, token_sequences(read_documents([str(ROOT / "data/tiny/calib.jsonl")]), tok,
                                                           24 if ck.smoke else 64, 128),
                               stride=2, batch_size=8, heldout_fraction=0.1, accumulate="twolevel")
    head_dim = kt.kv_shape(whole).head_dim
    sel = kt.select_topk(kt.r2_matrix(calib.train, heldout=calib.heldout, head_dim=head_dim)["train"], 2)
    fit = kt.fit_ridge(calib.train, sel, heldout=calib.heldout, head_dim=head_dim)
    mapper = kt.Mapper.from_ridge(fit, src, whole, calibration=calib.train.info).to(dev)
    prefix, cont = ids[:, :64], ids[:, 64:]
    src_cache = kt.prefill(src, prefix)
    devices = layer_devices(spread)
    placed = kt.transfer(src_cache, mapper, src, spread, as_layers=True)
    landed = [str(k.device) for k, _ in placed]
    nll = {}
    for name, model in (("whole", whole), ("spread", spread)):
        layers = kt.transfer(src_cache, mapper, src, model, as_layers=True)
        logits = forward_on_cache(model, layers, None, cont[:, :-1].to(model.device))
        nll[name] = -continuation_logprobs(logits, cont[:, 1:].to(logits.device)).mean(-1).cpu()
    factor = tol.forward_factor(whole, 96)
    allowed = tol.eps(torch.float32) * factor * 8
    diff = float((nll["spread"] - nll["whole"]).abs().max())
    ok = landed == [str(d) for d in devices] and diff <= allowed
    key = {"second_device": str(second), "layer_devices": sorted({str(d) for d in devices}),
           "nll_max_diff": f"{diff:.1e}", "bound": f"{allowed:.1e}"}
    return ("ok" if ok else "failed"), key, {"layer_devices": [str(d) for d in devices], "landed": landed,
                                             "device_map": spread_map if isinstance(spread_map, str) else
                                             {k: str(v) for k, v in spread_map.items()}, "reason": tol.FORWARD}


# ---------------------------------------------------------------------------------------------------- bench / calib
def check_bench(ck: Check) -> tuple[str, dict, dict]:
    """experiments/gpu_bench.py at the paper pair's shapes: the map in float32 and bfloat16, and the prefill."""
    out = ck.out / "bench"
    args = ["--out", str(out), "--pairs", PAIR, "--mapper-dtypes", "float32,bfloat16",
            "--budget-s", str(ck.bench_budget_s)]
    args += ["--smoke"] if ck.smoke else ["--repeats", "3", "--warmup", "1", "--tokens", "1024,8192,32768"]
    _load("experiments/gpu_bench.py").main(args)
    rows = json.loads((out / "bench.json").read_text())["rows"]
    timed = [r for r in rows if "speedup" in r]
    ok = bool(timed) and {r["mapper_dtype"] for r in timed} == {"float32", "bfloat16"} and all(
        r["speedup"] > 0 and math.isfinite(r["speedup"]) for r in timed)
    key = {f"{r['mapper_dtype']}@{r['tokens']}": round(r["speedup"], 1) for r in timed}
    key["layers_run"] = sorted({r["layers_run"] for r in rows})
    skipped = [f"{r['mapper_dtype']}@{r['tokens']}: {r['skipped']}" for r in rows if r.get("skipped")]
    return ("ok" if ok else "failed"), key, {"rows": rows, "skipped": skipped}


def check_calib(ck: Check) -> tuple[str, dict, dict]:
    """collect_moments as a run calls it (two-level moments, float64 masters on the host) at the pair's real widths
    and depth cut to a few layers; tokens/s against the two forwards alone and against the plan's estimate."""
    import kvtransfer as kt
    from kvtransfer import bench
    from kvtransfer.bench import timing

    if ck.smoke:   # the tiny family: the same code path at sizes a CPU runs in seconds
        layers, seq, batch, n_seq, dtype, pair = None, 128, 8, 40, torch.float32, "tiny"
        src, _ = kt.load_model(str(TINY / "qwen3-tiny-1m"), dtype="float32", device="cpu")
        tgt, _ = kt.load_model(str(TINY / "qwen3-tiny-7m"), dtype="float32", device="cpu")
    else:          # the paper pair's real widths, cut to a few layers (random weights)
        layers, seq, batch, n_seq, dtype, pair = 4, 1024, 4, 36, torch.bfloat16, PAIR
        src_name, tgt_name, _ = bench.PAIRS[PAIR]
        src = bench.build_shapes_only(bench.real_config(src_name, layers), device=ck.device, dtype=dtype, seed=1)
        tgt = bench.build_shapes_only(bench.real_config(tgt_name, layers), device=ck.device, dtype=dtype, seed=2)
    g = torch.Generator().manual_seed(0)  # device: seeded CPU ids (collect_moments moves each batch to its model)
    ids = torch.randint(1, min(src.config.vocab_size, tgt.config.vocab_size), (n_seq, seq), generator=g)
    sync = (lambda: torch.cuda.synchronize()) if ck.device == "cuda" else (lambda: None)
    kw = dict(stride=4, batch_size=batch, heldout_fraction=0.1, heldout_observations=2048, accumulate="twolevel",
              flush_batches=8)
    kt.collect_moments(src, tgt, ids[: 2 * batch + 2], **kw)   # warm-up: kernels, allocator
    sync()
    t0 = time.perf_counter()
    kt.collect_moments(src, tgt, ids, **kw)
    sync()
    seconds = time.perf_counter() - t0
    fwd = timing.time_fn(lambda i: (kt.prefill(src, i), kt.prefill(tgt, i)), [ids[:batch].to(ck.device)],
                         warmup=1, repeats=3, device=ck.device)
    tokens_per_s = n_seq * seq / seconds
    forward_tokens_per_s = batch * seq / (fwd["median_ms"] / 1e3)
    plan = _plan_calibrate(ck, pair, seq, n_seq, batch, src, tgt)
    key = {"pair": pair, "layers": layers or "all", "tokens_per_s": round(tokens_per_s), "forward_tokens_per_s": round(forward_tokens_per_s),
           "moments_overhead_pct": round(100 * (forward_tokens_per_s / tokens_per_s - 1), 1),
           "plan_seconds": plan.get("seconds"), "measured_seconds": round(seconds, 2)}
    ok = tokens_per_s > 0 and math.isfinite(tokens_per_s)
    return ("ok" if ok else "failed"), key, {"plan": plan, "dtype": str(dtype), "seq": seq, "batch": batch,
                                             "sequences": n_seq}


def _plan_calibrate(ck: Check, pair: str, seq: int, n_seq: int, batch: int, src, tgt) -> dict:
    """The resource plan's calibrate estimate for the same shapes and sequences on this machine ({} without Hydra)."""
    try:
        from kvtransfer import plan as P
        from kvtransfer.plan.cli import compose_config
    except ImportError as err:
        return {"error": str(err)}
    try:
        cfg = compose_config([f"pair={pair}", f"calib.n_sequences={n_seq}", f"calib.seq_len={seq}", "calib.stride=4",
                              f"calib.batch_size={batch}",
                              f"device={ck.device}", "stage=calibrate", "calib.mlp_samples=0"])
        shapes = (P.shape_from_config(src.config, "source"), P.shape_from_config(tgt.config, "target"))
        plan = P.make_plan(cfg, P.detect_node(cfg), shapes=shapes, local=True, stages=["calibrate"], knobs=False)
        st = plan["stages"]["calibrate"]
        return {k: st[k] for k in ("gpu_gib", "host_gib", "seconds")}
    except Exception as err:  # noqa: BLE001 -- the estimate is recorded beside the measurement, not required
        return {"error": f"{type(err).__name__}: {err}"}


# ---------------------------------------------------------------------------------------------------- main
def table(record: dict) -> str:
    """The one Markdown table: part, status, seconds, key numbers."""
    lines = [f"GPU check on {record['machine'].get('gpu') or 'cpu'} (torch {record['machine']['torch']}, commit "
             f"{(record['machine'].get('commit') or '?')[:7]}{'' if record['machine'].get('clean') else ', dirty'})"
             f"{', --smoke' if record['smoke'] else ''}", "",
             "| part | status | seconds | key numbers |", "|---|---|---|---|"]
    for part in PARTS:
        rec = record["parts"].get(part)
        if rec is None:
            continue
        key = "; ".join(f"{k} {v}" for k, v in rec["key"].items())
        lines.append(f"| {part} | {rec['status']} | {rec['seconds']:.0f} | {key} |")
    return "\n".join(lines) + "\n"


def parse_parts(text: str | None) -> list[str]:
    """The requested parts in PARTS order; ValueError naming the choices for an unknown one."""
    if not text:
        return list(PARTS)
    asked = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in asked if p not in PARTS]
    if unknown or not asked:
        raise ValueError(f"--parts {text!r}: unknown {unknown or 'empty list'}; choose from {','.join(PARTS)}")
    return [p for p in PARTS if p in asked]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a new or empty directory")
    ap.add_argument("--parts", default=None, help=f"comma list of {','.join(PARTS)} (default: all)")
    ap.add_argument("--smoke", action="store_true", help="every part on this CPU at tiny sizes")
    ap.add_argument("--bench-budget-s", type=float, default=120, help="stop starting new bench pairs after this")
    a = ap.parse_args(argv)
    try:
        parts = parse_parts(a.parts)
    except ValueError as err:
        ap.error(str(err))
    if not a.smoke and not torch.cuda.is_available():
        ap.error("no CUDA device here: run on the GPU node, or with --smoke for the CPU path")
    out = Path(a.out).resolve()
    if (out / "gpu_check.json").exists():
        ap.error(f"{out} already holds a check: give a new directory")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(OFFLINE)
    os.chdir(ROOT)   # the configs name the repository's models and data relative to it
    ck = Check(out, "cpu" if a.smoke else "cuda", a.smoke, parts, a.bench_budget_s)
    ck.write()
    t0 = time.time()
    starters = {"tiny": lambda: ck.start("tiny", [o.format(out=out) for o in tiny_overrides(ck.device, a.smoke)]),
                "mlp": lambda: ck.start("mlp", [o.format(out=out) for o in map_overrides("mlp", ck.device, a.smoke)]),
                "trained": lambda: ck.start("trained", [o.format(out=out) for o in
                                                        map_overrides("trained", ck.device, a.smoke)]),
                "dryrun": lambda: start_dryrun(ck)}
    finishers = {"tiny": finish_tiny, "mlp": lambda c: finish_map(c, "mlp"), "trained": lambda c: finish_map(c, "trained"),
                 "dryrun": finish_dryrun}
    checks = {"paged": check_paged, "device_map": check_device_map, "bench": check_bench, "calib": check_calib}
    if "tiny" in parts:   # the CPU reference the tiny run is held to: beside the runs, in a thread (torch frees the GIL)
        ck.reference = reference_calibration(ThreadPoolExecutor(max_workers=1))
    for part in (p for p in RUN_PARTS if p in parts):
        try:
            starters[part]()
        except Exception:  # noqa: BLE001 -- a part that cannot start is recorded; the others go on
            ck.done(part, time.time(), "error", {}, error=traceback.format_exc(limit=4))
    for part in [p for p in BESIDE if p in parts] + [p for p in RUN_PARTS if p in parts and p in ck.procs] + \
            [p for p in TIMED if p in parts]:
        started = time.time()
        try:
            if part in ck.procs:
                finishers[part](ck)
            else:
                status, key, details = checks[part](ck)
                ck.done(part, started, status, key, details)
        except Exception:  # noqa: BLE001 -- record and go on to the next part
            ck.done(part, started, "error", {}, error=traceback.format_exc(limit=6))
        if ck.device == "cuda":
            torch.cuda.empty_cache()
    ck.record["seconds"] = round(time.time() - t0, 1)
    ck.write()
    text = table(ck.record)
    atomic_write_bytes(out / "gpu_check.md", text.encode())
    print(text)
    return 0 if all(r["status"] == "ok" for r in ck.record["parts"].values()) and \
        set(ck.record["parts"]) == set(parts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
