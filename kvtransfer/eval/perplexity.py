"""WikiText-2 prefix-conditioned perplexity (the paper's PPL column, done the safe way).

lm-eval's `loglikelihood_rolling` gives every window a 1-token context, so through a transferred
cache it silently measures native perplexity. Here each window of `max_prefix + cont_len` tokens
is drawn once; for every prefix length P the context is the run's start ids (kvtransfer.core.context:
what sits at position 0) + the P tokens just before the continuation ([BOS/EOS] when that is
empty), and the scored text is always the same last `cont_len` tokens. In split modes the
source prefills start + prefix[:-1] (mapped), the target runs the last prefix token and the
continuation; at P = 0 nothing is transferred, so every split mode equals `target` there.
"""
from __future__ import annotations

import json
import math
import random
import warnings
from pathlib import Path


def load_pages(path: str | Path) -> list[str]:
    """WikiText-2 document-level pages (`{"page": ...}` per JSONL line); raises if missing/empty."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: point to wikitext2.jsonl (data/benchmarks)")
    pages = [json.loads(line)["page"] for line in path.open() if line.strip()]
    if not pages:
        raise ValueError(f"{path} holds no pages")
    return pages


DRAWS = ("per_document", "with_replacement")


def draw_windows(tokenizer, pages: list[str], *, max_prefix: int, cont_len: int = 256, n_windows: int = 8,
                 seed: int = 0, draw: str = "per_document", return_docs: bool = False):
    """Token windows of max_prefix + cont_len ids, drawn once (seeded) from the pages; with return_docs,
    (windows, [index into pages of each window]).

    Pages are tokenized without special tokens; a window never crosses pages. `draw`:
      per_document      (default) at most one window per page: min(n_windows, long-enough pages) pages chosen
                        at random without replacement, one window at a random offset in each -- the windows are
                        independent documents, so a bootstrap over windows resamples documents;
      with_replacement  n_windows (page, offset) draws with replacement (the draw of results made before
                        per_document existed: windows can overlap and share pages).
    Raises if no page is long enough; warns when fewer pages than n_windows are long enough."""
    if draw not in DRAWS:
        raise ValueError(f"eval.ppl.draw={draw!r}: use one of {DRAWS}")
    size = max_prefix + cont_len
    streams = [tokenizer.encode(p, add_special_tokens=False) for p in pages]
    spans = [(i, len(s) - size) for i, s in enumerate(streams) if len(s) >= size]
    if not spans:
        raise ValueError(f"no page has {size} tokens (max_prefix={max_prefix} + cont_len={cont_len}); "
                         "lower them or add text")
    rng = random.Random(seed)
    if draw == "per_document":
        if len(spans) < n_windows:
            warnings.warn(f"perplexity: only {len(spans)} of {len(pages)} pages hold {size} tokens, so {len(spans)} "
                          f"windows (one per page), not eval.ppl.windows={n_windows}", stacklevel=2)
        chosen = rng.sample(spans, min(n_windows, len(spans)))
    out, docs = [], []
    for j in range(len(chosen) if draw == "per_document" else n_windows):
        # with_replacement keeps its historical order of draws (page, then offset, per window)
        i, last = chosen[j] if draw == "per_document" else rng.choice(spans)
        start = rng.randint(0, last)
        out.append(streams[i][start:start + size])
        docs.append(i)
    return (out, docs) if return_docs else out


def prefix_pairs(windows: list[list[int]], prefix_len: int, max_prefix: int, bos_id: int,
                 start: list[int] | None = None):
    """(context, continuation) per window: context = start + the prefix_len tokens before max_prefix.

    `start`: the run's position-0 ids (kvtransfer.core.context.start_ids; default [bos_id]). A context
    that would be empty (P = 0 and no start ids) is [bos_id], lm-eval's empty-context rule.
    """
    if not 0 <= prefix_len <= max_prefix:
        raise ValueError(f"prefix length {prefix_len} must be in 0..{max_prefix}")
    start = [bos_id] if start is None else list(start)
    return [((start + w[max_prefix - prefix_len:max_prefix]) or [bos_id], w[max_prefix:]) for w in windows]


def prefix_conditioned_ppl(lm, windows: list[list[int]], prefix_lengths: list[int], *,
                           max_prefix: int | None = None) -> dict[int, dict]:
    """{P: {"ppl", "nll" (mean nats/token), "window_nll" (per window), "tokens", "continuation"}} for one
    KVTransferLM mode.

    The continuation (window[max_prefix:]) is identical for every P; `continuation` holds its ids
    so callers can check that. max_prefix defaults to max(prefix_lengths).
    """
    max_prefix = max(prefix_lengths) if max_prefix is None else max_prefix
    if lm.max_length < len(windows[0]) + 1:
        raise ValueError(f"max_length={lm.max_length} cannot hold BOS + {len(windows[0])} tokens; "
                         "lower max_prefix/cont_len or raise max_length")
    out = {}
    for p in prefix_lengths:
        pairs = prefix_pairs(windows, p, max_prefix, lm.prefix_token_id, getattr(lm, "_start_ids", None))
        scored = lm.score_tokens(pairs)
        total = sum(float(lp.sum()) for lp, _ in scored)
        n = sum(len(c) for _, c in pairs)
        out[p] = {"ppl": math.exp(-total / n), "nll": -total / n, "tokens": n,
                  "window_nll": [-float(lp.sum()) / len(c) for (lp, _), (_, c) in zip(scored, pairs)],
                  "continuation": [c for _, c in pairs]}
    return out


def ppl_curve(lm, windows: list[list[int]], prefix_lengths: list[int],
              modes: tuple[str, ...] = ("target", "transfer", "source", "native_injected")) -> dict[str, dict[int, float]]:
    """{mode: {P: perplexity}} for each mode the LM can run (modes lacking a model/mapper skipped)."""
    curve = {}
    for mode in modes:
        try:
            other = lm.with_mode(mode)
        except ValueError:
            continue
        res = prefix_conditioned_ppl(other, windows, prefix_lengths)
        curve[mode] = {p: r["ppl"] for p, r in res.items()}
    return curve


def ppl_contexts(lm, ecfg: dict, set_name: str, prefix: int, n: int, seed: int) -> tuple[list, list]:
    """(contexts, page indices) of the first `n` windows of perplexity set `set_name`'s draw (eval.ppl: the same
    windows the eval scores), each context the start ids + the `prefix` tokens before the window's largest P:
    what the tools that re-run part of an eval on a fixed subsample (timing, cache comparisons) read. `lm`: the
    eval's adapter (its tokenizer, start ids and prefix token)."""
    from .sources import ppl_pages   # the data's location: the bundled file, data_dir's or the hub's

    pcfg = ecfg["ppl"]
    top = max(pcfg["prefixes"])
    if not 0 < prefix <= top:
        raise ValueError(f"P = {prefix}: the run's windows hold 1..{top} context tokens; pick a run drawn at it")
    windows, docs = draw_windows(lm.tokenizer, ppl_pages(ecfg, set_name), max_prefix=top,
                                 cont_len=pcfg["continuation"], n_windows=pcfg["windows"], seed=seed,
                                 draw=pcfg.get("draw", "per_document"), return_docs=True)
    pairs = prefix_pairs(windows[:n], prefix, top, lm.prefix_token_id, lm._start_ids)
    return [c for c, _ in pairs], docs[:n]
