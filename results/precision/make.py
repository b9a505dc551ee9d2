"""The moments' precision: the default (two-level: float32 sums on the device for calib.flush_batches batches, folded
into float64 masters on the host) against the float64 host path (the former default) and the float32 device
moments (the former number-changing knob), on one pair, with the tolerance each output is held to.

    python results/precision/make.py                       # the committed tiny family, 1m -> 7m (~1 min, CPU)
    python results/precision/make.py --pair qwen25coder --source DIR --target DIR   # a downloaded pair

Writes results/precision/<pair>.json and <pair>.md. Compared on the same calibration sequences, selection k and
held-out text: the moments' relative error, the condition numbers of the ridge systems (Cxx[I, I] + lambda I of
each target layer and kind), the selected source layers, held-out R² (K and V) and the perplexity of held-out
windows whose prefix goes through the map.

Tolerance (derived, then held with the ratio observed / allowed printed):
* The ridge solution W = A^-1 B (A = Cxx[I, I] + lambda I, B = Cxy[I, t]) minimises f(W) = tr(W'AW) - 2 tr(W'B);
  for moments perturbed by (dA, dB) the perturbed solution W + D has D = (A + dA)^-1 (dB - dA W), and the train SSE
  grows by exactly tr(D'AD) <= |dB - dA W|_F^2 / lambda_min(A) <= (|dB|_F + |dA|_F |W|_F)^2 / lambda_min(A)
  (first order). With SST the layer's train total sum of squares, rho = that / SST is the share of the target's
  variance the perturbation can add to the residual. A held-out row set of the same distribution sees the same
  share, so |dR²_heldout| <= 2 sqrt((1 - R²) rho) + rho (Cauchy-Schwarz on the cross term). lambda_min(A) (the
  ill-conditioning: cond(A) is printed) is what makes rho large, not the size of W: the ridge weights along A's
  small directions move freely and the outputs do not.
* The map's outputs move by at most phi = sqrt(rho / (1 - R²)) of the map's own error, so to first order the
  mapped perplexity's log-gap to the target (log ppl_map - log ppl_target) moves by at most 2 phi of itself.
* Selected layers: the same, unless the train-R² margin between the k-th and (k+1)-th candidate of a target
  layer is within the R² tolerance (then either order is within tolerance; reported).
The float32-device row is shown with the same bound computed from its own perturbation: it is the row whose
moments moved most, not a row held to the default's bound.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

import kvtransfer as kt  # noqa: E402
from kvtransfer.core.cache import forward_on_cache, prefill  # noqa: E402
from kvtransfer.core.data import read_documents, token_sequences  # noqa: E402
from kvtransfer.core.ridge import DEFAULT_LAMBDA  # noqa: E402

PAIRS = {
    # conf/calib/tiny.yaml: 160 x 128 tokens, stride 2, batch 16. k = 2, not conf/pair/tiny.yaml's 4: the 1m source
    # has 4 layers, so k = 4 selects every one of them on every path and the selections could not differ
    "tiny": dict(source=ROOT / "models/tiny/qwen3-tiny-1m", target=ROOT / "models/tiny/qwen3-tiny-7m",
                 calib=[ROOT / "data/tiny/calib.jsonl"], held=[ROOT / "data/tiny/heldout.jsonl"], n_sequences=160,
                 seq_len=128, stride=2, batch=16, k=2, prefix=96, continuation=32, windows=32),
    # the real pair, Qwen2.5-Coder 0.5B -> 1.5B, at a CPU-sized protocol (64 x 128 Wikipedia tokens, stride 2, k = 4)
    "qwen25coder": dict(source=None, target=None, calib=None, held=None, n_sequences=64, seq_len=128, stride=2,
                        batch=4, k=4, prefix=96, continuation=32, windows=8),
}
PATHS = {  # name: collect_moments keywords
    "float64 host": dict(accumulate="host"),
    "two-level (default)": dict(accumulate="twolevel", flush_batches=8),
    "float32 device": dict(accumulate="device", dtype=torch.float32),
}
REFERENCE = "float64 host"


def _topk_margins(r2_train: dict, k: int) -> dict:
    """{kind: smallest train-R² gap between the k-th and (k+1)-th source layer over target layers}."""
    out = {}
    for kind, mat in r2_train.items():   # [target layers, source layers]
        srt = mat.double().sort(dim=1, descending=True).values
        out[kind] = float((srt[:, k - 1] - srt[:, k]).min()) if mat.shape[1] > k else math.inf
    return out


@torch.no_grad()
def _ppl(src, tgt, mapper, windows: torch.Tensor, prefix: int) -> float:
    """Perplexity of the continuation tokens after a mapped prefix (mapper None: the target's own prefix)."""
    nll, count = 0.0, 0
    for row in windows:
        ids = row[None]
        if mapper is None:
            cache = prefill(tgt, ids[:, :prefix])
        else:
            cache = kt.transfer(prefill(src, ids[:, :prefix]), mapper, src, tgt, input_ids=ids[:, :prefix],
                                as_layers=True)
        # logits at the continuation's positions prefix..end-1 score tokens prefix+1..end
        logits = forward_on_cache(tgt, cache, None, ids[:, prefix:-1])
        target = ids[:, prefix + 1:]
        lp = torch.log_softmax(logits.double(), -1).gather(-1, target[..., None])[..., 0]
        nll -= float(lp.sum())
        count += target.numel()
    return math.exp(nll / count)


def _condition_and_rho(calib, ref, fit, ref_fit, selected, lam) -> dict:
    """Per kind: max cond(A), max rho over target layers, and the layer's R² where rho is largest."""
    out = {}
    m, r = calib.train, ref.train
    for kind in ("k", "v"):
        conds, rhos = [], []
        for i, t in enumerate(r.target_layers):
            cols = r.source_columns(selected[i])
            a_ref = r.cov_xx(kind, cols).double() + lam * torch.eye(len(cols), dtype=torch.float64)
            a = m.cov_xx(kind, cols).double() + lam * torch.eye(len(cols), dtype=torch.float64)
            b_ref, b = r.cov_xy(kind, cols, t).double(), m.cov_xy(kind, cols, t).double()
            ev = torch.linalg.eigvalsh(a_ref)
            conds.append(float(ev[-1] / ev[0]))
            w = ref_fit.weights[kind][i].weight.double()
            num = (float((b - b_ref).norm()) + float((a - a_ref).norm()) * float(w.norm()))
            sst = float(r.stats[kind]["cyy"][r.target_columns(t)].double().sum())
            rhos.append(num * num / (float(ev[0]) * sst))
        out[kind] = {"cond_max": max(conds), "cond_median": sorted(conds)[len(conds) // 2], "rho_max": max(rhos)}
    return out


def _replay_features():
    """Every accumulation path sees the same float32 features: `kv_features` is memoised per (model, token ids,
    settings), so the models run once per batch, not once per path (the moments differ only by how they sum)."""
    import hashlib

    from kvtransfer.core import calibrate

    real, memo = calibrate.kv_features, {}

    def cached(model, input_ids, **kw):
        key = (id(model), hashlib.sha1(input_ids.cpu().numpy().tobytes()).hexdigest(),
               repr(sorted((k, v) for k, v in kw.items() if k != "codec")))
        if key not in memo:
            memo[key] = real(model, input_ids, **kw)
        return memo[key]

    calibrate.kv_features = cached


def measure(name: str, spec: dict) -> dict:
    from kvtransfer.config.provenance import json_provenance

    provenance = json_provenance()   # of the tree at the start (the outputs it writes are not yet there)
    torch.manual_seed(0)
    _replay_features()
    src, tok = kt.load_model(str(spec["source"]), dtype="float32", device="cpu")
    tgt, _ = kt.load_model(str(spec["target"]), dtype="float32", device="cpu")
    source_layers = kt.kv_shape(src).n_layers
    if not 0 < spec["k"] < source_layers:  # k = all the layers selects them all on every path: nothing to compare
        raise SystemExit(f"k = {spec['k']} must be below the source's {source_layers} layers, or every path selects "
                         "the same layers whatever its moments")
    ids = token_sequences(read_documents([str(f) for f in spec["calib"]]), tok, n_sequences=spec["n_sequences"],
                          seq_len=spec["seq_len"])
    held_ids = token_sequences(read_documents([str(f) for f in spec["held"]]), tok, n_sequences=spec["windows"],
                               seq_len=spec["prefix"] + spec["continuation"])
    head_dim = kt.kv_shape(tgt).head_dim
    kw = dict(stride=spec["stride"], batch_size=spec["batch"], heldout_fraction=0.1, heldout_observations=8192)
    rows = {}
    calibs, fits = {}, {}
    for path, extra in PATHS.items():
        t0 = time.perf_counter()
        calibs[path] = kt.collect_moments(src, tgt, ids, **kw, **extra)
        secs = time.perf_counter() - t0
        c = calibs[path]
        r2 = kt.r2_matrix(c.train, heldout=c.heldout, head_dim=head_dim)
        selected = kt.select_topk(r2["train"], spec["k"])
        fits[path] = (kt.fit_ridge(c.train, selected, heldout=c.heldout, head_dim=head_dim), selected, r2)
        rows[path] = {"seconds": round(secs, 1), "selected": selected}
    ref_calib, (ref_fit, ref_sel, ref_r2) = calibs[REFERENCE], fits[REFERENCE]
    native = _ppl(src, tgt, None, held_ids, spec["prefix"])
    m_per_batch = spec["batch"] * len(range(0, spec["seq_len"], spec["stride"]))
    for path in PATHS:
        c = calibs[path]
        fit, selected, r2 = fits[path]
        row = rows[path]
        rel = max(float((c.train.stats[k][s].double() - ref_calib.train.stats[k][s].double()).abs().max()
                        / ref_calib.train.stats[k][s].double().abs().max()) for k in ("k", "v") for s in ("cxx", "cxy"))
        cr = _condition_and_rho(c, ref_calib, fit, ref_fit, ref_sel, DEFAULT_LAMBDA)
        mapper = kt.Mapper.from_ridge(fit, src, tgt)
        ppl = _ppl(src, tgt, mapper, held_ids, spec["prefix"])
        row.update(moments_rel_err=rel, cond=cr)
        row["heldout_r2"] = {k: float(fit.r2["heldout"][k].double().mean()) for k in ("k", "v")}
        row["weights_rel_diff"] = max(
            float(sum((a.weight - b.weight).double().norm() ** 2 for a, b in zip(fit.weights[k], ref_fit.weights[k])) ** 0.5
                  / sum(b.weight.double().norm() ** 2 for b in ref_fit.weights[k]) ** 0.5) for k in ("k", "v"))
        row["ppl"] = ppl
        tol_r2 = {}
        for k in ("k", "v"):
            r2_min = float(ref_fit.r2["heldout"][k].double().min())
            rho = cr[k]["rho_max"]
            tol_r2[k] = 2 * math.sqrt(max(0.0, 1 - r2_min) * rho) + rho
        row["tol_heldout_r2"] = tol_r2
        r2_min = min(float(ref_fit.r2["heldout"][k].double().min()) for k in ("k", "v"))
        phi = math.sqrt(max(cr[k]["rho_max"] for k in ("k", "v")) / max(1e-12, 1 - r2_min))
        row["phi"] = phi
        row["margins"] = _topk_margins(ref_r2["train"], spec["k"])
        row["same_selection"] = selected == ref_sel
    ref_ppl = rows[REFERENCE]["ppl"]
    gap = abs(math.log(ref_ppl) - math.log(native))
    for path, row in rows.items():
        row["dlogppl"] = abs(math.log(row["ppl"]) - math.log(ref_ppl))
        row["tol_logppl"] = 2 * row["phi"] * gap
        row["dr2"] = {k: abs(row["heldout_r2"][k] - rows[REFERENCE]["heldout_r2"][k]) for k in ("k", "v")}
        row["selection_ok"] = row["same_selection"] or all(
            row["margins"][k] <= row["tol_heldout_r2"][k] for k in ("k", "v"))
        row["within"] = (row["selection_ok"] and row["dlogppl"] <= row["tol_logppl"] + 1e-15
                         and all(row["dr2"][k] <= row["tol_heldout_r2"][k] + 1e-15 for k in ("k", "v")))
    return {"pair": name, "protocol": {k: (str(v) if isinstance(v, Path) else v) for k, v in spec.items()
                                       if k not in ("source", "target", "calib", "held")},
            "source_layers": source_layers, "rows_per_batch": m_per_batch, "native_target_ppl": native,
            "lambda": DEFAULT_LAMBDA, "unit_roundoff_float32": 2.0 ** -24,
            "paths": {p: _jsonable(r) for p, r in rows.items()}, "provenance": provenance}


def _jsonable(row: dict) -> dict:
    return json.loads(json.dumps(row, default=lambda o: o if not isinstance(o, torch.Tensor) else o.tolist()))


def markdown(res: dict) -> str:
    pr = res["protocol"]
    lines = [f"# Moments' precision on `{res['pair']}`: the default against the float64 host path", "",
             f"Generated by `python results/precision/make.py{'' if res['pair'] == 'tiny' else ' --pair ' + res['pair']}`"
             f" (CPU). Calibration {pr['n_sequences']} x {pr['seq_len']} tokens, stride {pr['stride']}, batch "
             f"{pr['batch']} ({res['rows_per_batch']:,} rows a batch), k = {pr['k']} of the source's "
             f"{res['source_layers']} layers, lambda = {res['lambda']}; "
             f"perplexity of {pr['continuation'] - 1} continuation tokens after a {pr['prefix']}-token mapped prefix, "
             f"{pr['windows']} held-out windows (the target's own prefix: {res['native_target_ppl']:.4f}).", "",
             "Tolerances are derived in the script's docstring from the moments' perturbation and the ridge systems' "
             "smallest eigenvalue; `within` = every output inside its tolerance.", "",
             "| moments | max rel. error of Cxx / Cxy | cond(A) max (K / V) | rho max (K / V) | held-out R² K / V | "
             "abs. dR² K / V | tolerance K / V | ppl through the map | abs. d log ppl / tolerance | "
             "same layers (k-th / (k+1)-th train-R² margin K / V) | ridge weights rel. diff | within | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, r in res["paths"].items():
        c = r["cond"]
        lines.append(
            f"| {path} | {r['moments_rel_err']:.1e} | {c['k']['cond_max']:.1e} / {c['v']['cond_max']:.1e} | "
            f"{c['k']['rho_max']:.1e} / {c['v']['rho_max']:.1e} | {r['heldout_r2']['k']:.6f} / {r['heldout_r2']['v']:.6f} | "
            f"{r['dr2']['k']:.1e} / {r['dr2']['v']:.1e} | {r['tol_heldout_r2']['k']:.1e} / {r['tol_heldout_r2']['v']:.1e} | "
            f"{r['ppl']:.4f} | {r['dlogppl']:.1e} / {r['tol_logppl']:.1e} | "
            f"{'yes' if r['same_selection'] else 'no'} (margin {r['margins']['k']:.1e} / {r['margins']['v']:.1e}) | "
            f"{r['weights_rel_diff']:.1e} | {'yes' if r['within'] else 'NO'} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="tiny", choices=sorted(PAIRS))
    ap.add_argument("--source")
    ap.add_argument("--target")
    ap.add_argument("--calib", nargs="*", help="calibration .jsonl/.txt files (real pairs)")
    ap.add_argument("--held", nargs="*", help="held-out text files for the perplexity windows (real pairs)")
    ap.add_argument("--out", default=str(HERE))
    args = ap.parse_args(argv)
    spec = dict(PAIRS[args.pair])
    for key in ("source", "target", "calib", "held"):
        if getattr(args, key):
            spec[key] = getattr(args, key)
    if any(spec[k] is None for k in ("source", "target", "calib", "held")):
        ap.error(f"--pair {args.pair} needs --source, --target, --calib and --held")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    res = measure(args.pair, spec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.pair}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{args.pair}.md").write_text(markdown(res))
    print(markdown(res))
    return 0 if res["paths"]["two-level (default)"]["within"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
