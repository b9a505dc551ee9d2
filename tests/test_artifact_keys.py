"""Issue 20 §1-2: every artifact's key is the hash of exactly its declared inputs.

- every leaf of every composed config (each pair, each group option) is an input of some artifact or
  declared not to be one (with its reason): a new config key fails here until someone classifies it;
- mutation: changing a declared input changes the artifact's key, changing anything else does not;
- identities: new weights (a local directory's bytes, a hub snapshot's revision) or new data files
  change the identity the keys hash.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kvtransfer.config.identity import data_identity, directory_weights_digest, hub_revision, weights_identity
from kvtransfer.runner.artifacts import (ARTIFACTS, NOT_INPUTS, OPAQUE, classify, compute_key, key_inputs, leaf_keys,
                                         lookup, upstream_of)
from run_configs import ROOT, compose_config

GROUPS = {"calib": ["fineweb_edu", "local", "tiny"], "mapper": ["ridge", "mlp", "trained", "hidden"], "eval": ["default", "tiny"],
          "ablation": ["full", "no_rerotation", "no_rope", "no_rope_k1", "no_rope_k1_no_ridge"],
          "bench": ["default", "tiny"]}
PAIRS = sorted(p.stem for p in (ROOT / "conf" / "pair").glob("*.yaml"))


def _configs() -> list[dict]:
    """Each pair once, then each group option once (on a paper pair), as composed plain dicts."""
    out = [compose_config(f"pair={p}") for p in PAIRS]
    for group, options in GROUPS.items():
        for option in options:
            extra = ["calib.files=[x.jsonl]"] if (group, option) == ("calib", "local") else []
            out.append(compose_config("pair=qwen3_14b_32b", f"{group}={option}", *extra))
    return out


CONFIGS = _configs()


def test_the_group_options_listed_here_are_all_there_are():
    on_disk = {g: sorted(p.stem for p in (ROOT / "conf" / g).glob("*.yaml")) for g in GROUPS}
    assert on_disk == {g: sorted(o) for g, o in GROUPS.items()}


def test_every_config_key_is_classified():
    unclassified = sorted({k for cfg in CONFIGS for k in leaf_keys(cfg) if not classify(k)})
    assert not unclassified, (
        f"config keys {unclassified} are neither an input of an artifact nor in NOT_INPUTS: add each to the "
        "inputs of every artifact whose numbers it changes (kvtransfer/runner/artifacts.py), or to NOT_INPUTS "
        "with the reason it changes none")


def test_every_declared_key_exists_in_some_config():
    seen = {k for cfg in CONFIGS for k in leaf_keys(cfg)}
    declared = {k for a in ARTIFACTS.values() for k in a.inputs} | set(NOT_INPUTS)
    stale = sorted(declared - seen)
    assert not stale, f"declared keys {stale} are in no composed config (renamed or removed?)"


def _mutated(value):
    """A different value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "_x"
    if isinstance(value, list):
        return [*value, "x"]
    if isinstance(value, dict):
        return {**value, "x": 1}
    return "set"  # None


