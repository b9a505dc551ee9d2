#!/usr/bin/env python3
"""Train the tiny Qwen3 family (tokenizer + three models) on the get_corpus.py corpus.

1. A byte-level BPE tokenizer (HF ``tokenizers``, vocab 4096, single special
   token ``<|endoftext|>`` used as bos/eos/pad) is trained on the train split and
   wrapped as a ``PreTrainedTokenizerFast`` (``AutoTokenizer`` loads it offline).
2. Three ``Qwen3ForCausalLM`` models (see ``SPECS``) share num_key_value_heads=2
   and head_dim=32 but differ in width and depth.  Every model sees the same
   data in the same order: the train documents, each prefixed by
   ``<|endoftext|>``, are concatenated in file order, cut into non-overlapping
   ``--seq-len`` windows, and the windows are permuted once with ``--seed``.
   fp32 training, AdamW (0.9, 0.95, wd 0.1), linear warm-up then cosine decay
   to 10 % of the peak LR, grad-clip 1.0, ``torch.manual_seed(seed)`` before
   model init.  The budget is a fixed number of optimizer steps per model.
3. Models are saved in fp16 safetensors together with the tokenizer files to
   ``<outdir>/qwen3-tiny-<name>/``; loss curves go to ``<logdir>/<name>.csv``;
   held-out perplexity (all of data/tiny/heldout.jsonl, same packing, computed
   with the saved fp16 weights upcast to fp32) goes to ``<logdir>/<name>.json``.

Usage -- exactly how the committed models were made.  Phase 1 ran the three
models as parallel single-thread processes (the 2-core box was shared with
other jobs); after it the 3m/7m models were still WORSE than 1m on held-out
text (undertrained), so they got a phase 2: continue from the saved phase-1
weights with a fresh AdamW, peak LR x0.5, new 5 % warm-up + cosine, on the
next windows of the same data order (--resume-step):
  python experiments/tiny_family/train.py --steps ""          # tokenizer only
  for m in 1m=500 3m=450 7m=400; do
    python experiments/tiny_family/train.py --threads 1 --steps $m > /tmp/train_${m%%=*}.log 2>&1 &
  done; wait
  python experiments/tiny_family/train.py --threads 1 --steps 3m=350 --resume-from models/tiny/qwen3-tiny-3m \
      --resume-step 450 --lr-scale 0.5 --suffix .phase2
  python experiments/tiny_family/train.py --threads 1 --steps 7m=450 --resume-from models/tiny/qwen3-tiny-7m \
      --resume-step 400 --lr-scale 0.5 --suffix .phase2
Results are deterministic for a given CPU / thread count (fixed seeds and data
order); other CPUs or thread counts give float-level differences.
"""
import argparse
import csv
import json
import math
import os
import shutil
import time

import numpy as np
import torch

SPECIAL = "<|endoftext|>"
# name -> (hidden, layers, attention heads, intermediate, peak lr)
SPECS = {
    "1m": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512, lr=3e-3),
    "3m": dict(hidden_size=192, num_hidden_layers=6, num_attention_heads=6, intermediate_size=704, lr=2.5e-3),
    "7m": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, intermediate_size=896, lr=2e-3),
}
KV_HEADS, HEAD_DIM = 2, 32


def read_texts(path):
    with open(path) as f:
        return [json.loads(line)["text"] for line in f]


def train_tokenizer(texts, vocab_size, out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL, eos_token=SPECIAL,
                                   pad_token=SPECIAL, unk_token=SPECIAL, model_max_length=2048)
    fast.save_pretrained(out_dir)
    # name the generic fast-tokenizer class (transformers 5 writes its alias "TokenizersBackend")
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    json.dump(cfg, open(cfg_path, "w"), indent=2)
    return fast


def pack(tok, texts, seq_len):
    """<eot> doc <eot> doc ... cut into non-overlapping seq_len windows (remainder dropped)."""
    eot = tok.convert_tokens_to_ids(SPECIAL)
    ids = []
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(eot)
        ids.extend(enc.ids)
    n = len(ids) // seq_len
    return np.asarray(ids[: n * seq_len], dtype=np.int64).reshape(n, seq_len), len(ids)


def build_config(spec, vocab_size, eot):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"], num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
        rms_norm_eps=1e-6, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
    )


def count_params(model):
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    return total, total - emb


@torch.no_grad()
def mean_nll(model, windows, batch=32):
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), batch):
        x = torch.from_numpy(windows[i:i + batch])
        logits = model(input_ids=x).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                x[:, 1:].reshape(-1), reduction="sum")
        tot += nll.item()
        n += x[:, 1:].numel()
    model.train()
    return tot / n


