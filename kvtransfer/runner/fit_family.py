"""The fit of a map family beyond the paper (mapper.support / rank / weighting: kvtransfer.maps.families) and the
target-side statistics its weightings read: query-energy metrics (weighting=attention) and per-row attention mass
(weighting=attention_mass), each cached next to the calibration moments."""
from __future__ import annotations

import json

import torch

from ..core.io import atomic_save_tensors, load_tensors
from ..core.mapper import FactoredMapper
from ..core.models import kv_shape
from ..core.moments import HeldOut, Moments
from .calibrate_stage import feature_sample_path, train_batches

def fit(run, train: Moments, heldout: HeldOut, selected: list[list[int]], info: dict) -> FactoredMapper:
    """mapper=ridge with a family knob set: fit_family on the run's moments, with the weighting's target statistics."""
    from ..maps.families import fit_family

    mcfg = run.cfg["mapper"]
    src, tgt = (kv_shape(run.identity(side)) for side in ("source", "target"))
    weighting = mcfg.get("weighting", "none")
    metrics = attention_metrics(run) if weighting == "attention" else None
    sample, row_weights = observation_weights(run) if weighting == "attention_mass" else (None, None)
    result = fit_family(train, selected, n_kv_s=src.n_kv, d_s=src.head_dim, n_kv_t=tgt.n_kv, lam=run.lam,
                        support=mcfg.get("support", "full"), rank=mcfg.get("rank"), weighting=weighting,
                        metrics=metrics, sample=sample, row_weights=row_weights, heldout=heldout,
                        force=mcfg.get("force", False), stride=info["stride"], progress=run.progress)
    return FactoredMapper.from_family(result, run.identity("source"), run.identity("target"),
                                      key_space=run.key_space, calibration=info)


def attention_metrics(run) -> dict:
    """{"k", "v": [L_t, n_kv_t, d_t, d_t]} output metrics of weighting=attention (kvtransfer.maps.families):
    keys from the target's query energy on the first mapper.metric_sequences train sequences (cached
    next to the moments), values from its o_proj weights."""
    from ..maps.families import key_metric, query_energy, value_metric

    n_seq = int(run.cfg["mapper"].get("metric_sequences", 16))
    target = run.model("target")[0]
    path = run.moments_dir(run.key_space) / f"query_energy_{run.key('query_energy')}.safetensors"
    if path.exists():
        energy = load_tensors(path)[0]["energy"]
    else:
        calib = run.cfg["calib"]
        train_rows, _ = run.split()
        energy = query_energy(target, run.token_ids()[train_rows[:n_seq]], batch_size=calib["batch_size"])
        atomic_save_tensors(path, {"energy": energy}, {"sequences": str(n_seq),
                                                       "produced_by": json.dumps(run.stamp("query_energy"))})
    return {"k": key_metric(energy, kv_shape(target).n_kv), "v": value_metric(target)}


def observation_weights(run) -> tuple[dict, torch.Tensor]:
    """(feature sample, row weights [n, L_t]) of weighting=attention_mass (kvtransfer.maps.families): the train
    rows kept during calibration (calib.mlp_samples; all of them when it is >= the train observations)
    and the attention mass the target puts on each row's token (`families.attention_mass`, cached next
    to the moments), zero where the map is never applied (positions < mapper.native_sink)."""
    from ..maps.families import attention_mass
    from ..maps.mlp import FeatureSampler

    directory = run.moments_dir(run.key_space)
    calib, seed = run.cfg["calib"], run.cfg.get("seed", 0)
    ids = run.token_ids()
    train_idx, batches, positions = train_batches(run)
    path = feature_sample_path(run)
    sample, meta = load_tensors(path)
    # which (sequence, position) each kept row is: the sampler's own per-batch choice, replayed
    sampler = FeatureSampler(calib["mlp_samples"], len(batches), seed)
    seq, pos = [], []
    for b in json.loads(meta["batches"]) if "batches" in meta else range(len(batches)):
        keep = sampler.kept_rows(b, len(batches[b]) * len(positions))
        seq.append(keep // len(positions) + b * calib["batch_size"])  # index into train_idx
        pos.append(keep % len(positions))
    seq, pos = torch.cat(seq), torch.cat(pos)
    if seq.numel() != sample["xk"].shape[0]:
        raise ValueError(f"{path} holds {sample['xk'].shape[0]} rows but its sampler's choice replays to "
                         f"{seq.numel()}: delete it (the next run samples the features again)")
    mass_path = directory / f"attention_mass_{run.key('attention_mass')}.safetensors"
    if mass_path.exists():
        mass = load_tensors(mass_path)[0]["mass"]
    else:
        target = run.model("target")[0]
        mass = attention_mass(target, ids[train_idx], positions, batch_size=calib["batch_size"])
        atomic_save_tensors(mass_path, {"mass": mass}, {"sequences": "train", "window": "last quarter",
                                                        "produced_by": json.dumps(run.stamp("attention_mass"))})
    weights = mass[seq, :, pos]  # [n, L_t]
    weights[positions[pos] < int(run.cfg["mapper"].get("native_sink") or 0)] = 0.0
    return sample, weights
