"""The fit of mapper=trained: the paper's map, started from its ridge solution and trained for what the target
reads -- layer by layer for the attention output (objective=layer_local, kvtransfer.maps.train_map) or all layers
jointly for the next-token KL (objective=end_to_end, kvtransfer.maps.train_e2e) -- and the artifact's record of the
splits, losses, bytes and FLOPs."""
from __future__ import annotations

import time

import torch

from ..core.mapper import Mapper
from ..core.models import kv_shape
from ..core.moments import HeldOut, Moments

def fit_trained(run, ridge: Mapper, train: Moments, heldout: HeldOut):
    """mapper=trained (kvtransfer.maps.train_map): `ridge` trained layer by layer for the target's attention output
    on mapper.train_sequences sequences of the calibration's train split, early stopping on
    mapper.stop_sequences others (disjoint from the held-out split the fidelity numbers use); held-out R²
    recomputed for the trained weights. The artifact records both splits and every layer's losses."""
    from ..core.mapper import TrainedMapper
    from ..maps.train_map import OBJECTIVES, collect_layer_local, layer_local_nbytes, train_map

    mcfg = run.cfg["mapper"]
    if mcfg.get("objective", "layer_local") not in OBJECTIVES:
        raise ValueError(f"mapper.objective must be one of {OBJECTIVES}, got {mcfg.get('objective')!r}")
    if mcfg.get("objective") == "end_to_end":
        return _fit_end_to_end(run, ridge, train, heldout)
    fit_idx, stop_idx, held, settings, selected, used = _setup(run, ridge)
    source, target = run.model("source")[0], run.model("target")[0]
    started = time.perf_counter()
    data = collect_layer_local(source, target, run.token_ids()[fit_idx + stop_idx], used,
                               n_queries=int(mcfg["query_positions"]), native_sink=ridge.native_sink,
                               key_space=run.key_space, batch_size=run.cfg["calib"]["batch_size"],
                               progress=run.progress)
    collected = time.perf_counter()
    rows = list(range(len(fit_idx))), list(range(len(fit_idx), len(fit_idx) + len(stop_idx)))
    weight, bias, layers = train_map(ridge.weight, ridge.bias, selected, data, *rows, settings, progress=run.progress,
                                     lrs=run.lrs)
    n_q = data.queries[0].shape[1]
    training = {"objective": "layer_local", "fit_index": fit_idx, "stop_index": stop_idx, "heldout_index": held,
                "query_positions": data.positions.tolist(), "settings": _settings_record(run, settings),
                "collect_bytes": data.nbytes,
                "collect_bytes_formula": layer_local_nbytes(
                    len(fit_idx) + len(stop_idx), data.source_k.shape[1], len(used), train.source_width, len(layers),
                    n_q, data.queries[0].shape[-1], len(data.positions), data.n_kv, ridge.native_sink),
                "collect_seconds": round(collected - started, 2),
                "train_seconds": round(time.perf_counter() - collected, 2),
                "layers_worse_than_ridge": [r["layer"] for r in layers if r["worse_than_ridge"]], "layers": layers}
    del data
    return TrainedMapper.from_ridge_mapper(ridge, weight, bias, training=training,
                                           r2=_refit_r2(weight, bias, selected, train, heldout, run.target_head_dim()))


def _setup(run, ridge: Mapper):
    """What both objectives of mapper=trained share: (fit_idx, stop_idx, held-out idx, TrainSettings, the
    ridge map's selected layers [L_t][k], the sorted source layers any target layer reads)."""
    from ..maps.train_map import TrainSettings, split_stop

    mcfg, seed = run.cfg["mapper"], run.cfg.get("seed", 0)
    train_idx, held = run.split()
    fit_idx, stop_idx = split_stop(train_idx, int(mcfg["train_sequences"]), int(mcfg["stop_sequences"]), seed)
    device = run.device if mcfg.get("device", "auto") == "auto" else mcfg["device"]
    settings = TrainSettings(lr=run.lrs[0], steps=int(mcfg["steps"]), batch_sequences=int(mcfg["batch_sequences"]),
                             eval_every=int(mcfg["eval_every"]), patience=int(mcfg["patience"]), seed=seed, device=device)
    selected = ridge.selected_layers.tolist()
    return fit_idx, stop_idx, held, settings, selected, sorted({s for row in selected for s in row})


def _settings_record(run, settings) -> dict:
    """The training settings an artifact records; "lr" is the list mapper.lr gave when it gave several (each
    layer's / the joint map's kept rate is in its record)."""
    return {**vars(settings), "lr": run.lrs if len(run.lrs) > 1 else run.lrs[0]}


