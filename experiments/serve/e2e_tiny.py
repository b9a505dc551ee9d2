"""End to end through vLLM on the tiny family (tests/test_serve_vllm.py runs this; serving environment).

    python experiments/serve/e2e_tiny.py OUT_DIR        -> OUT_DIR/report.json

Engines, one after another (float32, eager, CPU):
  1 producer   qwen3-tiny-3m: cold-prefill outputs of every prompt, and their store entries
  2 consumer   the same model, identity map (native sink 1): the plumbing check, then every bad input
               (no entry, entry of another model, another context_start, corrupt, mis-shaped, NaN data
               that only the worker sees) -- each must serve the cold output -- then the good prompt again
  3 consumer   a mapper fitted for another target: every request falls back, the engine serves
  4 consumer   prefix caching on, a perturbed identity map: a salted request is mapped (its output is not
               the cold one), the same prompt unsalted right after must be the cold output (no mapped
               block served as an exact prefix-cache hit)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models/tiny/qwen3-tiny-3m"
OTHER = ROOT / "models/tiny/qwen3-tiny-1m"
START = 0  # the tiny tokenizer's BOS/EOS id: position 0 of every context (context_start=prefix_token)


def prompts() -> dict[str, list[int]]:
    body = lambda seed, n: [100 + (seed * 37 + 11 * i) % 3000 for i in range(n)]  # noqa: E731
    return {"good": [START] + body(1, 300), "short_block": [START] + body(2, 127), "no_entry": [START] + body(3, 200),
            "other_model": [START] + body(4, 200), "context_start": body(5, 201), "corrupt": [START] + body(6, 200),
            "mis_shaped": [START] + body(7, 200), "nan": [START] + body(8, 200)}


def spoil(store, ps: dict, work: Path) -> None:
    """The bad entries: truncated, mis-shaped (hand-written), NaN data, and one by another model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtransfer.core.io import atomic_save_tensors, load_tensors
    from kvtransfer.core.models import config_hash
    from kvtransfer.serve.store import save_prefill

    h = config_hash(AutoConfig.from_pretrained(TARGET))
    path = store.path(ps["corrupt"], h)
    path.write_bytes(path.read_bytes()[:-4096])
    for name, fix in (("mis_shaped", lambda t: t[:, :-1]), ("nan", lambda t: torch.full_like(t, float("nan")))):
        path = store.path(ps[name], h)
        tensors, header = load_tensors(path)
        tensors = {k: (fix(v) if k.startswith("layers.") and k.endswith(".k") else v) for k, v in tensors.items()}
        path.unlink()
        atomic_save_tensors(path, tensors, header)
    store.path(ps["no_entry"], h).unlink()
    store.path(ps["other_model"], h).unlink()  # the target's own entry goes; another model's takes its place
    save_prefill(store, AutoModelForCausalLM.from_pretrained(OTHER, dtype=torch.float32), ps["other_model"])


def mappers(work: Path) -> None:
    from transformers import AutoConfig

    from kvtransfer.serve.mapping import identity_mapper

    cfg = AutoConfig.from_pretrained(TARGET)
    identity_mapper(cfg, model_id=str(TARGET), start_ids=[START]).save(work / "identity")
    identity_mapper(cfg, model_id=str(TARGET), start_ids=[START], noise=0.05).save(work / "perturbed")
    identity_mapper(AutoConfig.from_pretrained(OTHER), model_id=str(OTHER), start_ids=[START]).save(work / "other_pair")


def main(out: Path) -> None:
    from engines import close, engine, generate, kv_config

    from kvtransfer.serve.policy import Counters
    from kvtransfer.serve.store import KVStore

    out.mkdir(parents=True, exist_ok=True)
    store = KVStore(out / "store")
    ps = prompts()
    names = list(ps)
    report = {"prompts": {k: len(v) for k, v in ps.items()}}
    mappers(out)

    llm = engine(TARGET, kv=kv_config("kv_producer", out / "store"))
    report["cold"] = dict(zip(names, generate(llm, [ps[n] for n in names], 8)))
    close(llm)
    report["entries"] = sorted(p.name for p in (out / "store").rglob("*.safetensors"))
    spoil(store, ps, out)

    stats = out / "stats_consumer.json"
    llm = engine(TARGET, kv=kv_config("kv_consumer", out / "store", mapper=out / "identity", source_model=TARGET,
                                      stats=stats))
    order = names + ["good"]
    got = generate(llm, [ps[n] for n in order], 8)
    report["consumer"] = {f"{i}:{n}": g for i, (n, g) in enumerate(zip(order, got))}
    report["consumer_stats"] = Counters.load(stats)
    report["consumer_worker"] = json.loads(Path(f"{stats}.worker.json").read_text())
    close(llm)

    stats = out / "stats_wrong_pair.json"
    llm = engine(TARGET, kv=kv_config("kv_consumer", out / "store", mapper=out / "other_pair", source_model=OTHER,
                                      stats=stats))
    report["wrong_pair"] = dict(zip(["good"], generate(llm, [ps["good"]], 8)))
    report["wrong_pair_stats"] = Counters.load(stats)
    close(llm)

    stats = out / "stats_prefix.json"
    llm = engine(TARGET, prefix_caching=True,
                 kv=kv_config("kv_consumer", out / "store", mapper=out / "perturbed", source_model=TARGET, stats=stats))
    salted = generate(llm, [ps["good"]], 8, salt="kvtransfer-mapped")[0]
    unsalted = generate(llm, [ps["good"]], 8)[0]
    salted_again = generate(llm, [ps["good"]], 8, salt="kvtransfer-mapped")[0]
    report["prefix"] = {"salted": salted, "unsalted": unsalted, "salted_again": salted_again}
    report["prefix_stats"] = Counters.load(stats)
    close(llm)
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(Path(sys.argv[1]))