def _set(cfg: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(cfg)
    node = out
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def _key(name: str, cfg: dict, **change) -> str:
    art = ARTIFACTS[name]
    ctx = {"upstream": {u: f"up-{u}" for u in upstream_of(name, cfg)},
           "identities": {i: {"id": i} for i in art.identities},
           "extra": {e: f"x-{e}" for e in art.extra}}
    for part, (entry, value) in change.items():
        ctx[part][entry] = value
    return compute_key(name, cfg, **ctx)


def _chain_key(name: str, cfg: dict) -> str:
    """The key as the runner computes it: upstream keys from the same config, down the chain (fixed identities)."""
    art = ARTIFACTS[name]
    return compute_key(name, cfg, upstream={u: _chain_key(u, cfg) for u in upstream_of(name, cfg)},
                       identities={i: {"id": i} for i in art.identities}, extra={e: f"x-{e}" for e in art.extra})


# a base per map kind and per weighting, so every conditional input and every conditional upstream is read by one
BASES = {"ridge": compose_config("pair=qwen3_14b_32b"),
         "attention": compose_config("pair=qwen3_14b_32b", "mapper.weighting=attention", "mapper.rank=64"),
         "attention_mass": compose_config("pair=qwen3_14b_32b", "mapper.weighting=attention_mass",
                                          "calib.mlp_samples=65536"),
         "mlp": compose_config("pair=qwen3_14b_32b", "mapper=mlp", "calib.mlp_samples=65536"),
         "trained": compose_config("pair=qwen3_14b_32b", "mapper=trained"),
         "hidden": compose_config("pair=qwen3_14b_32b", "mapper=hidden"),
         "trained_e2e": compose_config("pair=qwen3_14b_32b", "mapper=trained", "mapper.objective=end_to_end")}


@pytest.mark.parametrize("name", sorted(ARTIFACTS))
@pytest.mark.parametrize("base", sorted(BASES))
def test_a_key_changes_with_each_input_and_nothing_else(name, base):
    cfg = BASES[base]
    key = _key(name, cfg)
    # an input left out of the key at its default (omit_at) is still an input: any other value moves the key
    inputs = {**key_inputs(name, cfg), **ARTIFACTS[name].omit_at}
    for dotted in leaf_keys(cfg):
        changed = _key(name, _set(cfg, dotted, _mutated(lookup(cfg, dotted))))
        if dotted in inputs:
            assert changed != key, f"{name}: changing input {dotted} left the key unchanged"
        elif not any(dotted == c[0] for c in ARTIFACTS[name].when.values()):  # a condition selects inputs
            assert changed == key, f"{name}: {dotted} is not an input but changed the key"
    art = ARTIFACTS[name]
    for part, names in (("upstream", upstream_of(name, cfg)), ("identities", art.identities), ("extra", art.extra)):
        for entry in names:
            assert _key(name, cfg, **{part: (entry, "other")}) != key, f"{name}: {part} {entry} not keyed"


@pytest.mark.parametrize("name", sorted(ARTIFACTS))
@pytest.mark.parametrize("base", sorted(BASES))
def test_through_the_chain_every_input_of_what_is_read_moves_the_key(name, base):
    """The structural rule (issue 32): an input of any artifact `name` reads, directly or through its upstream
    chain, changes `name`'s key; a leaf no artifact of the chain reads leaves it."""
    cfg = BASES[base]
    key = _chain_key(name, cfg)
    chain, todo = set(), [name]
    while todo:
        chain.add(todo[-1])
        todo += [u for u in upstream_of(todo.pop(), cfg) if u not in chain]
    read = {k for a in chain for k in [*key_inputs(a, cfg), *ARTIFACTS[a].omit_at]}
    conditions = {c[0] for a in chain for c in ARTIFACTS[a].when.values()} | {
        leaf for a in chain for alts in ARTIFACTS[a].reads.values() for leaf, _ in alts}
    for dotted in leaf_keys(cfg):
        changed = _chain_key(name, _set(cfg, dotted, _mutated(lookup(cfg, dotted))))
        if dotted in read:
            assert changed != key, f"{name} under {base}: {dotted} is read down its chain but left the key unchanged"
        elif dotted not in conditions:
            assert changed == key, f"{name} under {base}: nothing down its chain reads {dotted} but it moved the key"


def test_a_knob_at_its_default_keeps_the_keys_made_before_it_existed():
    """calib.draw = 0 and calib.merge = [] are what every calibration was before those knobs: a config that lacks
    them and one that holds their defaults share every key, and any other value is another calibration and map."""
    cfg = BASES["ridge"]
    assert lookup(cfg, "calib.draw") == 0 and lookup(cfg, "calib.merge") == []
    older = json.loads(json.dumps(cfg))
    del older["calib"]["draw"], older["calib"]["merge"]
    for name in ("calibration", "mapper"):
        assert _chain_key(name, older) == _chain_key(name, cfg)
        assert _chain_key(name, _set(cfg, "calib.draw", 1)) != _chain_key(name, cfg)
        assert _chain_key(name, _set(cfg, "calib.merge", [{"draw": 1}])) != _chain_key(name, cfg)


def test_the_attention_mass_map_follows_its_feature_sample():
    """Issue 32: the attention-mass fit reads the kept feature rows, so 1,000 vs 65,536 of them are two maps."""
    mass = BASES["attention_mass"]
    assert set(upstream_of("mapper", mass)) == {"calibration", "feature_sample", "attention_mass"}
    few = _set(mass, "calib.mlp_samples", 1000)
    assert _chain_key("feature_sample", few) != _chain_key("feature_sample", mass)
    assert _chain_key("mapper", few) != _chain_key("mapper", mass)
    # a map that reads no feature rows keeps its key (one calibration serves ridge and MLP fits)
    ridge = BASES["ridge"]
    assert _chain_key("mapper", _set(ridge, "calib.mlp_samples", 1000)) == _chain_key("mapper", ridge)


def test_conditional_inputs_enter_only_when_read():
    ridge, attention, mlp, mass = BASES["ridge"], BASES["attention"], BASES["mlp"], BASES["attention_mass"]
    assert upstream_of("mapper", ridge) == ("calibration",)
    assert "query_energy" in upstream_of("mapper", attention)  # mapper.metric_sequences keys it
    assert "mapper.hidden" in key_inputs("mapper", mlp) and "feature_sample" in upstream_of("mapper", mlp)
    assert "feature_sample" in upstream_of("mapper", mass) and "attention_mass" in upstream_of("mapper", mass)
    # no knob of an upstream artifact is repeated as a direct input (its key carries it)
    for art in ARTIFACTS.values():
        for up in art.upstream:
            assert not set(art.inputs) & set(ARTIFACTS[up].inputs) - set(ARTIFACTS["calibration"].inputs), (art.name, up)


def test_the_trained_maps_knobs_key_only_the_trained_map():
    trained, ridge, mlp = BASES["trained"], BASES["ridge"], BASES["mlp"]
    knobs = {"mapper.objective", "mapper.train_sequences", "mapper.stop_sequences", "mapper.query_positions",
             "mapper.steps", "mapper.batch_sequences", "mapper.eval_every", "mapper.patience", "mapper.lr",
             "mapper.device", "calib.batch_size"}
    assert knobs <= set(key_inputs("mapper", trained))
    assert not knobs & set(key_inputs("mapper", ridge))
    assert knobs & set(key_inputs("mapper", mlp)) == {"mapper.lr", "mapper.device"}  # shared with the MLP
    # the trained map is its own artifact: the ridge map it starts from keeps its key
    assert _key("mapper", trained) != _key("mapper", ridge)


def test_the_source_features_key_the_calibration_and_the_map_only_for_the_hidden_kind():
    """mapper.features (issue 23 §2) decides what the calibration reads of the source: a hidden-state map's
    calibration and map are keyed by it, and every other kind keeps the paper's calibration key."""
    hidden, ridge = BASES["hidden"], BASES["ridge"]
    assert key_inputs("calibration", hidden)["mapper.features"] == "hidden"
    assert "mapper.features" not in key_inputs("calibration", ridge)
    other = _set(hidden, "mapper.features", "hidden_kv")
    for name in ("calibration", "mapper"):
        assert _key(name, other) != _key(name, hidden), f"{name}: mapper.features not keyed"
    # the hidden-state calibration is its own artifact; a ridge run's calibration key is the one it always had
    assert _key("calibration", hidden) != _key("calibration", ridge)
    assert _key("calibration", ridge) == _key("calibration", _set(ridge, "mapper.features", "hidden"))
    # through the runner's key chain: the mapper's key follows its calibration's
    from kvtransfer.config.runconfig import source_features

    assert source_features(hidden["mapper"]) == "hidden" and source_features(other["mapper"]) == "hidden_kv"
    assert source_features(ridge["mapper"]) == "kv"


def test_each_objective_keys_its_own_knobs_only():
    layer_local, e2e = BASES["trained"], BASES["trained_e2e"]
    ends = {"mapper.context_tokens", "mapper.continuation_tokens"}
    assert ends <= set(key_inputs("mapper", e2e)) and not ends & set(key_inputs("mapper", layer_local))
    assert "mapper.query_positions" in key_inputs("mapper", layer_local)
    assert "mapper.query_positions" not in key_inputs("mapper", e2e)
    shared = {"mapper.train_sequences", "mapper.stop_sequences", "mapper.steps", "mapper.batch_sequences",
              "mapper.eval_every", "mapper.patience", "mapper.lr", "mapper.device", "calib.batch_size"}
    assert shared <= set(key_inputs("mapper", e2e))
    # the two objectives are two artifacts; an e2e knob moves the e2e key only
    assert _key("mapper", e2e) != _key("mapper", layer_local)
    assert _key("mapper", _set(e2e, "mapper.continuation_tokens", 32)) != _key("mapper", e2e)
    assert _key("mapper", _set(layer_local, "mapper.continuation_tokens", 32)) == _key("mapper", layer_local)
    assert _key("mapper", _set(e2e, "mapper.query_positions", 8)) == _key("mapper", e2e)
    # the existing layer-local artifacts keep their keys: the inputs it reads are the ones it read before
    before = {"mapper.objective", "mapper.train_sequences", "mapper.stop_sequences", "mapper.query_positions",
              "mapper.steps", "mapper.batch_sequences", "mapper.eval_every", "mapper.patience"}
    assert before <= set(key_inputs("mapper", layer_local)) and not ends & set(key_inputs("mapper", layer_local))


def test_the_seed_and_the_model_run_settings_key_the_calibration():
    inputs = ARTIFACTS["calibration"].inputs
    assert {"seed", "pair.dtype", "attn_implementation", "calib.dtype", "calib.accumulate"} <= set(inputs)
    assert set(ARTIFACTS["calibration"].identities) == {"source", "target", "calib_data"}
    for name in ("feature_sample", "query_energy", "attention_mass", "mapper"):  # all hang off the calibration
        assert "calibration" in ARTIFACTS[name].upstream


def test_opaque_dicts_are_hashed_whole():
    cfg = _set(BASES["ridge"], "eval.limits", {"hellaswag": 10})
    assert "eval.limits" in leaf_keys(cfg) and "eval.limits.hellaswag" not in leaf_keys(cfg)
    assert _key("eval_tasks", cfg) != _key("eval_tasks", _set(cfg, "eval.limits", {"hellaswag": 11}))
    assert set(OPAQUE) <= {k for c in CONFIGS for k in leaf_keys(c)} | {"eval.limits"}


def test_a_forgotten_identity_is_an_error_not_a_smaller_key():
    with pytest.raises(KeyError):
        compute_key("calibration", BASES["ridge"], upstream={}, identities={"source": 1, "target": 2},
                    extra={"key_space": "stripped", "format": 3})


# -- identities --------------------------------------------------------------------------------------------------
def _save_model(directory: Path, seed: int) -> None:
    from tiny_models import tiny_model

    tiny_model("qwen3", layers=2, hidden=32, heads=4, seed=seed).save_pretrained(directory)


def test_the_weights_digest_follows_the_bytes_not_the_path(tmp_path):
    _save_model(tmp_path / "m", seed=1)
    first = directory_weights_digest(tmp_path / "m")
    assert first["files"] == 1 and first["tensors"] > 0 and first["bytes"] > 0
    assert directory_weights_digest(tmp_path / "m") == first  # deterministic
    _save_model(tmp_path / "m", seed=2)  # same shapes, same path, new weights
    assert directory_weights_digest(tmp_path / "m")["digest"] != first["digest"]
    # one tensor's first bytes changed in place (the header is the same): the sample sees it
    _save_model(tmp_path / "m", seed=1)
    path = tmp_path / "m" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    raw[8 + n] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert directory_weights_digest(tmp_path / "m")["digest"] != first["digest"]
    with pytest.raises(FileNotFoundError, match="no weights file"):
        directory_weights_digest(tmp_path / "empty")


def test_a_hub_id_is_identified_by_its_snapshot_revision(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--Org--Model"
    for rev in ("a" * 40, "b" * 40):
        (repo / "snapshots" / rev).mkdir(parents=True)
        (repo / "snapshots" / rev / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    with pytest.raises(ValueError, match="holds no snapshot"):
        weights_identity("Org/Other")
    (repo / "refs" / "main").write_text("a" * 40)
    assert weights_identity("Org/Model") == {"kind": "hub", "revision": "a" * 40}
    (repo / "refs" / "main").write_text("b" * 40)  # the hub moved main: new weights under the same id
    assert hub_revision("Org/Model") == "b" * 40


def test_data_files_are_identified_by_their_bytes(tmp_path):
    f = tmp_path / "calib.jsonl"
    f.write_text(json.dumps({"text": "a"}) + "\n")
    first = data_identity(files=[f])
    f.write_text(json.dumps({"text": "b"}) + "\n")
    assert data_identity(files=[f]) != first and data_identity(files=[f]) == data_identity(files=[f])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data_identity(files=[tmp_path / "missing.jsonl"])
    (tmp_path / "README.md").write_text("a note")  # a data directory's notes are not data
    assert [d["name"] for d in data_identity(directory=tmp_path)] == [f.name]
    # the bytes, not the path (issue 32): the same file in a moved checkout is the same data
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / f.name).write_bytes(f.read_bytes())
    assert data_identity(files=[moved / f.name]) == data_identity(files=[f])


def test_a_local_models_identity_holds_its_config_and_tokenizer(tmp_path):
    """Issue 32: a config.json edit (layer_types / sliding_window change the logits) or an edited tokenizer config
    (it decides the calibration token ids) is a new identity; the same bytes in a moved directory are the same."""
    _save_model(tmp_path / "m", seed=1)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    first = weights_identity(str(tmp_path / "m"))
    cfg_path = tmp_path / "m" / "config.json"
    raw = cfg_path.read_text()
    cfg_path.write_text(json.dumps({**json.loads(raw), "sliding_window": 4, "use_sliding_window": True}))
    assert weights_identity(str(tmp_path / "m")) != first
    cfg_path.write_text(raw)
    assert weights_identity(str(tmp_path / "m")) == first
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 65}))
    assert weights_identity(str(tmp_path / "m")) != first
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (tmp_path / "m").rename(tmp_path / "elsewhere")
    assert weights_identity(str(tmp_path / "elsewhere")) == first


