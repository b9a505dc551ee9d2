"""The calibrate stage: the moments of a run's calibration text (kvtransfer.core.calibrate), computed under a lock
so the jobs of one sweep calibrate once, and the train feature rows some fits read (calib.mlp_samples)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from ..core.calibrate import collect_moments, split_heldout
from ..core.context import describe as describe_context
from ..core.io import atomic_write_json, exclusive_lock

# what an entry of calib.merge may set: where its text comes from and how much of it; everything else (tokens per
# sequence, stride, precision, held-out share) is the run's own, so the parts' moments share one layout and protocol
MERGE_KEYS = ("files", "dataset", "dataset_name", "split", "text_field", "domain", "draw", "n_sequences")


def calibrate(run, directory: Path, key_space: str) -> None:
    # jobs of one sweep start together: one calibrates, the others wait and then read its artifact
    with exclusive_lock(run.cache_dir / "locks" / f"{directory.parent.name}-{directory.name}.lock"):
        if not (directory / "calibration.json").exists():
            if run.cfg["calib"].get("merge"):
                _merge_locked(run, directory, key_space)
            else:
                _calibrate_locked(run, directory, key_space)


def merge_parts(run) -> list:
    """The runs whose calibrations a calib.merge run combines: its own calibration without the merge, then one per
    entry of calib.merge (the entry's keys, `MERGE_KEYS`, over the run's calib). They share the run's loaded models."""
    import copy

    calib = run.cfg["calib"]
    parts = []
    for i, entry in enumerate([{}, *(calib.get("merge") or ())]):
        bad = sorted(set(entry) - set(MERGE_KEYS))
        if bad:
            raise ValueError(f"calib.merge[{i - 1}] sets {bad}: an entry names only its text ({', '.join(MERGE_KEYS)}); "
                             "the tokens per sequence, stride and precision are the run's own calib settings")
        cfg = copy.deepcopy(run.cfg)
        cfg["calib"].update(copy.deepcopy(dict(entry)), merge=[])
        if entry.get("files") and not entry.get("domain"):
            cfg["calib"]["domain"] = None   # the entry's own files name it, not the run's domain label
        part = type(run)(cfg, run.out_dir)
        part._models = run._models
        parts.append(part)
    keys = [p.key("calibration") for p in parts]
    if len(set(keys)) < len(keys):
        raise ValueError("calib.merge repeats a calibration (the same text, draw and size twice would count its "
                         "tokens twice): give each entry another calib.draw or other files")
    return parts


def _merge_locked(run, directory: Path, key_space: str) -> None:
    """The calibration of a calib.merge run: each part calibrated (or read from the cache) on its own, then the train
    moments merged exactly (Chan's pairwise update) and the held-out rows joined. Held-out sequences stay held out of
    the merged fit: the parts' texts never share a sequence (other draws or other files)."""
    from ..core.calibrate import CalibrationMoments, load_calibration, save_calibration
    from ..core.moments import HeldOut

    if run.cfg["calib"].get("mlp_samples"):
        raise ValueError("calib.merge keeps no MLP feature sample: set calib.mlp_samples=0 (a ridge map reads only "
                         "the moments), or calibrate the merged text as one calib.files list")
    parts = merge_parts(run)
    train, held, infos, own = None, [], [], None
    for part in parts:
        info = part.calibration_info(key_space)
        own = own or info   # the run's own part (the first): its held-out split and context start stand for the merge
        moments = load_calibration(part.moments_dir(key_space) / "calibration")
        train = moments.train if train is None else train.merge(moments.train)
        held.append(moments.heldout)
        infos.append({"key": part.moments_dir(key_space).name, **{k: info.get(k) for k in (
            "domain", "data", "sequences", "heldout_sequences", "observations", "seconds")},
            "draw": int(part.cfg["calib"].get("draw") or 0)})
        run.producers.update(part.producers)
    heldout = HeldOut.concat(held)
    train.info = {**train.info, "complete": True, "parts": [i["key"] for i in infos]}
    directory.mkdir(parents=True, exist_ok=True)
    save_calibration(directory / "calibration", CalibrationMoments(train, heldout))
    domains = list(dict.fromkeys(i["domain"] for i in infos))
    info = {**own, "sequences": sum(i["sequences"] for i in infos),
            "heldout_sequences": sum(i["heldout_sequences"] for i in infos),
            "observations": train.n, "heldout_observations": heldout.n, "heldout_observations_total": heldout.seen,
            "data": [f for i in infos for f in (i["data"] if isinstance(i["data"], list) else [i["data"]])],
            "domain": "+".join(domains), "seconds": round(sum(i["seconds"] for i in infos), 2), "parts": infos,
            "produced_by": run.stamp("calibration")}
    atomic_write_json(directory / "calibration.json", info)


