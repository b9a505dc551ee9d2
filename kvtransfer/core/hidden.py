"""Source hidden states as map features (issue 23 §2): what "the hidden state of source layer l" is, how it is
captured during the source's own prefill, and what a map from it costs.

The feature of source layer l is the **normed input of decoder layer l**: `input_layernorm_l(h_l)`, where
h_l = `output_hidden_states[l]` is the residual stream entering layer l (h_0 = the token embeddings). It is
exactly the tensor layer l's q_proj / k_proj / v_proj read, so:
- the source's own K_l (before k_norm / RoPE) and V_l are a *linear* function of it (`k_proj(x) = x W_k^T + b`):
  the K/V features of the paper's map are a linear image of these features, so a linear map from them can do
  everything a map from that layer's K/V can, and more (hidden_size dims per layer vs n_kv * d_head);
- the raw residual h_l is not: RMSNorm divides each token by its own RMS, and that scale grows with depth and
  is dominated by a few massive-activation tokens (the attention sink at position 0 has a residual norm orders
  of magnitude above the rest), which would dominate X^T X of an unnormalised fit. The normed input has the
  per-token scale removed and the norm's gain folded in, at no cost: the prefill computes it anyway, and the
  capture hooks the norm's output instead of recomputing it.
Hidden states carry no RoPE, so nothing is stripped; the targets are the target's RoPE-stripped K and V as
for the paper's map (`calibrate.kv_features`).

Feature sets (`mapper.features`), per source layer and kind (K or V), columns in this order:
    "kv"         the paper's: [K_l stripped] for K targets, [V_l] for V targets        width n_kv_s * d_s
    "hidden"     [x_l] for both K and V targets                                         width H
    "hidden_kv"  [x_l | K_l stripped] for K targets, [x_l | V_l] for V targets          width H + n_kv_s * d_s
so a map's feature vector for target layer t is the concatenation over its k selected source layers of these
blocks, and the calibration moments / ridge solver / R² code are the paper's, with a wider source block.

Small numerical core: no Hydra, lm-eval or W&B imports.
"""
from __future__ import annotations

import contextlib

import torch

from .models import decoder

FEATURES = ("kv", "hidden", "hidden_kv")


def check_features(features: str) -> str:
    """`features` if it is one of FEATURES; ValueError naming them otherwise."""
    if features not in FEATURES:
        raise ValueError(f"mapper.features must be one of {FEATURES}, got {features!r}")
    return features


def feature_width(features: str, hidden_size: int, kv_width: int) -> int:
    """Columns per source layer and kind: kv_width (n_kv_s * d_s), hidden_size, or their sum (see module doc)."""
    return {"kv": kv_width, "hidden": hidden_size, "hidden_kv": hidden_size + kv_width}[check_features(features)]


def hidden_size(model_or_config) -> int:
    """The residual-stream width H of a model or config (its text config for VLMs)."""
    from .models import text_config

    return int(text_config(getattr(model_or_config, "config", model_or_config)).hidden_size)


def _norms(model, layers) -> list:
    """The input_layernorm module of each decoder layer in `layers` (ValueError for an architecture without one)."""
    blocks = decoder(model).layers
    out = []
    for layer in layers:
        norm = getattr(blocks[layer], "input_layernorm", None)
        if norm is None:
            raise ValueError(f"decoder layer {layer} of {type(model).__name__} has no input_layernorm: hidden-state "
                             "features are defined as its output (kvtransfer.core.hidden); this architecture is not "
                             "supported")
        out.append(norm)
    return out


@contextlib.contextmanager
def capture_hidden(model, layers, positions: torch.Tensor | None = None):
    """Within the block, every forward of `model` stores the normed input of each decoder layer in `layers`:
    yields a dict {layer: [batch, seq or len(positions), H]} (the model's dtype, on that layer's device), filled
    by the forward. `positions` (int64 [n]) keeps only those sequence positions (the calibration's stride), so
    the whole sequence is never held per layer."""
    store: dict[int, torch.Tensor] = {}
    handles = []

    def hook(layer):
        def keep(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            store[layer] = out.detach() if positions is None else out.detach()[:, positions.to(out.device)]
        return keep

    try:
        for layer, norm in zip(layers, _norms(model, layers)):
            handles.append(norm.register_forward_hook(hook(layer)))
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def prefill_with_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        layers=None) -> tuple[list, dict[int, torch.Tensor]]:
    """`cache.prefill` that also returns the normed inputs of decoder `layers` (default all):
    (KV layers [batch, n_kv, seq, d] per layer, {layer: [batch, seq, H]}) from the same single forward."""
    from .cache import prefill

    layers = list(range(len(decoder(model).layers))) if layers is None else sorted({int(x) for x in layers})
    with capture_hidden(model, layers) as store:
        cache = prefill(model, input_ids, attention_mask)
    return cache, dict(store)


def used_layers(selected_layers) -> list[int]:
    """Sorted source layers any target layer reads (what a serving engine must keep hidden states of)."""
    rows = selected_layers.tolist() if hasattr(selected_layers, "tolist") else selected_layers
    return sorted({int(s) for row in rows for s in row})


def hidden_map_cost(n_layers_t: int, k: int, n_used: int, hidden: int, kv_width_s: int, kv_width_t: int,
                    features: str = "hidden") -> dict:
    """Counts of a linear map from `features` at these shapes (no weights needed), per token:
    - "n_parameters": L_t * 2 * (p * q + q), p = k * feature_width, q = kv_width_t (as the ridge kind);
    - "apply_flops_per_token": L_t * 2 * (2 p q + q) (2 per multiply-add, biases included; as `Mapper`);
    - "store_values_per_token": what a serving engine must keep per token to apply the map: n_used * H hidden
      values, + n_used * 2 * kv_width_s K/V values for hidden_kv ("kv": only those K/V).
    Multiply store_values_per_token by the dtype size (2 for bf16) for bytes."""
    fw = feature_width(features, hidden, kv_width_s)
    p, q = k * fw, kv_width_t
    store = n_used * ((hidden if features != "kv" else 0) + (2 * kv_width_s if features != "hidden" else 0))
    return {"p": p, "q": q, "n_parameters": n_layers_t * 2 * (p * q + q),
            "apply_flops_per_token": n_layers_t * 2 * (2 * p * q + q), "store_values_per_token": store}
