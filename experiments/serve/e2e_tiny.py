"""End to end through vLLM on the tiny family (tests/test_serve_vllm.py runs this; serving environment).

    python experiments/serve/e2e_tiny.py OUT_DIR        -> OUT_DIR/report.json

Engines, one after another (float32, eager, CPU):
  1 producer   qwen3-tiny-3m: cold-prefill outputs of every prompt, and their store blocks (16 tokens each)
  2 consumer   the same model, identity map (native sink 1): the plumbing check, then every bad input -- no
               entry, an entry of another model, of a same-architecture model with other weights ("foreign"),
               another context_start, a truncated block, a mis-shaped block, block headers with
               "n_layers": "two" and "model": [..], flipped bytes in K (header intact: the checksum), NaN data
               (a valid checksum: the map's NaN check), request fields kvtransfer_source_len "5" / 2.5 / true
               -- each must serve the cold output and count its reason -- then the good prompt again, and a
               second turn of the good conversation (the stored prefix mapped, only the new tokens prefilled)
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
BAD_FIELDS = {"field_str": {"kvtransfer_source_len": "5"}, "field_float": {"kvtransfer_source_len": 2.5},
              "field_bool": {"kvtransfer_source_len": True}}


def prompts() -> dict[str, list[int]]:
    body = lambda seed, n: [100 + (seed * 37 + 11 * i) % 3000 for i in range(n)]  # noqa: E731
    ps = {"good": [START] + body(1, 300), "short_block": [START] + body(2, 127), "no_entry": [START] + body(3, 200),
          "other_model": [START] + body(4, 200), "foreign": [START] + body(12, 200), "context_start": body(5, 201),
          "corrupt": [START] + body(6, 200), "mis_shaped": [START] + body(7, 200),
          "n_layers_two": [START] + body(9, 200), "model_list": [START] + body(10, 200),
          "flipped": [START] + body(11, 200), "nan": [START] + body(8, 200)}
    return ps | {name: ps["good"] for name in BAD_FIELDS}


def turn2(ps) -> list[int]:
    """The good conversation's next turn: its prompt, a reply and a new message (the store holds only turn 1)."""
    return ps["good"] + [100 + (7 * i) % 3000 for i in range(40)]


def foreign_model(work: Path) -> Path:
    """qwen3-tiny-3m's architecture with other weights (every weight + 1e-3 noise): what a fine-tune looks like."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = work / "foreign"
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(TARGET).save_pretrained(out)
    return out


def spoil(store, ps: dict, work: Path) -> None:
    """The bad entries, each on its prompt's first block: truncated, mis-shaped, bad header fields, flipped K bytes,
    NaN data (re-checksummed), and the prompts stored by another model / other weights instead."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvtransfer.core.io import atomic_save_tensors, load_tensors
    from kvtransfer.serve.ident import serving_identity
    from kvtransfer.serve.store import checksum, save_prefill

    key = serving_identity(str(TARGET))["key"]
    first = lambda name: store.block_path(key, store.hashes(ps[name], key)[0])  # noqa: E731
    path = first("corrupt")
    path.write_bytes(path.read_bytes()[:-4096])

    def rewrite(name, tensors_fix=None, header_fix=None):
        path = first(name)
        tensors, header = load_tensors(path)
        tensors = tensors_fix(tensors) if tensors_fix else tensors
        path.unlink()
        atomic_save_tensors(path, tensors, header_fix(header) if header_fix else header)

    rewrite("mis_shaped", lambda t: t | {"k": t["k"][:, :, :-1].contiguous()})
    rewrite("n_layers_two", header_fix=lambda h: h | {"model": h["model"] | {"n_layers": "two"}})
    rewrite("model_list", header_fix=lambda h: h | {"model": [h["model"]]})

    def nan(t):
        t = t | {"k": torch.full_like(t["k"], float("nan"))}
        return t

    rewrite("nan", nan, None)
    path = first("nan")  # a producer that computed NaN: its checksum is right, the map's NaN check refuses it
    tensors, header = load_tensors(path)
    path.unlink()
    atomic_save_tensors(path, tensors, header | {"checksum": checksum(tensors["token_ids"], tensors["k"], tensors["v"])})
    path = first("flipped")  # bytes flipped inside K (8 layers' worth of the tensor), header intact
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8:8 + n])["k"]["data_offsets"]
    for at in range(8 + n + start, 8 + n + end, 97):
        raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))
    for name in ("no_entry", "other_model", "foreign"):
        for h in store.hashes(ps[name], key):
            store.block_path(key, h).unlink(missing_ok=True)
    save_prefill(store, AutoModelForCausalLM.from_pretrained(OTHER, dtype=torch.float32), ps["other_model"], ref=OTHER)
    ref = foreign_model(work)
    save_prefill(store, AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32), ps["foreign"], ref=ref)


