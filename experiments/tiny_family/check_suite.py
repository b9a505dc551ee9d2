#!/usr/bin/env python3
"""Score the tiny models on data/tiny/{cloze,completion}.jsonl (sanity check of the suite).

cloze: lm-eval HellaSwag conventions -- query = preprocess(activity_label + ": "
  + ctx_a + " " + ctx_b.capitalize()), choice = " " + preprocess(ending); context
  and continuation are tokenized separately; the context is prefixed with
  <|endoftext|> (the document separator the models were trained with).
  acc = argmax of the summed continuation log-prob, acc_norm = argmax of the
  summed log-prob divided by the continuation's character length.
completion: greedy decoding of up to 24 new tokens after <|endoftext|> +
  context; the prediction is the generated text up to the first newline,
  truncated to the target's word count.  exact_match / token F1 after SQuAD-style
  normalisation (lower-case, punctuation removed, whitespace split; articles
  kept).  All numbers are on fp16-saved weights computed in fp32.

Usage:  python experiments/tiny_family/check_suite.py \
            [--models models/tiny/qwen3-tiny-1m ...] [--out experiments/tiny_family/logs/suite.json]
"""
import argparse
import collections
import glob
import json
import re
import string
import time

import torch


def preprocess(text):
    """lm-eval hellaswag preprocessing."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def norm_words(s):
    s = s.lower().translate(str.maketrans("", "", string.punctuation))
    return s.split()


def f1(pred, gold):
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gold)
    return 2 * p * r / (p + r)


@torch.no_grad()
def cloze(model, tok, rows):
    eot = tok.eos_token_id
    hit, hit_norm, by_src = 0, 0, collections.defaultdict(lambda: [0, 0])
    for row in rows:
        query = preprocess(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
        ctx = [eot] + tok.encode(query, add_special_tokens=False)
        conts = [tok.encode(" " + preprocess(e), add_special_tokens=False) for e in row["endings"]]
        L = max(len(ctx) + len(c) for c in conts)
        ids = torch.full((4, L), eot, dtype=torch.long)
        for i, c in enumerate(conts):
            ids[i, : len(ctx) + len(c)] = torch.tensor(ctx + c)
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        scores = []
        for i, c in enumerate(conts):
            pos = torch.arange(len(ctx) - 1, len(ctx) + len(c) - 1)
            scores.append(logp[i, pos, torch.tensor(c)].sum().item())
        lens = [len(" " + preprocess(e)) for e in row["endings"]]
        gold = int(row["label"])
        a = int(max(range(4), key=lambda i: scores[i]) == gold)
        an = int(max(range(4), key=lambda i: scores[i] / lens[i]) == gold)
        hit += a
        hit_norm += an
        src = row["source_id"].split("~")[-1]
        by_src[src][0] += an
        by_src[src][1] += 1
    n = len(rows)
    return dict(n=n, acc=hit / n, acc_norm=hit_norm / n,
                acc_norm_by_source={k: v[0] / v[1] for k, v in sorted(by_src.items())})


@torch.no_grad()
def completion(model, tok, rows, max_new_tokens=24):
    eot = tok.eos_token_id
    em = f = 0.0
    examples = []
    for row in rows:
        ids = torch.tensor([[eot] + tok.encode(row["context"], add_special_tokens=False)])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=eot, eos_token_id=eot)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
        gold = norm_words(row["target"])
        pred = text.split()[: len(row["target"].split())]
        pw = norm_words(" ".join(pred))
        em += float(pw == gold)
        f += f1(pw, gold)
        if len(examples) < 5:
            examples.append(dict(target=row["target"], prediction=" ".join(pred)))
    n = len(rows)
    return dict(n=n, exact_match=em / n, token_f1=f / n, examples=examples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=None, help="model dirs (default: models/tiny/qwen3-tiny-*)")
    ap.add_argument("--data", default="data/tiny")
    ap.add_argument("--limit", type=int, default=None, help="only the first N items of each file")
    ap.add_argument("--out", default="experiments/tiny_family/logs/suite.json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load = lambda name: [json.loads(line) for line in open(f"{args.data}/{name}.jsonl")][: args.limit]  # noqa: E731
    cl, co = load("cloze"), load("completion")
    models = args.models or sorted(glob.glob("models/tiny/qwen3-tiny-*"),
                                   key=lambda d: float(d.rsplit("-", 1)[-1].rstrip("m")))
    results = {}
    for d in models:
        t = time.time()
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        results[d] = dict(cloze=cloze(model, tok, cl), completion=completion(model, tok, co),
                          seconds=round(time.time() - t, 1))
        r = results[d]
        print(f"{d}: cloze acc {r['cloze']['acc']:.3f} acc_norm {r['cloze']['acc_norm']:.3f} "
              f"{r['cloze']['acc_norm_by_source']} | completion EM {r['completion']['exact_match']:.3f} "
              f"F1 {r['completion']['token_f1']:.3f} ({r['seconds']}s)", flush=True)
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
