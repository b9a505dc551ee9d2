"""Measure one calibration's host-memory peak next to the plan's prediction (issue 10 §4), in a fresh process.

    python tests/rss_probe.py DTYPE ACCUMULATE CAPTURE   ->  one JSON line

Random Qwen3 models from the real config class at 1/8 of Qwen3-14B -> 32B's K/V feature widths
(Dx = 5 layers x 8 kv heads x 128 = 5,120 = 40,960 / 8; Dy = 8 x 8 x 128 = 8,192 = 65,536 / 8), so the
moments (0.5-1 GiB) dominate. The peak is Linux's VmHWM, reset (/proc/self/clear_refs) just before
`collect_moments`, minus the RSS at that moment: what the calibration adds to a process that already holds the
models. The plan's figure for the same thing is its calibrate host peak minus the runtime and weights terms.
A separate process, so pages freed by earlier tests cannot be reused and hide the growth.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run_configs import compose_config  # noqa: E402
from tiny_models import random_ids, tiny_model  # noqa: E402

from kvtransfer import plan as P  # noqa: E402
from kvtransfer.core.calibrate import collect_moments  # noqa: E402

N_SEQ, SEQ_LEN, STRIDE, BATCH, EVERY = 8, 32, 2, 4, 8
SHAPE = dict(hidden=64, heads=8, kv_heads=8, head_dim=128)


def _status(key: str) -> int:
    """A /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status (Linux only)")


def main(dtype: str, accumulate: str, capture: str) -> dict:
    src = tiny_model("qwen3", seed=1, layers=5, **SHAPE)
    tgt = tiny_model("qwen3", seed=2, layers=8, **SHAPE)
    overrides = ["pair=tiny", "device=cpu", f"calib.n_sequences={N_SEQ}", f"calib.seq_len={SEQ_LEN}",
                 f"calib.stride={STRIDE}", f"calib.batch_size={BATCH}", "calib.heldout_fraction=0.25",
                 f"calib.dtype={dtype}", f"calib.accumulate={accumulate}", f"calib.capture={capture}",
                 f"calib.checkpoint_every={EVERY}"]
    cfg = compose_config(*overrides)
    shapes = (P.shape_from_config(src.config, "s"), P.shape_from_config(tgt.config, "t"))
    setup = P.Setup(cfg, *shapes, P.Node(), P.rates_for(P.Node(), "cpu", local=True))
    usage = P.stage_usage(setup)["calibrate"]
    predicted = usage.host - usage.parts["host"]["runtime"] - setup.weights("src", "tgt")
    ids = random_ids(N_SEQ, SEQ_LEN, seed=3)
    with tempfile.TemporaryDirectory() as tmp:
        Path("/proc/self/clear_refs").write_text("5")   # VmHWM := current RSS
        before = _status("VmRSS:")
        collect_moments(src, tgt, ids, stride=STRIDE, batch_size=BATCH, heldout_fraction=0.25,
                        checkpoint_path=Path(tmp) / "ckpt", checkpoint_every=EVERY, dtype=getattr(torch, dtype),
                        accumulate=accumulate, capture=capture,
                        feature_dir=Path(tmp) / "features" if capture == "sequential" else None)
        peak = _status("VmHWM:")
    return {"dx": setup.dx, "dy": setup.dy, "measured_bytes": peak - before, "planned_bytes": predicted,
            "rss_before_bytes": before, "planned_runtime_bytes": usage.parts["host"]["runtime"]}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