def _fit_end_to_end(run, ridge: Mapper, train: Moments, heldout: HeldOut):
    """mapper=trained mapper.objective=end_to_end (kvtransfer.maps.train_e2e): `ridge`, all layers jointly, trained
    for the frozen target's next-token KL on continuations of mapper.train_sequences train-split sequences
    (context: their first mapper.context_tokens tokens, default seq_len - continuation; continuation: the next
    mapper.continuation_tokens), early stopping on mapper.stop_sequences others (disjoint from the fidelity
    held-out split); held-out R² recomputed for the trained weights. The artifact records the splits, the
    per-step and per-evaluation KL, the collection's bytes and the per-step memory and FLOP formulas."""
    from ..core.mapper import TrainedMapper
    from ..core.models import decoder, text_config
    from ..maps.train_e2e import OBJECTIVE, collect_e2e, e2e_nbytes, e2e_step_flops, e2e_step_nbytes, train_e2e

    mcfg = run.cfg["mapper"]
    ids = run.token_ids()
    cont = int(mcfg["continuation_tokens"])
    ctx = ids.shape[1] - cont if mcfg.get("context_tokens") is None else int(mcfg["context_tokens"])
    if cont < 1 or ctx < 1 or ctx + cont > ids.shape[1]:
        raise ValueError(f"mapper.context_tokens={ctx} + mapper.continuation_tokens={cont} must be >= 1 each and "
                         f"fit the calibration's {ids.shape[1]}-token sequences (calib.seq_len)")
    fit_idx, stop_idx, held, settings, selected, used = _setup(run, ridge)
    source, target = run.model("source")[0], run.model("target")[0]
    started = time.perf_counter()
    data = collect_e2e(source, target, ids[fit_idx + stop_idx][:, :ctx + cont], used, context=ctx,
                       native_sink=ridge.native_sink, key_space=run.key_space,
                       batch_size=run.cfg["calib"]["batch_size"], progress=run.progress)
    collected = time.perf_counter()
    rows = list(range(len(fit_idx))), list(range(len(fit_idx), len(fit_idx) + len(stop_idx)))
    from ..maps.train_map import TrainSettings, lowest_stop_loss

    weight, bias, record = lowest_stop_loss(run.lrs, lambda lr: train_e2e(
        target, data, ridge.weight, ridge.bias, selected, *rows, TrainSettings(**{**vars(settings), "lr": lr}),
        progress=run.progress), "stop_kl_final")
    tc, kv = text_config(target.config), kv_shape(target)
    shape = dict(layers=kv.n_layers, hidden=tc.hidden_size, heads=tc.num_attention_heads, head_dim=kv.head_dim,
                 vocab=tc.vocab_size)
    b, p = settings.batch_sequences, ridge.weight.shape[2]
    act = torch.finfo(target.dtype).bits // 8
    layer_params = sum(x.numel() for x in decoder(target).layers[0].parameters())
    training = {"objective": OBJECTIVE, "fit_index": fit_idx, "stop_index": stop_idx, "heldout_index": held,
                "context_tokens": ctx, "continuation_tokens": cont, "settings": _settings_record(run, settings),
                "collect_bytes": data.nbytes,
                "collect_bytes_formula": e2e_nbytes(len(fit_idx) + len(stop_idx), ctx, cont, len(used),
                                                    train.source_width, kv.n_layers, kv.n_kv, kv.head_dim,
                                                    tc.hidden_size, ridge.native_sink),
                "step_activation_bytes_formula": e2e_step_nbytes(
                    b, ctx, cont, intermediate=tc.intermediate_size, kv_heads=kv.n_kv, p=p, act_bytes=act, **shape),
                "step_flops_formula": e2e_step_flops(b, ctx, cont, layer_params=layer_params, q=kv.n_kv * kv.head_dim,
                                                     p=p, **shape),
                "collect_seconds": round(collected - started, 2),
                "train_seconds": round(time.perf_counter() - collected, 2),
                "worse_than_ridge": record["worse_than_ridge"],
                "layers_worse_than_ridge": list(range(kv.n_layers)) if record["worse_than_ridge"] else [],
                **{k: v for k, v in record.items() if k not in ("objective", "worse_than_ridge")}}
    del data
    return TrainedMapper.from_ridge_mapper(ridge, weight, bias, training=training,
                                           r2=_refit_r2(weight, bias, selected, train, heldout, run.target_head_dim()))


def _refit_r2(weight: torch.Tensor, bias: torch.Tensor, selected: list[list[int]], train: Moments, heldout: HeldOut,
              head_dim: int) -> dict:
    """{"train", "heldout": {"k", "v": [L_t][n_kv_t]}} R² of the map weight [L_t, 2, p, q], bias [L_t, 2, q] on the
    calibration's train moments and held-out features (`ridge.head_r2`), as a ridge fit reports them."""
    from ..core.moments import KINDS
    from ..core.ridge import LayerFit, head_r2

    out: dict = {"train": {k: [] for k in KINDS}, "heldout": {k: [] for k in KINDS}}
    for t, layers in enumerate(selected):
        cols = train.source_columns(list(layers))
        for i, kind in enumerate(KINDS):
            fit = LayerFit(weight[t, i].double(), bias[t, i].double(), cols)
            out["train"][kind].append(head_r2(train, kind, fit, train.target_layers[t], head_dim).tolist())
            if heldout is not None and heldout.n > 0:
                out["heldout"][kind].append(head_r2(heldout, kind, fit, train.target_layers[t], head_dim).tolist())
    return {split: per for split, per in out.items() if all(per.values())}
