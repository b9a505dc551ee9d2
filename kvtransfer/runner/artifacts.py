"""What each cached artifact is made of, declared in one place, and the key that follows from it.

An artifact's key is the hash of exactly its declared inputs: the config leaves it reads, the keys
of the artifacts it is computed from, the identities of the models and data it reads (weights
included, `kvtransfer.config.identity`), and runtime values its caller names (the key space, the device).
Every leaf of the composed config is either an input of some artifact or listed in `NOT_INPUTS`
with the reason; tests/test_artifact_keys.py walks every pair and group option and fails on a key
that is neither, so a new config key cannot slip into a run without deciding what it changes.

A leaf module (standard library only): the pipeline, the eval and bench stages and the plan share it.
It reads each kind's code version from code_versions.json (kept by kvtransfer.runner.code_versions).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .keys import artifact_key

# Bumped whenever the key rules change what an existing key means. Version 2 (issue 20): the seed and the
# model weights (hub revision or a digest of the local files) entered the keys; artifacts under version-1
# keys are never read (their inputs are not known to match) -- `check_cache_version` says so once.
# Version 3 (issue 32): an artifact read by a fit is its upstream (the attention-mass map follows its feature
# sample), a local model is identified by its config and tokenizer files too, data and local models by their bytes
# (not their path), hub datasets by their revision, and native_injected by eval.native_tail.
KEY_VERSION = 3


@dataclass(frozen=True)
class Artifact:
    """One cached artifact: `inputs` (dotted config leaves), `upstream` artifacts, `identities` of the
    models/data it reads, `extra` runtime values. `when` maps an input to (config leaf, values): the input
    enters the key only while that leaf takes one of those values (a knob read only by some map kinds).

    The upstream rule is structural: every artifact a computation reads is in its `upstream`, and a knob that
    only shapes an upstream artifact is that artifact's input, never repeated here (its key carries it).
    `reads` maps an upstream artifact that is read only under some configs to the alternatives
    ((config leaf, values), ...) under which it is read (any one suffices).
    `omit_at` maps an input to the values at which it stays out of the key (the knob's default), so the artifacts
    made before the knob existed keep their keys.

    `code`: the modules ("runner/fit_stage") that compute it; with what they import they are its producing
    code, whose version (kvtransfer.runner.code_versions) enters the key from version 2 on."""
    name: str
    inputs: tuple[str, ...]
    upstream: tuple[str, ...] = ()
    identities: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    when: dict = field(default_factory=dict)
    reads: dict = field(default_factory=dict)
    omit_at: dict = field(default_factory=dict)
    doc: str = ""
    code: tuple[str, ...] = ()


# what every model computation reads: weights dtype and attention kernel change the numbers
_MODEL_RUN = ("pair.dtype", "attn_implementation")
_EVAL_COMMON = ("eval.data_dir", "eval.batch_size", "eval.bootstrap", "calib.context_start", "seed", *_MODEL_RUN)
_EVAL_MAPPED = ("eval.native_tail", "eval.allow_context_start_mismatch", "ablation.rope_at_inference",
                "eval.map_dtype")
# the dtype the map is applied in enters the mapped results' keys only when it is not the fitted map's float32, so the
# results computed before eval.map_dtype existed (all float32) keep their keys, and a bfloat16 evaluation never reads them
_MAP_DTYPE_WHEN = {"eval.map_dtype": ("eval.map_dtype", ("bfloat16",))}
_TASKS = ("eval.limit", "eval.limits", "eval.num_fewshot", "eval.share_prefix", "eval.max_gen_toks")
_PPL = ("eval.ppl.file", "eval.ppl.dataset", "eval.ppl.dataset_name", "eval.ppl.split", "eval.ppl.field",
        "eval.ppl.prefixes", "eval.ppl.continuation", "eval.ppl.windows", "eval.ppl.draw")
_COQA = ("eval.coqa.file", "eval.coqa.dataset", "eval.coqa.dataset_name", "eval.coqa.split",
         "eval.coqa.conversations", "eval.coqa.turns", "eval.coqa.protocols",
         "eval.coqa.max_gen_toks")
_MLP = ("mapper.hidden", "mapper.epochs", "mapper.batch_tokens")
_TRAINING = ("mapper.lr", "mapper.device")  # read by the MLP and the trained map
_TRAINED = ("mapper.objective", "mapper.train_sequences", "mapper.stop_sequences", "mapper.query_positions",
            "mapper.steps", "mapper.batch_sequences", "mapper.eval_every", "mapper.patience")
_LAYER_LOCAL = ("mapper.query_positions",)  # read by the trained map's layer-local objective only
_END_TO_END = ("mapper.context_tokens", "mapper.continuation_tokens")  # read by its end-to-end objective only

_EVAL_CODE = ("runner/eval_stage",)  # the eval stage, the adapter and the metrics it imports

ARTIFACTS: dict[str, Artifact] = {a.name: a for a in (
    Artifact("calibration", code=("runner/calibrate_stage",),
             doc="train moments + held-out features (+ the R² matrix of them, stored inside)",
             inputs=("calib.dataset", "calib.dataset_name", "calib.split", "calib.files", "calib.text_field",
                     "calib.domain", "calib.context_start", "calib.n_sequences", "calib.seq_len", "calib.stride",
                     "calib.heldout_fraction", "calib.heldout_observations", "calib.batch_size", "calib.capture",
                     "calib.dtype", "calib.compute_dtype", "calib.accumulate", "calib.flush_batches", "seed", "mapper.features",
                     "calib.draw", "calib.merge", *_MODEL_RUN),
             identities=("source", "target", "calib_data"), extra=("key_space", "format"),
             # the first draw and no merge are what every calibration was before these knobs: the same key
             # (a merged calibration's key holds each part's data by its entry; the files' bytes by calib_data)
             omit_at={"calib.draw": (None, 0), "calib.merge": (None, [])},
             # the source's hidden states are calibrated only for the map that reads them (runconfig.source_features):
             # a ridge/MLP/trained run keeps the paper's calibration (and its key)
             when={"mapper.features": ("mapper.kind", ("hidden",))}),
    Artifact("feature_sample", code=("runner/calibrate_stage",),
             doc="train feature rows for mapper=mlp / weighting=attention_mass",
             inputs=("calib.mlp_samples",), upstream=("calibration",)),
    Artifact("query_energy", code=("runner/fit_family",),
             doc="target query energy of weighting=attention (families.query_energy)",
             inputs=("mapper.metric_sequences",), upstream=("calibration",)),
    Artifact("attention_mass", code=("runner/fit_family",),
             doc="target attention mass per train token (families.attention_mass)",
             inputs=(), upstream=("calibration",)),
    Artifact("mapper", code=("runner/fit_stage",),
             doc="the fitted map (ridge, its families, the trained map, the hidden-state map, or the MLP)",
             inputs=("mapper.kind", "mapper.k", "mapper.lam", "mapper.selection", "mapper.force",
                     "mapper.native_sink", "mapper.support", "mapper.rank", "mapper.weighting",
                     "calib.batch_size", "ablation.k", "ablation.lam",
                     "mapper.features", *_MLP, *_TRAINING, *_TRAINED, *_END_TO_END),
             # what each fit reads besides the moments (Run._fit): the MLP and the attention-mass weighting fit on the
             # kept feature rows, the attention-mass weighting on the target's attention mass, the attention metric on
             # the query energy; their own knobs (calib.mlp_samples, mapper.metric_sequences) key them, and so the map
             upstream=("calibration", "feature_sample", "attention_mass", "query_energy"),
             reads={"feature_sample": (("mapper.kind", ("mlp",)), ("mapper.weighting", ("attention_mass",))),
                    "attention_mass": (("mapper.weighting", ("attention_mass",)),),
                    "query_energy": (("mapper.weighting", ("attention",)),)},
             when={"mapper.features": ("mapper.kind", ("hidden",)),
                   # the trained map's collection batches its forwards by calib.batch_size (kernel rounding)
                   "calib.batch_size": ("mapper.kind", ("trained",)),
                   **{k: ("mapper.kind", ("mlp",)) for k in _MLP},
                   **{k: ("mapper.kind", ("mlp", "trained")) for k in _TRAINING},
                   **{k: ("mapper.kind", ("trained",)) for k in _TRAINED},
                   # the objective decides which of its knobs are read (mapper.objective exists under kind=trained only)
                   **{k: ("mapper.objective", ("layer_local",)) for k in _LAYER_LOCAL},
                   **{k: ("mapper.objective", ("end_to_end",)) for k in _END_TO_END}}),
    Artifact("fidelity", code=("runner/fidelity",), doc="mapped vs native cache on held-out calibration sequences",
             inputs=("eval.fidelity.sequences", "eval.fidelity.continuation", "ablation.rope_at_inference"),
             upstream=("mapper",)),
    Artifact("gate", code=("runner/gate_stage",),
             doc="the per-request gate's thresholds on held-out calibration text (kvtransfer.core.gate)",
             inputs=("eval.gate.tail", "eval.gate.recompute_rate", "eval.gate.full_rate", "eval.gate.fraction",
                     "eval.gate.sequences", "eval.gate.select", "eval.gate.score", "ablation.rope_at_inference"),
             upstream=("mapper",),
             # the score a gate is fitted on enters its key only when it is not the tail score (kvtransfer.core.signals),
             # so the gates fitted before eval.gate.score existed keep their keys
             when={"eval.gate.score": ("eval.gate.score", ("first_layer", "tail_kl", "tail_nll_gain"))}),
    Artifact("eval_tasks", code=_EVAL_CODE,
             doc="lm-eval task scores of the baseline modes (target, source, native_injected, floor)",
             inputs=(*_TASKS, *_EVAL_COMMON), identities=("source", "target", "eval_data")),
    Artifact("eval_ppl", code=_EVAL_CODE, doc="WikiText-2 prefix perplexity of the baseline modes",
             inputs=(*_PPL, *_EVAL_COMMON), identities=("source", "target", "eval_data", "ppl_data")),
    Artifact("eval_coqa", code=_EVAL_CODE, doc="multi-turn CoQA drift of the baseline modes",
             inputs=(*_COQA, *_EVAL_COMMON), identities=("source", "target", "eval_data")),
    # native_injected reads the target's own cache with its last eval.native_tail tokens recomputed: a split mode
    Artifact("eval_tasks_native", code=_EVAL_CODE,
             doc="lm-eval task scores of native_injected (the tail > 1 plumbing check)",
             inputs=(*_TASKS, *_EVAL_COMMON, "eval.native_tail"), identities=("source", "target", "eval_data")),
    Artifact("eval_ppl_native", code=_EVAL_CODE, doc="prefix perplexity of native_injected",
             inputs=(*_PPL, *_EVAL_COMMON, "eval.native_tail"), identities=("source", "target", "eval_data", "ppl_data")),
    Artifact("eval_coqa_native", code=_EVAL_CODE, doc="CoQA drift of native_injected",
             inputs=(*_COQA, *_EVAL_COMMON, "eval.native_tail"), identities=("source", "target", "eval_data")),
    Artifact("eval_tasks_mapped", code=_EVAL_CODE, doc="lm-eval task scores through the map",
             inputs=(*_TASKS, *_EVAL_COMMON, *_EVAL_MAPPED), upstream=("mapper",), identities=("eval_data",),
             when=_MAP_DTYPE_WHEN),
    Artifact("eval_ppl_mapped", code=_EVAL_CODE, doc="prefix perplexity through the map",
             inputs=(*_PPL, *_EVAL_COMMON, *_EVAL_MAPPED), upstream=("mapper",), identities=("eval_data", "ppl_data"),
             when=_MAP_DTYPE_WHEN),
    Artifact("eval_coqa_mapped", code=_EVAL_CODE, doc="CoQA drift through the map",
             inputs=(*_COQA, *_EVAL_COMMON, *_EVAL_MAPPED), upstream=("mapper",), identities=("eval_data",),
             when=_MAP_DTYPE_WHEN),
    Artifact("bench", code=("runner/bench_stage",), doc="mapper vs re-prefill timing of the run's models",
             inputs=("bench.tokens", "bench.warmup", "bench.repeats", "bench.shapes_only", "bench.dtype",
                     "bench.native_tails", "bench.mapper_dtypes", *_MODEL_RUN),
             upstream=("mapper",), identities=("source", "target"), extra=("device", "torch")),
    Artifact("bench_shapes", code=("runner/bench_stage",),
             doc="timing on random weights with the pair's real shapes (bench.shapes_only)",
             inputs=("pair.name", "bench.tokens", "bench.warmup", "bench.repeats", "bench.layers", "bench.dtype",
                     "bench.mapper_dtypes"), extra=("device", "torch")),
)}

# Config leaves that are an input of no artifact, and why. Each is still used by the run, only not in a
# way that changes a cached number.
NOT_INPUTS: dict[str, str] = {
    "stage": "selects which stages run", "out_dir": "where the run writes", "cache_dir": "where artifacts live",
    "progress": "progress bars", "dry_run": "runs the same stages on stand-ins (see dry.)",
    "device": "placement: which device computes (kernel rounding only)",
    "device_map": "placement across GPUs", "trust_remote_code": "permission to run hub code; the model's "
    "config hash and weights identity are keyed", "context_start": "read through calib.context_start "
    "(interpolated from it)", "pair.name": "a label (the models are keyed by their identity)",
    "pair.family": "a label", "pair.k": "read through mapper.k (interpolated from it by mapper=ridge/mlp/trained; "
    "mapper=hidden fixes k=2 and ignores pair.k: set mapper.k there)",
    "pair.source.id": "keyed through the model identity", "pair.source.path": "keyed through the model identity",
    "pair.target.id": "keyed through the model identity", "pair.target.path": "keyed through the model identity",
    "pair.direction": "keyed through the model identities (it swaps them)",
    "pair.source.device_map": "placement", "pair.target.device_map": "placement",
    "pair.source.max_memory": "placement", "pair.target.max_memory": "placement",
    "calib.store_device": "where the moments are held (placement)",
    "calib.checkpoint_every": "how often a calibration checkpoints (the result is the same)",
    "eval.tasks": "selects which task files are computed (each task is its own file)",
    "eval.modes": "selects which mode files are computed (each mode is its own file)",
    "eval.controls": "selects which content-control mode files are computed (each mode is its own file)",
    "eval.ppl.sets": "selects which perplexity set files are computed (each set is its own file; a bundled set's "
                     "file is keyed through the ppl_data identity)",
    "eval.recompute_fraction": "selects which recompute mode files are computed (the mode name carries r)",
    "eval.recompute_select": "selects which recompute mode files are computed (the mode name carries the rule)",
    "eval.truncate.twins": "selects which truncation mode files are computed (the mode name carries r)",
    "eval.truncate.curve": "selects which truncation-curve mode files are computed (the mode name carries m)",
    "eval.truncate.always": "selects whether the truncation-curve mode files are computed",
    "eval.time_contexts": "records seconds and FLOPs of reading the contexts beside each result (records only, no "
                          "number scored moves; a file cached without them reports no timing)",
    "eval.gate.enabled": "selects whether the gated mode runs (its files carry the gate artifact's key)",
    "eval.gate.signals": "which per-request signals the gated mode records beside its decision (records only, no number "
                         "moves; its file names carry a digest of the list: eval_stage.gated_label)",
    "eval.native_sink": "a check against the mapper's own native_sink (keyed through the mapper)",
    "eval.fidelity.enabled": "selects whether fidelity runs", "eval.ppl.enabled": "selects whether perplexity runs",
    "eval.coqa.enabled": "selects whether CoQA runs",
    "eval.coqa.truncate": "selects which CoQA truncation-twin mode files are computed (the mode name carries m)",
    "ablation.name": "a label", "ablation.key_space": "keyed as the calibration's key_space (runtime value)",
    "report.variance_k": "the report's Table-7 rows are recomputed each run (not cached)",
    "report.rotated_heatmap": "asks for a second calibration (keyed by its key_space)",
}
NOT_INPUT_PREFIXES: dict[str, str] = {
    "plan.": "the resource plan decides whether and how a run starts; the knobs it applies are config keys "
             "that are classified themselves",
    "wandb.": "logging only",
    "dry.": "the dry run's sizes are applied to the config keys above before anything is keyed, and its "
            "stand-in weights are keyed through the model identity",
    "hydra.": "launcher settings",
}
# dict-valued leaves hashed whole: their keys are user data (task names, devices), not config keys
OPAQUE = ("eval.limits", "pair.source.max_memory", "pair.target.max_memory")


def leaf_keys(cfg: dict, prefix: str = "") -> list[str]:
    """Dotted names of the config's leaves (values that are not non-empty dicts, and the OPAQUE dicts)."""
    out = []
    for name, value in cfg.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict) and value and dotted not in OPAQUE:
            out += leaf_keys(value, dotted + ".")
        else:
            out.append(dotted)
    return out


