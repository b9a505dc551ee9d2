"""KV cache I/O for transformers 5 `DynamicCache`, prefill, and scoring a continuation on a cache.

A cache is handled here as `layers`: a list with one `(keys, values)` pair per decoder layer, each
[batch, n_kv, seq, head_dim], keys post-RoPE exactly as the model stores them.
Forward passes append to a `DynamicCache` in place, so every scoring call builds a fresh cache from
tensors; tensors themselves are never modified.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from .models import decoder

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


def cache_to_layers(cache) -> KVLayers:
    """A `DynamicCache` -> list of (keys, values) per layer, [batch, n_kv, seq, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def layers_to_cache(layers: KVLayers, config) -> DynamicCache:
    """A fresh `DynamicCache` for `config`'s model holding the given per-layer (keys, values)."""
    return DynamicCache(ddp_cache_data=[(k, v) for k, v in layers], config=config)


def positions_from_mask(attention_mask: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
    """Token positions [batch, seq] from a 0/1 mask (left padding allowed); pads get position 0.

    `offset` ([batch] or int) is the number of real tokens before this block (e.g. a cached prefix).
    """
    pos = attention_mask.long().cumsum(-1) - 1
    if not isinstance(offset, int):
        offset = offset.to(pos.device)[:, None]
    return (pos + offset).clamp(min=0)


# the first transformers release whose decoders take `cache=` (pyproject.toml's lower bound)
MIN_TRANSFORMERS = "5.24"


def _ones_mask(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(input_ids, dtype=torch.long)


def _check_extended(cache: DynamicCache, before: int, new: int) -> None:
    """Raise when the forward left `cache` as it was: a transformers release that names the cache argument
    otherwise silently computes without it (releases before 5.24 take `past_key_values` only). Only "not extended
    at all" is checked: a sliding-window layer may hold fewer than before + new tokens."""
    if new > 0 and cache.get_seq_length() == before:
        import transformers

        raise RuntimeError(f"the model did not extend the cache it was given ({before} + {new} tokens expected, "
                           f"{cache.get_seq_length()} held): transformers {transformers.__version__} does not take "
                           f"the decoder's `cache` argument (it is named so from transformers {MIN_TRANSFORMERS} on); "
                           f"run `pip install 'transformers>={MIN_TRANSFORMERS},<6'`. A model with custom code "
                           "(trust_remote_code) that names its cache argument otherwise cannot be prefilled here")


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> KVLayers:
    """Run the decoder body (no LM head) on token ids [batch, seq]; return its cache as layers.

    Left padding is supported through `attention_mask`; positions count real tokens only.
    """
    if input_ids.shape[-1] == 0:
        raise ValueError("prefill needs at least one token: an empty prefix has no cache; run the model on "
                         "the whole input instead")
    mask = _ones_mask(input_ids) if attention_mask is None else attention_mask
    cache = DynamicCache(config=model.config)
    decoder(model)(input_ids=input_ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                   cache=cache, use_cache=True)
    _check_extended(cache, 0, input_ids.shape[-1])
    return cache_to_layers(cache)


@torch.no_grad()
def forward_on_cache(model, layers: KVLayers | None, prefix_mask: torch.Tensor | None,
                     input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     *, return_cache: bool = False):
    """Run `model` on new tokens [batch, new] after a cached prefix; return logits [batch, new, vocab].

    `prefix_mask` [batch, prefix] marks real prefix tokens (None: all real). The attention mask
    passed to the model spans prefix + new tokens, and positions continue from the number of real
    prefix tokens, so left-padded batches are exact. With `return_cache`, also returns the
    `DynamicCache` that now holds prefix + new tokens.
    """
    new_mask = _ones_mask(input_ids) if attention_mask is None else attention_mask
    if layers:
        prefix_len = layers[0][0].shape[-2]
        if prefix_mask is None:
            prefix_mask = torch.ones(input_ids.shape[0], prefix_len, dtype=torch.long, device=input_ids.device)
        if prefix_mask.shape[-1] != prefix_len:
            raise ValueError(f"prefix_mask covers {prefix_mask.shape[-1]} tokens but the cache holds {prefix_len}")
        cache = layers_to_cache(layers, model.config)
        offset = prefix_mask.long().sum(-1)
        full_mask = torch.cat([prefix_mask.long(), new_mask.long()], dim=-1)
    else:
        cache = DynamicCache(config=model.config)
        offset, full_mask = 0, new_mask.long()
    before = cache.get_seq_length()
    out = model(input_ids=input_ids, attention_mask=full_mask,
                position_ids=positions_from_mask(new_mask, offset), cache=cache, use_cache=True)
    _check_extended(cache, before, input_ids.shape[-1])
    return (out.logits, cache) if return_cache else out.logits


def continuation_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities [batch, n] of `targets` [batch, n] under `logits` [batch, n, vocab]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
