"""One configured run as an artifact cache: its models (loaded once), the identities and keys of its artifacts
(kvtransfer.runner.artifacts), and the artifacts themselves -- calibration moments, R² matrices, the mapper --
read from `cache_dir` or computed by their stage (calibrate_stage, fit_stage) when missing."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config.runconfig import learning_rates, resolve, source_features
from ..core.calibrate import load_calibration, split_heldout
from ..core.data import read_documents, stream_hf_documents, token_sequences
from ..core.io import atomic_save_tensors, exclusive_lock, load_tensors
from ..core.mapper import load_mapper
from ..core.models import check_same_tokenizer, config_hash, device_map_for, kv_shape, load_model, max_memory_for
from ..core.moments import HeldOut, Moments
from ..core.select import r2_matrix
from . import calibrate_stage, fit_stage
from .artifacts import ARTIFACTS, KEY_VERSION, compute_key, upstream_of

# Layout of a calibration artifact; part of its cache key, so artifacts of another layout are never misread.
# 1: train + held-out moments; 2: train moments + held-out raw features (moments.HeldOut), one file each;
# 3: the same as a tensor directory `calibration/` (calibrate.save_calibration: pieces + manifest), which is
# also the calibration's checkpoint -- the finished checkpoint is the artifact, nothing is copied.
MOMENTS_FORMAT = 3


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return lambda it, **kw: tqdm(it, **kw)


def resolved_device(cfg: dict) -> str:
    """The compute device a config runs on: its `device`, with `auto` the CUDA device when one is visible, else cpu."""
    device = cfg.get("device", "auto")
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


class Run:
    """One configured run: lazily loads models and computes or reuses each stage's artifact."""

    def __init__(self, cfg: dict, out_dir: str | Path):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.cache_dir = Path(cfg.get("cache_dir", "artifacts"))
        self.progress = _progress(cfg.get("progress", True))
        self._models: dict = {}
        self._memo: dict = {}
        self.producers: dict[str, dict] = {}  # artifact path (under cache_dir) -> its produced_by, as read
        resolved = resolve(cfg)   # the same reading of the config as the resource plan's (kvtransfer.config.runconfig)
        self.key_space, self.rope_at_inference = resolved.key_space, resolved.rope_at_inference
        self.k, self.lam = resolved.k, resolved.lam
        self.lrs = learning_rates(cfg["mapper"])  # refused here, before any stage, when a list is not allowed

    @property
    def context_start(self) -> str:
        """The run's position-0 convention (kvtransfer.core.context), shared by calibration and eval."""
        return self.cfg["calib"].get("context_start", "tokenizer")

    # -- models -----------------------------------------------------------------------------------
    def model_ref(self, side: str) -> str:
        """Local path (if set) or hub id of the source/target, after applying pair.direction."""
        pair = self.cfg["pair"]
        if pair.get("direction", "forward") not in ("forward", "reverse"):
            raise ValueError(f"pair.direction must be forward or reverse, got {pair['direction']!r}")
        if pair.get("direction", "forward") == "reverse":
            side = {"source": "target", "target": "source"}[side]
        spec = pair[side]
        ref = spec.get("path") or spec.get("id")
        if not ref:
            raise ValueError(f"pair.{side} has neither path nor id: set pair.{side}.path=/local/dir")
        return str(ref)

    def model(self, side: str):
        """(model, tokenizer) for "source" or "target", loaded once."""
        if side not in self._models:
            self._models[side] = load_model(
                self.model_ref(side), dtype=self.cfg["pair"].get("dtype", "auto"), device=self.device,
                device_map=device_map_for(self.cfg, side), max_memory=max_memory_for(self.cfg, side),
                trust_remote_code=self.cfg.get("trust_remote_code", False),
                attn_implementation=self.cfg.get("attn_implementation"))
            if len(self._models) == 2:
                check_same_tokenizer(self._models["source"][1], self._models["target"][1])
        return self._models[side]

    def identity(self, side: str):
        """What `models.model_identity` reads of the source/target -- the loaded model when it is in memory,
        else a config-only stand-in (config + name_or_path as `load_model` sets it), so no weights load."""
        if side in self._models:
            return self._models[side][0]
        from types import SimpleNamespace

        return SimpleNamespace(config=self.auto_config(side), name_or_path=self.model_ref(side))

    @property
    def device(self) -> str:
        """Resolved compute device (`resolved_device`)."""
        return resolved_device(self.cfg)

    def pair_identity(self) -> dict:
        """{"source", "target": model identity, "dtype"}: each side's ref, architecture hash and weights
        identity (kvtransfer.config.identity: hub revision or local-file digest), read without loading weights."""
        if "pair" not in self._memo:
            self._memo["pair"] = {side: self.model_identity(side) for side in ("source", "target")}
            self._memo["pair"]["dtype"] = self.cfg["pair"].get("dtype", "auto")
        return self._memo["pair"]

    def model_identity(self, side: str) -> dict:
        """{"ref", "config_hash", "weights"} of the source/target: what its artifacts are keyed by. A hub model's
        ref is its id (the weights its revision); a local directory is its bytes only (ref "local": weights,
        config and tokenizer files, `identity.weights_identity`), so a moved checkout keeps its keys."""
        import os

        from ..config.identity import weights_identity

        memo = f"identity/{side}"
        if memo not in self._memo:
            ref = self.model_ref(side)
            self._memo[memo] = {"ref": "local" if os.path.isdir(ref) else ref,
                                "config_hash": config_hash(self.auto_config(side)), "weights": weights_identity(ref)}
        return self._memo[memo]

    def auto_config(self, side: str):
        """The source/target's `AutoConfig`, read once per run (every identity, shape and head-size query shares it)."""
        memo = f"config/{side}"
        if memo not in self._memo:
            from transformers import AutoConfig

            self._memo[memo] = AutoConfig.from_pretrained(self.model_ref(side),
                                                          trust_remote_code=self.cfg.get("trust_remote_code", False))
        return self._memo[memo]

    def input_identity(self, name: str):
        """Identity named by an artifact declaration: "source"/"target" (model identity), "calib_data" /
        "eval_data" (size + sha256 of the local files the calibration / evaluation reads), "ppl_data" (the
        perplexity sets' files outside eval.data_dir)."""
        from ..config.identity import data_identity

        if name in ("source", "target"):
            return self.model_identity(name)
        memo = f"identity/{name}"
        if memo not in self._memo:
            if name == "calib_data":
                calib = self.cfg["calib"]
                merged = [f for part in calib.get("merge") or () for f in part.get("files") or ()]
                self._memo[memo] = data_identity(files=[*(calib.get("files") or ()), *merged])
                if not calib.get("files") and calib.get("dataset"):  # streamed from the hub: its revision
                    self._memo[memo].append(_hub_dataset(calib["dataset"], calib.get("dataset_name")))
            elif name == "eval_data":
                from ..eval.sources import eval_sources

                self._memo[memo] = data_identity(directory=self.cfg["eval"].get("data_dir"))
                # hub datasets the benchmarks, perplexity or CoQA read (eval.data_dir: null): their revisions
                hub = {(s.dataset, s.name) for s in eval_sources(self.cfg["eval"]) if s.dataset}
                self._memo[memo] += [_hub_dataset(d, n) for d, n in sorted(hub, key=str)]
            elif name == "ppl_data":  # perplexity sets read from the repository, outside eval.data_dir
                from ..eval.sources import ppl_bundled_files
                self._memo[memo] = data_identity(files=ppl_bundled_files(self.cfg["eval"]))
            else:
                raise KeyError(f"no identity named {name!r}")
        return self._memo[memo]

    def key(self, name: str, key_space: str | None = None) -> str:
        """Key of artifact `name` under this run's config, from its declaration (kvtransfer.runner.artifacts):
        its config inputs, upstream keys, identities and runtime values. key_space: the calibration's
        (default: the run's; a mapper is always fitted on the run's own key space)."""
        art = ARTIFACTS[name]
        upstream = {u: self.key(u) for u in upstream_of(name, self.cfg)}
        runtime = {"key_space": key_space or self.key_space, "format": MOMENTS_FORMAT, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(0) if self.device.startswith("cuda") else "cpu"}
        return compute_key(name, self.cfg, upstream=upstream,
                           identities={i: self.input_identity(i) for i in art.identities},
                           extra={e: runtime[e] for e in art.extra})

    # -- provenance of artifacts -------------------------------------------------------------------
    def stamp(self, kind: str) -> dict:
        """`produced_by` of a new artifact of `kind` (kvtransfer.config.provenance): the checkout's commit and
        dirty flag, the time, package versions and the producing code's version."""
        from ..config.provenance import produced_by
        from .artifacts import version

        return produced_by(version(kind))

    def note(self, kind: str, path, stamp: dict | None) -> None:
        """Record that this run read artifact `kind` at `path` made by `stamp` (None: it records none, made before
        artifacts carried provenance); summary.json `producers` lists them (provenance.summarize_producers)."""
        try:
            where = str(Path(path).resolve().relative_to(self.cache_dir.resolve()))
        except ValueError:
            where = str(path)
        self.producers[where] = {"artifact": kind, **(stamp or {"commit": None})}

    # -- calibration ------------------------------------------------------------------------------
    def moments_dir(self, key_space: str) -> Path:
        """Artifact directory of the calibration moments for `key_space`."""
        check_cache_version(self.cache_dir)
        return self.cache_dir / "moments" / self.key("calibration", key_space)

    def token_ids(self) -> torch.Tensor:
        """Calibration sequences [n_sequences, seq_len] from calib.files or calib.dataset: the text's sequences
        draw * n_sequences .. (draw + 1) * n_sequences - 1 (calib.draw; draws never share a sequence)."""
        if "token_ids" not in self._memo:
            calib = self.cfg["calib"]
            if calib.get("files"):
                docs = read_documents(calib["files"], calib.get("text_field", "text"))
            elif calib.get("dataset"):
                docs = stream_hf_documents(calib["dataset"], calib.get("dataset_name"), calib.get("split", "train"),
                                           calib.get("text_field", "text"))
            else:
                raise ValueError("set calib.files=[...] or calib.dataset=... to calibrate")
            n, draw = int(calib["n_sequences"]), int(calib.get("draw") or 0)
            if draw < 0:
                raise ValueError(f"calib.draw must be >= 0 (the index of a disjoint block of calib.n_sequences "
                                 f"sequences), got {draw}")
            ids = token_sequences(docs, self.model("source")[1], n * (draw + 1), calib["seq_len"],
                                  context_start=self.context_start)
            self._memo["token_ids"] = ids[draw * n:]
        return self._memo["token_ids"]

    def moments(self, key_space: str | None = None) -> tuple[Moments, HeldOut, dict]:
        """(train, heldout, provenance) calibration moments, computed once per config."""
        key_space = key_space or self.key_space
        memo = f"moments/{key_space}"
        if memo not in self._memo:  # the full moments of a big pair are tens of GB: read them once
            directory = self.moments_dir(key_space)
            done = directory / "calibration.json"
            if not done.exists():
                calibrate_stage.calibrate(self, directory, key_space)
            calib = load_calibration(directory / "calibration")
            info = json.loads(done.read_text())
            self.note("calibration", directory, info.get("produced_by"))
            self._memo[memo] = (calib.train, calib.heldout, info)
        return self._memo[memo]

    def calibration_info(self, key_space: str | None = None) -> dict:
        """The calibration's provenance (calibration.json), calibrating first when needed; loads no moments."""
        key_space = key_space or self.key_space
        directory = self.moments_dir(key_space)
        done = directory / "calibration.json"
        if not done.exists():
            calibrate_stage.calibrate(self, directory, key_space)
        info = json.loads(done.read_text())
        self.note("calibration", directory, info.get("produced_by"))
        return info

    def split(self) -> tuple[list[int], list[int]]:
        """(train, held-out) calibration sequence indices this run's moments were computed on. The
        calibration records its held-out sequences; a split that disagrees with them (an artifact made
        under another seed) is an error, never a silent mix of one seed's rows with another's split."""
        info = self.calibration_info()
        calib = self.cfg["calib"]
        train, held = split_heldout(self.token_ids().shape[0], calib["heldout_fraction"], self.cfg.get("seed", 0))
        if info.get("heldout_index") != held:
            raise RuntimeError(f"the calibration at {self.moments_dir(self.key_space)} holds out sequences "
                               f"{info.get('heldout_index')} but seed={self.cfg.get('seed', 0)} holds out {held}: it "
                               "was made under another split; delete it (the next run calibrates again)")
        return train, held

    def release_moments(self) -> None:
        """Drop the moments read by `moments` (tens of GB at paper scale); a later call reads them again."""
        for key in [k for k in self._memo if k.startswith("moments/")]:
            del self._memo[key]
        import gc

        gc.collect()

    @property
    def features(self) -> str:
        """What the calibration and the map read of the source per layer: "kv", or its hidden states under
        mapper=hidden (runconfig.source_features, kvtransfer.core.hidden)."""
        return source_features(self.cfg["mapper"])

    def source_prefill(self, ids: torch.Tensor, mapper, attention_mask: torch.Tensor | None = None):
        """(source cache layers, source_hidden or None) of ids on the source: the normed layer inputs of the
        source layers `mapper` reads are captured from the same forward only when the mapper needs them."""
        from ..core.cache import prefill
        from ..core.hidden import prefill_with_hidden, used_layers

        source = self.model("source")[0]
        if getattr(mapper, "needs_hidden", False):
            return prefill_with_hidden(source, ids, attention_mask, layers=used_layers(mapper.selected_layers))
        return prefill(source, ids, attention_mask), None

    def _release(self, side: str) -> None:
        self._models.pop(side, None)
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def r2(self, key_space: str | None = None) -> dict:
        """Single-source R² matrices {"train"|"heldout": {"k"|"v": [L_t, L_s]}} (cached)."""
        key_space = key_space or self.key_space
        path = self.moments_dir(key_space) / "r2_matrix.safetensors"
        if not path.exists():
            train, heldout, _ = self.moments(key_space)
            r2 = r2_matrix(train, heldout=heldout, head_dim=self.target_head_dim(), progress=self.progress)
            atomic_save_tensors(path, {f"{s}.{k}": t for s, per in r2.items() for k, t in per.items()})
        tensors, _ = load_tensors(path)
        out: dict = {}
        for name, t in tensors.items():
            split, kind = name.split(".")
            out.setdefault(split, {})[kind] = t
        return out

    def target_head_dim(self) -> int:
        """Target head size, from its config (no weights needed)."""
        return kv_shape(self.auto_config("target")).head_dim

    # -- fit ----------------------------------------------------------------------------------------
    def mapper_dir(self) -> Path:
        """Artifact directory of the mapper this config fits."""
        check_cache_version(self.cache_dir)
        return self.cache_dir / "mappers" / self.key("mapper")

    def mapper(self):
        """The fitted mapper (any kind), loaded from cache or fitted now. The file is read (and its hash checked)
        once per run; each call returns a fresh copy of it (callers move it to their device/dtype)."""
        import copy

        directory = self.mapper_dir()
        memo = f"mapper/{directory.name}"
        if memo not in self._memo:
            if not (directory / "mapper.json").exists():
                # jobs of one sweep sharing a mapper key: one fits, the others wait and then read its artifact
                with exclusive_lock(self.cache_dir / "locks" / f"mappers-{directory.name}.lock"):
                    if not (directory / "mapper.json").exists():
                        fit_stage.fit(self, directory)
            self._memo[memo] = load_mapper(directory)
            loaded = self._memo[memo]
            self.note("mapper", directory, getattr(loaded, "produced_by", None) or None)
            # the calibration it was fitted on, as the mapper recorded it (a cached map reads no moments)
            fitted_on = getattr(loaded, "calibration", None) or {}
            self.note("calibration", directory / "calibration", fitted_on.get("produced_by"))
        return copy.deepcopy(self._memo[memo])

    def native_sink(self, mapper=None) -> int:
        """Leading context positions the target computes itself: the mapper artifact's `native_sink`
        (mapper.native_sink when it was fitted). eval.native_sink, when set, must agree with it."""
        mapper = mapper or self.mapper()
        asked = self.cfg.get("eval", {}).get("native_sink")
        if asked is not None and int(asked) != mapper.native_sink:
            raise ValueError(f"eval.native_sink={asked} but the mapper at {self.mapper_dir()} was fitted to be applied "
                             f"with native_sink={mapper.native_sink}; the sink is part of the map: set "
                             f"mapper.native_sink={asked} (fits that map) and drop eval.native_sink")
        return mapper.native_sink

    # -- fidelity on held-out text ------------------------------------------------------------------


