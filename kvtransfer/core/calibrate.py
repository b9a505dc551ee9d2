"""Calibration: token sequences -> train `Moments` and held-out raw features (`HeldOut`) of source/target
KV features.

Held-out R² does not need held-out moments (a second [Dx, Dx] + [Dx, Dy] per kind): the held-out
sequences' observations are offered to a `HeldOut`, which keeps a seeded uniform subsample of at most
`heldout_observations` raw feature rows (float32, as `kv_features` makes them) and R² is evaluated on
them directly.

Two capture modes:
* "co-resident": source and target are both in memory; each batch goes through both.
* "sequential": only one model is ever loaded. Pass 1 runs the source over every batch and stores
  its subsampled features on disk (safetensors); the source is released; pass 2 loads the target
  and streams it against the stored features. For pairs like Llama 3.1 8B -> 70B.
Models may be given as loaded models or as zero-argument callables that load them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .cache import prefill
from .io import PIECE_BYTES, atomic_save_tensors, load_tensor_dir, load_tensors, read_tensor_manifest, save_tensor_dir
from .models import KVShape, decoder, kv_shape
from .moments import KINDS, HeldOut, Moments
from .rope import RopeCodec

KEY_SPACES = ("stripped", "rotated")


@dataclass
class CalibrationMoments:
    """Moments of the train sequences and raw features sampled from the held-out sequences."""

    train: Moments
    heldout: HeldOut


def subsample_positions(seq_len: int, stride: int, device=None) -> torch.Tensor:
    """Positions kept for calibration: 0, stride, 2*stride, ... int64 on `device` (None: the CPU; position 0
    keeps the attention sink)."""
    return torch.arange(0, seq_len, stride, device=device)


@torch.no_grad()
def kv_features(model, input_ids: torch.Tensor, *, stride: int = 4, key_space: str = "stripped",
                layers: list[int] | None = None, codec: RopeCodec | None = None,
                features: str = "kv") -> dict[str, torch.Tensor]:
    """Per-token KV features of `model` on unpadded ids [batch, seq].

    Returns {"k": [batch * kept, len(layers) * width], "v": same} in float32, rows ordered
    (batch, position), columns (layer, feature); keys RoPE-stripped when key_space="stripped".
    features (kvtransfer.core.hidden): "kv" (width n_kv * d: the layer's K or V, head by head), "hidden" (width H: the
    layer's normed input, the same block for "k" and "v") or "hidden_kv" (width H + n_kv * d: [normed input | K]
    for "k", [normed input | V] for "v"); the normed inputs come from the same prefill (`hidden.capture_hidden`).
    """
    from .hidden import capture_hidden, check_features

    if key_space not in KEY_SPACES:
        raise ValueError(f"key_space must be one of {KEY_SPACES}, got {key_space!r}")
    check_features(features)
    keep = subsample_positions(input_ids.shape[1], stride, device=input_ids.device)
    if features == "kv":
        cache, hidden = prefill(model, input_ids), {}
        layers = range(len(cache)) if layers is None else layers
    else:
        layers = range(len(decoder(model).layers)) if layers is None else layers
        with capture_hidden(model, list(layers), keep) as hidden:
            cache = prefill(model, input_ids)
    if key_space == "stripped" and features != "hidden":
        codec = codec or RopeCodec(model)
    out = {"k": [], "v": []}
    for layer in layers:  # per layer: [normed input] (hidden, hidden_kv), then [K or V] (kv, hidden_kv)
        kv = {}
        if features != "hidden":
            keys, values = cache[layer]
            idx = keep.to(keys.device)   # a model spread by device_map keeps each layer's cache on its own device
            kv = {"k": codec.strip(keys[:, :, idx], idx) if key_space == "stripped" else keys[:, :, idx],
                  "v": values[:, :, idx]}
        for kind in KINDS:
            if features != "kv":
                x = hidden[layer]  # [batch, kept, H]
                out[kind].append(x.float().reshape(-1, x.shape[-1]).to(input_ids.device))
            if kind in kv:
                b, h, s, d = kv[kind].shape
                out[kind].append(kv[kind].float().permute(0, 2, 1, 3).reshape(b * s, h * d).to(input_ids.device))
    return {kind: torch.cat(out[kind], dim=1) for kind in KINDS}


def split_heldout(n_sequences: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Sequence-level split: (train indices, held-out indices), deterministic in `seed`."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    order = torch.randperm(n_sequences, generator=torch.Generator().manual_seed(seed)).tolist()  # device: host-side order
    n_held = int(round(n_sequences * heldout_fraction))
    if heldout_fraction > 0 and n_held == 0:
        n_held = 1
    return sorted(order[n_held:]), sorted(order[:n_held])


def _resolve(model_or_loader):
    return model_or_loader() if callable(model_or_loader) and not isinstance(model_or_loader, torch.nn.Module) \
        else model_or_loader


def _fingerprint(token_ids: torch.Tensor, settings: dict) -> str:
    h = hashlib.sha256(token_ids.cpu().numpy().tobytes())
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


def collect_moments(source, target, token_ids: torch.Tensor, *, stride: int = 4, batch_size: int = 8,
                    heldout_fraction: float = 0.1, heldout_observations: int | None = None, seed: int = 0,
                    key_space: str = "stripped",
                    target_layers: list[int] | None = None, capture: str = "co-resident",
                    feature_dir: str | Path | None = None, checkpoint_path: str | Path | None = None,
                    checkpoint_every: int = 64, checkpoint_piece_bytes: int = PIECE_BYTES, dtype: torch.dtype = torch.float64,
                    compute_dtype: torch.dtype | None = None, store_device="cpu", accumulate: str = "host",
                    flush_batches: int = 8,
                    stop_after_batches: int | None = None, feature_sink: Callable | None = None,
                    progress: Callable | None = None, features: str = "kv") -> CalibrationMoments:
    """Stream calibration sequences through source and target; return train/held-out moments.

    token_ids: int64 [n_sequences, seq_len], no padding (equal-length chunks of text).
    stride: keep every stride-th position from 0. heldout_fraction: share of whole sequences kept
    out of the train moments (seeded). heldout_observations: how many of the held-out sequences' observations
    (tokens) to keep as raw features for held-out R² (a seeded uniform subsample; None = all). target_layers: a shard of target layers (default all) for
    pairs whose full moments do not fit. dtype / store_device: accumulator precision and location
    (float64 on host by default; float32 halves memory). compute_dtype: precision of each batch's
    products (default dtype; float32 is fast on GPUs, merged into the accumulator's dtype).
    accumulate: "twolevel" (the run's default, conf/calib: each train batch merged in place into a float32 buffer on the
    target's device by `Moments.accumulate`, the buffer folded into the `dtype` -- float64 -- moments on `store_device`
    by `Moments.absorb` after every `flush_batches` train batches and after the last; the flush schedule depends on
    the batch index only, so checkpoints, their cadence and resumes never change a number: a checkpoint taken
    mid-flush stores the buffer too), "host" (the batch's products are formed, shipped to `store_device` and merged there) or
    "device" (the train moments live on the target's device in `dtype` -- float32 on a GPU -- with float64
    means, merged in place per batch by `Moments.accumulate`; store_device then holds only the held-out
    features; compute_dtype is ignored).
    checkpoint_path: a directory (`save_calibration`'s layout) rewritten every `checkpoint_every` sequences
    in place, one piece of <= checkpoint_piece_bytes at a time (disk peak: the calibration + one piece);
    a rerun with the same inputs resumes from it and ends bit-identical to an uninterrupted run. After
    the last batch it holds the finished calibration (`load_calibration` reads it).
    stop_after_batches: process at most this many batches in this call (then checkpoint) -- for
    time-boxed jobs; the result is partial unless the run has finished.
    feature_sink: optional callable(split, batch_index, x, y) given every batch's features (with a
    `checkpoint()` method, called before each moments checkpoint, it can keep its state across resumes; e.g. to
    keep a bounded sample for training an MLP mapper); not replayed for batches restored from a
    checkpoint.
    progress: optional callable wrapping an iterable (e.g. tqdm).
    features: the source's features (`kv_features`; kvtransfer.core.hidden): "kv" (the paper's), "hidden" or
    "hidden_kv" (the source's normed layer inputs, alone or beside its K/V); the moments' source_width is then
    H or H + n_kv_s * d_s per source layer. The target's features are always its K/V.
    """
    from .hidden import check_features, feature_width, hidden_size

    check_features(features)
    if accumulate not in ("host", "device", "twolevel"):
        raise ValueError(f"accumulate must be 'host', 'device' or 'twolevel', got {accumulate!r}")
    if int(flush_batches) < 1:
        raise ValueError(f"flush_batches must be >= 1, got {flush_batches}")
    if capture not in ("co-resident", "sequential"):
        raise ValueError(f"capture must be 'co-resident' or 'sequential', got {capture!r}")
    if capture == "sequential" and feature_dir is None:
        raise ValueError("capture='sequential' needs feature_dir= (where source features are stored)")
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)  # device: host-side ids, each batch moved to its model
    if token_ids.dim() != 2 or token_ids.shape[0] < 2:
        raise ValueError(f"token_ids must be [n_sequences >= 2, seq_len], got {tuple(token_ids.shape)}")
    train_idx, held_idx = split_heldout(token_ids.shape[0], heldout_fraction, seed)
    batches = [("train", train_idx[i:i + batch_size]) for i in range(0, len(train_idx), batch_size)]
    batches += [("heldout", held_idx[i:i + batch_size]) for i in range(0, len(held_idx), batch_size)]
    every = max(1, checkpoint_every // batch_size)
    if accumulate == "twolevel":   # checkpoints at flush boundaries: the buffer is then empty and not written
        every = -(-every // int(flush_batches)) * int(flush_batches)
    wrap = progress or (lambda it, **_: it)

    src_model = _resolve(source) if capture == "co-resident" else None
    tgt_model = _resolve(target) if capture == "co-resident" else None
    settings = {"stride": stride, "batch_size": batch_size, "heldout_fraction": heldout_fraction,
                "heldout_observations": heldout_observations, "seed": seed,
                "key_space": key_space, "target_layers": target_layers, "dtype": str(dtype),
                "compute_dtype": (str(compute_dtype) if accumulate == "host" else
                                  str(torch.float32) if accumulate == "twolevel" else str(dtype)),
                "accumulate": accumulate}   # twolevel: float32 sums (ridge.moments_eps reads it)
    if accumulate == "twolevel":   # only then: earlier calibrations keep their fingerprints
        settings["flush_batches"] = int(flush_batches)
    if features != "kv":  # only then: the paper's calibrations keep their fingerprints (and resume their checkpoints)
        settings["features"] = features
    fingerprint = _fingerprint(token_ids, settings)

    split, done = None, 0
    if checkpoint_path is not None and Path(checkpoint_path).exists():
        split, done = _load_checkpoint(checkpoint_path, fingerprint, store_device)
        split = split or None

    if capture == "sequential":
        feature_dir = Path(feature_dir)
        feature_dir.mkdir(parents=True, exist_ok=True)
        pending = [i for i in range(done, len(batches)) if not (feature_dir / f"batch_{i:06d}.safetensors").exists()]
        if pending:
            src_model = _resolve(source)
            src_codec = RopeCodec(src_model) if key_space == "stripped" else None
            shape = kv_shape(src_model)
            for i in wrap(pending, desc="source features"):
                ids = token_ids[batches[i][1]].to(src_model.device)
                feats = kv_features(src_model, ids, stride=stride, key_space=key_space, codec=src_codec,
                                    features=features)
                atomic_save_tensors(feature_dir / f"batch_{i:06d}.safetensors", feats,
                                    {"fingerprint": fingerprint, "batch": i,
                                     "source_shape": [shape.n_layers, shape.n_kv, shape.head_dim],
                                     "source_hidden": hidden_size(src_model)})
            del src_model, src_codec
            _free_accelerator()
        meta = load_tensors(feature_dir / f"batch_{len(batches) - 1:06d}.safetensors")[1]
        src_shape, src_hidden = KVShape(*meta["source_shape"]), meta.get("source_hidden", 0)
        tgt_model = _resolve(target)
    else:
        src_codec = RopeCodec(src_model) if key_space == "stripped" else None
        src_shape, src_hidden = kv_shape(src_model), hidden_size(src_model)
    src_width = feature_width(features, src_hidden, src_shape.width)
    tgt_codec = RopeCodec(tgt_model) if key_space == "stripped" else None
    tgt_shape = kv_shape(tgt_model)
    tgt_layers = list(range(tgt_shape.n_layers)) if target_layers is None else list(target_layers)
    if split is None:
        info = {"sequences": len(train_idx), "heldout_sequences": len(held_idx),
                "tokens_per_seq": token_ids.shape[1], **settings}
        src_layers = list(range(src_shape.n_layers))
        held_total = len(held_idx) * len(subsample_positions(token_ids.shape[1], stride))
        train_device = tgt_model.device if accumulate == "device" else store_device
        split = {"train": Moments(src_layers, tgt_layers, src_width, tgt_shape.width, dtype, train_device,
                                  info=dict(info), wide=accumulate == "device"),
                 "heldout": HeldOut.sampled(src_layers, tgt_layers, src_width, tgt_shape.width,
                                            total=held_total, capacity=heldout_observations, seed=seed,
                                            device=store_device, info=dict(info))}

    elif accumulate == "device":
        split["train"].to(tgt_model.device)   # resumed from a checkpoint read to the store
    buffer = None
    if accumulate == "twolevel":   # the device-side float32 buffer (restored when a checkpoint was cut mid-flush)
        train = split["train"]
        buffer = split.pop("buffer", None)
        buffer = (buffer.to(tgt_model.device) if buffer is not None else
                  Moments(train.source_layers, train.target_layers, train.source_width, train.target_width,
                          torch.float32, tgt_model.device, wide=True))
    n_train_batches = -(-len(train_idx) // batch_size)

    end = len(batches) if stop_after_batches is None else min(len(batches), done + stop_after_batches)
    for i in wrap(range(done, end), desc="calibration", initial=done, total=len(batches)):
        name, idx = batches[i]
        ids = token_ids[idx].to(tgt_model.device)
        y = kv_features(tgt_model, ids, stride=stride, key_space=key_space, layers=tgt_layers, codec=tgt_codec)
        if capture == "sequential":
            x, meta = load_tensors(feature_dir / f"batch_{i:06d}.safetensors")
            if meta.get("fingerprint") != fingerprint:
                raise ValueError(f"{feature_dir} holds features of a different calibration; use an empty feature_dir")
        else:
            x = kv_features(src_model, token_ids[idx].to(src_model.device), stride=stride, key_space=key_space,
                            codec=src_codec, features=features)
        x = {k: t.to(y["k"].device) for k, t in x.items()}
        if name == "train" and accumulate == "twolevel":
            buffer.accumulate(x, y)
            if (i + 1) % flush_batches == 0 or i + 1 == n_train_batches:
                split[name].absorb(buffer)
        elif name == "train" and accumulate == "device":
            split[name].accumulate(x, y)
        elif name == "train":
            split[name].add(x, y, compute_dtype=compute_dtype)
        else:
            split[name].add(x, y)
        if feature_sink is not None:
            feature_sink(name, i, x, y)
        if checkpoint_path is not None and ((i + 1) % every == 0 or i + 1 == end):
            if hasattr(feature_sink, "checkpoint"):  # first: a sink ahead of the moments skips what it has
                feature_sink.checkpoint()
            _mark(split, i + 1, len(batches))
            parts = split if buffer is None or buffer.n == 0 else {**split, "buffer": buffer}
            _save_checkpoint(checkpoint_path, parts, i + 1, fingerprint, checkpoint_piece_bytes)
    _mark(split, end, len(batches))
    return CalibrationMoments(split["train"], split["heldout"])


@torch.no_grad()
def sample_features(source, target, token_ids: torch.Tensor, train_batches: list[list[int]], sink, *, stride: int,
                    key_space: str = "stripped", target_layers: list[int] | None = None, checkpoint_every: int = 8,
                    progress=None, features: str = "kv") -> None:
    """Feed `sink(split, batch_index, x, y)` (a `mlp.FeatureSampler`) the train batches' features exactly as
    `collect_moments` would, without the moments: for a calibration whose moments exist but whose feature
    sample does not. Batches the sink already holds are skipped, and `sink.checkpoint()` runs every
    `checkpoint_every` batches, so an interrupted pass resumes. `features`: the source's, as in `collect_moments`."""
    wrap = progress or (lambda it, **_: it)
    src_codec = RopeCodec(source) if key_space == "stripped" else None
    tgt_codec = RopeCodec(target) if key_space == "stripped" else None
    held = set(getattr(sink, "batches", []))
    pending = [i for i in range(len(train_batches)) if i not in held]
    for n, i in enumerate(wrap(pending, desc="feature sample")):
        idx = train_batches[i]
        y = kv_features(target, token_ids[idx].to(target.device), stride=stride, key_space=key_space,
                        layers=target_layers, codec=tgt_codec)
        x = kv_features(source, token_ids[idx].to(source.device), stride=stride, key_space=key_space, codec=src_codec,
                        features=features)
        sink("train", i, x, y)
        if (n + 1) % checkpoint_every == 0 and hasattr(sink, "checkpoint"):
            sink.checkpoint()


def _mark(split: dict, done: int, total: int) -> None:
    for part in ("train", "heldout"):
        split[part].info["batches_done"] = done
        split[part].info["complete"] = done == total


def _save_checkpoint(path, split: dict, batches_done: int, fingerprint: str, piece_bytes: int = PIECE_BYTES) -> None:
    tensors, metas = {}, {}
    for part, moments in split.items():
        t, m = moments.state(prefix=f"{part}.")
        tensors.update(t)
        metas[part] = m
    save_tensor_dir(path, tensors, {"checkpoint": {"batches_done": batches_done, "fingerprint": fingerprint,
                                                   "moments": metas}}, piece_bytes=piece_bytes)


def _load_checkpoint(path, fingerprint: str, device) -> tuple[dict, int]:
    """(split, batches_done) of a checkpoint directory; ({}, 0) when it has no manifest (a write was cut:
    start afresh -- the next checkpoint overwrites it piece by piece)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a kvtransfer calibration checkpoint (a directory)")
    manifest = read_tensor_manifest(path)
    if manifest is None:
        if any(path.iterdir()):
            import warnings

            warnings.warn(f"checkpoint {path} was cut while being written; starting the calibration afresh",
                          stacklevel=3)
        return {}, 0
    ck = manifest.get("checkpoint")
    if ck is None:
        raise ValueError(f"{path} is not a kvtransfer calibration checkpoint")
    if ck["fingerprint"] != fingerprint:
        raise ValueError(f"checkpoint {path} was made from other data or settings; delete it or pass a "
                         "different checkpoint_path to start afresh")
    tensors, _ = load_tensor_dir(path, device=device)
    split = {part: (HeldOut if m.get("heldout") else Moments).from_state(tensors, m, prefix=f"{part}.", device=device)
             for part, m in ck["moments"].items()}
    return split, ck["batches_done"]


def save_calibration(directory, calib: CalibrationMoments, *, piece_bytes: int = PIECE_BYTES) -> None:
    """Write train moments + held-out features as a tensor directory (`io.save_tensor_dir`): rewritten in
    place piece by piece, so an existing calibration there never needs twice its size on disk."""
    split = {"train": calib.train, "heldout": calib.heldout}
    done = calib.train.info.get("batches_done", 0)
    _save_checkpoint(directory, split, done, calib.train.info.get("fingerprint", ""), piece_bytes)


def load_calibration(directory, device="cpu") -> CalibrationMoments:
    """Read a calibration written by `save_calibration` or left by a finished `collect_moments` checkpoint."""
    manifest = read_tensor_manifest(directory)
    if manifest is None or "checkpoint" not in manifest:
        raise ValueError(f"{directory} holds no complete kvtransfer calibration")
    tensors, _ = load_tensor_dir(directory, device=device)
    metas = manifest["checkpoint"]["moments"]
    return CalibrationMoments(Moments.from_state(tensors, metas["train"], prefix="train.", device=device),
                              HeldOut.from_state(tensors, metas["heldout"], prefix="heldout.", device=device))


def _free_accelerator() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
