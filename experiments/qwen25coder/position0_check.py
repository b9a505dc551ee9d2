"""Is the flat K R² heatmap of results/qwen25coder an artefact of the position-0 (attention-sink) rows?

    python experiments/qwen25coder/position0_check.py     # ~2 min on 2 cores; needs experiments/qwen25coder/get_models.sh

Takes 16 Wikipedia sequences x 256 tokens with <|endoftext|> at position 0 (the calibration's convention),
keeps every second position (stride 2), and holds out 4 sequences. It then measures:
  * the share of each layer's centred K/V energy that sits on position-0 rows;
  * the single-source-layer held-out K and V R² for every (source layer, target layer), computed with
    and without the position-0 rows. The ridge is float64 with lambda = 0.01 on the centred sum of
    squares, as kvtransfer.core.ridge fits it.
Writes results/qwen25coder/tables/position0_check.md.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.core.calibrate import kv_features  # noqa: E402
from kvtransfer.core.data import read_documents, token_sequences  # noqa: E402
from kvtransfer.core.io import atomic_write_bytes  # noqa: E402
from kvtransfer.core.models import kv_shape, load_model  # noqa: E402

REAL = Path(os.environ.get("KVT_REAL_DIR", Path.home() / ".cache" / "kvtransfer-real"))
TEXT = Path(os.environ.get("KVT_REAL_TEXT", ROOT.parent / "shared" / "realmodels" / "text"))
N_SEQ, SEQ_LEN, STRIDE, HELD, LAM = 16, 256, 2, 4, 0.01


def heldout_r2(x: torch.Tensor, y: torch.Tensor, train: torch.Tensor, test: torch.Tensor) -> float:
    """Held-out R² of a ridge y ~ x fitted on rows `train`, scored on rows `test` (float64)."""
    mx, my = x[train].mean(0), y[train].mean(0)
    xc, yc = x[train] - mx, y[train] - my
    w = torch.linalg.solve(xc.T @ xc + LAM * torch.eye(x.shape[1], dtype=x.dtype), xc.T @ yc)
    res = (y[test] - my) - (x[test] - mx) @ w
    return float(1 - (res ** 2).sum() / ((y[test] - y[test].mean(0)) ** 2).sum())


def main() -> None:
    torch.manual_seed(0)
    src, tok = load_model(str(REAL / "hf" / "qwen25coder-0.5b"), dtype="float32", device="cpu")
    tgt, _ = load_model(str(REAL / "hf" / "qwen25coder-1.5b"), dtype="float32", device="cpu")
    ids = token_sequences(read_documents([TEXT / "wikipedia_enwiki_extract.jsonl"]), tok, N_SEQ, SEQ_LEN,
                          context_start="prefix_token")
    with torch.no_grad():
        fs, ft = kv_features(src, ids, stride=STRIDE), kv_features(tgt, ids, stride=STRIDE)
    kept = fs["k"].shape[0] // N_SEQ
    pos = (torch.arange(kept) * STRIDE).repeat(N_SEQ)
    seq = torch.arange(N_SEQ).repeat_interleave(kept)
    train, test = seq >= HELD, seq < HELD
    ws, wt = kv_shape(src).width, kv_shape(tgt).width
    ls, lt = kv_shape(src).n_layers, kv_shape(tgt).n_layers
    lines = ["# Position-0 rows and the flat K R² heatmap", "",
             "Made by `python experiments/qwen25coder/position0_check.py` on a 2-core CPU.",
             f"Data: {N_SEQ} Wikipedia sequences of {SEQ_LEN} tokens, `<|endoftext|>` at position 0, stride {STRIDE}.",
             f"That gives {kept} rows per sequence, so position 0 is {100 / kept:.1f} % of the rows.",
             f"{HELD} sequences are held out.", "",
             "| model | kind | position-0 share of centred energy, mean over layers | max over layers |", "|---|---|---|---|"]
    for name, f, w in (("source 0.5B", fs, ws), ("target 1.5B", ft, wt)):
        for kind in ("k", "v"):
            x = f[kind].double()
            e = ((x - x.mean(0)) ** 2).reshape(x.shape[0], -1, w).sum(-1)
            share = e[pos == 0].sum(0) / e.sum(0)
            lines.append(f"| {name} | {kind.upper()} | {share.mean():.3f} | {share.max():.3f} |")
    lines += ["", "Single-source-layer held-out R², over all (source layer, target layer) cells:", "",
              "| kind | mean R² with position 0 | without | mean abs diff | max abs diff | "
              "spread over source layers (mean of per-target-layer max - min) |", "|---|---|---|---|---|---|"]
    for kind in ("k", "v"):
        xs, ys = fs[kind].double(), ft[kind].double()
        with_p0 = torch.zeros(lt, ls)
        without = torch.zeros(lt, ls)
        for t in range(lt):
            y = ys[:, t * wt:(t + 1) * wt]
            for s in range(ls):
                x = xs[:, s * ws:(s + 1) * ws]
                with_p0[t, s] = heldout_r2(x, y, train, test)
                without[t, s] = heldout_r2(x, y, train & (pos > 0), test & (pos > 0))
        diff = (with_p0 - without).abs()
        spread = (with_p0.max(1).values - with_p0.min(1).values).mean()
        lines.append(f"| {kind.upper()} | {with_p0.mean():.3f} | {without.mean():.3f} | {diff.mean():.4f} | "
                     f"{diff.max():.4f} | {spread:.3f} |")
        print(kind, "done", flush=True)
    out = ROOT / "results" / "qwen25coder" / "tables" / "position0_check.md"
    atomic_write_bytes(out, ("\n".join(lines) + "\n").encode())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
