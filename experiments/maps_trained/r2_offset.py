"""Where a trained map's held-out R² goes: its residual split into the shift shared by every token and the rest.

    python experiments/maps_trained/r2_offset.py [--calibration DIR] [--maps NAME=MAPPER_DIR ...] [--out FILE]

On the calibration's held-out rows (the ones the table's "K/V R² held-out" is computed on, `ridge.feature_sse`), a
map's residual r = y - (x W + b) per target column splits exactly into
    SSE = sum_rows (r - mean r)^2  +  n (mean r)^2        (centred part + shared shift)
so R² = 1 - SSE / SST (SST about the held-out mean, as the table) and the *centred* R² = 1 - centred SSE / SST
is what remains once one constant vector per head is added to every mapped token. A map whose R² fell through
the shift alone has its centred R² where it was. Reported per kind (K, V) and target layer, as the table does
(mean over KV heads), for each map named, and how far each map's weights and biases moved from the first map
named (the ridge start of the trained ones); written to results/maps_trained/r2_offset.json.
Reads only artifacts (safetensors + JSON): no model is loaded.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtransfer.core.calibrate import load_calibration  # noqa: E402
from kvtransfer.core.io import atomic_write_json  # noqa: E402
from kvtransfer.core.mapper import load_mapper  # noqa: E402

ART = Path("artifacts/qwen25coder")
MAPS = {"paper_sink1": ART / "mappers/b0eb9ce8807e3a38", "e2e_lr1e-4_cpu_sink1": ART / "mappers/6c14988129d46dc2",
        "trained_lr3e-4_short_sink1": ART / "mappers/d168197979a57d27",
        "e2e_lr1e-4_cpu48_sink1": ART / "mappers/284baaf733d25a8e"}
CALIBRATION = ART / "moments/365c5508aea7082e/calibration"


def split_sse(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per target column (float64): SST about y's mean, the centred SSE and the shared-shift term n (mean r)^2 of
    r = y - (x weight + bias); x [n, p], y [n, q], weight [p, q], bias [q]."""
    r = y.double() - torch.addmm(bias.double(), x.double(), weight.double())
    mean_r = r.mean(0)
    return {"sst": ((y.double() - y.double().mean(0)) ** 2).sum(0), "centred": ((r - mean_r) ** 2).sum(0),
            "shift": r.shape[0] * mean_r ** 2}


def per_head_r2(sse: torch.Tensor, sst: torch.Tensor, head_dim: int) -> torch.Tensor:
    """R² per head [q / head_dim] from per-column sums (as ridge._per_head)."""
    return 1 - sse.view(-1, head_dim).sum(-1) / sst.view(-1, head_dim).sum(-1)


def decompose(mapper, held, head_dim: int) -> dict:
    """{kind: {"r2", "r2_centred", "shift_share": [L_t], "pooled_shift_share": float}} of one map (means over the
    layer's KV heads; shift_share: the shared shift's part of the layer's SSE; pooled_shift_share: its part of the
    SSE summed over every layer, i.e. the per-layer shares weighted by each layer's SSE, not their plain mean)."""
    out = {}
    for i, kind in enumerate(("k", "v")):
        rows = {"r2": [], "r2_centred": [], "shift_share": []}
        shift_total = sse_total = 0.0
        for t, layers in enumerate(mapper.selected_layers.tolist()):
            cols = held.source_columns(layers)
            parts = split_sse(held.x(kind)[:, cols], held.y(kind)[:, held.target_columns(held.target_layers[t])],
                              mapper.weight[t, i], mapper.bias[t, i])
            rows["r2"].append(float(per_head_r2(parts["centred"] + parts["shift"], parts["sst"], head_dim).mean()))
            rows["r2_centred"].append(float(per_head_r2(parts["centred"], parts["sst"], head_dim).mean()))
            rows["shift_share"].append(float(parts["shift"].sum() / (parts["centred"] + parts["shift"]).sum()))
            shift_total += float(parts["shift"].sum())
            sse_total += float((parts["centred"] + parts["shift"]).sum())
        out[kind] = {**rows, "pooled_shift_share": shift_total / sse_total if sse_total > 0 else None}
    return out


def change(mapper, start) -> dict:
    """{kind: {"weight_rel": [L_t] |W - W0|_F / |W0|_F, "bias_abs": [L_t] |b - b0|}} of a map against the map it
    was trained from (same selected layers)."""
    if not torch.equal(mapper.selected_layers, start.selected_layers):
        raise ValueError("the two maps read different source layers: no weight-by-weight change to report")
    out = {}
    for i, kind in enumerate(("k", "v")):
        w, w0 = mapper.weight[:, i].double(), start.weight[:, i].double()
        b, b0 = mapper.bias[:, i].double(), start.bias[:, i].double()
        out[kind] = {"weight_rel": ((w - w0).flatten(1).norm(dim=1) / w0.flatten(1).norm(dim=1)).tolist(),
                     "bias_abs": (b - b0).norm(dim=1).tolist(), "start_bias_norm": b0.norm(dim=1).tolist()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", default=str(CALIBRATION))
    ap.add_argument("--maps", nargs="*", default=[f"{k}={v}" for k, v in MAPS.items()])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default="results/maps_trained/r2_offset.json")
    args = ap.parse_args(argv)
    held = load_calibration(args.calibration).heldout
    result = {"calibration": args.calibration, "heldout_rows": held.n, "maps": {}}
    start = load_mapper(args.maps[0].split("=", 1)[1])  # the first map named: the ridge start of the others
    for spec in args.maps:
        name, path = spec.split("=", 1)
        mapper = load_mapper(path)
        d = decompose(mapper, held, args.head_dim)
        result["maps"][name] = {"mapper": path, **d, "change_from_first": change(mapper, start)}
        for kind in ("k", "v"):
            c = result["maps"][name]["change_from_first"][kind]
            print(f"{name} {kind.upper()}: change from {args.maps[0].split('=')[0]}: weights at most "
                  f"{100 * max(c['weight_rel']):.2f} % (relative Frobenius, per layer), biases at most {max(c['bias_abs']):.3g}")
        for kind in ("k", "v"):
            mean = {m: sum(v) / len(v) for m, v in d[kind].items() if isinstance(v, list)}
            print(f"{name} {kind.upper()}: R² {mean['r2']:.3f}, centred R² {mean['r2_centred']:.3f}, "
                  f"shared shift {100 * mean['shift_share']:.1f} % of the SSE (mean over layers), "
                  f"{100 * d[kind]['pooled_shift_share']:.1f} % pooled over layers")
    from kvtransfer.config.provenance import json_provenance

    atomic_write_json(Path(args.out), {**result, "provenance": json_provenance()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
