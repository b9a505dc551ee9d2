"""The dtype a map is applied in (its weights and the GEMM over the source's features): one name for the evaluation
(`eval.map_dtype`), the bench (`bench.mapper_dtypes`, which follows it) and serving (the connector's `map_dtype`).

    float32   the map as fitted and saved (float32 weights)
    bfloat16  weights and features rounded to bfloat16 (8-bit mantissa) before the GEMM, which accumulates in
              float32; about twice the float32 GEMM rate on GPUs, at a quality cost measured per pair
              (experiments/map_dtype: within its margin on the real pair, on float32 and on bfloat16 engines)
    auto      the evaluation's default: bfloat16 on a CUDA device, float32 elsewhere (`resolve_map_dtype`, applied
              to the config before anything keys or runs on it)
"""
from __future__ import annotations

import copy

import torch

MAP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAP_DTYPE = "float32"   # what a resolved config without the key means (and every CPU run's `auto`)
AUTO = "auto"


def resolve_map_dtype(value, device) -> str:
    """The dtype name `value` means on `device` (a torch device or its name): `auto` (or None) is bfloat16 on CUDA
    and float32 elsewhere; any other value is checked (`map_dtype`) and returned by name."""
    if value in (None, AUTO):
        return "bfloat16" if torch.device(device).type == "cuda" else DEFAULT_MAP_DTYPE
    return str(map_dtype(value)).removeprefix("torch.")


def resolve_config(cfg: dict, device) -> dict:
    """`cfg` with eval.map_dtype resolved for `device` (`resolve_map_dtype`) and bench.mapper_dtypes' `auto`
    entries too -- on CUDA an `auto` bench entry times bfloat16 and the float32 map beside it -- so that every key,
    artifact and record holds the dtype that ran, never `auto`. Returns a new dict; `cfg` is not changed."""
    cfg = copy.deepcopy(cfg)
    ecfg = cfg.get("eval")
    if isinstance(ecfg, dict) and "map_dtype" in ecfg:
        ecfg["map_dtype"] = resolve_map_dtype(ecfg["map_dtype"], device)
    bcfg = cfg.get("bench")
    if isinstance(bcfg, dict) and bcfg.get("mapper_dtypes"):
        names = []
        for value in bcfg["mapper_dtypes"]:
            chosen = [resolve_map_dtype(value, device)]
            if value in (None, AUTO) and chosen[0] != DEFAULT_MAP_DTYPE:
                chosen.append(DEFAULT_MAP_DTYPE)   # the float32 row beside the default
            names += [n for n in chosen if n not in names]
        bcfg["mapper_dtypes"] = names
    return cfg


def map_dtype(value) -> torch.dtype:
    """The torch dtype named by `value` (a MAP_DTYPES name, "torch.<name>" or a torch dtype); ValueError naming
    the choices otherwise."""
    if isinstance(value, torch.dtype) and value in MAP_DTYPES.values():
        return value
    name = str(value).removeprefix("torch.")
    if name == AUTO:
        raise ValueError("map dtype 'auto' must be resolved for a device first "
                         "(kvtransfer.core.map_dtype.resolve_map_dtype): name float32 or bfloat16 here")
    if name not in MAP_DTYPES:
        raise ValueError(f"map dtype {value!r} is not one of {sorted(MAP_DTYPES)}: set eval.map_dtype (or the "
                         f"connector's map_dtype) to float32 (the fitted map) or bfloat16")
    return MAP_DTYPES[name]


def in_map_dtype(mapper, dtype, device=None):
    """`mapper` with its floating-point weights in `dtype` (a MAP_DTYPES name or dtype) on `device` (default: its
    own): the mapper itself when nothing changes, else a shallow copy, so the caller's mapper is never cast."""
    dtype = map_dtype(dtype)
    device = mapper.device if device is None else torch.device(device)
    if mapper.dtype == dtype and mapper.device == device:
        return mapper
    return copy.copy(mapper).to(device, dtype)   # shallow: .to rebinds the copy's tensors only