def test_a_hub_dataset_is_keyed_by_its_revision(tmp_path, monkeypatch):
    """Issue 32: a streamed calibration dataset's revision enters calib_data (offline: the HF cache's ref)."""
    import huggingface_hub
    import huggingface_hub.constants as hub

    from kvtransfer.config.identity import hub_dataset_revision

    import datasets.config

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "prepared"))
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(ValueError, match="calib.files"):
        hub_dataset_revision("Org/Data")
    # offline with only the `datasets` cache's prepared copy (what `datasets` then reads): its fingerprint
    (tmp_path / "prepared" / "Org___Data" / "default" / "0.0.0" / "abc123").mkdir(parents=True)
    assert hub_dataset_revision("Org/Data") == "datasets-cache:default/0.0.0/abc123"
    (tmp_path / "prepared" / "Org___Data" / "default" / "0.0.0" / "abc123").rename(
        tmp_path / "prepared" / "Org___Data" / "default" / "0.0.0" / "fed456")   # re-prepared from new files
    assert hub_dataset_revision("Org/Data") == "datasets-cache:default/0.0.0/fed456"
    refs = tmp_path / "datasets--Org--Data" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("c" * 40)
    assert hub_dataset_revision("Org/Data") == "c" * 40
    (refs / "main").write_text("d" * 40)  # the dataset was updated: a new identity, so new moments
    assert hub_dataset_revision("Org/Data") == "d" * 40