def train_one(name, spec, steps, train_w, held_w, tok, args):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    eot = tok.convert_tokens_to_ids(SPECIAL)
    torch.manual_seed(args.seed)
    if args.resume_from:  # phase 2: continue from saved weights with a fresh optimizer and schedule
        model = AutoModelForCausalLM.from_pretrained(args.resume_from, dtype=torch.float32)
    else:
        model = Qwen3ForCausalLM(build_config(spec, len(tok), eot))
    model.config._attn_implementation = "sdpa"
    total, non_emb = count_params(model)
    print(f"[{name}] params total {total:,} non-embedding {non_emb:,}; {steps} steps", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    warm = max(1, int(0.05 * steps))

    def lr_at(s):
        if s < warm:
            return spec["lr"] * (s + 1) / warm
        p = (s - warm) / max(1, steps - warm)
        return spec["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    held_small = held_w[:: max(1, len(held_w) // 64)][:64]  # fixed subset for the running curve
    os.makedirs(args.logdir, exist_ok=True)
    log = open(os.path.join(args.logdir, f"{name}{args.suffix}.csv"), "w", newline="")
    wr = csv.writer(log)
    wr.writerow(["step", "tokens", "lr", "train_loss", "heldout_loss_subset", "elapsed_s"])
    t0, run = time.time(), []
    model.train()
    for s in range(steps):
        idx = [((args.resume_step + s) * args.batch + j) % len(train_w) for j in range(args.batch)]
        x = torch.from_numpy(train_w[idx])
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run.append(loss.item())
        if (s + 1) % args.log_every == 0 or s + 1 == steps:
            hl = mean_nll(model, held_small) if ((s + 1) % (args.log_every * 10) == 0 or s + 1 == steps) else ""
            wr.writerow([s + 1, (s + 1) * args.batch * args.seq_len, f"{lr_at(s):.3e}",
                         f"{np.mean(run):.4f}", f"{hl:.4f}" if hl != "" else "", f"{time.time() - t0:.1f}"])
            log.flush()
            print(f"[{name}] step {s + 1}/{steps} loss {np.mean(run):.4f} {hl} {time.time() - t0:.0f}s", flush=True)
            run = []
    train_s = time.time() - t0
    log.close()
    out = os.path.join(args.outdir, f"qwen3-tiny-{name}")
    model.config.use_cache = True
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = eot
    model.generation_config.pad_token_id = eot
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(args.tokdir, f), os.path.join(out, f))
    # held-out perplexity of what was saved (fp16 weights, computed in fp32)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    nll = mean_nll(saved, held_w)
    res = dict(name=name, dir=out, total_params=total, non_embedding_params=non_emb, steps=steps,
               tokens=steps * args.batch * args.seq_len, train_seconds=round(train_s, 1),
               heldout_nll=round(nll, 4), heldout_ppl=round(math.exp(nll), 3), lr=spec["lr"],
               resume_from=args.resume_from, resume_step=args.resume_step,
               **{k: v for k, v in spec.items() if k != "lr"})
    print(json.dumps(res), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="/tmp/kvt_tiny/train.jsonl")
    ap.add_argument("--heldout", default="data/tiny/heldout.jsonl")
    ap.add_argument("--outdir", default="models/tiny")
    ap.add_argument("--logdir", default="experiments/tiny_family/logs")
    ap.add_argument("--tokdir", default="/tmp/kvt_tiny/tokenizer")
    ap.add_argument("--steps", default="1m=500,3m=450,7m=400",
                    help="name=steps,... (subset allowed; empty: train/load the tokenizer only)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--resume-from", default=None, help="phase 2: start from this saved model (one name in --steps)")
    ap.add_argument("--resume-step", type=int, default=0, help="phase 2: steps already taken (data continues there)")
    ap.add_argument("--lr-scale", type=float, default=1.0, help="multiply the SPECS peak LR (phase 2 uses 0.5)")
    ap.add_argument("--suffix", default="", help="suffix for the log/result file names (e.g. .phase2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    texts = read_texts(args.corpus)
    if os.path.exists(os.path.join(args.tokdir, "tokenizer.json")):
        tok = AutoTokenizer.from_pretrained(args.tokdir)
    else:
        t = time.time()
        tok = train_tokenizer(texts, args.vocab, args.tokdir)
        print(f"tokenizer trained in {time.time() - t:.0f}s", flush=True)
    if not args.steps:
        return  # tokenizer only
    train_w, n_tok = pack(tok, texts, args.seq_len)
    train_w = train_w[np.random.default_rng(args.seed).permutation(len(train_w))]
    held_w, n_held = pack(tok, read_texts(args.heldout), args.seq_len)
    print(f"train tokens {n_tok:,} ({len(train_w)} windows); heldout tokens {n_held:,} ({len(held_w)} windows)")
    data = dict(train_tokens=n_tok, train_windows=len(train_w), heldout_tokens=n_held, heldout_windows=len(held_w),
                seq_len=args.seq_len, batch=args.batch, seed=args.seed, vocab=len(tok), threads=args.threads)
    for item in filter(None, args.steps.split(",")):
        name, steps = item.split("=")
        spec = {**SPECS[name], "lr": SPECS[name]["lr"] * args.lr_scale}
        res = train_one(name, spec, int(steps), train_w, held_w, tok, args)
        json.dump({**res, "data": data}, open(os.path.join(args.logdir, f"{name}{args.suffix}.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