def _calibrate_locked(run, directory: Path, key_space: str) -> None:
    calib = run.cfg["calib"]
    directory.mkdir(parents=True, exist_ok=True)
    ids = run.token_ids()
    sampler = None
    # the MLP's feature sample is kept whenever asked for, so one calibration serves ridge and MLP fits; not in a
    # hidden-state calibration (mapper=hidden), whose rows no MLP or attention-mass fit reads (they calibrate K/V)
    if calib.get("mlp_samples", 0) and key_space == run.key_space and run.features == "kv":
        from ..maps.mlp import FeatureSampler

        n_train = len(split_heldout(ids.shape[0], calib["heldout_fraction"], run.cfg.get("seed", 0))[0])
        sampler = FeatureSampler(calib["mlp_samples"], -(-n_train // calib["batch_size"]), run.cfg.get("seed", 0),
                                 state_path=directory / "mlp_sample.partial.safetensors")
    dtype = getattr(torch, calib.get("dtype", "float64"))
    compute = getattr(torch, calib["compute_dtype"]) if calib.get("compute_dtype") else None
    if calib.get("capture", "co-resident") == "sequential":
        source = lambda: run.model("source")[0]  # noqa: E731
        target = lambda: run._release("source") or run.model("target")[0]  # noqa: E731
    else:
        source, target = run.model("source")[0], run.model("target")[0]
    started = time.perf_counter()
    result = collect_moments(
        source, target, ids, stride=calib["stride"], batch_size=calib["batch_size"],
        heldout_fraction=calib["heldout_fraction"], heldout_observations=calib.get("heldout_observations"),
        seed=run.cfg.get("seed", 0), key_space=key_space,
        capture=calib.get("capture", "co-resident"), feature_dir=directory / "features",
        checkpoint_path=directory / "calibration", checkpoint_every=calib.get("checkpoint_every", 64),
        dtype=dtype, compute_dtype=compute, store_device=calib.get("store_device", "cpu"),
        accumulate=calib.get("accumulate", "host"), flush_batches=int(calib.get("flush_batches", 8)),
        feature_sink=sampler, progress=run.progress, features=run.features)
    seconds = time.perf_counter() - started
    if not result.train.info.get("complete"):
        raise RuntimeError(f"calibration in {directory} did not finish")
    if sampler is not None:
        if not sampler.complete:
            raise RuntimeError(f"the MLP feature sample in {directory} covers {len(sampler.batches)} of "
                               f"{sampler.n_batches} train batches (a calibration resumed from a checkpoint "
                               "written without it); delete that directory and calibrate again, or set "
                               "calib.mlp_samples=0")
        sampler.save(directory / "mlp_sample.safetensors")
        (directory / "mlp_sample.partial.safetensors").unlink(missing_ok=True)
    info = {"sequences": result.train.info["sequences"], "heldout_sequences": result.heldout.info["heldout_sequences"],
            "seed": run.cfg.get("seed", 0),
            "heldout_index": split_heldout(ids.shape[0], calib["heldout_fraction"], run.cfg.get("seed", 0))[1],
            "tokens_per_seq": calib["seq_len"], "stride": calib["stride"], "observations": result.train.n,
            "heldout_observations": result.heldout.n, "heldout_observations_total": result.heldout.seen,
            "features": result.train.source_width, "source_features": run.features,
            "source_layers": len(result.train.source_layers), "key_space": key_space,
            "data": calib.get("files") or f"{calib.get('dataset')}/{calib.get('dataset_name')}",
            "domain": calib.get("domain") or _domain_name(calib),
            **describe_context(run.model("source")[1], run.context_start),
            "seconds": round(seconds, 2), "produced_by": run.stamp("calibration")}
    atomic_write_json(directory / "calibration.json", info)  # the calibration/ checkpoint is now the artifact
    shutil.rmtree(directory / "features", ignore_errors=True)


def train_batches(run) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """(train sequence indices, calibration's train batches of them, kept positions per sequence)."""
    from ..core.calibrate import subsample_positions

    calib = run.cfg["calib"]
    ids = run.token_ids()
    train_idx, _ = run.split()
    batches = [train_idx[i:i + calib["batch_size"]] for i in range(0, len(train_idx), calib["batch_size"])]
    return train_idx, batches, subsample_positions(ids.shape[1], calib["stride"])


def feature_sample_path(run) -> Path:
    """The train feature rows kept for calib.mlp_samples (mapper=mlp, weighting=attention_mass): the sample
    the calibration kept, or, when it kept none or another number of rows, a sample-only pass over the
    train batches (both models' forward, no moments; resumable), cached next to the moments."""
    from ..core.calibrate import sample_features
    from ..maps.mlp import FeatureSampler

    calib, seed = run.cfg["calib"], run.cfg.get("seed", 0)
    n = int(calib.get("mlp_samples") or 0)
    if n <= 0:
        raise ValueError("this mapper fits on calibration feature rows: set calib.mlp_samples > 0")
    directory = run.moments_dir(run.key_space)
    _, batches, positions = train_batches(run)
    sampler = FeatureSampler(n, len(batches), seed)
    rows = sum(min(sampler.per_batch, len(b) * len(positions)) for b in batches)
    kept = directory / "mlp_sample.safetensors"   # what the calibration kept (with its own mlp_samples)
    if kept.exists():
        from safetensors import safe_open

        with safe_open(str(kept), framework="pt") as f:
            if f.get_slice("xk").get_shape()[0] == rows:
                return kept
    path = directory / f"feature_sample_{run.key('feature_sample')}.safetensors"
    if not path.exists():
        partial = path.with_suffix(".partial.safetensors")
        sampler = FeatureSampler(n, len(batches), seed, state_path=partial)
        source, target = run.model("source")[0], run.model("target")[0]
        sample_features(source, target, run.token_ids(), batches, sampler, stride=calib["stride"],
                        key_space=run.key_space, features=run.features,
                        checkpoint_every=max(1, calib.get("checkpoint_every", 64) // calib["batch_size"]),
                        progress=run.progress)
        sampler.save(path, meta={"produced_by": run.stamp("feature_sample")})
        partial.unlink(missing_ok=True)
    return path


def _domain_name(calib: dict) -> str:
    """A short calibration-domain label: calib.dataset, else the calibration files' stems."""
    if calib.get("files"):
        return "+".join(Path(f).stem for f in calib["files"])
    return str(calib.get("dataset"))
