"""Content controls: caches that look like a transferred context but do not carry *this* context.

A gain over the no-context floor can come from the context's content or merely from a cache of the right
length, statistics and genre. Each control below keeps one of those and removes the content:

    wrong context   each item's context replaced by another item's, cut or drawn to the same token length, with
                    the start ids and the true last context token kept (the native tail every split mode runs
                    itself) -- `wrong_contexts`. Run natively by the target (`target_wrong`) and through the
                    map (`transfer_wrong`), it gives the content share (kvtransfer.eval.metrics.content_share).
    mean map        the fitted map with its weights zeroed: every mapped position gets the calibration mean of
                    the target's (stripped) K and V -- `mean_map`. The right first moment, no token information.
    random map      the fitted map's shapes and per-head weight norms with seeded random directions, its bias set
                    so that the calibration mean still maps to the calibration mean -- `random_map`.

The controls keep the map's pair identity, calibration provenance and native sink, so they are applied through
the same code path as the map itself (kvtransfer.core.transfer: strip, map, re-rotate, native sink).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from ..core.mapper import Mapper, MapperBase
from ..core.moments import Moments


# control mode -> (the adapter mode it runs in, what it changes); kvtransfer.eval.metrics.CONTROL_MODES names them too
CONTROLS = {"target_wrong": ("target", "wrong_context"), "transfer_wrong": ("transfer", "wrong_context"),
            "mean_map": ("transfer", "mean_map"), "random_map": ("transfer", "random_map")}


def with_controls(modes: list[str], controls: list[str] | None) -> list[str]:
    """The eval modes of a run: `modes`, then each of `controls` not already there when `transfer` is among them
    (every control is read against the transfer). ValueError naming the fix for an unknown control."""
    controls = list(controls or [])
    unknown = [c for c in controls if c not in CONTROLS]
    if unknown:
        raise ValueError(f"eval.controls={controls}: unknown {unknown}; use a list of {list(CONTROLS)} (or [])")
    modes = list(modes)
    return modes + [c for c in controls if c not in modes] if "transfer" in modes else modes


def wrong_contexts(contexts: list[list[int]], start_ids: list[int], seed: int = 0) -> dict[tuple, list[int]]:
    """{context: wrong context} for every distinct context of `contexts` (token-id lists).

    The distinct contexts are put in a seeded random order and each takes its body from the next ones in that
    cycle (never from itself): body = context without the leading `start_ids`; the wrong context is
    start_ids + the last (len(body) - 1) tokens of the donors' bodies (the next donor's last, preceded by the
    one after it while more are needed) + the context's own last token. Its length equals the context's, so
    left-truncation and positions are the same. A context with at most one body token is its own wrong context.
    Raises ValueError when a context needs a donor and there is no other distinct context to take one from."""
    distinct = sorted({tuple(c) for c in contexts})
    s = len(start_ids)

    def body(ctx: tuple) -> list[int]:
        return list(ctx[s:]) if list(ctx[:s]) == list(start_ids) else list(ctx)

    if all(len(body(c)) <= 1 for c in distinct):  # e.g. perplexity at P = 0: nothing to replace anywhere
        return {c: list(c) for c in distinct}
    if len(distinct) < 2:
        raise ValueError(f"a wrong-context control needs >= 2 distinct contexts, got {len(distinct)}: evaluate "
                         "more than one item (eval.limit), or drop target_wrong/transfer_wrong from eval.controls")
    order = distinct[:]
    random.Random(seed).shuffle(order)

    bodies = [body(c) for c in order]
    total_other = sum(len(b) for b in bodies)
    out = {}
    for i, ctx in enumerate(order):
        own = bodies[i]
        need = len(own) - 1
        if need <= 0:
            out[ctx] = list(ctx)
            continue
        if total_other - len(own) <= 0:
            raise ValueError("every other context is empty: a wrong-context control has nothing to draw from")
        stream: list[int] = []
        j = i
        while len(stream) < need:  # prepend donors i+1, i+2, ... (skipping i itself) until long enough
            j = (j + 1) % len(order)
            if j != i:
                stream = bodies[j] + stream
        head = list(ctx[:len(ctx) - len(own)])  # the start ids (or nothing)
        out[ctx] = head + stream[-need:] + [own[-1]]
    return out


def control_applies(mapper: MapperBase, control: str) -> bool:
    """Whether `control` is defined for this map: random_map needs a linear map of the source's K/V (ridge or
    trained kind); the wrong-context controls and mean_map apply to every map."""
    if control != "random_map":
        return True
    return isinstance(mapper, Mapper) and getattr(mapper, "features", "kv") == "kv"


def _check_linear(mapper: MapperBase, control: str) -> None:
    if not control_applies(mapper, control):
        raise ValueError(f"the {control} control is defined for linear K/V maps (mapper.kind ridge or trained), not "
                         f"{mapper.kind!r} (features {getattr(mapper, 'features', 'kv')!r}): drop {control} from "
                         "eval.controls for this map")


def calibration_means(moments: Moments, mapper: MapperBase) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean_x [L_t, 2, p], mean_y [L_t, 2, q]) float32: the calibration means of each target layer's features
    (its selected source layers, in the map's feature order) and of its K / V targets ([.., 0] K, [.., 1] V),
    in the key space the map was fitted in. p = k * n_kv_s * d_s, q = n_kv_t * d_t."""
    selected = mapper.selected_layers.tolist()
    xs, ys = [], []
    for t, layers in enumerate(selected):
        tcols = moments.target_columns(moments.target_layers[t])
        cols = moments.source_columns(layers)
        xs.append(torch.stack([moments.stats[kind]["mean_x"][cols.to(moments.stats[kind]["mean_x"].device)].float().cpu()
                               for kind in ("k", "v")]))
        ys.append(torch.stack([moments.stats[kind]["mean_y"][tcols].float().cpu() for kind in ("k", "v")]))
    return torch.stack(xs), torch.stack(ys)


