#!/usr/bin/env python3
"""Build the tiny evaluation suite from data/tiny/eval.jsonl only (deterministic).

All spans are cut at whitespace-delimited word boundaries of the original text,
so newlines inside spans are kept exactly as in the documents the models were
trained on.  A document is "kjv" if its first line looks like "<Book> <n>",
else "wordnet".  One ``random.Random(seed)`` drives everything.  Each file is
balanced by source: half the items come from kjv documents and half from
wordnet documents (the eval split has 28 kjv chapters vs 276 wordnet groups,
so kjv chapters give several items each, at independently drawn positions);
within a source, documents are visited in a seeded shuffled order, one item
per document per pass.  The two halves are then shuffled together.

cloze.jsonl  (HellaSwag schema, ``Rowan/hellaswag`` fields)
  ctx = 40-80 consecutive words; the correct ending = the next 10-20 words.
  The split point must be a single space (mid-line), because lm-eval joins
  query and ending with " ".  3 distractors = spans with the same word count,
  also starting mid-line, from 3 OTHER eval documents of the SAME source (so
  genre alone does not give the answer; make_cloze gets one source at a time).  The gold position is uniform in 0..3.
  ``ctx_a = ctx``, ``ctx_b = ""`` (lm-eval capitalises ctx_b), activity_label =
  book name (kjv) or "WordNet"; split "val", split_type "indomain".
completion.jsonl  {"context", "target"}
  target = 3-8 words that finish a verse / gloss line or a sentence (last word
  ends in . ; : ? ! or is the last on its line), contains no earlier sentence
  end and starts mid-line; context = up to the 100 preceding words of the
  same document (>= 30), ending without trailing whitespace (continue it with
  " " + target).
multiturn.jsonl  (CoQA-style: source, story, questions{input_text,
  answer_start, answer_end}, answers{input_text, answer_start, answer_end})
  story = the document cut at the last line break before 2000 chars; 12 turns
  in story order; turn = "What follows '<5 words>'?" -> next 3-6 words.  The
  quote occurs exactly once in the story; quote+answer never cross a line
  break and never overlap another turn.  Offsets are character offsets into
  story (question spans point at the quote, answer spans at the answer).

Usage:  python experiments/tiny_family/make_suite.py [--seed 1234]
"""
import argparse
import json
import random
import re

KJV_TITLE = re.compile(r"^[A-Za-z][A-Za-z ]* \d+$")


def load(path):
    docs = []
    for line in open(path):
        text = json.loads(line)["text"]
        first = text.split("\n", 1)[0]
        src = "kjv" if KJV_TITLE.match(first) else "wordnet"
        label = first.rsplit(" ", 1)[0] if src == "kjv" else "WordNet"
        words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        docs.append(dict(text=text, source=src, label=label, words=words))
    return docs


def mid_line(doc, i):
    """True if word i is preceded by exactly one space (not a line start)."""
    w = doc["words"]
    return i > 0 and doc["text"][w[i - 1][1]:w[i][0]] == " "


def span(doc, i, j):
    """Text of words i..j-1."""
    return doc["text"][doc["words"][i][0]:doc["words"][j - 1][1]]


def make_cloze(docs, n, rng):
    items, order = [], list(range(len(docs)))
    rng.shuffle(order)
    for attempt in range(20 * n):
        if len(items) >= n:
            break
        d = docs[order[attempt % len(order)]]
        n_ctx, n_end = rng.randint(40, 80), rng.randint(10, 20)
        cands = [i for i in range(n_ctx, len(d["words"]) - n_end + 1) if mid_line(d, i)]
        if not cands:
            continue
        i = rng.choice(cands)
        ctx, gold = span(d, i - n_ctx, i), span(d, i, i + n_end)
        others = [k for k in order if docs[k] is not d]  # docs hold one source only
        distract = []
        for k in rng.sample(others, len(others)):
            o = docs[k]
            oc = [j for j in range(1, len(o["words"]) - n_end + 1) if mid_line(o, j)]
            if oc:
                j = rng.choice(oc)
                e = span(o, j, j + n_end)
                if e != gold and e not in distract:
                    distract.append(e)
            if len(distract) == 3:
                break
        if len(distract) < 3:
            continue
        label = rng.randrange(4)
        endings = distract[:label] + [gold] + distract[label:]
        items.append(dict(ind=len(items), activity_label=d["label"], ctx_a=ctx, ctx_b="", ctx=ctx,
                          endings=endings, source_id=f"kvt-tiny-eval~{d['source']}", split="val",
                          split_type="indomain", label=str(label)))
    return items


