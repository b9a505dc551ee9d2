"""The handoff on the real pair (Qwen2.5-Coder 0.5B -> 1.5B), through the proxy and two vLLM engines (serving env).

    PYTHONPATH=$PWD .venv-serve/bin/python experiments/handoff/real_pair.py OUT_DIR \
        --real ~/.cache/kvtransfer-real --mapper artifacts/qwen25coder/mappers/b0eb9ce8807e3a38 [--sizes 1024 2048]
        -> OUT_DIR/real_pair.json (never overwritten)

Engines: the 0.5B as producer, the 1.5B as consumer with the mapper (bf16, eager, prefix caching off,
`--enable-prompt-tokens-details`), the proxy with `--start-ids 151643` (<|endoftext|>, the mapper's prefix_token).
1. Handoff latency: for each size n, a fresh <|endoftext|> + WikiText-2 window of n tokens (another offset per
   repeat, so the producer really prefills and saves): the proxy's time from the request to the target's first
   (only) token, the producer's save included (source engine warm), against the consumer's cold prefill of the
   same ids (kvtransfer off, sent directly). First tokens of both recorded.
2. A CoQA conversation (story, then Q/A turns, 12 greedy tokens an answer, stop at a newline) served through
   the proxy, source for turns 1-2, handed over at turn 3, later turns mapping the handed-over prefix; each
   turn's prompt is also sent to the consumer directly with kvtransfer off (the target re-prefilling the whole
   session: its own answer). Per turn: TTFT of both (streamed, time to the first content event) and whether the
   answers agree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from load_tiny import kill, machine, wait_up  # noqa: E402

START = 151643
PY = sys.executable


def kv(role, store, **extra):
    return json.dumps({"kv_connector": "KVTransferConnector", "kv_connector_module_path": "kvtransfer.serve.connector",
                       "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"store": str(store), **{k: str(v) for k, v in extra.items()}}})


def engine(model, port, kvcfg, log):
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port), "--host",
           "127.0.0.1", "--dtype", "bfloat16", "--enforce-eager", "--no-enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", "4608", "--served-model-name", f"m{port}",
           "--kv-transfer-config", kvcfg]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stream_ttft(client, url, body, headers=None):
    """(seconds to the first content event, text, token ids, last kvtransfer field) of a streamed completion."""
    t0 = time.perf_counter()
    ttft, text, ids, field = None, "", [], None
    with client.stream("POST", url, json={**body, "stream": True}, headers=headers or {}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            field = ev.get("kvtransfer", field)
            for ch in ev.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += ch.get("text", "")
                for tok in (ch.get("logprobs") or {}).get("tokens") or []:
                    ids.append(int(tok.split(":")[1]))
    return ttft, text, ids, field


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--real", default=str(Path.home() / ".cache/kvtransfer-real"))
    ap.add_argument("--mapper", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--turns", type=int, default=6)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "real_pair.json").exists():
        raise SystemExit(f"{out}/real_pair.json exists: pick a new OUT_DIR")
    src, tgt = Path(args.real) / "hf/qwen25coder-0.5b", Path(args.real) / "hf/qwen25coder-1.5b"
    store = out / "store"
    import torch

    from kvtransfer.serve.mapping import native_sink_layers
    native_sink_layers(str(tgt), [START], torch.float32, cache_dir=str(store / "sinks"))  # before the engines start
    from transformers import AutoTokenizer

    from kvtransfer.eval.perplexity import load_pages
    tok = AutoTokenizer.from_pretrained(tgt)
    wiki = [i for page in load_pages(ROOT / "data/benchmarks/wikitext2.jsonl")[:400]
            for i in tok.encode(page, add_special_tokens=False)]
    t0 = time.time()
    procs = [engine(src, 8201, kv("kv_producer", store), out / "producer.log"),
             engine(tgt, 8202, kv("kv_consumer", store, mapper=Path(args.mapper).resolve(), source_model=src,
                                  stats=out / "consumer_stats.json"), out / "consumer.log")]
    procs.append(subprocess.Popen([PY, "-m", "kvtransfer.serve.proxy", "--source", "http://127.0.0.1:8201", "--target",
                                   "http://127.0.0.1:8202", "--start-ids", str(START), "--port", "8200"],
                                  stdout=(out / "proxy.log").open("w"), stderr=subprocess.STDOUT,
                                  env=os.environ | {"PYTHONPATH": str(ROOT)}, start_new_session=True))
    report = {"sizes": args.sizes, "repeats": args.repeats, "latency": [], "conversation": []}
    try:
        for url, p in zip(("http://127.0.0.1:8201", "http://127.0.0.1:8202", "http://127.0.0.1:8200"), procs):
            wait_up(url, p, timeout=1500)
        report["startup_s"] = time.time() - t0
        c = httpx.Client(timeout=1200)
        proxy, direct = "http://127.0.0.1:8200/v1/completions", "http://127.0.0.1:8202/v1/completions"
        one = {"max_tokens": 1, "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True}
        # warm both engines
        c.post(direct, json={**one, "model": "m8202", "prompt": [START] + wiki[:16]})
        c.post("http://127.0.0.1:8201/v1/completions", json={**one, "model": "m8201", "prompt": [START] + wiki[:16]})
        offset = 0
        for n in args.sizes:
            for rep in range(args.repeats):
                ids = [START] + wiki[offset:offset + n - 1]
                offset += n
                t = time.perf_counter()
                r = c.post(proxy, json={**one, "model": "target", "prompt": ids}).json()
                handoff_s = time.perf_counter() - t
                t = time.perf_counter()
                cold = c.post(direct, json={**one, "model": "m8202", "prompt": ids,
                                            "kv_transfer_params": {"kvtransfer": "off"}}).json()
                cold_s = time.perf_counter() - t
                report["latency"].append({"n": n, "rep": rep, "handoff_s": handoff_s, "cold_s": cold_s,
                                          "kvtransfer": r["kvtransfer"],
                                          "first_token": r["choices"][0]["logprobs"]["tokens"][0],
                                          "cold_first_token": cold["choices"][0]["logprobs"]["tokens"][0]})
                print(json.dumps(report["latency"][-1]), flush=True)
        # the conversation
        rec = json.loads((ROOT / "data/benchmarks/coqa.jsonl").read_text().splitlines()[0])
        questions = rec["questions"]["input_text"] if isinstance(rec["questions"], dict) else rec["questions"]
        gold = rec["answers"]["input_text"] if isinstance(rec["answers"], dict) else rec["answers"]
        ids = [START] + tok.encode(rec["story"], add_special_tokens=False)
        gen = {"max_tokens": 12, "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True, "stop": ["\n"]}
        for turn in range(args.turns):
            ids = ids + tok.encode(f"\n\nQ: {questions[turn]}\nA:", add_special_tokens=False)
            model = "target" if turn >= 2 else "source"
            ttft, text, ans, field = stream_ttft(c, proxy, {**gen, "model": model, "prompt": ids},
                                                 {"x-kvtransfer-session": "coqa"})
            row = {"turn": turn + 1, "prompt": len(ids), "engine": model, "ttft_s": ttft, "answer": text,
                   "gold": gold[turn], "kvtransfer": field}
            if model == "target":
                r_ttft, r_text, _, _ = stream_ttft(c, direct, {**gen, "model": "m8202", "prompt": ids,
                                                               "kv_transfer_params": {"kvtransfer": "off"}})
                row.update(reprefill_ttft_s=r_ttft, reprefill_answer=r_text, same_answer=r_text == text)
            report["conversation"].append(row)
            print(json.dumps(row), flush=True)
            ids = ids + ans
        report["proxy_stats"] = c.get("http://127.0.0.1:8200/kvtransfer/stats").json()
    finally:
        for p in procs:
            kill(p)
    report["consumer_reasons"] = json.loads((out / "consumer_stats.json").read_text()).get("reasons") \
        if (out / "consumer_stats.json").exists() else None
    report["machine"] = machine()
    (out / "real_pair.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
