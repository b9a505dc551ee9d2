"""The fit stage: source-layer selection and one fit function per map kind (`FITS`, kind -> function); each
function takes the run, the calibration moments and the selected layers and returns an unsaved mapper."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..core.mapper import HiddenMapper, Mapper
from ..core.models import kv_shape
from ..core.moments import HeldOut, Moments
from ..core.ridge import UnderdeterminedFit, fit_ridge
from ..core.select import select_greedy, select_topk
from . import fit_family, fit_trained

def selected_layers(run) -> list[list[int]]:
    """Source layers per target layer by the configured rule (top-k or greedy)."""
    if run.cfg["mapper"].get("selection", "topk") == "greedy":
        train, _, _ = run.moments()
        return select_greedy(train, run.k, lam=run.lam, head_dim=run.target_head_dim(), progress=run.progress)
    return select_topk(run.r2()["train"], run.k)


def fit(run, directory: Path) -> None:
    """Fit the map this run's config asks for (mapper.kind, via FITS) and save it to `directory`: the fit's seconds
    and the native sink (mapper.native_sink, which travels with the map) are recorded in the artifact."""
    train, heldout, info = run.moments()
    selected = selected_layers(run)
    kind = run.cfg["mapper"]["kind"]
    if kind not in FITS:
        raise ValueError(f"mapper.kind must be one of {sorted(FITS)}, got {kind!r}")
    started = time.perf_counter()
    mapper = FITS[kind](run, train, heldout, selected, info)
    mapper.calibration["fit_seconds"] = round(time.perf_counter() - started, 2)
    mapper.native_sink = int(run.cfg["mapper"].get("native_sink") or 0)
    mapper.produced_by = run.stamp("mapper")
    mapper.save(directory)


def _ridge(run, train: Moments, heldout: HeldOut, selected: list[list[int]], info: dict):
    """mapper=ridge: the paper's closed-form map, or a family beyond it (head-local support, reduced rank,
    attention metric: kvtransfer.maps.families). The solve needs no model: the pair identity comes from configs."""
    mcfg = run.cfg["mapper"]
    if _is_family(mcfg):
        return fit_family.fit(run, train, heldout, selected, info)
    return Mapper.from_ridge(_ridge_fit(run, train, heldout, selected, info), run.identity("source"),
                             run.identity("target"), key_space=run.key_space, calibration=info)


def _ridge_fit(run, train: Moments, heldout: HeldOut, selected: list[list[int]], info: dict):
    """The paper's ridge solve on the run's moments (kvtransfer.core.ridge.fit_ridge)."""
    return fit_ridge(train, selected, lam=run.lam, heldout=heldout, head_dim=run.target_head_dim(),
                     force=run.cfg["mapper"].get("force", False), stride=info["stride"], progress=run.progress)


def _trained(run, train: Moments, heldout: HeldOut, selected: list[list[int]], info: dict):
    """mapper=trained: the paper's map, ridge-initialised, trained for what the target reads (fit_trained)."""
    ridge = Mapper.from_ridge(_ridge_fit(run, train, heldout, selected, info), run.identity("source"),
                              run.identity("target"), key_space=run.key_space, calibration=info)
    ridge.native_sink = int(run.cfg["mapper"].get("native_sink") or 0)
    return fit_trained.fit_trained(run, ridge, train, heldout)


def fit_hidden(run, train: Moments, heldout: HeldOut, selected: list[list[int]], info: dict) -> HiddenMapper:
    """mapper=hidden: the paper's closed-form ridge fit and top-k selection, on moments whose source block per
    layer is the normed layer input [H] (features=hidden) or [normed input | K or V] (hidden_kv), i.e. the
    calibration this config keys (`source_features`). The selection is the paper's procedure run on these
    features (single-source R² of each target layer from each source layer's block, top k). A refused p/n
    names the config fix."""
    from ..core.hidden import hidden_size

    mcfg = run.cfg["mapper"]
    try:
        fit = fit_ridge(train, selected, lam=run.lam, heldout=heldout, head_dim=run.target_head_dim(),
                        force=mcfg.get("force", False), stride=info["stride"], progress=run.progress)
    except UnderdeterminedFit as err:
        raise UnderdeterminedFit(
            f"mapper=hidden (features={run.features}) reads {train.source_width:,} features from each of its "
            f"k = {max(len(s) for s in selected)} source layers, too many for the {train.n:,} calibration "
            "observations: use fewer layers (mapper.k), more calibration text (calib.n_sequences, calib.seq_len, "
            f"or a smaller calib.stride), or set mapper.force=true to fit anyway ({err})") from err
    return HiddenMapper.from_ridge(fit, run.identity("source"), run.identity("target"), features=run.features,
                                   hidden_size=hidden_size(run.identity("source")), key_space=run.key_space,
                                   calibration=info)


def _mlp(run, train: Moments, heldout: HeldOut, selected: list[list[int]], info: dict):
    """mapper=mlp: the paper's MLP fallback, trained on the calibration's kept feature rows (kvtransfer.maps.mlp)."""
    from ..maps.mlp import FeatureSampler, fit_mlp
    from .calibrate_stage import feature_sample_path

    mcfg = run.cfg["mapper"]
    source, target = run.model("source")[0], run.model("target")[0]
    device = run.device if mcfg.get("device", "auto") == "auto" else mcfg["device"]
    return fit_mlp(FeatureSampler.load(feature_sample_path(run)), selected, source, target,
                   source_width=train.source_width, target_heads=kv_shape(target).n_kv, hidden=mcfg["hidden"],
                   lr=run.lrs[0], epochs=mcfg["epochs"], batch_tokens=mcfg["batch_tokens"], device=device,
                   seed=run.cfg.get("seed", 0), key_space=run.key_space, calibration=info, progress=run.progress)


# kind -> fit(run, train moments, held-out features, selected layers [L_t][k], calibration info) -> unsaved mapper
FITS = {"ridge": _ridge, "trained": _trained, "hidden": fit_hidden, "mlp": _mlp}


def _is_family(mcfg: dict) -> bool:
    """Whether the ridge config asks for a map family beyond the paper's (kvtransfer.maps.families)."""
    return (mcfg.get("support", "full") != "full" or mcfg.get("rank") is not None
            or mcfg.get("weighting", "none") != "none")


def mean_r2(mapper_r2: dict) -> dict:
    """{split: {kind: [[...]]}} -> {kind: {split: mean}}."""
    out: dict = {}
    for split, per in mapper_r2.items():
        for kind, values in per.items():
            flat = torch.tensor(values, dtype=torch.float64)  # device: host-side summary of Python lists
            out.setdefault(kind, {})[split] = float(flat.mean())
    return out
