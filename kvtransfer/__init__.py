"""kvtransfer: cross-model KV cache transfer with closed-form per-head ridge maps in RoPE-stripped space.

Public API (the numerical core; no Hydra, lm-eval or W&B imports here):
    load_model(name_or_path, ...)            -> (model, tokenizer)
    collect_moments(source, target, ids, ...) -> CalibrationMoments(train Moments, heldout HeldOut features)
    r2_matrix / select_topk / select_greedy   source-layer selection
    fit_ridge(moments, selected_layers, ...)  -> RidgeFit
    Mapper.from_ridge / Mapper.save / Mapper.load; load_mapper (any kind: ridge, trained, hidden, factored, mlp)
    prefill_with_hidden(model, ids, ...)      -> (cache, {layer: normed input}) for hidden-state maps (HiddenMapper)
    transfer(source_cache, mapper, source_model, target_model, ...) -> DynamicCache
    map_layers / map_layers_reference        the fast mapping path and the plain one it is tested against
"""
from .core.cache import cache_to_layers, forward_on_cache, layers_to_cache, prefill
from .core.calibrate import CalibrationMoments, collect_moments, kv_features
from .core.diagnostics import compare_caches
from .core.hidden import prefill_with_hidden
from .core.mapper import HiddenMapper, Mapper, MapperBase, load_mapper
from .core.models import check_same_tokenizer, kv_shape, load_model, model_identity
from .core.moments import HeldOut, Moments
from .core.ridge import RidgeFit, UnderdeterminedFit, fit_ridge
from .core.rope import RopeCodec
from .core.select import r2_matrix, select_greedy, select_topk
from .core.transfer import codec_for, map_layers, map_layers_reference, transfer

__version__ = "0.1.0"
__all__ = [
    "load_model", "check_same_tokenizer", "kv_shape", "model_identity", "RopeCodec", "prefill",
    "forward_on_cache", "cache_to_layers", "layers_to_cache", "collect_moments", "kv_features",
    "CalibrationMoments", "Moments", "HeldOut", "r2_matrix", "select_topk", "select_greedy", "fit_ridge", "RidgeFit",
    "UnderdeterminedFit", "Mapper", "MapperBase", "HiddenMapper", "load_mapper", "prefill_with_hidden", "transfer", "map_layers", "map_layers_reference",
    "codec_for", "compare_caches",
]