def mean_map(mapper: MapperBase, mean_y: torch.Tensor) -> Mapper:
    """The `mean_map` control of `mapper`: a ridge-kind Mapper with zero weights and bias = mean_y [L_t, 2, q],
    so every mapped position gets the calibration mean (re-rotated at its position like any mapped key).
    Works for every map kind: it reads the source's K/V of the map's selected layers (p = k * n_kv_s * d_s) and
    ignores them, so a hidden-state or MLP map's control is applied like a ridge map."""
    n_t, _, q = mean_y.shape
    common = {f.name: getattr(mapper, f.name) for f in dataclasses.fields(MapperBase) if f.init}
    p = mapper.selected_layers.shape[1] * _source_width(mapper)
    weight = torch.zeros(n_t, 2, p, q, dtype=torch.float32, device=mean_y.device)
    return Mapper(weight=weight, bias=mean_y.float().clone(), **common)


def random_map(mapper: MapperBase, mean_x: torch.Tensor, mean_y: torch.Tensor, seed: int = 0) -> Mapper:
    """The `random_map` control of a linear map: weight [L_t, 2, p, q] Gaussian (seeded), each target head's
    column block scaled to the Frobenius norm of the fitted map's block, bias = mean_y - mean_x @ weight (the
    calibration mean still maps to the calibration mean); weight and bias float32 on the map's device, the draw
    the same on every device for a seed. Raises ValueError for a non-linear map kind."""
    _check_linear(mapper, "random_map")
    w = mapper.weight.detach().float().cpu()
    n_t, kinds, p, q = w.shape
    d = _target_head_dim(mapper, q)
    # drawn on the CPU (the fitted weight is read there too) so a seed gives the same map on every device; the
    # draw then meets the calibration means on theirs
    gen = torch.Generator().manual_seed(int(seed))  # device: seeded CPU draw, moved to mean_x's device below
    rand = torch.randn(w.shape, generator=gen, dtype=torch.float32)  # device: seeded CPU draw, moved below
    blocks_fit = w.reshape(n_t, kinds, p, q // d, d).pow(2).sum(dim=(2, 4)).sqrt()      # [L, 2, heads]
    blocks_rand = rand.reshape(n_t, kinds, p, q // d, d).pow(2).sum(dim=(2, 4)).sqrt()
    scale = (blocks_fit / blocks_rand.clamp_min(1e-30))[:, :, None, :, None]
    rand = (rand.reshape(n_t, kinds, p, q // d, d) * scale).reshape(w.shape)
    bias = mean_y.float() - torch.einsum("lkp,lkpq->lkq", mean_x.float(), rand.to(mean_x.device))
    common = {f.name: getattr(mapper, f.name) for f in dataclasses.fields(MapperBase) if f.init}
    return Mapper(weight=rand.to(mapper.weight.device), bias=bias.to(mapper.weight.device), **common)


def _source_width(mapper: MapperBase) -> int:
    """n_kv_s * d_s of the map's source (from its pair identity, else from a linear map's weight shape)."""
    src = mapper.source
    if src.get("n_kv") and src.get("head_dim"):
        return int(src["n_kv"]) * int(src["head_dim"])
    if isinstance(mapper, Mapper):
        return mapper.weight.shape[2] // mapper.selected_layers.shape[1]
    raise ValueError("cannot tell the source's K/V width from this map: its pair identity lacks n_kv/head_dim")


def _target_head_dim(mapper: MapperBase, q: int) -> int:
    """d_t of the map's target (its pair identity); q = n_kv_t * d_t must be a multiple of it."""
    d = int(mapper.target.get("head_dim") or 0)
    if d <= 0 or q % d:
        raise ValueError(f"cannot split the map's {q} output columns into heads: target head_dim {d or 'unknown'}")
    return d
