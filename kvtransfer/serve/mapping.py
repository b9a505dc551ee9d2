"""A fitted mapper as the serving engine applies it: source entry -> target K/V for a token range.

What `kvtransfer.core.transfer.transfer` does inside the harness, for one prompt, without the models
loaded: RoPE codecs are built from the two configs alone (`codec_from_config`), the map itself is
`kvtransfer.core.transfer.map_layers` (strip source RoPE, map, re-apply target RoPE, cast), and the
native sink -- the target's own K/V at positions 0..native_sink-1 -- is computed once per layer by
an HF prefill of the fixed start tokens (`native_sink_layers`), since under the run's
`context_start` those tokens are the same for every prompt.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import torch

from ..core.map_dtype import DEFAULT_MAP_DTYPE, in_map_dtype
from ..core.mapper import MapperBase, load_mapper
from ..core.models import config_hash, kv_shape, text_config
from ..core.rope import RopeCodec
from ..core.transfer import Workspace, map_layers


def codec_from_config(config) -> RopeCodec:
    """A RopeCodec for a model known by its HF config: the model family's own rotary module, no weights.

    The rotary class is found next to the family's causal-LM class (transformers.models.<type>.modeling_<type>),
    so its cos/sin are exactly what the HF model (and the mapper's calibration) used.
    """
    cfg = text_config(config)
    module = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    classes = [getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding")]
    if len(classes) != 1:
        raise ValueError(f"{module.__name__} has {len(classes)} *RotaryEmbedding classes; cannot build its RoPE")
    rotary = classes[0](config=cfg)
    # RopeCodec reads `model.config` and `model.<base_model_prefix>.rotary_emb`: a stand-in with just those
    return RopeCodec(SimpleNamespace(config=cfg, base_model_prefix="model", model=SimpleNamespace(rotary_emb=rotary)))


@torch.no_grad()
def native_sink_layers(target_path: str, start_ids: list[int], dtype: torch.dtype, *,
                       cache_dir: str | Path | None = None, key: str | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's own (keys, values) [n_kv, len(start_ids), head_dim] per layer for the start tokens at
    positions 0.. (one HF prefill, float32 weights, cast to `dtype`; the model is freed afterwards).

    cache_dir: keep the float32 result there (`sink.<key>.<ids>.safetensors`, written once, atomically) so later
    engines read it instead of loading the target's weights a second time. key: the target's weights key
    (kvtransfer.serve.ident; default: computed from target_path), so other weights never read this sink.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..core.io import atomic_save_tensors, load_tensors
    from .hf import prefill_layers

    if key is None and cache_dir:
        from .ident import serving_identity

        key = serving_identity(str(target_path), AutoConfig.from_pretrained(target_path))["key"]
    name = f"sink.{key}.{'-'.join(map(str, start_ids))}"
    path = Path(cache_dir) / f"{name}.safetensors" if cache_dir else None
    if path is not None and path.is_file():
        tensors, _ = load_tensors(path)
        n = len(tensors) // 2
        return [(tensors[f"{i}.k"].to(dtype), tensors[f"{i}.v"].to(dtype)) for i in range(n)]
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    model.eval()
    layers = prefill_layers(model, list(start_ids))
    del model
    if path is not None:
        tensors = {f"{i}.{kind}": t for i, kv in enumerate(layers) for kind, t in zip("kv", kv)}
        atomic_save_tensors(path, tensors, {"target": str(target_path), "start_ids": list(start_ids)})
    return [(k.to(dtype), v.to(dtype)) for k, v in layers]


class ServeMap:
    """A mapper bound to a (source config, target config) pair, with the target's native sink.

    mapper_dir: a saved mapper (kvtransfer.core.mapper). The constructor raises ValueError naming the fix when the
    mapper was fitted for another target than `target_config`, from another source than `source_config`, or --
    where the mapper records "weights" for a side and that side's serving identity is given
    (`source_identity` / `target_identity`, kvtransfer.serve.ident) -- for other weights of the same
    architecture. `source_hash` is the key store blocks are looked up under (the source's weights key when
    `source_identity` is given, else its config hash). `map_dtype`: the dtype the map is applied in (float32, the
    fitted map, or bfloat16: kvtransfer.core.map_dtype); `dtype`: the mapped K/V's (the engine's cache).
    """

    def __init__(self, mapper_dir: str | Path, source_config, target_config, *, target_path: str | None = None,
                 dtype: torch.dtype = torch.float32, sink_cache: str | Path | None = None,
                 source_identity: dict | None = None, target_identity: dict | None = None,
                 map_dtype: str | torch.dtype = DEFAULT_MAP_DTYPE):
        # the dtype the map is applied in (kvtransfer.core.map_dtype, as eval.map_dtype); `dtype` is the cache's
        self.mapper: MapperBase = in_map_dtype(load_mapper(mapper_dir), map_dtype)
        if self.mapper.needs_hidden:  # issue 23 §2: documented (conf/mapper/hidden.yaml), not served
            raise ValueError(f"mapper {mapper_dir} is a {self.mapper.kind!r} map from the source's hidden states "
                             f"(features {self.mapper.features!r}); the vLLM connector stores only the source's K/V, "
                             "so it cannot serve it: serve a K/V map (mapper=ridge, trained, factored or mlp)")
        have = config_hash(text_config(target_config))
        if self.mapper.target["config_hash"] != have:
            raise ValueError(f"mapper {mapper_dir} was fitted for target {self.mapper.target.get('model_id')} "
                             f"(config {self.mapper.target['config_hash']}), but this engine serves config {have}: "
                             "give this engine the mapper fitted for its model")
        if config_hash(text_config(source_config)) != self.mapper.source["config_hash"]:
            raise ValueError(f"source config {config_hash(text_config(source_config))} is not the mapper's source "
                             f"({self.mapper.source['config_hash']}): point source_model at the model the mapper was "
                             "fitted from")
        for side, ident in (("source", source_identity), ("target", target_identity)):
            fitted = getattr(self.mapper, side).get("weights")
            if ident is not None and fitted is not None and fitted != ident.get("weights"):
                raise ValueError(f"mapper {mapper_dir} was fitted with {side} weights {fitted}, but the {side} here "
                                 f"({ident.get('model_id')}) has weights {ident.get('weights')}: the same architecture "
                                 f"with other weights; give the mapper fitted for these weights")
        self.source_identity, self.target_identity = source_identity, target_identity
        self.source_codec, self.target_codec = codec_from_config(source_config), codec_from_config(target_config)
        self.target_n_kv, self.target_head_dim = kv_shape(target_config).n_kv, kv_shape(target_config).head_dim
        self.dtype = dtype
        self.workspace = Workspace()  # the apply's buffers, reused by every load (the worker maps one at a time)
        cal = self.mapper.calibration
        self.context_start = cal.get("context_start")
        self.start_ids = [int(i) for i in cal.get("start_ids") or []]
        self.native_sink = int(self.mapper.native_sink)
        if self.native_sink > len(self.start_ids):
            raise ValueError(f"the mapper's native_sink={self.native_sink} covers more than its fixed start tokens "
                             f"{self.start_ids}: serving needs the sink to be the same for every prompt "
                             "(refit with context_start=prefix_token and native_sink <= 1)")
        self.sink = (native_sink_layers(target_path, self.start_ids[:self.native_sink], dtype, cache_dir=sink_cache,
                                        key=(target_identity or {}).get("key"))
                     if self.native_sink and target_path else None)

    @property
    def source_hash(self) -> str:
        """The store key of the source (weights key with a source_identity, else the mapper's source config hash)."""
        if self.source_identity is not None:
            return self.source_identity["key"]
        return self.mapper.source["config_hash"]

    def map_range(self, source_layers: list[tuple[torch.Tensor, torch.Tensor]], lo: int, hi: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target (keys, values) [n_kv_t, hi - lo, d_t] per target layer for prompt positions lo..hi-1.

        source_layers: the source's (keys, values) [n_kv_s, hi - lo, d_s] of those positions (post-RoPE).
        Positions below `native_sink` get the target's own sink K/V instead of mapped ones.
        """
        batched = [(k[None], v[None]) for k, v in source_layers]
        mapped = map_layers(batched, self.mapper, torch.arange(lo, hi, device=batched[0][0].device), source_codec=self.source_codec,
                            target_codec=self.target_codec, target_n_kv=self.target_n_kv, out_dtype=self.dtype,
                            workspace=self.workspace)
        out = [(k[0], v[0]) for k, v in mapped]
        if lo < self.native_sink:
            if self.sink is None:
                raise ValueError("the mapper keeps a native sink but no target_path was given to compute it")
            n = min(self.native_sink, hi) - lo
            for (k, v), (sk, sv) in zip(out, self.sink):
                k[:, :n], v[:, :n] = sk[:, lo:lo + n], sv[:, lo:lo + n]
        return out


def identity_mapper(config, *, model_id: str = "", context_start: str = "prefix_token",
                    start_ids: list[int] | None = None, native_sink: int = 1, noise: float = 0.0, seed: int = 0,
                    weights: dict | None = None):
    """A ridge-kind Mapper from a model to itself that maps every layer onto itself (the plumbing check's map).

    Weight = identity (+ `noise` * N(0, 1) when a test wants a map whose output differs from the
    model's own cache), bias 0, float32; the calibration record carries the position-0 convention. weights: the
    model's weights identity (kvtransfer.config.identity), recorded on both sides so the pair check refuses other weights.
    """
    from ..core.mapper import Mapper
    from .store import identity_from_config

    shape = kv_shape(config)
    width = shape.n_kv * shape.head_dim
    weight = torch.eye(width).expand(shape.n_layers, 2, width, width).clone()  # device: built on the CPU like a loaded map (Mapper.to moves it)
    if noise:
        weight += noise * torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))  # device: seeded CPU draw into the CPU weight
    ident = identity_from_config(config, model_id) | ({"weights": weights} if weights is not None else {})
    return Mapper(weight=weight, bias=torch.zeros(shape.n_layers, 2, width), source=ident, target=ident,  # device: built on the CPU like a loaded map (Mapper.to moves it)
                  selected_layers=torch.arange(shape.n_layers)[:, None], native_sink=native_sink,  # device: host-side layer indices (a map keeps them on the CPU)
                  calibration={"context_start": context_start, "start_ids": list(start_ids or [])})