def check_cache_version(cache_dir: Path) -> None:
    """Say once per cache when it holds artifacts keyed under older key rules (they are never read: their
    inputs are not known to match), and stamp the cache with the current KEY_VERSION."""
    stamp = cache_dir / "KEYS_VERSION"
    if stamp.exists() and stamp.read_text().strip() == str(KEY_VERSION):
        return
    old = [d.name for d in (cache_dir / "moments", cache_dir / "mappers", cache_dir / "eval", cache_dir / "bench")
           if d.is_dir() and any(d.iterdir())]
    if old:
        import warnings

        warnings.warn(f"{cache_dir} holds artifacts ({', '.join(old)}) keyed under key version "
                      f"{stamp.read_text().strip() if stamp.exists() else 1}; version {KEY_VERSION} keys every artifact "
                      "by the seed and the model weights too (kvtransfer.runner.artifacts), so none of them is reused "
                      "and this run computes its own. Delete the old ones when no longer needed.", stacklevel=3)
    cache_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(f"{KEY_VERSION}\n")


def _hub_dataset(dataset: str, name: str | None) -> dict:
    """Identity of a hub dataset a run streams: its id, config name and resolved revision (identity.hub_dataset_revision)."""
    from ..config.identity import hub_dataset_revision

    return {"hub": dataset, "name": name, "revision": hub_dataset_revision(dataset)}