def ends_unit(doc, k):
    """Word k ends a sentence or is the last word on its line."""
    w, t = doc["words"], doc["text"]
    if t[w[k][0]:w[k][1]].rstrip("\"')")[-1:] in ".;:?!":
        return True
    return k + 1 == len(w) or "\n" in t[w[k][1]:w[k + 1][0]]


def make_completion(docs, n, rng):
    items, order = [], list(range(len(docs)))
    rng.shuffle(order)
    for attempt in range(5 * n):
        if len(items) >= n:
            break
        d = docs[order[attempt % len(order)]]
        cands = []
        for i in range(30, len(d["words"])):
            if not mid_line(d, i):
                continue
            for k in range(i, min(i + 8, len(d["words"]))):
                if "\n" in span(d, i, k + 1):
                    break
                if ends_unit(d, k):
                    if k - i + 1 >= 3:
                        cands.append((i, k + 1))
                    break
        if not cands:
            continue
        i, j = rng.choice(cands)
        items.append(dict(context=span(d, max(0, i - 100), i), target=span(d, i, j)))
    return items


def make_multiturn(docs, n, turns, rng):
    convs, order = [], list(range(len(docs)))
    rng.shuffle(order)
    for k in order * 3:
        if len(convs) >= n:
            break
        d = docs[k]
        text = d["text"]
        story = text if len(text) <= 2000 else text[:text.rfind("\n", 0, 2000)]
        words = [w for w in d["words"] if w[1] <= len(story)]
        cands = []
        for i in range(len(words) - 5):
            q0, q1 = words[i][0], words[i + 4][1]
            quote = story[q0:q1]
            for m in range(3, 7):
                if i + 5 + m > len(words):
                    break
                a0, a1 = words[i + 5][0], words[i + 4 + m][1]
                if "\n" in story[q0:a1] or story.count(quote) != 1:
                    break
                cands.append((i, m, q0, q1, a0, a1))
        chosen, used = [], set()
        for c in rng.sample(cands, len(cands)):
            span_ids = set(range(c[0], c[0] + 5 + c[1]))
            if span_ids & used:
                continue
            chosen.append(c)
            used |= span_ids
            if len(chosen) == turns:
                break
        if len(chosen) < turns:
            continue
        chosen.sort()
        qs = dict(input_text=[f"What follows '{story[c[2]:c[3]]}'?" for c in chosen],
                  answer_start=[c[2] for c in chosen], answer_end=[c[3] for c in chosen])
        ans = dict(input_text=[story[c[4]:c[5]] for c in chosen],
                   answer_start=[c[4] for c in chosen], answer_end=[c[5] for c in chosen])
        convs.append(dict(source=d["source"], story=story, questions=qs, answers=ans))
    return convs


def write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval", default="data/tiny/eval.jsonl")
    ap.add_argument("--outdir", default="data/tiny")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--n-cloze", type=int, default=300)
    ap.add_argument("--n-completion", type=int, default=200)
    ap.add_argument("--n-multiturn", type=int, default=30)
    ap.add_argument("--turns", type=int, default=12)
    args = ap.parse_args()
    docs = load(args.eval)
    rng = random.Random(args.seed)
    by_src = [[d for d in docs if d["source"] == s] for s in ("kjv", "wordnet")]

    def balanced(fn, n, *extra):
        rows = fn(by_src[0], n // 2, *extra, rng) + fn(by_src[1], n - n // 2, *extra, rng)
        rng.shuffle(rows)
        return rows

    cloze = balanced(make_cloze, args.n_cloze)
    for i, row in enumerate(cloze):
        row["ind"] = i
    comp = balanced(make_completion, args.n_completion)
    mt = balanced(make_multiturn, args.n_multiturn, args.turns)
    write(f"{args.outdir}/cloze.jsonl", cloze)
    write(f"{args.outdir}/completion.jsonl", comp)
    write(f"{args.outdir}/multiturn.jsonl", mt)
    for name, rows in [("cloze", cloze), ("completion", comp), ("multiturn", mt)]:
        print(name, len(rows))
    print("docs", {s: sum(d["source"] == s for d in docs) for s in ("kjv", "wordnet")})


if __name__ == "__main__":
    main()