def lookup(cfg: dict, dotted: str):
    """The value at a dotted key, None where the key is absent (a group option without that knob)."""
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def classify(dotted: str) -> list[str]:
    """Names of the artifacts `dotted` is an input of, or ["-"] when it is declared not an input; [] when
    it is neither (a key nobody classified)."""
    users = [a.name for a in ARTIFACTS.values() if dotted in a.inputs]
    if users:
        return users
    if dotted in NOT_INPUTS or any(dotted.startswith(p) for p in NOT_INPUT_PREFIXES):
        return ["-"]
    return []


def _holds(cfg: dict, alternatives) -> bool:
    return any(lookup(cfg, leaf) in values for leaf, values in alternatives)


def upstream_of(name: str, cfg: dict) -> tuple[str, ...]:
    """The upstream artifacts artifact `name` reads under this config (all of `upstream` but those of `reads`
    whose conditions do not hold)."""
    art = ARTIFACTS[name]
    return tuple(u for u in art.upstream if u not in art.reads or _holds(cfg, art.reads[u]))


def key_inputs(name: str, cfg: dict) -> dict:
    """{dotted key: value} of the config leaves artifact `name` reads under this config."""
    art = ARTIFACTS[name]
    out = {}
    for dotted in art.inputs:
        cond = art.when.get(dotted)
        if cond is not None and lookup(cfg, cond[0]) not in cond[1]:
            continue
        if dotted in art.omit_at and lookup(cfg, dotted) in art.omit_at[dotted]:
            continue
        out[dotted] = lookup(cfg, dotted)
    return out


