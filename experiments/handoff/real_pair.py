"""The handoff on the real pair (Qwen2.5-Coder 0.5B -> 1.5B), through the proxy and two vLLM engines (serving env).

    PYTHONPATH=$PWD .venv-serve/bin/python experiments/handoff/real_pair.py OUT_DIR \
        --real ~/.cache/kvtransfer-real --mapper MAPPER_DIR [--sizes 1024 2048 4096 8192 --repeats 10 10 5 5]
        -> OUT_DIR/latency.json, OUT_DIR/overhead.json, OUT_DIR/conversation.json (each written once, atomically)
    --reverse: large -> small (the 1.5B reads the context as the source, the 0.5B answers; a 1.5B -> 0.5B --mapper)

Engines as docs/serving.md starts them: the 0.5B as producer and the 1.5B as consumer with the mapper, float32
(`--dtype`), eager, prefix caching on, `--enable-prompt-tokens-details`; the proxy with `--mapper` and `--store`.

1. Switch latency (latency.json). For each size n and repeat: a session whose context is <|endoftext|> + a
   WikiText-2 window of n tokens (another window per repeat) and a first question, which the source answers
   through the proxy (16 greedy tokens; its turn is written through). The switch prompt is that turn, the
   answer, and a new question of 30-60 tokens, sent to the target through the proxy (`max_tokens=1`: the time to
   the response is the time to the first token). Against it, on the same ids: the target's cold prefill (sent to
   the consumer directly, kvtransfer off, a fresh cache salt: nothing cached) and the truncation twin (the target
   prefilling only <|endoftext|> + the last 128 tokens, nothing mapped). The order of the switch and the cold
   prefill alternates between repeats. First tokens of all three are recorded. Rows finished are kept in
   OUT_DIR/latency.jsonl, so a killed run resumes where it stopped.
2. Write-through overhead (overhead.json, `--overhead N`): the consumer is stopped and a plain 0.5B engine (no
   connector, prefix caching on) started; N interleaved pairs of fresh 1,024-token contexts, each sent as a source
   turn through the proxy (written through) and to the plain engine, order alternating; TTFT of each.
3. A 10-turn CoQA session handed over at turn 3 (conversation.json, `--conversations N`): turns 1-2 on the source,
   3-10 on the target through the proxy; beside it the target serving the whole session itself (direct, kvtransfer
   off, its own cache salt: its prefix cache serves earlier turns). Per turn: TTFT of both (streamed), the
   answers, F1 against gold, and whether the two answers agree. (Runs before step 2, which stops the consumer.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from load_tiny import kill, machine, wait_up  # noqa: E402

START = 151643
PY = sys.executable
QUESTIONS = [  # second-turn questions of 30-60 tokens (the switch's new user turn)
    "Thinking about everything in the passage above, which person, place or event is described in the most detail, "
    "and what are the two or three most important facts the passage gives about it?",
    "Summarise in one sentence what the passage above says happened first and what happened last, and name any "
    "dates or numbers that the passage mentions along the way.",
    "If you had to give the passage above a short title of at most eight words, what would it be, and which "
    "sentence of the passage made you choose that title?",
]


KEY = {"authorization": "Bearer real-pair"}  # sessions are bound to an API key


def kv(role, store, **extra):
    return json.dumps({"kv_connector": "KVTransferConnector", "kv_connector_module_path": "kvtransfer.serve.connector",
                       "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"store": str(store), **{k: str(v) for k, v in extra.items()}}})


def engine(model, port, kvcfg, log, max_len, space_gb, dtype="float32"):
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port), "--host",
           "127.0.0.1", "--dtype", dtype, "--enforce-eager", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", str(max_len), "--served-model-name", f"m{port}"]
    cmd += ["--kv-transfer-config", kvcfg] if kvcfg else []
    # every engine on the same cores: vLLM's CPU binding reserves one core per engine for its scheduler, and one
    # more with a KV connector, which on 2 cores leaves a plain engine 1 OMP thread and a connector engine both
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": str(space_gb), "PYTHONPATH": str(ROOT),
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def timed(client, url, body, headers=None) -> tuple[float, dict]:
    """(seconds, JSON reply) of one non-streamed request."""
    t0 = time.perf_counter()
    r = client.post(url, json=body, headers=headers or {})
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return seconds, r.json()


def first_token(reply: dict) -> int:
    return int(reply["choices"][0]["logprobs"]["tokens"][0].split(":")[1])


def tokens(reply: dict) -> list[int]:
    return [int(t.split(":")[1]) for t in reply["choices"][0]["logprobs"]["tokens"]]


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


def write_once(path: Path, data: dict) -> None:
    from kvtransfer.core.io import atomic_write_json

    if path.exists():
        raise SystemExit(f"{path} exists: results are never overwritten, pick a new OUT_DIR")
    atomic_write_json(path, data)


def summary(rows: list[dict]) -> list[dict]:
    """Per size: n, median and max of the switch and the cold prefill, and the median speedup."""
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        sel = [r for r in rows if r["tokens"] == n]
        hand = [x for r in sel for x in r["handoff_ttft_s"]]
        cold = [x for r in sel for x in r["cold_ttft_s"]]
        out.append({"tokens": n, "n": len(hand), "handoff_median_s": statistics.median(hand),
                    "handoff_max_s": max(hand), "cold_median_s": statistics.median(cold), "cold_max_s": max(cold),
                    "speedup_median": statistics.median(cold) / statistics.median(hand)})
    return out


def f1(pred: str, gold: str) -> float:
    from kvtransfer.eval.coqa import f1_score

    return f1_score(pred, gold)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--real", default=str(Path.home() / ".cache/kvtransfer-real"))
    ap.add_argument("--mapper", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, nargs="+", default=[10, 10, 5, 5])
    ap.add_argument("--overhead", type=int, default=10)
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--truncate", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="both engines' dtype (bfloat16 halves their memory)")
    ap.add_argument("--reverse", action="store_true",
                    help="large -> small: the 1.5B is the source (reads the context), the 0.5B the target; --mapper "
                         "must be a 1.5B -> 0.5B map (pair.direction=reverse)")
    args = ap.parse_args()
    if len(args.repeats) != len(args.sizes):
        ap.error("give one --repeats value per --sizes value")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from kvtransfer.serve.proxy import mapper_start_ids

    global START
    START = mapper_start_ids(args.mapper)[0]  # <|endoftext|> (151643) for the real pair's prefix_token mapper
    src, tgt = Path(args.real) / "hf/qwen25coder-0.5b", Path(args.real) / "hf/qwen25coder-1.5b"
    if args.reverse:
        src, tgt = tgt, src
    store = out / "store"
    provenance = machine()  # the tree the engines load, before anything else can change it
    from transformers import AutoTokenizer

    from kvtransfer.eval.perplexity import load_pages
    tok = AutoTokenizer.from_pretrained(tgt)
    wiki = [i for page in load_pages(ROOT / "data/benchmarks/wikitext2.jsonl")
            for i in tok.encode(page, add_special_tokens=False)]
    max_len = max(args.sizes) + 256
    t0 = time.time()
    procs = {"producer": engine(src, 8201, kv("kv_producer", store), out / "producer.log", max_len, 1, args.dtype),
             "consumer": engine(tgt, 8202, kv("kv_consumer", store, mapper=Path(args.mapper).resolve(), source_model=src,
                                               stats=out / "consumer_stats.json"), out / "consumer.log", max_len, 1,
                                  args.dtype)}
    procs["proxy"] = subprocess.Popen([PY, "-m", "kvtransfer.serve.proxy", "--source", "http://127.0.0.1:8201",
                                       "--target", "http://127.0.0.1:8202", "--mapper", str(Path(args.mapper).resolve()),
                                       "--store", str(store), "--port", "8200", "--switch-wait", "30"],
                                      stdout=(out / "proxy.log").open("w"), stderr=subprocess.STDOUT,
                                      env=os.environ | {"PYTHONPATH": str(ROOT)}, start_new_session=True)
    proxy, direct = "http://127.0.0.1:8200/v1/completions", "http://127.0.0.1:8202/v1/completions"
    one = {"max_tokens": 1, "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True}
    done_path = out / "latency.jsonl"
    done = [json.loads(line) for line in done_path.read_text().splitlines()] if done_path.exists() else []
    try:
        for url, name in (("http://127.0.0.1:8201", "producer"), ("http://127.0.0.1:8202", "consumer"),
                          ("http://127.0.0.1:8200", "proxy")):
            wait_up(url, procs[name], timeout=1800)
        startup_s = time.time() - t0
        c = httpx.Client(timeout=3600)
        for url, model in ((direct, "m8202"), ("http://127.0.0.1:8201/v1/completions", "m8201")):  # warm-up
            c.post(url, json={**one, "model": model, "prompt": [START] + wiki[:64],
                              "kv_transfer_params": {"kvtransfer": "off"}})
        # 1. switch latency
        offset = sum(n + 64 for n in args.sizes for _ in range(max(args.repeats)))  # windows past those of step 3
        for n, repeats in zip(args.sizes, args.repeats):
            for rep in range(repeats):
                start = offset + sum(m * r for m, r in zip(args.sizes, args.repeats) if m < n) + rep * n
                if any(r["tokens"] == n and r["rep"] == rep for r in done):
                    continue
                context = [START] + wiki[start:start + n - 1]
                q1 = tok.encode("\n\nQuestion: what is the passage above about?\nAnswer:", add_special_tokens=False)
                session = {**KEY, "x-kvtransfer-session": f"latency-{n}-{rep}-{uuid.uuid4().hex[:8]}"}
                source_s, turn1 = timed(c, proxy, {**one, "max_tokens": 16, "model": "source", "prompt": context + q1},
                                        session)
                q2 = tok.encode(f"\n\nQuestion: {QUESTIONS[rep % len(QUESTIONS)]}\nAnswer:", add_special_tokens=False)
                ids = context + q1 + tokens(turn1) + q2
                cold_body = {**one, "model": "m8202", "prompt": ids, "kv_transfer_params": {"kvtransfer": "off"},
                             "cache_salt": uuid.uuid4().hex}
                if rep % 2:
                    cold_s, cold = timed(c, direct, cold_body)
                hand_s, hand = timed(c, proxy, {**one, "model": "target", "prompt": ids}, session)
                if not rep % 2:
                    cold_s, cold = timed(c, direct, cold_body)
                trunc_s, trunc = timed(c, direct, {**one, "model": "m8202", "prompt": [START] + ids[-args.truncate:],
                                                   "kv_transfer_params": {"kvtransfer": "off"},
                                                   "cache_salt": uuid.uuid4().hex})
                row = {"tokens": n, "rep": rep, "prompt": len(ids), "new_turn": len(tokens(turn1)) + len(q2),
                       "source_turn_s": source_s, "handoff_s": hand_s, "cold_s": cold_s, "truncate_s": trunc_s,
                       "kvtransfer": hand["kvtransfer"], "first_token": first_token(hand),
                       "cold_first_token": first_token(cold), "truncate_first_token": first_token(trunc)}
                done.append(row)
                with done_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
        rows = []
        for n in args.sizes:
            sel = [r for r in done if r["tokens"] == n]
            if sel:
                rows.append({"tokens": n, "direction": "large_to_small" if args.reverse else "small_to_large",
                             "repair": "none", "source_warm": True,
                             "handoff_ttft_s": [r["handoff_s"] for r in sel], "cold_ttft_s": [r["cold_s"] for r in sel],
                             "truncate_ttft_s": [r["truncate_s"] for r in sel], "truncate_tokens": args.truncate,
                             "mapped": [r["kvtransfer"]["mapped"] for r in sel],
                             "prefilled": [r["kvtransfer"]["prefilled"] for r in sel],
                             "first_token_equal_cold": sum(r["first_token"] == r["cold_first_token"] for r in sel),
                             "first_token_equal_truncate": sum(r["truncate_first_token"] == r["cold_first_token"]
                                                               for r in sel)})
        stats = c.get("http://127.0.0.1:8200/kvtransfer/stats").json()
        write_once(out / "latency.json", {"rows": rows, "summary": summary(rows), "startup_s": startup_s,
                                          "dtype": args.dtype,
                                          "proxy_stats": stats, "provenance": provenance})
        # 3. the conversation, handed over at turn 3
        if args.conversations:
            convo = []
            records = [json.loads(line) for line in (ROOT / "data/benchmarks/coqa.jsonl").read_text().splitlines()]
            gen = {"max_tokens": 12, "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True,
                   "stop": ["\n"]}
            for k, rec in enumerate(records[:args.conversations]):
                questions = rec["questions"]["input_text"] if isinstance(rec["questions"], dict) else rec["questions"]
                gold = rec["answers"]["input_text"] if isinstance(rec["answers"], dict) else rec["answers"]
                ids = [START] + tok.encode(rec["story"], add_special_tokens=False)
                ref_ids = list(ids)
                session, salt = {**KEY, "x-kvtransfer-session": f"coqa-{k}-{uuid.uuid4().hex[:8]}"}, uuid.uuid4().hex
                for turn in range(min(10, len(questions))):
                    q = tok.encode(f"\n\nQ: {questions[turn]}\nA:", add_special_tokens=False)
                    ids, ref_ids = ids + q, ref_ids + q
                    model = "target" if turn >= 2 else "source"
                    ttft, text, ans, field = stream_ttft(c, proxy, {**gen, "model": model, "prompt": ids}, session)
                    r_ttft, r_text, r_ans, _ = stream_ttft(c, direct, {**gen, "model": "m8202", "prompt": ref_ids,
                                                                       "kv_transfer_params": {"kvtransfer": "off"},
                                                                       "cache_salt": salt})
                    row = {"conversation": k, "turn": turn + 1, "prompt": len(ids), "engine": model, "ttft_s": ttft,
                           "answer": text, "gold": gold[turn], "f1": f1(text, gold[turn]), "kvtransfer": field,
                           "target_only_ttft_s": r_ttft, "target_only_answer": r_text,
                           "target_only_f1": f1(r_text, gold[turn]), "same_answer": r_text.strip() == text.strip()}
                    convo.append(row)
                    print(json.dumps(row), flush=True)
                    ids, ref_ids = ids + ans, ref_ids + r_ans
            write_once(out / "conversation.json", {"rows": convo, "provenance": provenance})
        # 2. write-through overhead: a plain 0.5B in the consumer's place
        if args.overhead:
            kill(procs["consumer"])
            procs["plain"] = engine(src, 8203, None, out / "plain.log", 2048, 1, args.dtype)
            wait_up("http://127.0.0.1:8203", procs["plain"], timeout=1800)
            plain = "http://127.0.0.1:8203/v1/completions"
            c.post(plain, json={**one, "model": "m8203", "prompt": [START] + wiki[:64]})
            pairs = []
            n_over = min(1024, max_len - 64)  # a context the source's max-model-len admits
            for i in range(args.overhead):
                ids = [START] + wiki[i * (n_over + 64):i * (n_over + 64) + n_over - 1]
                session = {**KEY, "x-kvtransfer-session": f"overhead-{i}-{uuid.uuid4().hex[:8]}"}
                runs = [("through", lambda: timed(c, proxy, {**one, "model": "source", "prompt": ids}, session)),
                        ("plain", lambda: timed(c, plain, {**one, "model": "m8203", "prompt": ids}))]
                got = {name: fn()[0] for name, fn in (runs if i % 2 == 0 else runs[::-1])}
                pairs.append(got)
                print(json.dumps(got), flush=True)
            through, plain_s = [p["through"] for p in pairs], [p["plain"] for p in pairs]
            write_once(out / "overhead.json", {"pairs": pairs, "tokens": n_over, "through_median_s": statistics.median(through),
                                               "plain_median_s": statistics.median(plain_s),
                                               "overhead_median": statistics.median(through) / statistics.median(plain_s) - 1,
                                               "provenance": provenance})
    finally:
        for p in procs.values():
            kill(p)


if __name__ == "__main__":
    main()
