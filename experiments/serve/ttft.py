"""Time to first token of the 1.5B target inside vLLM: mapped cache vs cold prefill (issue 22, speed).

    .venv-serve/bin/python experiments/serve/ttft.py --real ~/.cache/kvtransfer-real --mapper <dir> \
        --out results/serve/ttft [--tokens 256 1024 2048] [--repeats 3] [--dtype bfloat16]

Prompts: <|endoftext|> + WikiText-2 text, n tokens in all. The 0.5B source (kv_producer) prefills each
prompt once (its time is recorded: it runs on the source's engine, not on the target's critical path).
The 1.5B target (kv_consumer, prefix caching off, eager) then answers each prompt with max_tokens=1:
mapped (n - 1 tokens mapped, the last computed) and cold ({"kvtransfer": "off"}: the same engine's own
full prefill), one warm-up and `repeats` timed requests each; TTFT = wall time of the request in the
offline LLM API. The map's share = the worker's load time (read + map + scatter) / mapped TTFT.
FLOPs: the target's body prefill of n tokens vs the mapper's apply FLOPs on n - 1 tokens + the target's
one-token step at sequence length n (kvtransfer.plan.prefill_flops).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def prompts(tokenizer, sizes: list[int]) -> dict[int, list[int]]:
    from kvtransfer.eval.perplexity import load_pages

    ids = [i for page in load_pages(ROOT / "data/benchmarks/wikitext2.jsonl")
           for i in tokenizer.encode(page, add_special_tokens=False)]
    start = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return {n: [start] + ids[:n - 1] for n in sizes}


def flops(real: Path, mapper_dir: str, n: int) -> dict:
    from transformers import AutoConfig

    from kvtransfer.core.mapper import load_mapper
    from kvtransfer.plan import prefill_flops, shape_from_config

    target = shape_from_config(AutoConfig.from_pretrained(real / "hf/qwen25coder-1.5b"))
    mapper = load_mapper(mapper_dir)
    cold = prefill_flops(target, n, n, lm_head=True)
    mapped = mapper.apply_flops_per_token * (n - 1) + prefill_flops(target, 1, n, lm_head=True)
    return {"cold_flops": cold, "mapped_flops": mapped, "flop_ratio": cold / mapped}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", default=os.path.expanduser(os.environ.get("KVT_REAL_DIR", "~/.cache/kvtransfer-real")))
    ap.add_argument("--mapper", default=os.environ.get("KVT_REAL_MAPPER"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from engines import close, engine, generate, kv_config

    real, out = Path(args.real), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ps = prompts(AutoTokenizer.from_pretrained(real / "hf/qwen25coder-1.5b"), args.tokens)
    src = engine(real / "hf/qwen25coder-0.5b", dtype=args.dtype, max_model_len=4096,
                 kv=kv_config("kv_producer", out / "store"))
    source_s = {n: generate(src, [p], 1)[0]["seconds"] for n, p in ps.items()}
    close(src)
    stats = out / "stats.json"
    llm = engine(real / "hf/qwen25coder-1.5b", dtype=args.dtype, max_model_len=4096,
                 kv=kv_config("kv_consumer", out / "store", mapper=args.mapper, source_model=real / "hf/qwen25coder-0.5b",
                              stats=stats))
    rows = []
    for n, p in ps.items():
        timed = {}
        for mode, params in (("cold", {"kvtransfer": "off"}), ("mapped", None)):
            runs = generate(llm, [p] * (1 + args.repeats), 1, logprobs=1, params=params)[1:]
            timed[mode] = [r["seconds"] for r in runs]
        loads = json.loads(Path(f"{stats}.worker.json").read_text())["loads"][-args.repeats:]
        row = {"tokens": n, "cold_s": statistics.median(timed["cold"]), "mapped_s": statistics.median(timed["mapped"]),
               "cold_all_s": timed["cold"], "mapped_all_s": timed["mapped"], "source_prefill_s": source_s[n],
               "load_s": statistics.median(x["total_s"] for x in loads),
               "map_s": statistics.median(x["map_s"] for x in loads), **flops(real, args.mapper, n)}
        row["speedup"] = row["cold_s"] / row["mapped_s"]
        row["map_share"] = row["load_s"] / row["mapped_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    close(llm)
    from kvtransfer.config.provenance import json_provenance

    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
               **{k: v for k, v in json_provenance().items() if k in ("commit", "dirty")}, "dtype": args.dtype, "mapper": args.mapper,
               "load_avg_end": os.getloadavg()}
    (out / "ttft.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (out / "ttft.md").write_text(table(rows))
    print(table(rows))


def table(rows: list[dict]) -> str:
    lines = ["| prompt tokens | cold TTFT (s) | mapped TTFT (s) | speed-up | map load (s) | map share of mapped TTFT "
             "| FLOP ratio cold / mapped | source 0.5B prefill (s, its own engine) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']:,} | {r['cold_s']:.2f} | {r['mapped_s']:.3f} | {r['speedup']:.1f}x | "
                     f"{r['load_s']:.3f} | {100 * r['map_share']:.0f} % | {r['flop_ratio']:.1f} | "
                     f"{r['source_prefill_s']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