def test_a_cache_of_older_keys_is_named_once_and_never_read(tmp_path):
    import warnings

    from kvtransfer.runner.artifacts import KEY_VERSION
    from kvtransfer.runner.pipeline import check_cache_version

    (tmp_path / "moments" / "0123456789abcdef").mkdir(parents=True)  # a version-1 calibration
    with pytest.warns(UserWarning, match="keyed under key version 1"):
        check_cache_version(tmp_path)
    assert (tmp_path / "KEYS_VERSION").read_text().strip() == str(KEY_VERSION)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_cache_version(tmp_path)  # said once: the cache is stamped now
    fresh = tmp_path / "fresh"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_cache_version(fresh)  # an empty cache has nothing to say


def test_the_map_dtype_keys_the_mapped_results_only_when_it_is_not_float32():
    """eval.map_dtype=float32 (the default) keeps the keys the mapped results had before the knob existed;
    bfloat16 gives every mapped part a key of its own, and no baseline result moves."""
    from kvtransfer.core.map_dtype import resolve_config

    base = resolve_config(BASES["ridge"], "cpu")   # as execute() resolves the default `auto` on a CPU
    assert BASES["ridge"]["eval"]["map_dtype"] == "auto" and base["eval"]["map_dtype"] == "float32"
    without = copy.deepcopy(base)
    del without["eval"]["map_dtype"]
    bf16 = _set(base, "eval.map_dtype", "bfloat16")
    for part in ("tasks", "ppl", "coqa"):
        mapped = f"eval_{part}_mapped"
        assert _chain_key(mapped, base) == _chain_key(mapped, without)
        assert _chain_key(mapped, bf16) != _chain_key(mapped, base)
        for baseline in (f"eval_{part}", f"eval_{part}_native"):
            assert _chain_key(baseline, bf16) == _chain_key(baseline, base)