def mappers(work: Path) -> None:
    from transformers import AutoConfig

    from kvtransfer.config.identity import weights_identity
    from kvtransfer.serve.mapping import identity_mapper

    cfg = AutoConfig.from_pretrained(TARGET)
    w = weights_identity(str(TARGET))
    identity_mapper(cfg, model_id=str(TARGET), start_ids=[START], weights=w).save(work / "identity")
    identity_mapper(cfg, model_id=str(TARGET), start_ids=[START], noise=0.05, weights=w).save(work / "perturbed")
    identity_mapper(AutoConfig.from_pretrained(OTHER), model_id=str(OTHER), start_ids=[START]).save(work / "other_pair")


def settle() -> None:
    """The connector writes its stats on a 0.5 s timer (kvtransfer.serve.policy.Counters): wait one period."""
    import time

    time.sleep(1.0)


def main(out: Path) -> None:
    from engines import close, engine, generate, kv_config

    from kvtransfer.serve.policy import Counters
    from kvtransfer.serve.store import KVStore

    out.mkdir(parents=True, exist_ok=True)
    store = KVStore(out / "store")
    ps = prompts()
    names = [n for n in ps if n not in BAD_FIELDS]
    report = {"prompts": {k: len(v) for k, v in ps.items()} | {"turn2": len(turn2(ps))}, "block_size": store.block_size}
    mappers(out)

    llm = engine(TARGET, kv=kv_config("kv_producer", out / "store"))
    report["cold"] = dict(zip(names, generate(llm, [ps[n] for n in names], 8)))
    report["cold"]["turn2"] = generate(llm, [turn2(ps)], 8)[0]
    close(llm)
    for h in store.hashes(turn2(ps), next(iter(store.model_keys())))[len(ps["good"]) // store.block_size:]:
        for key in store.model_keys():  # the producer stored turn 2 too: keep only turn 1's blocks
            store.block_path(key, h).unlink(missing_ok=True)
    report["blocks"] = len(store.blocks())
    spoil(store, ps, out)

    stats = out / "stats_consumer.json"
    llm = engine(TARGET, kv=kv_config("kv_consumer", out / "store", mapper=out / "identity", source_model=TARGET,
                                      stats=stats))
    order = names + list(BAD_FIELDS) + ["good", "turn2"]
    report["consumer"] = {}
    for i, name in enumerate(order):
        ids = turn2(ps) if name == "turn2" else ps[name]
        tag = {"kvtransfer_tag": f"{i}:{name}"}
        params = tag | BAD_FIELDS.get(name, {})
        report["consumer"][f"{i}:{name}"] = generate(llm, [ids], 8, params=params)[0]
    settle()
    close(llm)
    report["consumer_stats"] = Counters.load(stats)
    report["consumer_worker"] = json.loads(Path(f"{stats}.worker.json").read_text())

    stats = out / "stats_wrong_pair.json"
    llm = engine(TARGET, kv=kv_config("kv_consumer", out / "store", mapper=out / "other_pair", source_model=OTHER,
                                      stats=stats))
    report["wrong_pair"] = dict(zip(["good"], generate(llm, [ps["good"]], 8)))
    settle()
    close(llm)
    report["wrong_pair_stats"] = Counters.load(stats)

    stats = out / "stats_prefix.json"
    llm = engine(TARGET, prefix_caching=True,
                 kv=kv_config("kv_consumer", out / "store", mapper=out / "perturbed", source_model=TARGET, stats=stats))
    salted = generate(llm, [ps["good"]], 8, salt="kvtransfer-mapped")[0]
    unsalted = generate(llm, [ps["good"]], 8)[0]
    salted_again = generate(llm, [ps["good"]], 8, salt="kvtransfer-mapped")[0]
    report["prefix"] = {"salted": salted, "unsalted": unsalted, "salted_again": salted_again}
    settle()
    close(llm)
    report["prefix_stats"] = Counters.load(stats)
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(Path(sys.argv[1]))
