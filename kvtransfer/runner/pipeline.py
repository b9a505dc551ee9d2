"""The stages of a run -- calibrate -> fit -> eval -> bench -> report -- with cached artifacts.

Takes a plain dict config (run.py resolves the Hydra config into one), so this module has no Hydra
import. Before anything loads, `plan_run` plans the run on this machine (kvtransfer.plan), applies the
knobs the plan recommends when a requested stage would not fit (plan.auto), and refuses a stage that does
not fit even so or runs past plan.max_hours. Every stage artifact lives under `cache_dir` in a directory
named by the hash of exactly its declared inputs (`artifacts.ARTIFACTS`: config keys, upstream
artifacts, model and data identities), so changing lambda or
k reuses the moments, changing tasks reuses the mapper, and an interrupted calibration resumes from
its checkpoint. A stage asked for pulls the artifacts it needs, computing the missing ones.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from .. import plan as resource_plan
from ..calibrate import collect_moments, load_calibration, split_heldout
from ..context import describe as describe_context
from ..data import read_documents, stream_hf_documents, token_sequences
from ..io import atomic_save_tensors, atomic_write_json, exclusive_lock, load_tensors
from ..eval.metrics import SCHEMA_VERSION
from ..mapper import FactoredMapper, HiddenMapper, Mapper, load_mapper
from ..models import check_same_tokenizer, config_hash, device_map_for, kv_shape, load_model, max_memory_for
from ..moments import HeldOut, Moments
from ..preflight import preflight
from ..provenance import environment
from ..ridge import UnderdeterminedFit, fit_ridge
from ..runconfig import (STAGES, needs_feature_sample, parse_stages, resolve,  # noqa: F401 (STAGES: re-exported)
                         learning_rates, source_features)
from ..select import r2_matrix, select_greedy, select_topk
from .artifacts import ARTIFACTS, KEY_VERSION, compute_key

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


class Run:
    """One configured run: lazily loads models and computes or reuses each stage's artifact."""

    def __init__(self, cfg: dict, out_dir: str | Path):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.cache_dir = Path(cfg.get("cache_dir", "artifacts"))
        self.progress = _progress(cfg.get("progress", True))
        self._models: dict = {}
        self._memo: dict = {}
        resolved = resolve(cfg)   # the same reading of the config as the resource plan's (kvtransfer.runconfig)
        self.key_space, self.rope_at_inference = resolved.key_space, resolved.rope_at_inference
        self.k, self.lam = resolved.k, resolved.lam
        self.lrs = learning_rates(cfg["mapper"])  # refused here, before any stage, when a list is not allowed

    @property
    def context_start(self) -> str:
        """The run's position-0 convention (kvtransfer.context), shared by calibration and eval."""
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

        from transformers import AutoConfig

        ref = self.model_ref(side)
        cfg = AutoConfig.from_pretrained(ref, trust_remote_code=self.cfg.get("trust_remote_code", False))
        return SimpleNamespace(config=cfg, name_or_path=ref)

    @property
    def device(self) -> str:
        """Resolved compute device."""
        device = self.cfg.get("device", "auto")
        return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device

    def pair_identity(self) -> dict:
        """{"source", "target": model identity, "dtype"}: each side's ref, architecture hash and weights
        identity (kvtransfer.identity: hub revision or local-file digest), read without loading weights."""
        if "pair" not in self._memo:
            self._memo["pair"] = {side: self.model_identity(side) for side in ("source", "target")}
            self._memo["pair"]["dtype"] = self.cfg["pair"].get("dtype", "auto")
        return self._memo["pair"]

    def model_identity(self, side: str) -> dict:
        """{"ref", "config_hash", "weights"} of the source/target: what its artifacts are keyed by."""
        from transformers import AutoConfig

        from ..identity import weights_identity

        memo = f"identity/{side}"
        if memo not in self._memo:
            ref = self.model_ref(side)
            cfg = AutoConfig.from_pretrained(ref, trust_remote_code=self.cfg.get("trust_remote_code", False))
            self._memo[memo] = {"ref": ref, "config_hash": config_hash(cfg), "weights": weights_identity(ref)}
        return self._memo[memo]

    def input_identity(self, name: str):
        """Identity named by an artifact declaration: "source"/"target" (model identity), "calib_data" /
        "eval_data" (size + sha256 of the local files the calibration / evaluation reads), "ppl_data" (the
        perplexity sets' files outside eval.data_dir)."""
        from ..identity import data_identity

        if name in ("source", "target"):
            return self.model_identity(name)
        memo = f"identity/{name}"
        if memo not in self._memo:
            if name == "calib_data":
                self._memo[memo] = data_identity(files=self.cfg["calib"].get("files") or ())
            elif name == "eval_data":
                self._memo[memo] = data_identity(directory=self.cfg["eval"].get("data_dir"))
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
        upstream = {u: self.key(u) for u in art.upstream}
        runtime = {"key_space": key_space or self.key_space, "format": MOMENTS_FORMAT, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(0) if self.device.startswith("cuda") else "cpu"}
        return compute_key(name, self.cfg, upstream=upstream,
                           identities={i: self.input_identity(i) for i in art.identities},
                           extra={e: runtime[e] for e in art.extra})

    # -- calibration ------------------------------------------------------------------------------
    def moments_dir(self, key_space: str) -> Path:
        """Artifact directory of the calibration moments for `key_space`."""
        check_cache_version(self.cache_dir)
        return self.cache_dir / "moments" / self.key("calibration", key_space)

    def token_ids(self) -> torch.Tensor:
        """Calibration sequences [n_sequences, seq_len] from calib.files or calib.dataset."""
        if "token_ids" not in self._memo:
            calib = self.cfg["calib"]
            if calib.get("files"):
                docs = read_documents(calib["files"], calib.get("text_field", "text"))
            elif calib.get("dataset"):
                docs = stream_hf_documents(calib["dataset"], calib.get("dataset_name"), calib.get("split", "train"),
                                           calib.get("text_field", "text"))
            else:
                raise ValueError("set calib.files=[...] or calib.dataset=... to calibrate")
            self._memo["token_ids"] = token_sequences(docs, self.model("source")[1], calib["n_sequences"],
                                                      calib["seq_len"], context_start=self.context_start)
        return self._memo["token_ids"]

    def moments(self, key_space: str | None = None) -> tuple[Moments, HeldOut, dict]:
        """(train, heldout, provenance) calibration moments, computed once per config."""
        key_space = key_space or self.key_space
        memo = f"moments/{key_space}"
        if memo not in self._memo:  # the full moments of a big pair are tens of GB: read them once
            directory = self.moments_dir(key_space)
            done = directory / "calibration.json"
            if not done.exists():
                self._calibrate(directory, key_space)
            calib = load_calibration(directory / "calibration")
            self._memo[memo] = (calib.train, calib.heldout, json.loads(done.read_text()))
        return self._memo[memo]

    def calibration_info(self, key_space: str | None = None) -> dict:
        """The calibration's provenance (calibration.json), calibrating first when needed; loads no moments."""
        key_space = key_space or self.key_space
        directory = self.moments_dir(key_space)
        done = directory / "calibration.json"
        if not done.exists():
            self._calibrate(directory, key_space)
        return json.loads(done.read_text())

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

    def _calibrate(self, directory: Path, key_space: str) -> None:
        # jobs of one sweep start together: one calibrates, the others wait and then read its artifact
        with exclusive_lock(self.cache_dir / "locks" / f"{directory.parent.name}-{directory.name}.lock"):
            if not (directory / "calibration.json").exists():
                self._calibrate_locked(directory, key_space)

    def _calibrate_locked(self, directory: Path, key_space: str) -> None:
        calib = self.cfg["calib"]
        directory.mkdir(parents=True, exist_ok=True)
        ids = self.token_ids()
        sampler = None
        # the MLP's feature sample is kept whenever asked for, so one calibration serves ridge and MLP fits; not in a
        # hidden-state calibration (mapper=hidden), whose rows no MLP or attention-mass fit reads (they calibrate K/V)
        if calib.get("mlp_samples", 0) and key_space == self.key_space and self.features == "kv":
            from ..mlp import FeatureSampler

            n_train = len(split_heldout(ids.shape[0], calib["heldout_fraction"], self.cfg.get("seed", 0))[0])
            sampler = FeatureSampler(calib["mlp_samples"], -(-n_train // calib["batch_size"]), self.cfg.get("seed", 0),
                                     state_path=directory / "mlp_sample.partial.safetensors")
        dtype = getattr(torch, calib.get("dtype", "float64"))
        compute = getattr(torch, calib["compute_dtype"]) if calib.get("compute_dtype") else None
        if calib.get("capture", "co-resident") == "sequential":
            source = lambda: self.model("source")[0]  # noqa: E731
            target = lambda: self._release("source") or self.model("target")[0]  # noqa: E731
        else:
            source, target = self.model("source")[0], self.model("target")[0]
        started = time.perf_counter()
        result = collect_moments(
            source, target, ids, stride=calib["stride"], batch_size=calib["batch_size"],
            heldout_fraction=calib["heldout_fraction"], heldout_observations=calib.get("heldout_observations"),
            seed=self.cfg.get("seed", 0), key_space=key_space,
            capture=calib.get("capture", "co-resident"), feature_dir=directory / "features",
            checkpoint_path=directory / "calibration", checkpoint_every=calib.get("checkpoint_every", 64),
            dtype=dtype, compute_dtype=compute, store_device=calib.get("store_device", "cpu"),
            accumulate=calib.get("accumulate", "host"),
            feature_sink=sampler, progress=self.progress, features=self.features)
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
                "seed": self.cfg.get("seed", 0),
                "heldout_index": split_heldout(ids.shape[0], calib["heldout_fraction"], self.cfg.get("seed", 0))[1],
                "tokens_per_seq": calib["seq_len"], "stride": calib["stride"], "observations": result.train.n,
                "heldout_observations": result.heldout.n, "heldout_observations_total": result.heldout.seen,
                "features": result.train.source_width, "source_features": self.features,
                "source_layers": len(result.train.source_layers), "key_space": key_space,
                "data": calib.get("files") or f"{calib.get('dataset')}/{calib.get('dataset_name')}",
                "domain": calib.get("domain") or _domain_name(calib),
                **describe_context(self.model("source")[1], self.context_start),
                "seconds": round(seconds, 2)}
        atomic_write_json(directory / "calibration.json", info)  # the calibration/ checkpoint is now the artifact
        shutil.rmtree(directory / "features", ignore_errors=True)

    @property
    def features(self) -> str:
        """What the calibration and the map read of the source per layer: "kv", or its hidden states under
        mapper=hidden (runconfig.source_features, kvtransfer.hidden)."""
        return source_features(self.cfg["mapper"])

    def source_prefill(self, ids: torch.Tensor, mapper, attention_mask: torch.Tensor | None = None):
        """(source cache layers, source_hidden or None) of ids on the source: the normed layer inputs of the
        source layers `mapper` reads are captured from the same forward only when the mapper needs them."""
        from ..cache import prefill
        from ..hidden import prefill_with_hidden, used_layers

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
        from transformers import AutoConfig

        return kv_shape(AutoConfig.from_pretrained(self.model_ref("target"),
                                                   trust_remote_code=self.cfg.get("trust_remote_code", False))).head_dim

    # -- fit ----------------------------------------------------------------------------------------
    def mapper_dir(self) -> Path:
        """Artifact directory of the mapper this config fits."""
        check_cache_version(self.cache_dir)
        return self.cache_dir / "mappers" / self.key("mapper")

    def mapper(self):
        """The fitted mapper (ridge or mlp), loaded from cache or fitted now."""
        directory = self.mapper_dir()
        if not (directory / "mapper.json").exists():
            self._fit(directory)
        return load_mapper(directory)  # a fresh copy each call: callers move it to their device/dtype

    def selected_layers(self) -> list[list[int]]:
        """Source layers per target layer by the configured rule (top-k or greedy)."""
        if self.cfg["mapper"].get("selection", "topk") == "greedy":
            train, _, _ = self.moments()
            return select_greedy(train, self.k, lam=self.lam, head_dim=self.target_head_dim(), progress=self.progress)
        return select_topk(self.r2()["train"], self.k)

    def _fit(self, directory: Path) -> None:
        train, heldout, info = self.moments()
        selected = self.selected_layers()
        mcfg = self.cfg["mapper"]
        started = time.perf_counter()
        if mcfg["kind"] == "ridge" and _is_family(mcfg):  # head-local support, reduced rank, attention metric
            from ..families import fit_family

            src, tgt = (kv_shape(self.identity(side)) for side in ("source", "target"))
            weighting = mcfg.get("weighting", "none")
            metrics = self.attention_metrics() if weighting == "attention" else None
            sample, row_weights = self.observation_weights() if weighting == "attention_mass" else (None, None)
            fit = fit_family(train, selected, n_kv_s=src.n_kv, d_s=src.head_dim, n_kv_t=tgt.n_kv, lam=self.lam,
                             support=mcfg.get("support", "full"), rank=mcfg.get("rank"), weighting=weighting,
                             metrics=metrics, sample=sample, row_weights=row_weights, heldout=heldout,
                             force=mcfg.get("force", False), stride=info["stride"], progress=self.progress)
            mapper = FactoredMapper.from_family(fit, self.identity("source"), self.identity("target"),
                                                key_space=self.key_space, calibration=info)
        elif mcfg["kind"] == "ridge":  # the solve needs no model: the mapper's pair identity comes from the configs
            fit = fit_ridge(train, selected, lam=self.lam, heldout=heldout, head_dim=self.target_head_dim(),
                            force=mcfg.get("force", False), stride=info["stride"], progress=self.progress)
            mapper = Mapper.from_ridge(fit, self.identity("source"), self.identity("target"), key_space=self.key_space,
                                       calibration=info)
        elif mcfg["kind"] == "trained":  # the paper's map, ridge-initialised, trained for the target's output
            fit = fit_ridge(train, selected, lam=self.lam, heldout=heldout, head_dim=self.target_head_dim(),
                            force=mcfg.get("force", False), stride=info["stride"], progress=self.progress)
            ridge = Mapper.from_ridge(fit, self.identity("source"), self.identity("target"), key_space=self.key_space,
                                      calibration=info)
            ridge.native_sink = int(mcfg.get("native_sink") or 0)
            mapper = self._train_map(ridge, train, heldout)
        elif mcfg["kind"] == "hidden":  # ridge on the source's hidden states (kvtransfer.hidden; issue 23 §2)
            mapper = self._fit_hidden(train, heldout, selected, info)
        elif mcfg["kind"] == "mlp":
            from ..mlp import FeatureSampler, fit_mlp

            source, target = self.model("source")[0], self.model("target")[0]

            sample_path = self.feature_sample_path()
            tgt = kv_shape(target)
            device = self.device if mcfg.get("device", "auto") == "auto" else mcfg["device"]
            mapper = fit_mlp(FeatureSampler.load(sample_path), selected, source, target,
                             source_width=train.source_width, target_heads=tgt.n_kv, hidden=mcfg["hidden"],
                             lr=self.lrs[0], epochs=mcfg["epochs"], batch_tokens=mcfg["batch_tokens"], device=device,
                             seed=self.cfg.get("seed", 0), key_space=self.key_space, calibration=info,
                             progress=self.progress)
        else:
            raise ValueError(f"mapper.kind must be ridge, trained, hidden or mlp, got {mcfg['kind']!r}")
        mapper.calibration["fit_seconds"] = round(time.perf_counter() - started, 2)
        mapper.native_sink = int(mcfg.get("native_sink") or 0)  # the sink travels with the map
        mapper.save(directory)

    def _fit_hidden(self, train: Moments, heldout: HeldOut, selected: list[list[int]], info: dict) -> HiddenMapper:
        """mapper=hidden: the paper's closed-form ridge fit and top-k selection, on moments whose source block per
        layer is the normed layer input [H] (features=hidden) or [normed input | K or V] (hidden_kv), i.e. the
        calibration this config keys (`source_features`). The selection is the paper's procedure run on these
        features (single-source R² of each target layer from each source layer's block, top k). A refused p/n
        names the config fix."""
        from ..hidden import hidden_size

        mcfg = self.cfg["mapper"]
        try:
            fit = fit_ridge(train, selected, lam=self.lam, heldout=heldout, head_dim=self.target_head_dim(),
                            force=mcfg.get("force", False), stride=info["stride"], progress=self.progress)
        except UnderdeterminedFit as err:
            raise UnderdeterminedFit(
                f"mapper=hidden (features={self.features}) reads {train.source_width:,} features from each of its "
                f"k = {max(len(s) for s in selected)} source layers, too many for the {train.n:,} calibration "
                "observations: use fewer layers (mapper.k), more calibration text (calib.n_sequences, calib.seq_len, "
                f"or a smaller calib.stride), or set mapper.force=true to fit anyway ({err})") from err
        return HiddenMapper.from_ridge(fit, self.identity("source"), self.identity("target"), features=self.features,
                                       hidden_size=hidden_size(self.identity("source")), key_space=self.key_space,
                                       calibration=info)

    def _train_map(self, ridge: Mapper, train: Moments, heldout: HeldOut):
        """mapper=trained (kvtransfer.train_map): `ridge` trained layer by layer for the target's attention output
        on mapper.train_sequences sequences of the calibration's train split, early stopping on
        mapper.stop_sequences others (disjoint from the held-out split the fidelity numbers use); held-out R²
        recomputed for the trained weights. The artifact records both splits and every layer's losses."""
        from ..mapper import TrainedMapper
        from ..train_map import OBJECTIVES, collect_layer_local, layer_local_nbytes, train_map

        mcfg = self.cfg["mapper"]
        if mcfg.get("objective", "layer_local") not in OBJECTIVES:
            raise ValueError(f"mapper.objective must be one of {OBJECTIVES}, got {mcfg.get('objective')!r}")
        if mcfg.get("objective") == "end_to_end":
            return self._train_e2e(ridge, train, heldout)
        fit_idx, stop_idx, held, settings, selected, used = self._train_setup(ridge)
        source, target = self.model("source")[0], self.model("target")[0]
        started = time.perf_counter()
        data = collect_layer_local(source, target, self.token_ids()[fit_idx + stop_idx], used,
                                   n_queries=int(mcfg["query_positions"]), native_sink=ridge.native_sink,
                                   key_space=self.key_space, batch_size=self.cfg["calib"]["batch_size"],
                                   progress=self.progress)
        collected = time.perf_counter()
        rows = list(range(len(fit_idx))), list(range(len(fit_idx), len(fit_idx) + len(stop_idx)))
        weight, bias, layers = train_map(ridge.weight, ridge.bias, selected, data, *rows, settings, progress=self.progress,
                                         lrs=self.lrs)
        n_q = data.queries[0].shape[1]
        training = {"objective": "layer_local", "fit_index": fit_idx, "stop_index": stop_idx, "heldout_index": held,
                    "query_positions": data.positions.tolist(), "settings": self._settings_record(settings),
                    "collect_bytes": data.nbytes,
                    "collect_bytes_formula": layer_local_nbytes(
                        len(fit_idx) + len(stop_idx), data.source_k.shape[1], len(used), train.source_width, len(layers),
                        n_q, data.queries[0].shape[-1], len(data.positions), data.n_kv, ridge.native_sink),
                    "collect_seconds": round(collected - started, 2),
                    "train_seconds": round(time.perf_counter() - collected, 2),
                    "layers_worse_than_ridge": [r["layer"] for r in layers if r["worse_than_ridge"]], "layers": layers}
        del data
        return TrainedMapper.from_ridge_mapper(ridge, weight, bias, training=training,
                                               r2=_refit_r2(weight, bias, selected, train, heldout, self.target_head_dim()))

    def _train_setup(self, ridge: Mapper):
        """What both objectives of mapper=trained share: (fit_idx, stop_idx, held-out idx, TrainSettings, the
        ridge map's selected layers [L_t][k], the sorted source layers any target layer reads)."""
        from ..train_map import TrainSettings, split_stop

        mcfg, seed = self.cfg["mapper"], self.cfg.get("seed", 0)
        train_idx, held = self.split()
        fit_idx, stop_idx = split_stop(train_idx, int(mcfg["train_sequences"]), int(mcfg["stop_sequences"]), seed)
        device = self.device if mcfg.get("device", "auto") == "auto" else mcfg["device"]
        settings = TrainSettings(lr=self.lrs[0], steps=int(mcfg["steps"]), batch_sequences=int(mcfg["batch_sequences"]),
                                 eval_every=int(mcfg["eval_every"]), patience=int(mcfg["patience"]), seed=seed, device=device)
        selected = ridge.selected_layers.tolist()
        return fit_idx, stop_idx, held, settings, selected, sorted({s for row in selected for s in row})

    def _settings_record(self, settings) -> dict:
        """The training settings an artifact records; "lr" is the list mapper.lr gave when it gave several (each
        layer's / the joint map's kept rate is in its record)."""
        return {**vars(settings), "lr": self.lrs if len(self.lrs) > 1 else self.lrs[0]}

    def _train_e2e(self, ridge: Mapper, train: Moments, heldout: HeldOut):
        """mapper=trained mapper.objective=end_to_end (kvtransfer.train_e2e): `ridge`, all layers jointly, trained
        for the frozen target's next-token KL on continuations of mapper.train_sequences train-split sequences
        (context: their first mapper.context_tokens tokens, default seq_len - continuation; continuation: the next
        mapper.continuation_tokens), early stopping on mapper.stop_sequences others (disjoint from the fidelity
        held-out split); held-out R² recomputed for the trained weights. The artifact records the splits, the
        per-step and per-evaluation KL, the collection's bytes and the per-step memory and FLOP formulas."""
        from ..mapper import TrainedMapper
        from ..models import decoder, text_config
        from ..train_e2e import OBJECTIVE, collect_e2e, e2e_nbytes, e2e_step_flops, e2e_step_nbytes, train_e2e

        mcfg = self.cfg["mapper"]
        ids = self.token_ids()
        cont = int(mcfg["continuation_tokens"])
        ctx = ids.shape[1] - cont if mcfg.get("context_tokens") is None else int(mcfg["context_tokens"])
        if cont < 1 or ctx < 1 or ctx + cont > ids.shape[1]:
            raise ValueError(f"mapper.context_tokens={ctx} + mapper.continuation_tokens={cont} must be >= 1 each and "
                             f"fit the calibration's {ids.shape[1]}-token sequences (calib.seq_len)")
        fit_idx, stop_idx, held, settings, selected, used = self._train_setup(ridge)
        source, target = self.model("source")[0], self.model("target")[0]
        started = time.perf_counter()
        data = collect_e2e(source, target, ids[fit_idx + stop_idx][:, :ctx + cont], used, context=ctx,
                           native_sink=ridge.native_sink, key_space=self.key_space,
                           batch_size=self.cfg["calib"]["batch_size"], progress=self.progress)
        collected = time.perf_counter()
        rows = list(range(len(fit_idx))), list(range(len(fit_idx), len(fit_idx) + len(stop_idx)))
        from ..train_map import TrainSettings, lowest_stop_loss

        weight, bias, record = lowest_stop_loss(self.lrs, lambda lr: train_e2e(
            target, data, ridge.weight, ridge.bias, selected, *rows, TrainSettings(**{**vars(settings), "lr": lr}),
            progress=self.progress), "stop_kl_final")
        tc, kv = text_config(target.config), kv_shape(target)
        shape = dict(layers=kv.n_layers, hidden=tc.hidden_size, heads=tc.num_attention_heads, head_dim=kv.head_dim,
                     vocab=tc.vocab_size)
        b, p = settings.batch_sequences, ridge.weight.shape[2]
        act = torch.finfo(target.dtype).bits // 8
        layer_params = sum(x.numel() for x in decoder(target).layers[0].parameters())
        training = {"objective": OBJECTIVE, "fit_index": fit_idx, "stop_index": stop_idx, "heldout_index": held,
                    "context_tokens": ctx, "continuation_tokens": cont, "settings": self._settings_record(settings),
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
                                               r2=_refit_r2(weight, bias, selected, train, heldout, self.target_head_dim()))

    def attention_metrics(self) -> dict:
        """{"k", "v": [L_t, n_kv_t, d_t, d_t]} output metrics of weighting=attention (kvtransfer.families):
        keys from the target's query energy on the first mapper.metric_sequences train sequences (cached
        next to the moments), values from its o_proj weights."""
        from ..families import key_metric, query_energy, value_metric

        n_seq = int(self.cfg["mapper"].get("metric_sequences", 16))
        target = self.model("target")[0]
        path = self.moments_dir(self.key_space) / f"query_energy_{self.key('query_energy')}.safetensors"
        if path.exists():
            energy = load_tensors(path)[0]["energy"]
        else:
            calib = self.cfg["calib"]
            train_rows, _ = self.split()
            energy = query_energy(target, self.token_ids()[train_rows[:n_seq]], batch_size=calib["batch_size"])
            atomic_save_tensors(path, {"energy": energy}, {"sequences": str(n_seq)})
        return {"k": key_metric(energy, kv_shape(target).n_kv), "v": value_metric(target)}

    def _train_batches(self) -> tuple[list[int], list[list[int]], torch.Tensor]:
        """(train sequence indices, calibration's train batches of them, kept positions per sequence)."""
        from ..calibrate import subsample_positions

        calib = self.cfg["calib"]
        ids = self.token_ids()
        train_idx, _ = self.split()
        batches = [train_idx[i:i + calib["batch_size"]] for i in range(0, len(train_idx), calib["batch_size"])]
        return train_idx, batches, subsample_positions(ids.shape[1], calib["stride"])

    def feature_sample_path(self) -> Path:
        """The train feature rows kept for calib.mlp_samples (mapper=mlp, weighting=attention_mass): the sample
        the calibration kept, or, when it kept none or another number of rows, a sample-only pass over the
        train batches (both models' forward, no moments; resumable), cached next to the moments."""
        from ..calibrate import sample_features
        from ..mlp import FeatureSampler

        calib, seed = self.cfg["calib"], self.cfg.get("seed", 0)
        n = int(calib.get("mlp_samples") or 0)
        if n <= 0:
            raise ValueError("this mapper fits on calibration feature rows: set calib.mlp_samples > 0")
        directory = self.moments_dir(self.key_space)
        _, batches, positions = self._train_batches()
        sampler = FeatureSampler(n, len(batches), seed)
        rows = sum(min(sampler.per_batch, len(b) * len(positions)) for b in batches)
        kept = directory / "mlp_sample.safetensors"   # what the calibration kept (with its own mlp_samples)
        if kept.exists():
            from safetensors import safe_open

            with safe_open(str(kept), framework="pt") as f:
                if f.get_slice("xk").get_shape()[0] == rows:
                    return kept
        path = directory / f"feature_sample_{self.key('feature_sample')}.safetensors"
        if not path.exists():
            partial = path.with_suffix(".partial.safetensors")
            sampler = FeatureSampler(n, len(batches), seed, state_path=partial)
            source, target = self.model("source")[0], self.model("target")[0]
            sample_features(source, target, self.token_ids(), batches, sampler, stride=calib["stride"],
                            key_space=self.key_space, features=self.features,
                            checkpoint_every=max(1, calib.get("checkpoint_every", 64) // calib["batch_size"]),
                            progress=self.progress)
            sampler.save(path)
            partial.unlink(missing_ok=True)
        return path

    def observation_weights(self) -> tuple[dict, torch.Tensor]:
        """(feature sample, row weights [n, L_t]) of weighting=attention_mass (kvtransfer.families): the train
        rows kept during calibration (calib.mlp_samples; all of them when it is >= the train observations)
        and the attention mass the target puts on each row's token (`families.attention_mass`, cached next
        to the moments), zero where the map is never applied (positions < mapper.native_sink)."""
        from ..families import attention_mass
        from ..mlp import FeatureSampler

        directory = self.moments_dir(self.key_space)
        calib, seed = self.cfg["calib"], self.cfg.get("seed", 0)
        ids = self.token_ids()
        train_idx, batches, positions = self._train_batches()
        path = self.feature_sample_path()
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
        mass_path = directory / f"attention_mass_{self.key('attention_mass')}.safetensors"
        if mass_path.exists():
            mass = load_tensors(mass_path)[0]["mass"]
        else:
            target = self.model("target")[0]
            mass = attention_mass(target, ids[train_idx], positions, batch_size=calib["batch_size"])
            atomic_save_tensors(mass_path, {"mass": mass}, {"sequences": "train", "window": "last quarter"})
        weights = mass[seq, :, pos]  # [n, L_t]
        weights[positions[pos] < int(self.cfg["mapper"].get("native_sink") or 0)] = 0.0
        return sample, weights

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
    def fidelity(self) -> dict:
        """What the target does with the mapped cache on held-out calibration sequences.

        Up to eval.fidelity.sequences held-out sequences: the first seq_len - continuation tokens
        (continuation at most seq_len / 2) are the prefix (source prefill -> mapper, with its native sink), the rest the continuation.
        Returns {"per_layer": compare_caches(...), "per_position": position_diagnostics(...),
        "sequences", "prefix", "continuation", "native_sink"}; cached next to the mapper.
        """
        from ..cache import prefill
        from ..diagnostics import compare_caches, position_diagnostics
        from ..transfer import transfer

        ecfg = self.cfg.get("eval", {})
        fcfg = ecfg.get("fidelity") or {}
        n_seq, cont = int(fcfg.get("sequences", 4)), int(fcfg.get("continuation", 32))
        mapper = self.mapper()
        sink = self.native_sink(mapper)
        path = self.mapper_dir() / f"fidelity_{self.key('fidelity')}.json"
        if path.exists():
            return json.loads(path.read_text())
        ids = self.token_ids()
        _, held = self.split()
        # calib.heldout_fraction=0 holds nothing out: the diagnostics then run on train sequences and say so
        rows = ids[held[:n_seq] or list(range(min(n_seq, ids.shape[0])))]
        cont = min(cont, rows.shape[1] // 2)  # short calibration sequences: half prefix, half continuation
        source, target = self.model("source")[0], self.model("target")[0]
        prefix, continuation = rows[:, :-cont], rows[:, -cont:]
        mapper = mapper.to(target.device)
        src, hidden = self.source_prefill(prefix.to(source.device), mapper)  # + hidden states for mapper=hidden
        mapped = transfer(src, mapper, source, target, input_ids=prefix.to(source.device), native_sink=sink,
                          rope_at_inference=self.rope_at_inference, as_layers=True, source_hidden=hidden)
        native = prefill(target, prefix.to(target.device))
        continuation = continuation.to(target.device)
        result = {"sequences": int(rows.shape[0]), "heldout_index": held[:n_seq], "on_train_sequences": not held,
                  "prefix": int(prefix.shape[1]),
                  "continuation": cont,
                  "native_sink": sink, "per_layer": compare_caches(target, native, mapped, continuation),
                  "per_position": position_diagnostics(target, native, mapped, continuation)}
        atomic_write_json(path, result)
        return result

    # -- the per-request gate's thresholds, chosen on calibration text ------------------------------
    def gate(self) -> dict:
        """The gate artifact (kvtransfer.gate.save_gate): thresholds fitted on held-out calibration sequences
        (never evaluation items) for eval.gate's rates. Each of up to eval.gate.sequences held-out sequences
        is one request: the source prefills it, the map (with its native sink) maps it, and the target's tail
        score over its last eval.gate.tail tokens is taken (kvtransfer.gate.tail_score); the thresholds are
        quantiles of those scores (kvtransfer.gate.fit_thresholds). Cached next to the mapper."""
        from ..gate import fit_thresholds, load_gate, save_gate, tail_score
        from ..transfer import transfer

        gcfg = self.cfg["eval"]["gate"]
        path = self.mapper_dir() / f"gate_{self.key('gate')}.json"
        if path.exists():
            return load_gate(path)
        mapper = self.mapper()
        sink = self.native_sink(mapper)
        ids = self.token_ids()
        _, held = self.split()
        index = held[:int(gcfg["sequences"])] or list(range(min(int(gcfg["sequences"]), ids.shape[0])))
        source, target = self.model("source")[0], self.model("target")[0]
        mapper = mapper.to(target.device)
        scores = []
        batch = int(self.cfg["calib"].get("batch_size", 8))
        for start in range(0, len(index), batch):
            rows = ids[index[start:start + batch]].to(source.device)
            src, hidden = self.source_prefill(rows, mapper)
            mapped = transfer(src, mapper, source, target, input_ids=rows, native_sink=sink,
                              rope_at_inference=self.rope_at_inference, as_layers=True, source_hidden=hidden)
            score, _ = tail_score(target, mapped, rows.to(target.device), None, int(gcfg["tail"]))
            scores += score.tolist()
        thresholds = fit_thresholds(scores, recompute_rate=gcfg["recompute_rate"], full_rate=gcfg["full_rate"],
                                    fraction=gcfg["fraction"])
        save_gate(path, thresholds, {"tail": int(gcfg["tail"]), "sequences": index, "on_train_sequences": not held,
                                     "sequence_tokens": int(ids.shape[1]), "scores": scores, "native_sink": sink})
        return load_gate(path)

    # -- variance explained vs k (Table 7) --------------------------------------------------------
    def variance_vs_k(self) -> list[dict]:
        """Mean R² (train, held-out; K and V) of top-k ridge fits for each k in report.variance_k."""
        train, heldout, info = self.moments()
        r2m = self.r2()["train"]
        rows = []
        for k in self.cfg.get("report", {}).get("variance_k", []):
            k_eff = len(train.source_layers) if k == "all" else int(k)
            if k_eff > len(train.source_layers):
                continue
            try:
                fit = fit_ridge(train, select_topk(r2m, k_eff), lam=self.lam, heldout=heldout,
                                head_dim=self.target_head_dim(), stride=info["stride"])
            except UnderdeterminedFit as err:
                rows.append({"k": k, "skipped": str(err)})
                continue
            row = {"k": k, "features": k_eff * train.source_width, "p_over_n": k_eff * train.source_width / train.n}
            for split, per in fit.r2.items():
                for kind, t in per.items():
                    row[f"{kind}_{split}"] = float(t.mean())
            rows.append(row)
        return rows


def _domain_name(calib: dict) -> str:
    """A short calibration-domain label: calib.dataset, else the calibration files' stems."""
    if calib.get("files"):
        return "+".join(Path(f).stem for f in calib["files"])
    return str(calib.get("dataset"))


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


def _refit_r2(weight: torch.Tensor, bias: torch.Tensor, selected: list[list[int]], train: Moments, heldout: HeldOut,
              head_dim: int) -> dict:
    """{"train", "heldout": {"k", "v": [L_t][n_kv_t]}} R² of the map weight [L_t, 2, p, q], bias [L_t, 2, q] on the
    calibration's train moments and held-out features (`ridge.head_r2`), as a ridge fit reports them."""
    from ..moments import KINDS
    from ..ridge import LayerFit, head_r2

    out: dict = {"train": {k: [] for k in KINDS}, "heldout": {k: [] for k in KINDS}}
    for t, layers in enumerate(selected):
        cols = train.source_columns(list(layers))
        for i, kind in enumerate(KINDS):
            fit = LayerFit(weight[t, i].double(), bias[t, i].double(), cols)
            out["train"][kind].append(head_r2(train, kind, fit, train.target_layers[t], head_dim).tolist())
            if heldout is not None and heldout.n > 0:
                out["heldout"][kind].append(head_r2(heldout, kind, fit, train.target_layers[t], head_dim).tolist())
    return {split: per for split, per in out.items() if all(per.values())}


def _is_family(mcfg: dict) -> bool:
    """Whether the ridge config asks for a map family beyond the paper's (kvtransfer.families)."""
    return (mcfg.get("support", "full") != "full" or mcfg.get("rank") is not None
            or mcfg.get("weighting", "none") != "none")


def _mean_r2(mapper_r2: dict) -> dict:
    """{split: {kind: [[...]]}} -> {kind: {split: mean}}."""
    out: dict = {}
    for split, per in mapper_r2.items():
        for kind, values in per.items():
            flat = torch.tensor(values, dtype=torch.float64)
            out.setdefault(kind, {})[split] = float(flat.mean())
    return out


def plan_run(cfg: dict, out_dir: str | Path, stages: list[str] | None = None, *, log=print) -> tuple[dict, dict]:
    """What `execute` does first: plan this run on this machine (kvtransfer.plan), print the table, write
    out_dir/plan.json + plan.md, and return (the config to run, the plan).

    plan.enforce=true (default): with plan.auto=true (default) the knob set the plan recommends for `stages`
    (default cfg.stage) is applied to the returned config and printed; a stage that does not fit even so, or
    whose estimate exceeds plan.max_hours, raises PlanError before anything loads. plan.auto=false: the
    config is run as typed and any stage that does not fit raises PlanError naming the knobs (the behaviour
    before plan.auto). plan.enforce=false: the config is run as typed whatever the plan says (a warning).
    Errors in planning propagate: a planner that cannot plan fails the run, it never turns enforcement off."""
    import warnings

    stages = parse_stages(cfg.get("stage", "all")) if stages is None else stages
    settings = cfg.get("plan") or {}
    enforce = bool(settings.get("enforce", True))
    node = resource_plan.detect_node(cfg)
    plan = resource_plan.make_plan(cfg, node, local=True, stages=stages,
                                   auto=bool(settings.get("auto", True)) and enforce)
    resource_plan.write_plan(plan, out_dir)
    log(resource_plan.format_plan(plan, details=False).rstrip())
    msg = resource_plan.refusal_message(plan, stages)
    if msg and enforce:
        raise resource_plan.PlanError(msg)
    if msg:
        warnings.warn(msg + "\n(plan.enforce=false: running as typed)", stacklevel=2)
    if plan["applied"]:
        log(f"resource plan: applying {plan['overrides']} (plan.auto=false to refuse instead)")
    return resource_plan.applied_config(cfg, plan), plan


def check_feature_sample(cfg: dict) -> None:
    """Refuse, before anything loads or calibrates, a mapper that needs the feature sample when none is kept."""
    if needs_feature_sample(cfg["mapper"]) and not cfg["calib"].get("mlp_samples"):
        what = "mapper=mlp" if cfg["mapper"].get("kind") == "mlp" else "mapper.weighting=attention_mass"
        raise ValueError(f"{what} fits on calibration feature rows, but calib.mlp_samples=0 keeps none: set "
                         "calib.mlp_samples (e.g. 65536; host memory and disk: see the resource plan)")


def execute(cfg: dict, out_dir: str | Path, *, plan: dict | None = None) -> dict:
    """Run the configured stages; write summary.json (+ tables/figures in the report stage).

    Returns the summary dict. Refuses an out_dir that already holds a summary (never overwrites).
    Before anything loads: the resource plan (`plan_run`; a given `plan` -- the dry run's plan of the real
    run, already written -- replaces it) and the preflight of every data source (kvtransfer.preflight).
    """
    out_dir = Path(out_dir)
    if (out_dir / "summary.json").exists():
        raise FileExistsError(f"{out_dir} already holds a run; choose another out_dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    stages = parse_stages(cfg.get("stage", "all"))
    check_feature_sample(cfg)
    if plan is None:  # prints + writes plan.json, applies the plan's knobs (plan.auto); PlanError before any load
        cfg, plan = plan_run(cfg, out_dir, stages)
    atomic_write_json(out_dir / "config.json", cfg)  # the resolved config that made this run, knobs applied
    preflight(cfg, stages)  # every data source resolves, or PreflightError in seconds naming the fix
    run = Run(cfg, out_dir)
    summary: dict = {"pair": cfg["pair"]["name"], "direction": cfg["pair"].get("direction", "forward"),
                     "source": run.model_ref("source"), "target": run.model_ref("target"), "stages": stages,
                     "ablation": cfg.get("ablation", {}), "resources": resource_plan.resources_summary(plan),
                     "environment": environment(cfg), "schema_version": SCHEMA_VERSION}
    r2_figure: dict = {}
    # moments are read only where a stage needs them and released after it (issue 10 §2): eval and bench never
    # hold them, and the rotated-key calibration of the report does not sit next to the stripped moments
    if "calibrate" in stages or "report" in stages:
        summary["calibration"] = run.calibration_info()
        if "report" in stages:
            r2_figure = {f"{run.key_space} keys": run.r2()["train"]}
            run.release_moments()
            if cfg.get("report", {}).get("rotated_heatmap"):
                other = "rotated" if run.key_space == "stripped" else "stripped"
                r2_figure[f"{other} keys"] = run.r2(other)["train"]
                run.release_moments()
    if any(s in stages for s in ("fit", "eval", "report")):
        mapper = run.mapper()
        run.release_moments()
        summary["mapper"] = {"kind": mapper.kind, "k": mapper.k, "lambda": mapper.lam,
                             "selection": cfg["mapper"].get("selection", "topk"),
                             "selected_layers": mapper.selected_layers.tolist(), "key_space": mapper.key_space,
                             "n_parameters": mapper.n_parameters, "apply_flops_per_token": mapper.apply_flops_per_token,
                             "native_sink": mapper.native_sink, **mapper.extra_manifest(), "path": str(run.mapper_dir()),
                             "fit_seconds": mapper.calibration.get("fit_seconds")}
        summary["calibration"] = {k: v for k, v in mapper.calibration.items() if k != "fit_seconds"}
        summary["r2"] = _mean_r2(mapper.r2)
    else:
        summary["mapper"] = {"kind": cfg["mapper"]["kind"], "k": run.k, "lambda": run.lam}
    if "eval" in stages:
        from .eval_stage import evaluate

        if (cfg["eval"].get("fidelity") or {}).get("enabled", True):
            summary["fidelity"] = run.fidelity()
        summary.update(evaluate(run))
        if (cfg["eval"].get("gate") or {}).get("enabled"):  # the thresholds the gated rows were decided with
            gate = run.gate()
            summary["gate_artifact"] = {"thresholds": gate["thresholds"], "tail": gate["tail"],
                                        "calibration_sequences": len(gate["sequences"]),
                                        "on_train_sequences": gate["on_train_sequences"]}
    if "bench" in stages:
        from .bench_stage import benchmark

        summary["speed"] = benchmark(run)
    if "report" in stages:
        summary["variance_explained"] = run.variance_vs_k()
        run.release_moments()
        from ..report.outputs import write_outputs

        summary["outputs"] = write_outputs(cfg, summary, out_dir, r2_figure)
    atomic_write_json(out_dir / "summary.json", summary)
    return summary