# the code version of each artifact kind and the digest of its producing code (kvtransfer.runner.code_versions)
CODE_VERSIONS_FILE = Path(__file__).with_name("code_versions.json")


@lru_cache(maxsize=1)
def recorded() -> dict:
    """{kind: {"version": int, "digest": str}, "python": "3.11"} as committed in code_versions.json."""
    return json.loads(CODE_VERSIONS_FILE.read_text())


def version(kind: str) -> int:
    """The committed code version of artifact kind `kind` (KeyError naming the fix for an unlisted kind)."""
    try:
        return int(recorded()[kind]["version"])
    except KeyError:
        raise KeyError(f"artifact kind {kind!r} has no code version in {CODE_VERSIONS_FILE}: run "
                       "`python -m kvtransfer.runner.code_versions --update`") from None


def compute_key(name: str, cfg: dict, *, upstream: dict[str, str], identities: dict, extra: dict) -> str:
    """Key of artifact `name`: the hash of the key version, its inputs, upstream keys, identities and extra
    values, and its producing code's version (kvtransfer.runner.code_versions) once that is 2 or more.

    upstream (every one of `upstream_of(name, cfg)`), identities and extra must hold every name the declaration
    lists (KeyError otherwise: a caller that forgets an input fails, it does not hash without it)."""
    art = ARTIFACTS[name]
    parts = [KEY_VERSION, name, key_inputs(name, cfg), {u: upstream[u] for u in upstream_of(name, cfg)},
             {i: identities[i] for i in art.identities}, {e: extra[e] for e in art.extra}]
    code = version(name)
    if code > 1:  # version 1 hashes as before code versions existed, so the keys of that code's artifacts stay valid
        parts.append({"code_version": code})
    return artifact_key(*parts)
