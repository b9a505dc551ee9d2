"""What the target writes on GSM8K-CoT with its own cache vs the transferred one (the main map).

    python experiments/qwen25coder/gsm8k_samples.py [--limit 2]    # ~5 min on 2 cores; after run.sh step 2

It runs the first --limit items of gsm8k_cot (8-shot, greedy) through lm-eval with log_samples, in the modes
target, transfer and no_context, with the main run's mapper and eval settings. It writes each generation and
its score to results/qwen25coder/tables/gsm8k_samples.md. The aggregate scores are in the main summary; this
file shows what the numbers are made of.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.eval.adapter import KVTransferLM  # noqa: E402
from kvtransfer.eval.tasks import task_manager  # noqa: E402
from kvtransfer.core.io import atomic_write_bytes  # noqa: E402

REAL = Path(os.environ.get("KVT_REAL_DIR", Path.home() / ".cache" / "kvtransfer-real"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--modes", default="transfer,target,no_context")
    ap.add_argument("--main", default=str(ROOT / "results" / "qwen25coder" / "runs" / "main"))
    args = ap.parse_args()
    from lm_eval import simple_evaluate

    summary = json.loads((Path(args.main) / "summary.json").read_text())
    config = json.loads((Path(args.main) / "config.json").read_text())
    mapper = ROOT / summary["mapper"]["path"]
    ecfg = config["eval"]
    lm = KVTransferLM(str(REAL / "hf" / "qwen25coder-0.5b"), str(REAL / "hf" / "qwen25coder-1.5b"), str(mapper),
                      mode="transfer", dtype="float32", device="cpu", context_start=config["context_start"],
                      share_prefix=ecfg["share_prefix"], batch_size=ecfg["batch_size"])
    lines = ["# GSM8K-CoT generations: target vs transferred cache", "",
             f"Made by `python experiments/qwen25coder/gsm8k_samples.py --limit {args.limit} --modes {args.modes}` on a 2-core CPU.",
             f"Mapper `{summary['mapper']['path']}` (the main run), native sink {lm.native_sink}, greedy, 8-shot.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        manager = task_manager(ROOT / ecfg["data_dir"], include_defaults=False, out_dir=tmp)
        for mode in args.modes.split(","):
            res = simple_evaluate(model=lm.with_mode(mode), tasks=["gsm8k_cot"], task_manager=manager,
                                  limit=args.limit, log_samples=True, bootstrap_iters=0, random_seed=0,
                                  numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
            for sample in res["samples"]["gsm8k_cot"]:
                if sample.get("filter", "strict-match") != "strict-match":
                    continue   # lm-eval lists each document once per filter; the generation is the same
                gen, score = sample["resps"][0][0], sample.get("exact_match")
                lines += [f"## item {sample['doc_id']}, {mode} (strict exact match: {score}; gold: "
                          f"{sample['target'].split('####')[-1].strip()})", "", "```text", gen.strip()[:1200], "```", ""]
            out = ROOT / "results" / "qwen25coder" / "tables" / "gsm8k_samples.md"
            atomic_write_bytes(out, ("\n".join(lines) + "\n").encode())   # after each mode: nothing is lost
            print(mode, "done", out, flush=True)


if __name__ == "__main__":
    main()
