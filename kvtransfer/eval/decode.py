"""Greedy decoding on a prefix cache, and the batching helpers the lm-eval adapter and CoQA share."""
from __future__ import annotations

import torch

from ..core.cache import cache_to_layers, forward_on_cache


def chunks(items: list, n: int):
    """Consecutive slices of `items` of at most n (at least 1) elements."""
    for i in range(0, len(items), max(1, n)):
        yield items[i:i + max(1, n)]


def pad(rows: list[list[int]], pad_id: int, side: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows -> (ids [batch, max_len], 0/1 mask [batch, max_len]) padded on `side`."""
    width = max(len(r) for r in rows)
    # filled row by row on the host, then moved to `device` in one copy each
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # device: host-side, moved below
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # device: host-side, moved below
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.long)  # device: host-side, as ids
        mask[i, sl] = 1
    return ids.to(device), mask.to(device)


def hit_stop(tokenizer, tokens: list[int], until: list[str]) -> bool:
    """True once the decoded generation contains any non-empty stop string."""
    text = tokenizer.decode(tokens)
    return any(s and s in text for s in until)


@torch.no_grad()
def greedy_decode(model, layers, prefix_mask, input_ids, attention_mask, *, max_gen_toks: int, eos_ids: set[int],
                  is_done) -> list[list[int]]:
    """Greedy decoding on a cache: feed input_ids [B, T] (left-padded) after `layers`, then one token
    at a time, reusing the returned cache. Rows stop at an EOS id (not returned) or when
    `is_done(tokens)`; returns the generated ids per row (at most max_gen_toks each).
    """
    batch = input_ids.shape[0]
    gen: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    ids, mask = input_ids, attention_mask
    for _ in range(max_gen_toks):
        logits, cache = forward_on_cache(model, layers, prefix_mask, ids, mask, return_cache=True)
        layers = cache_to_layers(cache)
        prefix_mask = mask if prefix_mask is None else torch.cat([prefix_mask, mask], dim=-1)
        nxt = logits[:, -1].argmax(-1)
        for r in range(batch):
            if done[r]:
                continue
            tok = int(nxt[r])
            if tok in eos_ids:
                done[r] = True
                continue
            gen[r].append(tok)
            done[r] = bool(is_done(gen[r]))
        if all(done):
            break
        ids = nxt[:, None]
        mask = torch.ones_like(ids)
    return gen
