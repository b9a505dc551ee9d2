"""The dtype a map is applied in (its weights and the GEMM over the source's features): one name for the evaluation
(`eval.map_dtype`), the bench (`bench.mapper_dtypes`, which follows it) and serving (the connector's `map_dtype`).

    float32   the map as fitted and saved (float32 weights): the evaluation's default
    bfloat16  weights and features rounded to bfloat16 (8-bit mantissa) before the GEMM, which accumulates in
              float32; about twice the float32 GEMM rate on GPUs, at a quality cost measured per pair
              (experiments/map_dtype)
"""
from __future__ import annotations

import copy

import torch

MAP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAP_DTYPE = "float32"


def map_dtype(value) -> torch.dtype:
    """The torch dtype named by `value` (a MAP_DTYPES name, "torch.<name>" or a torch dtype); ValueError naming
    the choices otherwise."""
    if isinstance(value, torch.dtype) and value in MAP_DTYPES.values():
        return value
    name = str(value).removeprefix("torch.")
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
