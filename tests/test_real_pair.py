"""Guard on the real pretrained pair (Qwen2.5-Coder 0.5B -> 1.5B, experiments/qwen25coder/get_models.sh).

Slow (a few minutes on 2 cores) and needs the converted models, so it is marked slow and runs
only when KVT_REAL_DIR names their directory:
    KVT_REAL_DIR=~/.cache/kvtransfer-real python -m pytest -q -m slow tests/test_real_pair.py
Without KVT_REAL_DIR it is skipped with that reason (the only skip allowed in this suite; it is
deselected from the default run anyway).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
REAL = os.environ.get("KVT_REAL_DIR")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not REAL, reason="set KVT_REAL_DIR to the directory experiments/qwen25coder/get_models.sh "
                                                  "filled (hf/qwen25coder-0.5b, hf/qwen25coder-1.5b)")]


def test_real_pair_small_calibration_beats_no_context():
    import kvtransfer as kt
    from kvtransfer.core.data import read_documents, token_sequences
    from kvtransfer.eval import KVTransferLM
    from kvtransfer.eval.perplexity import draw_windows, prefix_conditioned_ppl

    hf = Path(REAL).expanduser() / "hf"
    source, tok = kt.load_model(str(hf / "qwen25coder-0.5b"), dtype="float32", device="cpu")
    target, tok_t = kt.load_model(str(hf / "qwen25coder-1.5b"), dtype="float32", device="cpu")
    kt.check_same_tokenizer(tok, tok_t)
    # calibration on the handbook get.sh converts (not the WikiText-2 pages the perplexity is scored on)
    text = Path(REAL).expanduser() / "text" / "handbook_en.txt"
    ids = token_sequences(read_documents([text]), tok, n_sequences=8, seq_len=512, context_start="prefix_token")
    calib = kt.collect_moments(source, target, ids, stride=2, heldout_fraction=0.25, batch_size=4)
    r2 = kt.r2_matrix(calib.train, heldout=calib.heldout, head_dim=kt.kv_shape(target).head_dim)
    fit = kt.fit_ridge(calib.train, kt.select_topk(r2["train"], 2), lam=0.01, heldout=calib.heldout,
                       head_dim=kt.kv_shape(target).head_dim)
    k_heldout = float(fit.r2["heldout"]["k"].mean())
    assert k_heldout > 0.5, f"held-out K R² {k_heldout:.3f}"
    mapper = kt.Mapper.from_ridge(fit, source, target, calibration={"context_start": "prefix_token"})
    lm = KVTransferLM(source_model=source, target_model=target, tokenizer=tok, mapper=mapper, mode="transfer",
                      native_sink=1, context_start="prefix_token", batch_size=4)
    pages = [json.loads(line)["page"] for line in (ROOT / "data/benchmarks/wikitext2.jsonl").open()]
    windows = draw_windows(tok, pages, max_prefix=128, cont_len=32, n_windows=4, seed=0)
    ppl = {m: prefix_conditioned_ppl(lm.with_mode(m), windows, [128])[128]["ppl"]
           for m in ("transfer", "no_context", "target")}
    assert all(math.isfinite(v) for v in ppl.values()), ppl
    # the mapped prefix must carry real context: clearly below the no-context floor, above the target.
    # Measured: 39.5 vs floor 48.2 (0.82) from this 8-sequence handbook calibration (out of domain for
    # WikiText); the 160-sequence Wikipedia map of results/qwen25coder reaches 0.67; a broken transfer
    # (no re-rotation, a position-0 convention mismatch) lands at or far above the floor.
    assert ppl["transfer"] < 0.9 * ppl["no_context"], ppl
    assert ppl["transfer"] > ppl["target"] * 0.99, ppl
