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

def calibrate(run, directory: Path, key_space: str) -> None:
    # jobs of one sweep start together: one calibrates, the others wait and then read its artifact
    with exclusive_lock(run.cache_dir / "locks" / f"{directory.parent.name}-{directory.name}.lock"):
        if not (directory / "calibration.json").exists():
            _calibrate_locked(run, directory, key_space)


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
