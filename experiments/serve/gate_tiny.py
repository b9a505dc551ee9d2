"""The per-request gate served through vLLM on the tiny family (tests/test_serve_gate.py runs this; serving env).

    python experiments/serve/gate_tiny.py OUT_DIR        -> OUT_DIR/report.json

Engines, one after another (float32, eager, CPU), qwen3-tiny-3m to itself with a perturbed identity map (so the
mapped output is not the cold one), gate tail 8:
  1 producer     cold outputs of every prompt, and their store blocks
  2 gate "recompute" (thresholds -1 / 1e9, fraction 0.5: every request recomputes half its context)
  3 gate "map"   (thresholds 1e9: every request keeps the map)
  4 gate "full"  (thresholds -1: every request falls back to a full prefill; its output must be the cold one)
  5 gate file that is not a gate artifact: every request prefilled normally, reason "gate_unusable"
  6 no gate, native_tail = 9 (the gate's tail + the last token): each prompt as it is (today's connector then maps
    exactly what the gated "map" keeps: the prompts are 16 k + 1 tokens, so the store's whole blocks end at the last
    token) and with kvtransfer_source_len = the start engine 2 ("recompute") recorded
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models/tiny/qwen3-tiny-3m"
START = 0
TAIL = 8
FORCE = {"recompute": {"recompute": -1.0, "full": 1e9, "fraction": 0.5},
         "map": {"recompute": 1e9, "full": 1e9, "fraction": 0.5},
         "full": {"recompute": -1.0, "full": -1.0, "fraction": 0.5}}


def prompts() -> dict[str, list[int]]:
    body = lambda seed, n: [100 + (seed * 37 + 11 * i) % 3000 for i in range(n)]  # noqa: E731
    return {"longer": [START] + body(4, 592), "long": [START] + body(1, 288), "mid": [START] + body(2, 144),
            "short": [START] + body(3, 80)}


def run_consumer(name: str, out: Path, ps: dict, params: dict | None = None, **extra) -> tuple[dict, dict]:
    from e2e_tiny import settle
    from engines import close, engine, generate, kv_config

    from kvtransfer.serve.policy import Counters

    stats = out / f"stats_{name}.json"
    llm = engine(TARGET, kv=kv_config("kv_consumer", out / "store", mapper=out / "perturbed", source_model=TARGET,
                                      stats=stats, **extra))
    got = {}
    for key, ids in ps.items():
        p = (params or {}).get(key, {}) | {"kvtransfer_tag": f"{name}:{key}"}
        got[key] = generate(llm, [ids], 8, params=p)[0]
    settle()
    close(llm)
    return got, Counters.load(stats)


def main(out: Path) -> None:
    from engines import close, engine, generate, kv_config
    from transformers import AutoConfig

    from kvtransfer.config.identity import weights_identity
    from kvtransfer.core.gate import save_gate
    from kvtransfer.serve.mapping import identity_mapper

    out.mkdir(parents=True, exist_ok=True)
    ps = prompts()
    identity_mapper(AutoConfig.from_pretrained(TARGET), model_id=str(TARGET), start_ids=[START], noise=0.05,
                    weights=weights_identity(str(TARGET))).save(out / "perturbed")
    for name, t in FORCE.items():
        save_gate(out / f"gate_{name}.json", t, {"tail": TAIL, "forced": name})
    (out / "gate_bad.json").write_text('{"format": "kvtransfer-gate/1", "thresholds": {"recompute": "x"}}')
    report = {"prompts": {k: len(v) for k, v in ps.items()}, "tail": TAIL}

    llm = engine(TARGET, kv=kv_config("kv_producer", out / "store"))
    report["cold"] = dict(zip(ps, generate(llm, list(ps.values()), 8)))
    close(llm)
    for name in (*FORCE, "bad"):
        got, stats = run_consumer(name, out, ps, gate=out / f"gate_{name}.json")
        report[name], report[f"{name}_stats"] = got, stats
    starts = {f"{mode}:{k}": report[mode][k]["kv_transfer_params"]["kvtransfer"]["gate"]["start"]
              for mode in ("map", "recompute") for k in ps}
    got, stats = run_consumer("shorter", out, {key: ps[key.split(":")[1]] for key in starts}, native_tail=TAIL + 1,
                              params={key: {"kvtransfer_source_len": s} for key, s in starts.items()
                                      if key.startswith("recompute:")})
    report["shorter"], report["shorter_stats"], report["starts"] = got, stats, starts
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(Path(sys.argv[1]))
