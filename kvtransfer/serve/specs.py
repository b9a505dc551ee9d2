"""The connector's instructions to its worker (kvtransfer.serve.connector) and vLLM's layer names."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class LoadSpec:
    """Worker instruction: map stored tokens lo..hi-1 (blocks `hashes` of model `model_key` in store namespace `ns`)
    into the request's blocks; `prompt` is the request's prompt ids over the blocks read (the worker checks every
    block against it). `error`: the scheduler failed building this load -- the worker reports the blocks as load
    errors."""

    req_id: str
    model_key: str
    hashes: list[str]
    lo: int
    hi: int
    block_ids: list[int]
    prompt: list[int] = field(default_factory=list)
    error: str = ""
    gate_hi: int = 0  # gated: the worker maps lo..gate_hi-1, scatters lo..hi-1 and scores hi..gate_hi-1 (serve.gating)
    native_sink: int = 0
    prompt_len: int = 0
    ns: str = ""


@dataclass
class SaveSpec:
    """Worker instruction: store the request's prompt K/V (its prefill completes this step) from token `first` on
    (the store already holds the blocks before it) to the end of its last full store block, `end`, in store
    namespace `ns` (the request's `kvtransfer_ns`)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    first: int = 0
    end: int | None = None
    ns: str = ""


def layer_index(layer_name: str) -> int:
    """Decoder layer index of a vLLM attention layer name ("model.layers.7.self_attn.attn" -> 7)."""
    found = _LAYER_INDEX.search(layer_name)
    if found is None:
        raise ValueError(f"cannot tell the decoder layer of attention layer {layer_name!r}")
    return int(found.group(1))
