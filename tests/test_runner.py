"""Runner: config composition for every pair/ablation, staged pipeline, artifact reuse, outputs."""
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

import kvtransfer.runner.run as run_module
from kvtransfer.runner import Run, artifact_key, calibrate_stage, execute, fit_family, fit_stage, parse_stages
from kvtransfer.runner.fidelity import fidelity
from kvtransfer.core.mapper import load_mapper
from run_configs import compose_config as _compose
from tolerance import FORWARD, assert_close, assert_far, forward_factor

ROOT = Path(__file__).resolve().parents[1]
PAIRS = sorted(p.stem for p in (ROOT / "conf" / "pair").glob("*.yaml"))
ABLATIONS = sorted(p.stem for p in (ROOT / "conf" / "ablation").glob("*.yaml"))
PAPER_K = {"qwen3_14b_32b": 8, "qwen3_8b_32b": 12, "llama31_8b_70b": 20, "ministral3_3b_8b": "all",
           "ministral3_3b_14b": 20, "ministral3_8b_14b": 12}


def test_all_paper_pairs_and_laptop_pairs_exist():
    assert set(PAPER_K) | {"qwen3_0.6b_1.7b", "qwen25coder_0.5b_1.5b", "tiny"} <= set(PAPERS := PAIRS), PAPERS
    assert set(ABLATIONS) == {"full", "no_rerotation", "no_rope", "no_rope_k1", "no_rope_k1_no_ridge"}


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("ablation", ABLATIONS)
def test_config_composes_for_every_pair_and_ablation(pair, ablation):
    cfg = _compose(f"pair={pair}", f"ablation={ablation}")
    run = Run(cfg, "unused")
    assert cfg["pair"]["name"] == pair
    if pair in PAPER_K:
        assert cfg["pair"]["k"] == PAPER_K[pair] and cfg["calib"]["n_sequences"] == 500
        assert cfg["calib"]["seq_len"] == 1024 and cfg["calib"]["stride"] == 4 and cfg["mapper"]["lam"] == 0.01
        assert run.model_ref("source").count("/") == 1  # an HF id
    expected = {"full": ("stripped", True, cfg["pair"]["k"], 0.01), "no_rerotation": ("stripped", False, cfg["pair"]["k"], 0.01),
                "no_rope": ("rotated", True, cfg["pair"]["k"], 0.01), "no_rope_k1": ("rotated", True, 1, 0.01),
                "no_rope_k1_no_ridge": ("rotated", True, 1, 0.0)}[ablation]
    assert (run.key_space, run.rope_at_inference, run.k, run.lam) == expected


def test_reverse_direction_and_local_paths_swap_sides():
    cfg = _compose("pair=qwen3_14b_32b", "pair.direction=reverse", "pair.target.path=/models/q32")
    run = Run(cfg, "unused")
    assert run.model_ref("source") == "/models/q32" and run.model_ref("target") == "Qwen/Qwen3-14B"
    with pytest.raises(ValueError, match="forward or reverse"):
        Run(_compose("pair=tiny", "pair.direction=sideways"), "x").model_ref("source")


def test_stage_parsing():
    assert parse_stages("all") == ["calibrate", "fit", "eval", "bench", "report"]
    assert parse_stages("report,fit") == ["fit", "report"]
    with pytest.raises(ValueError, match="unknown stage"):
        parse_stages("train")


@pytest.fixture(scope="module")
def tiny_pair_dirs(tmp_path_factory):
    """Two small Qwen3 models with a BPE tokenizer trained on the tiny calibration text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import tiny_model

    texts = [json.loads(line)["text"] for line in (ROOT / "data/tiny/calib.jsonl").open()][:100]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=96, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    vocab = len(hf_tok)
    dirs = {}
    for name, layers, hidden in (("small", 2, 32), ("large", 3, 48)):
        model = tiny_model("qwen3", layers=layers, hidden=hidden, heads=hidden // 8, seed=layers)
        model.resize_token_embeddings(vocab, mean_resizing=False)
        model.config.vocab_size = vocab
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        hf_tok.save_pretrained(d)
        dirs[name] = str(d)
    return dirs


def _tiny_cfg(dirs, tmp_path, *extra):
    cfg = _compose("pair=tiny", f"pair.source.path={dirs['small']}", f"pair.target.path={dirs['large']}",
                   "pair.k=2", "calib.n_sequences=24", "calib.seq_len=32", "calib.batch_size=8",
                   "report.variance_k=[1,2,all]", f"cache_dir={tmp_path / 'artifacts'}", "progress=false", *extra)
    return cfg


def test_pipeline_calibrate_fit_report_and_artifact_reuse(tiny_pair_dirs, tmp_path, monkeypatch):
    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[calibrate,fit,report]")
    summary = execute(cfg, tmp_path / "run1")
    # summary schema
    assert summary["pair"] == "tiny" and summary["source"] == tiny_pair_dirs["small"]
    assert summary["mapper"]["kind"] == "ridge" and summary["mapper"]["k"] == 2 and summary["mapper"]["lambda"] == 0.01
    assert len(summary["mapper"]["selected_layers"]) == 3 and all(len(s) == 2 for s in summary["mapper"]["selected_layers"])
    cal = summary["calibration"]
    assert cal["tokens_per_seq"] == 32 and cal["stride"] == 2 and cal["observations"] > 0 and cal["features"] == 16
    for kind in ("k", "v"):
        assert set(summary["r2"][kind]) == {"train", "heldout"}
        assert all(-10 < v <= 1 for v in summary["r2"][kind].values())
    assert [r["k"] for r in summary["variance_explained"]] == [1, 2, "all"]
    assert summary["variance_explained"][0]["k_train"] <= summary["variance_explained"][-1]["k_train"] + 1e-9
    out = tmp_path / "run1"
    on_disk = json.loads((out / "summary.json").read_text())
    ran = json.loads((out / "config.json").read_text())
    assert ran["mapper"]["lam"] == 0.01
    # the default eval.map_dtype=auto is resolved before anything keys on it: float32 on a CPU (device=auto)
    cuda = torch.cuda.is_available()
    assert cfg["eval"]["map_dtype"] == "auto" and ran["eval"]["map_dtype"] == ("bfloat16" if cuda else "float32")
    assert ran["bench"]["mapper_dtypes"] == (["bfloat16", "float32"] if cuda else ["float32"])
    assert on_disk["mapper"] == summary["mapper"]
    for name in ("variance_explained.csv", "variance_explained.md"):
        assert (out / "tables" / name).stat().st_size > 0
    for name in ("r2_heatmap.png", "r2_vs_k.png"):
        assert (out / "figures" / name).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileExistsError, match="already holds a run"):
        execute(cfg, out)

    # a second run with another lambda reuses the moments (no calibration) and fits a new mapper

    def no_calibration(*a, **k):
        raise AssertionError("moments should have been reused")

    monkeypatch.setattr(calibrate_stage, "collect_moments", no_calibration)
    cfg2 = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", "mapper.lam=1.0")
    s2 = execute(cfg2, tmp_path / "run2")
    assert s2["mapper"]["lambda"] == 1.0 and s2["mapper"]["path"] != summary["mapper"]["path"]
    # the same config again reuses the mapper too
    fitted = []
    monkeypatch.setattr(fit_stage, "fit_ridge", lambda *a, **k: fitted.append(1))
    s3 = execute(cfg2, tmp_path / "run3")
    assert not fitted and s3["mapper"]["path"] == s2["mapper"]["path"]


def test_artifact_keys_follow_the_config(tiny_pair_dirs, tmp_path):
    base = Run(_tiny_cfg(tiny_pair_dirs, tmp_path), "x")
    lam = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, "mapper.lam=0.5"), "x")
    rot = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, "ablation=no_rope"), "x")
    assert base.moments_dir("stripped") == lam.moments_dir("stripped") and base.mapper_dir() != lam.mapper_dir()
    assert rot.moments_dir(rot.key_space) != base.moments_dir(base.key_space)
    assert artifact_key({"a": 1, "b": 2}) == artifact_key({"b": 2, "a": 1})
    # eval.native_tail changes the keys of what reads the tail: the mapped results and native_injected (a split mode,
    # issue 32), never the other baselines
    from kvtransfer.runner.eval_stage import result_dirs

    tail = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, "eval.native_tail=8"), "x")
    assert result_dirs(tail)["baseline"] == result_dirs(base)["baseline"]
    assert result_dirs(tail)["mapped"] != result_dirs(base)["mapped"]
    assert result_dirs(tail)["native"] != result_dirs(base)["native"]
    # whether perplexity runs selects what is computed, not how: a tasks-only run reads the full run's files,
    # while a perplexity setting that changes the numbers still changes both keys
    no_ppl = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, "eval.ppl.enabled=false"), "x")
    windows = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, "eval.ppl.windows=3"), "x")
    assert all(result_dirs(no_ppl, part) == result_dirs(base, part) for part in ("tasks", "ppl", "coqa"))
    assert all(result_dirs(windows, "ppl")[k] != result_dirs(base, "ppl")[k] for k in ("baseline", "mapped"))
    assert result_dirs(windows, "tasks") == result_dirs(base, "tasks")  # no task reads the perplexity windows


def test_calibration_artifact_layout_is_part_of_the_moments_key(tiny_pair_dirs, tmp_path, monkeypatch):
    """Issue 10 §2 changed the calibration artifact (held-out raw features; a piece-wise tensor directory):
    an artifact of another layout sits under another key, so it is never read as this one."""

    run = Run(_tiny_cfg(tiny_pair_dirs, tmp_path), "x")
    now = run.moments_dir("stripped")
    assert run_module.MOMENTS_FORMAT == 3
    monkeypatch.setattr(run_module, "MOMENTS_FORMAT", 2)
    assert Run(_tiny_cfg(tiny_pair_dirs, tmp_path), "x").moments_dir("stripped") != now
    other = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, "calib.heldout_observations=64"), "x")
    monkeypatch.setattr(run_module, "MOMENTS_FORMAT", 3)
    assert other.moments_dir("stripped") != now


def test_device_accumulation_through_the_pipeline(tiny_pair_dirs, tmp_path):
    """calib.accumulate=device + float32 calibrates into calibration/ (the finished checkpoint) and fits."""
    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "calib.accumulate=device", "calib.dtype=float32", "stage=fit")
    summary = execute(cfg, tmp_path / "run")
    run = Run(cfg, tmp_path / "run")
    directory = run.moments_dir("stripped")
    assert (directory / "calibration" / "manifest.json").exists() and not (directory / "features").exists()
    train, held, info = run.moments()
    assert train.wide and train.stats["k"]["cxx"].dtype == torch.float32 and held.n == info["heldout_observations"]
    assert all(-10 < v <= 1 for kind in ("k", "v") for v in summary["r2"][kind].values())


def test_ridge_fit_loads_no_model_and_keeps_the_pair_identity(tiny_pair_dirs, tmp_path, monkeypatch):
    """Issue 10 §2: the ridge fit needs the moments only; the mapper's identity (model id, config hash,
    geometry, RoPE type) comes from the configs and equals the loaded models' identity."""
    from kvtransfer.core.models import load_model, model_identity

    execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=calibrate"), tmp_path / "cal")

    def no_load(*a, **k):
        raise AssertionError("the ridge fit loaded a model")

    monkeypatch.setattr(run_module, "load_model", no_load)
    execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit"), tmp_path / "fit")
    mapper = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit"), "x").mapper()
    assert mapper.source == model_identity(load_model(tiny_pair_dirs["small"])[0])
    assert mapper.target == model_identity(load_model(tiny_pair_dirs["large"])[0])


def test_moments_are_read_only_where_needed_and_released(tiny_pair_dirs, tmp_path, monkeypatch):
    """Issue 10 §2: a calibrate-only run reads no moments back; the report's rotated-key calibration does not
    sit next to the stripped moments; nothing holds them after the run's last stage that needs them."""

    reads, held_at_calibration = [], {}
    real_load, real_cal = run_module.load_calibration, calibrate_stage.calibrate
    monkeypatch.setattr(run_module, "load_calibration", lambda d, **k: reads.append(d) or real_load(d, **k))

    def spy(self, directory, key_space):
        held_at_calibration[key_space] = [k for k in self._memo if k.startswith("moments/")]
        return real_cal(self, directory, key_space)

    monkeypatch.setattr(calibrate_stage, "calibrate", spy)
    execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=calibrate"), tmp_path / "cal")
    assert reads == [] and held_at_calibration == {"stripped": []}
    released = []
    real_release = Run.release_moments
    monkeypatch.setattr(Run, "release_moments", lambda self: released.append(
        [k for k in self._memo if k.startswith("moments/")]) or real_release(self))
    execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[fit,report]", "report.rotated_heatmap=true"), tmp_path / "rep")
    assert held_at_calibration["rotated"] == []   # the stripped moments were released first
    assert released[0] == ["moments/stripped"] and released[1] == ["moments/rotated"]


def test_mlp_mapper_through_the_pipeline(tiny_pair_dirs, tmp_path):
    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "mapper=mlp", "mapper.hidden=32", "mapper.epochs=2",
                    "calib.mlp_samples=256", "stage=fit")
    summary = execute(cfg, tmp_path / "mlp")
    assert summary["mapper"]["kind"] == "mlp" and summary["mapper"]["n_parameters"] > 0
    assert set(summary["r2"]["k"]) == {"train"}


def test_trained_mapper_through_the_pipeline(tiny_pair_dirs, tmp_path):
    """mapper=trained (issue 23 §1): fit + transfer through the runner; the artifact round-trips through
    load_mapper with the ridge map's shapes and cost; its stop split is disjoint from the fidelity held-out split."""
    from kvtransfer.core.mapper import TrainedMapper

    knobs = ("mapper=trained", "pair.k=2", "mapper.train_sequences=6", "mapper.stop_sequences=3",
             "mapper.query_positions=8", "mapper.steps=4", "mapper.eval_every=2", "mapper.batch_sequences=3",
             "mapper.native_sink=1")
    fid = ("stage=[fit,eval]", "eval.tasks=[]", "eval.ppl.enabled=false", "eval.coqa.enabled=false",
           "eval.fidelity.sequences=2", "eval.fidelity.continuation=8")
    summary = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, *knobs, *fid), tmp_path / "trained")
    ridge = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", "mapper.native_sink=1"), tmp_path / "ridge")
    m = summary["mapper"]
    assert m["kind"] == "trained" and m["path"] != ridge["mapper"]["path"]
    assert m["apply_flops_per_token"] == ridge["mapper"]["apply_flops_per_token"]
    assert m["n_parameters"] == ridge["mapper"]["n_parameters"] and m["fit_seconds"] is not None
    mapper = load_mapper(m["path"])
    assert type(mapper) is TrainedMapper and mapper.native_sink == 1
    training = mapper.training
    assert training == m["training"] and len(training["layers"]) == 3
    fit, stop, held = set(training["fit_index"]), set(training["stop_index"]), set(summary["fidelity"]["heldout_index"])
    assert len(fit) == 6 and len(stop) == 3 and held and not (fit | stop) & set(training["heldout_index"])
    assert not fit & stop and not (fit | stop) & held  # the stop split is not the split fidelity is reported on
    for r in training["layers"]:
        assert r["stop_loss_final"] <= r["stop_loss_ridge"] and r["steps"] <= 4
        assert r["layer"] in training["layers_worse_than_ridge"] or r["stop_loss_trained"] <= r["stop_loss_ridge"]
    assert training["collect_bytes"] == training["collect_bytes_formula"]
    assert set(summary["r2"]["k"]) == {"train", "heldout"}  # recomputed for the trained weights (_refit_r2)
    assert summary["fidelity"]["native_sink"] == 1 and len(summary["fidelity"]["per_layer"]["attn_cosine"]) == 3


def test_a_trained_map_of_zero_steps_is_the_ridge_map(tiny_pair_dirs, tmp_path):
    trained = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", "mapper=trained", "pair.k=2", "mapper.steps=0",
                                "mapper.train_sequences=4", "mapper.stop_sequences=2", "mapper.query_positions=4"),
                      tmp_path / "trained")
    ridge = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit"), tmp_path / "ridge")
    t, r = load_mapper(trained["mapper"]["path"]), load_mapper(ridge["mapper"]["path"])
    assert torch.equal(t.weight, r.weight) and torch.equal(t.bias, r.bias)
    assert not t.training["layers_worse_than_ridge"] and all(x["steps"] == 0 for x in t.training["layers"])
    # R² recomputed from the stored float32 weights vs the ridge fit's float64 ones: the weights differ by float32
    # rounding (eps32 relative), which moves SSE / SST by a few eps32 x the condition of the fit (features p = 32)
    for kind in ("k", "v"):
        for split in ("train", "heldout"):
            assert_close(trained["r2"][kind][split], ridge["r2"][kind][split], dtype=torch.float32, factor=4 * 32,
                         magnitude=1.0, reason="R² of float32-rounded ridge weights, p = 32 features")


@pytest.mark.parametrize("objective", ["layer_local", "end_to_end"])
def test_a_list_of_learning_rates_is_chosen_on_the_stop_split(tiny_pair_dirs, tmp_path, objective):
    """mapper.lr=[a,b] through the runner: each layer (end_to_end: the joint map) keeps the rate of the lowest
    stop-split loss, the artifact records every rate's loss, and a list is refused for a map that takes one."""
    knobs = ("mapper=trained", f"mapper.objective={objective}", "pair.k=2", "mapper.train_sequences=6",
             "mapper.stop_sequences=3", "mapper.query_positions=8", "mapper.continuation_tokens=8", "mapper.steps=4",
             "mapper.eval_every=2", "mapper.batch_sequences=3", "stage=fit")
    summary = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, *knobs, "mapper.lr=[1e-6,3e-3]"), tmp_path / "lrs")
    t = load_mapper(summary["mapper"]["path"]).training
    assert t["settings"]["lr"] == [1e-6, 3e-3]
    key = "stop_loss_final" if objective == "layer_local" else "stop_kl_final"
    for r in t["layers"] if objective == "layer_local" else [t]:
        assert [x["lr"] for x in r["by_lr"]] == [1e-6, 3e-3]
        best = min(r["by_lr"], key=lambda x: x[key])  # the first listed on a tie, as min() picks
        assert r["lr"] == best["lr"] and r[key] == best[key]
    with pytest.raises(ValueError, match="only mapper=trained"):
        execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "mapper=mlp", "mapper.lr=[1e-3,1e-2]", "stage=fit"), tmp_path / "mlp")


def test_an_end_to_end_trained_map_through_the_pipeline(tiny_pair_dirs, tmp_path):
    """mapper=trained mapper.objective=end_to_end (issue 23 §1) on two different models: fit through the runner,
    saved, read back by load_mapper, applied by transfer (fidelity, and directly); its stop split is disjoint from
    the held-out split fidelity reports on; the record holds every step's and evaluation's KL."""
    from transformers import AutoModelForCausalLM

    from kvtransfer.core.cache import prefill
    from kvtransfer.core.mapper import TrainedMapper
    from kvtransfer.core.transfer import transfer

    knobs = ("mapper=trained", "mapper.objective=end_to_end", "pair.k=2", "mapper.train_sequences=6",
             "mapper.stop_sequences=3", "mapper.continuation_tokens=8", "mapper.steps=4", "mapper.eval_every=2",
             "mapper.batch_sequences=3", "mapper.lr=1e-3", "mapper.native_sink=1")
    fid = ("stage=[fit,eval]", "eval.tasks=[]", "eval.ppl.enabled=false", "eval.coqa.enabled=false",
           "eval.fidelity.sequences=2", "eval.fidelity.continuation=8")
    summary = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, *knobs, *fid), tmp_path / "e2e")
    ridge = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", "mapper.native_sink=1"), tmp_path / "ridge")
    m = summary["mapper"]
    assert m["kind"] == "trained" and m["path"] != ridge["mapper"]["path"]
    assert m["apply_flops_per_token"] == ridge["mapper"]["apply_flops_per_token"]
    mapper, start = load_mapper(m["path"]), load_mapper(ridge["mapper"]["path"])
    assert type(mapper) is TrainedMapper and mapper.native_sink == 1
    t = mapper.training
    assert t == m["training"] and t["objective"] == "end_to_end"
    assert (t["context_tokens"], t["continuation_tokens"]) == (32 - 8, 8)  # calib.seq_len = 32
    fit, stop, held = set(t["fit_index"]), set(t["stop_index"]), set(summary["fidelity"]["heldout_index"])
    assert len(fit) == 6 and len(stop) == 3 and held and not fit & stop and not (fit | stop) & held
    assert t["collect_bytes"] == t["collect_bytes_formula"] and t["step_flops_formula"] > 0
    assert len(t["train_kl"]) == t["steps"] <= 4 and [e["step"] for e in t["evaluations"]] == [2, 4][:len(t["evaluations"])]
    assert t["stop_kl_final"] <= t["stop_kl_start"]
    assert t["worse_than_ridge"] == (t["stop_kl_trained"] is None or t["stop_kl_trained"] > t["stop_kl_start"])
    if t["kept_start"]:  # the ridge start, bit for bit
        assert torch.equal(mapper.weight, start.weight) and torch.equal(mapper.bias, start.bias)
    else:
        assert not torch.equal(mapper.weight, start.weight)
    assert math.isfinite(summary["fidelity"]["per_layer"]["kl"])
    source = AutoModelForCausalLM.from_pretrained(tiny_pair_dirs["small"], dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dirs["large"], dtype=torch.float32).eval()
    ids = torch.randint(1, source.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = transfer(prefill(source, ids), load_mapper(m["path"], source, target), source, target, input_ids=ids)
    assert cache.get_seq_length() == 12


def test_the_map_carries_its_native_sink(tiny_pair_dirs, tmp_path):
    # mapper.native_sink is fitted into the artifact; evaluating it with another sink is refused with the fix
    base = ("stage=[fit,eval]", "eval.tasks=[tiny_cloze]", "eval.limit=3", "eval.ppl.enabled=false",
            "eval.coqa.enabled=false", "eval.bootstrap=10", "eval.fidelity.enabled=false", "eval.modes=[transfer]")
    summary = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, *base, "mapper.native_sink=2"), tmp_path / "a")
    assert summary["mapper"]["native_sink"] == 2
    mapper = load_mapper(summary["mapper"]["path"])
    assert mapper.native_sink == 2
    with pytest.raises(ValueError, match="set mapper.native_sink=1"):
        execute(_tiny_cfg(tiny_pair_dirs, tmp_path, *base, "mapper.native_sink=2", "eval.native_sink=1"),
                tmp_path / "b")


def test_map_families_through_the_pipeline(tiny_pair_dirs, tmp_path):
    # head-local + reduced rank + attention metric: a factored artifact with its cost in the summary, and
    # the paper's map keeps its artifact key (families at their defaults do not enter it)
    paper = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit"), tmp_path / "paper")
    explicit = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", "mapper.support=full", "mapper.rank=null",
                                 "mapper.weighting=none", "mapper.native_sink=0"), tmp_path / "explicit")
    assert paper["mapper"]["path"] == explicit["mapper"]["path"] and paper["mapper"]["kind"] == "ridge"
    fam = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", "mapper.support=head_local", "mapper.rank=2",
                            "mapper.weighting=attention", "mapper.metric_sequences=4"), tmp_path / "fam")
    m = fam["mapper"]
    assert m["kind"] == "factored" and (m["support"], m["rank"], m["weighting"]) == ("head_local", 2, "attention")
    assert m["apply_flops_per_token"] < paper["mapper"]["apply_flops_per_token"] / 2
    assert m["n_parameters"] < paper["mapper"]["n_parameters"] and m["fit_seconds"] is not None
    assert fam["r2"]["k"]["train"] < paper["r2"]["k"]["train"]  # fewer features, lower rank: a worse in-sample fit


def test_attention_mass_weighting_through_the_pipeline(tiny_pair_dirs, tmp_path):
    """weighting=attention_mass: every weighted row is the (sequence, position) the sampler says it is (its
    features are the target's at that token), its weight is the target's attention mass there, the sink
    rows weigh nothing, and the fit is another map than the unweighted one."""
    from kvtransfer.core.calibrate import kv_features, split_heldout
    from kvtransfer.maps.families import attention_mass

    extra = ("calib.mlp_samples=100", "mapper.native_sink=1")  # ~100 of the 22 x 16 train rows: a real subsample
    with pytest.raises(ValueError, match="set calib.mlp_samples"):  # refused before anything calibrates
        execute(_tiny_cfg(tiny_pair_dirs, tmp_path / "bare", "stage=fit", "calib.mlp_samples=0",
                          "mapper.weighting=attention_mass"), tmp_path / "none")
    assert not (tmp_path / "bare" / "artifacts").exists()
    run = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", "mapper.weighting=attention_mass", *extra), "x")
    run.moments()
    sample, weights = fit_family.observation_weights(run)
    n = sample["xk"].shape[0]
    assert weights.shape == (n, 3) and 100 <= n < 352  # ceil(100 / 3 batches) per batch
    ids = run.token_ids()
    train_idx, _ = split_heldout(ids.shape[0], run.cfg["calib"]["heldout_fraction"], 0)
    target = run.model("target")[0]
    feats = kv_features(target, ids[train_idx], stride=2)["k"].view(len(train_idx), 16, -1)
    mass = attention_mass(target, ids[train_idx], torch.arange(0, 32, 2))
    found = 0
    for row in range(n):  # locate each kept row among all train tokens: its features pin down (sequence, position)
        hit = (feats - sample["yk"][row]).abs().amax(-1) < 1e-5
        # sequences that share a prefix share its rows: every match must be at one position, and the weight
        # must be the mass of one of the matching sequences (their later tokens, and so the mass, differ)
        hits = hit.nonzero().tolist()
        assert hits and len({p for _, p in hits}) == 1
        pos = hits[0][1]
        expect = [torch.zeros(3) if pos == 0 else mass[seq, :, pos] for seq, _ in hits]
        nearest = min(expect, key=lambda e: float((weights[row] - e).abs().max()))
        assert_close(weights[row], nearest, factor=forward_factor(target, 32), magnitude=1.0, reason=(
            FORWARD + "; attention masses are <= 1, from batches of other shapes"))
        found += pos > 0
    assert 0 < found < n  # sink rows (weight 0) and others both in the sample
    fam = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", "mapper.weighting=attention_mass", *extra),
                  tmp_path / "mass")
    plain = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "stage=fit", *extra), tmp_path / "plain")
    m = fam["mapper"]
    assert m["kind"] == "factored" and m["weighting"] == "attention_mass" and m["rank"] is None
    assert m["path"] != plain["mapper"]["path"] and fam["r2"]["k"]["train"] != plain["r2"]["k"]["train"]
    assert load_mapper(m["path"]).calibration["weighted_rows"] == n


def test_feature_sample_after_a_calibration_that_kept_none(tiny_pair_dirs, tmp_path, monkeypatch):
    """Moments calibrated with calib.mlp_samples=0 (the paper's ridge default: at 14B -> 32B a 65,536-row sample
    is 52 GiB) serve a later MLP / attention_mass run: a sample-only pass keeps exactly the rows a calibration
    with that mlp_samples keeps, without calibrating again."""
    from kvtransfer.core.io import load_tensors

    execute(_tiny_cfg(tiny_pair_dirs, tmp_path / "a", "stage=[calibrate,fit]", "calib.mlp_samples=0"), tmp_path / "r0")
    direct = Run(_tiny_cfg(tiny_pair_dirs, tmp_path / "b", "calib.mlp_samples=100"), "x")
    direct.moments()  # a calibration that keeps the sample itself
    reference = load_tensors(calibrate_stage.feature_sample_path(direct))[0]
    later = Run(_tiny_cfg(tiny_pair_dirs, tmp_path / "a", "calib.mlp_samples=100"), "x")
    assert not (later.moments_dir("stripped") / "mlp_sample.safetensors").exists()
    monkeypatch.setattr(calibrate_stage, "collect_moments", lambda *a, **k: pytest.fail("calibrated again"))
    path = calibrate_stage.feature_sample_path(later)
    assert path.name == f"feature_sample_{later.key('feature_sample')}.safetensors"
    got = load_tensors(path)[0]
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)
    # and a fit that reads it runs on those moments
    fam = execute(_tiny_cfg(tiny_pair_dirs, tmp_path / "a", "stage=fit", "calib.mlp_samples=100",
                            "mapper.weighting=attention_mass"), tmp_path / "r1")
    assert fam["mapper"]["weighting"] == "attention_mass"


def test_one_calibration_serves_ridge_and_mlp(tiny_pair_dirs, tmp_path):
    # the feature sample is kept whenever calib.mlp_samples > 0, not only when the run fits an MLP:
    # a ridge run's calibration must let a later MLP run fit without calibrating again
    ridge = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "calib.mlp_samples=256", "stage=[calibrate,fit]"),
                    tmp_path / "ridge")
    assert ridge["mapper"]["kind"] == "ridge"
    calibrated = []
    monkey = calibrate_stage.calibrate
    calibrate_stage.calibrate = lambda self, d, k: calibrated.append(k) or monkey(self, d, k)
    try:
        mlp = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, "mapper=mlp", "mapper.hidden=32", "mapper.epochs=1",
                                "calib.mlp_samples=256", "stage=fit"), tmp_path / "mlp")
    finally:
        calibrate_stage.calibrate = monkey
    assert calibrated == [] and mlp["mapper"]["kind"] == "mlp"
    env = mlp["environment"]
    assert len(env["commit"]) == 40 and isinstance(env["dirty"], bool)  # the checkout that produced the numbers


def test_eval_stage_on_the_tiny_suite(tiny_pair_dirs, tmp_path):
    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[eval,report]", "eval.limit=6", "eval.max_gen_toks=4",
                    "eval.ppl.prefixes=[0,16,48]", "eval.ppl.continuation=16", "eval.ppl.windows=3",
                    "eval.coqa.conversations=2", "eval.coqa.turns=3", "eval.coqa.max_gen_toks=4",
                    "eval.bootstrap=50", "report.rotated_heatmap=false")
    summary = execute(cfg, tmp_path / "eval")
    tasks = summary["tasks"]
    assert set(tasks) == {"tiny_cloze", "tiny_completion"}
    for row in tasks.values():
        assert row["n"] == 6
        assert {"target", "transfer", "source", "native_injected", "no_context", "gap_closed", "retention",
                "gap_closed_vs_source", "retention_vs_chance"} <= set(row)
        assert row["native_injected"] == row["target"]  # the built-in control
    assert tasks["tiny_cloze"]["metric"] == "acc_norm" and tasks["tiny_cloze"]["chance"] == 0.25
    ppl = {r["prefix"]: r for r in summary["ppl"]}
    assert set(ppl) == {0, 16, 48}
    # at P=0 nothing is transferred; with a prefix the mapped cache is used, native_injected == target
    ppl_factor = forward_factor(AutoConfig.from_pretrained(tiny_pair_dirs["large"]), 64)
    ppl_reason = ("ppl = exp(mean NLL): relative error = the NLL's absolute error, a float32 forward's (FORWARD) "
                  "on log-probs up to log(vocab 96) < 5")
    assert_close(ppl[0]["transfer"], ppl[0]["target"], dtype=torch.float32, factor=ppl_factor,
                 magnitude=5 * ppl[0]["target"], reason=ppl_reason)
    for p in (16, 48):
        assert_close(ppl[p]["native_injected"], ppl[p]["target"], dtype=torch.float32, factor=ppl_factor,
                     magnitude=5 * ppl[p]["target"], reason=ppl_reason)
        assert_far(ppl[p]["transfer"], ppl[p]["target"], atol=1e-4 * ppl[p]["target"], reason=(
            "a fitted map on 2-layer -> 3-layer models moves perplexity by percents, not 1e-4"))
        # per-window NLLs give the gap closed on log-perplexity (the same number as from the perplexities) and its SE
        ln_none, ln_transfer, ln_target = (math.log(ppl[p][m]) for m in ("no_context", "transfer", "target"))
        want = (ln_none - ln_transfer) / (ln_none - ln_target)
        # each difference of logs loses (|a| + |b|) / |a - b| of its relative precision to cancellation
        condition = ((abs(ln_none) + abs(ln_transfer)) / abs(ln_none - ln_transfer)
                     + (abs(ln_none) + abs(ln_target)) / abs(ln_none - ln_target))
        assert_close(ppl[p]["transfer_gap_closed"], want, factor=10 * 40, magnitude=(abs(want) + 1) * condition,
                     reason=("per-window NLL means and a quotient of their differences vs logs of the summary's "
                             "perplexities, float64: ~40 roundings, x10 few ops, x the cancellation of the two "
                             "differences"))
        assert ppl[p]["transfer_gap_closed_se"] > 0
    assert "transfer_gap_closed" not in ppl[0]
    fid = summary["fidelity"]
    assert fid["continuation"] == 16 and fid["prefix"] == 16
    assert set(fid["per_position"]) == {"pos0", "pos1-3", "rest", "all"}
    for group in fid["per_position"].values():
        assert 0 <= group["key_rel_err"] and -1 <= group["attn_cosine"] <= 1 and group["kl"] >= -1e-6
    assert len(fid["per_layer"]["attn_cosine"]) == 3
    turns = {(r["series"], r["turn"]) for r in summary["drift"]}
    assert ("transfer (once)", 3) in turns and ("target (every_turn)", 1) in turns
    for row in summary["drift_summary"]:  # pooled over turns = the per-turn means weighted by conversations
        per_turn = [r for r in summary["drift"] if r["protocol"] == row["protocol"] and r["series"].startswith("transfer")]
        assert row["turns"] == sum(r["n"] for r in per_turn) and row["conversations"] == 2
        assert_close(row["transfer_f1"], sum(r["f1"] * r["n"] for r in per_turn) / row["turns"], factor=10 * 12,
                     magnitude=1.0, reason="pooled F1 (<= 1) two ways over 6 turns, float64: ~12 roundings, x10 few ops")
    out = tmp_path / "eval"
    assert (out / "tables" / "retention.md").exists() and (out / "tables" / "ppl.csv").exists()
    assert (out / "figures" / "retention.png").exists() and (out / "figures" / "drift.png").exists()
    assert (out / "figures" / "fidelity.png").exists() and (out / "tables" / "fidelity_positions.md").exists()
    assert "no_context" in (out / "tables" / "tasks.csv").read_text().splitlines()[0]
    # the per-item / per-window scores behind the summary are written next to it, and reproduce its numbers
    scores = json.loads((out / summary["scores_file"]).read_text())
    assert summary["schema_version"] == 2 and summary["environment"]["config_sha256"]
    for task, row in tasks.items():
        assert float(__import__("numpy").mean(scores["tasks"][task]["transfer"])) == row["transfer"]  # same kernel
    assert sorted(scores["ppl_window_nll"]) == ["0", "16", "48"] and len(scores["ppl_window_nll"]["16"]["target"]) == 3
    assert len(scores["coqa"]["once"]["transfer"]) == 2
    # cached per mode: a rerun with the same config evaluates nothing
    import kvtransfer.runner.eval_stage as stage

    def no_eval(*a, **k):
        raise AssertionError("eval results should have been reused")

    original = stage._benchmarks
    stage._benchmarks = no_eval
    try:
        again = execute(cfg, tmp_path / "eval2")
    finally:
        stage._benchmarks = original
    assert again["tasks"] == summary["tasks"]


def test_bench_stage_times_the_run_models(tiny_pair_dirs, tmp_path):
    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[bench,report]", "bench.tokens=[16,64]", "bench.warmup=1",
                    "bench.repeats=3", "report.rotated_heatmap=false", "report.variance_k=[1]")
    summary = execute(cfg, tmp_path / "bench")
    rows = summary["speed"]
    assert [r["tokens"] for r in rows] == [16, 64]
    for r in rows:
        assert r["mapper_ms_min"] <= r["mapper_ms"] <= r["mapper_ms_max"] and r["prefill_ms"] > 0
        assert r["speedup"] == r["prefill_ms"] / r["mapper_ms"]  # the same float64 expression: bit for bit
        assert r["mapper_floor_ms"] > 0 and r["flop_ratio"] > 0
    assert (tmp_path / "bench" / "tables" / "speed.md").exists()
    assert (tmp_path / "bench" / "figures" / "speedup.png").exists()


def test_sweep_collection_writes_one_table(tmp_path):
    from kvtransfer.report.sweep import collect

    # the second job's name holds a path override, which nests its directory (Hydra keeps the slashes)
    for i, (k, ret) in enumerate(((1, 0.5), (4, 0.9))):
        run = tmp_path / (f"{i}_mapper.k={k}" if i == 0 else f"{i}_cache_dir=/x/y,mapper.k={k}")
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({
            "pair": "tiny", "ablation": {"name": "full"}, "mapper": {"kind": "ridge", "k": k, "lambda": 0.01},
            "r2": {"k": {"train": 0.8, "heldout": 0.7}},
            "tasks": {"tiny_cloze": {"target": 0.4, "transfer": 0.4 * ret, "retention": ret, "retention_vs_chance": ret}}}))
    paths = collect(tmp_path)
    assert {"sweep.csv", "sweep.md", "sweep_retention.md", "sweep_ablation.md"} <= set(paths)
    import pandas as pd

    sweep = pd.read_csv(tmp_path / "sweep.csv")
    assert list(sweep["k"]) == [1, 4] and list(sweep["tiny_cloze_retention"]) == [0.5, 0.9]
    assert list(sweep["run"]) == ["0_mapper.k=1", "1_cache_dir=/x/y,mapper.k=4"]


def test_k_sweep_and_sink_change_compute_baselines_once(tiny_pair_dirs, tmp_path, monkeypatch):
    """A 3-value k sweep plus a native_sink change: target/source/native_injected/no_context are
    computed once; only `transfer` is recomputed per mapper / sink (issue: sweeps pay once)."""
    import kvtransfer.runner.eval_stage as stage

    computed: list[str] = []
    target_forwards = []
    real_evaluate = stage.evaluate
    monkeypatch.setattr(stage, "evaluate", lambda run: real_evaluate(run, on_compute=computed.append))
    base = ("stage=[eval]", "eval.limit=4", "eval.max_gen_toks=2", "eval.ppl.prefixes=[0,16]",
            "eval.ppl.continuation=8", "eval.ppl.windows=2", "eval.coqa.enabled=false", "eval.bootstrap=20",
            "eval.fidelity.enabled=false")
    summaries = []
    for i, extra in enumerate(("pair.k=1", "pair.k=2", "pair.k=all", "pair.k=2 mapper.native_sink=1",
                               "pair.k=2 mapper.native_sink=1 eval.native_tail=6")):
        cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, *base, *extra.split())
        if i == 0:  # count the target's forward passes from the second run on
            summaries.append(execute(cfg, tmp_path / f"s{i}"))
            run = stage.KVTransferLM
            orig = run.prefix_cache

            def counting(self, prefixes, _orig=orig):
                if self.mode in ("target", "native_injected", "no_context"):
                    target_forwards.append(self.mode)
                return _orig(self, prefixes)

            monkeypatch.setattr(run, "prefix_cache", counting)
            continue
        summaries.append(execute(cfg, tmp_path / f"s{i}"))
    assert [s["mapper"]["native_sink"] for s in summaries] == [0, 0, 0, 1, 1]
    assert [s["native_tail"] for s in summaries] == [1, 1, 1, 1, 6]
    modes = ["target", "source", "transfer", "native_injected", "no_context"]
    mapped_controls = ["transfer_wrong", "mean_map", "random_map"]
    # the content controls: target_wrong is a baseline, computed once; the mapped ones follow the map; native_injected
    # follows eval.native_tail (the last run's 6-token tail is computed, not read from the 1-token run's files)
    assert computed == (modes + ["target_wrong", *mapped_controls] + ["transfer", *mapped_controls] * 3
                        + ["transfer", "native_injected", *mapped_controls]), computed
    assert set(target_forwards) <= {"native_injected"}  # no other baseline forward after the first run
    for s in summaries[1:]:
        for task, row in s["tasks"].items():
            assert row["target"] == summaries[0]["tasks"][task]["target"]
            assert row["no_context"] == summaries[0]["tasks"][task]["no_context"]
    # the mapped mode really changed with k (else the sweep would prove nothing)
    ppl = [{r["prefix"]: r["transfer"] for r in s["ppl"]}[16] for s in summaries]
    assert len({round(p, 6) for p in ppl}) >= 3, ppl
    assert round(ppl[-1], 6) != round(ppl[-2], 6)  # the 6-token native tail changed what the target read


def test_concurrent_jobs_calibrate_once(tmp_path, monkeypatch):
    # two jobs of one sweep reach the same calibration together: the second waits on the lock, then
    # finds the first one's artifact instead of calibrating into the same directory again
    import threading
    import time as _time

    calls = []

    def fake_locked(self, directory, key_space):
        calls.append(threading.current_thread().name)
        _time.sleep(0.3)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "calibration.json").write_text("{}")

    monkeypatch.setattr(calibrate_stage, "_calibrate_locked", fake_locked)
    run = Run.__new__(Run)
    run.cache_dir, run.cfg = tmp_path, {"calib": {}}
    directory = tmp_path / "moments" / "abc"
    jobs = [threading.Thread(target=calibrate_stage.calibrate, args=(run, directory, "stripped"), name=f"job{i}") for i in range(2)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    assert len(calls) == 1 and (directory / "calibration.json").exists()


def test_concurrent_jobs_fit_a_shared_mapper_once(tmp_path, monkeypatch):
    """Issue 32: sweep jobs sharing a mapper key used to all fit it, the losers dying in `save` with
    FileExistsError after a full fit; the fit is locked as calibration is, and the file is read once per run."""
    import threading
    import time as _time

    calls, loads = [], []
    directory = tmp_path / "mappers" / "abc"

    def fake_fit(self, d):
        calls.append(threading.current_thread().name)
        _time.sleep(0.3)
        d.mkdir(parents=True, exist_ok=False)  # a second fit into the same directory fails, as save does
        (d / "mapper.json").write_text("{}")

    monkeypatch.setattr(fit_stage, "fit", fake_fit)
    monkeypatch.setattr(Run, "mapper_dir", lambda self: directory)
    monkeypatch.setattr(run_module, "load_mapper", lambda d: loads.append(d) or {"loaded": str(d)})
    runs = []
    for _ in range(2):
        run = Run.__new__(Run)
        run.cache_dir, run._memo, run.producers = tmp_path, {}, {}
        runs.append(run)
    errors = []
    jobs = [threading.Thread(target=lambda r=r: errors.append(None) if r.mapper() else None, name=f"job{i}")
            for i, r in enumerate(runs)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    assert len(calls) == 1 and len(errors) == 2 and (directory / "mapper.json").exists()
    first = runs[0].mapper()
    assert first == {"loaded": str(directory)} and first is not runs[0].mapper()  # a fresh copy each call
    assert len(loads) == 2  # one read per run, not per call


def test_switching_coqa_on_reuses_every_task_and_perplexity_result(tiny_pair_dirs, tmp_path, monkeypatch):
    import kvtransfer.runner.eval_stage as stage

    computed: list[tuple[str, str]] = []
    real_write = stage.atomic_write_json
    monkeypatch.setattr(stage, "atomic_write_json", lambda path, obj: computed.append(Path(path).name) or
                        real_write(path, obj))
    base = ("stage=[eval]", "eval.limit=3", "eval.max_gen_toks=2", "eval.ppl.prefixes=[0,16]",
            "eval.ppl.continuation=8", "eval.ppl.windows=2", "eval.bootstrap=20", "eval.fidelity.enabled=false",
            "eval.coqa.conversations=1", "eval.coqa.turns=2", "eval.coqa.max_gen_toks=2")
    first = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, *base, "eval.coqa.enabled=false"), tmp_path / "a")
    assert computed and not any("coqa" in name for name in computed)
    computed.clear()
    second = execute(_tiny_cfg(tiny_pair_dirs, tmp_path, *base, "eval.coqa.enabled=true"), tmp_path / "b")
    assert sorted(computed) == ["target.coqa.json", "transfer.coqa.json"], computed
    assert second["tasks"] == first["tasks"] and second["ppl"] == first["ppl"] and "drift" in second


def _locate(rows: torch.Tensor, tokens: torch.Tensor) -> list[set[tuple[int, int]]]:
    """For each feature row, the (sequence, position) whose token in tokens [n_seq, positions, D] has that exact
    row (sequences that share a prefix share its rows, so a row can sit in several)."""
    hits = []
    for row in rows:
        close = (tokens - row.to(tokens.dtype)).abs().amax(-1) < 1e-4  # batching moves float32 features ~1e-6
        hits.append({(int(s), int(p)) for s, p in close.nonzero().tolist()})
    return hits


def test_each_seed_calibrates_on_its_own_split(tiny_pair_dirs, tmp_path):
    """Issue 20: seed=0, seed=1, then seed=0 again on one cache. Each run's held-out rows come from its own
    held-out sequences, its feature-sample rows from its own train sequences with the attention mass of that
    very token as weight, and its fidelity from its own held-out sequences; the seeds share no calibration.
    (Before the seed was keyed, seed 1 reused seed 0's calibration and re-drew the split over it.)"""
    from kvtransfer.core.calibrate import kv_features, split_heldout, subsample_positions
    from kvtransfer.maps.families import attention_mass

    extra = ("calib.mlp_samples=100", "calib.heldout_fraction=0.25", "mapper.weighting=attention_mass",
             "eval.fidelity.sequences=2")
    dirs = {}
    for seed in (0, 1, 0):
        run = Run(_tiny_cfg(tiny_pair_dirs, tmp_path, f"seed={seed}", *extra), "x")
        _, heldout, _ = run.moments()
        ids = run.token_ids()
        train_idx, held_idx = split_heldout(ids.shape[0], 0.25, seed)
        assert run.split() == (train_idx, held_idx)
        tokens = kv_features(run.model("source")[0], ids, stride=2)["k"].view(ids.shape[0], 16, -1)
        sample, weights = fit_family.observation_weights(run)
        for rows, own in ((heldout.features["k"]["x"][:heldout.n], held_idx), (sample["xk"], train_idx)):
            found = _locate(rows, tokens)
            unique = [next(iter(f)) for f in found if len(f) == 1]  # rows past any prefix another sequence shares
            assert all({s for s, _ in f} & set(own) for f in found) and len(unique) > len(found) / 2
            assert {s for s, _ in unique} <= set(own), f"seed {seed}: rows of other sequences than its own"
        mass = attention_mass(run.model("target")[0], ids[train_idx], subsample_positions(32, 2), batch_size=8)
        for row, f in enumerate(_locate(sample["xk"], tokens)):  # each weight is the mass at that very token
            if len(f) == 1:
                seq, pos = next(iter(f))
                assert torch.equal(weights[row], mass[train_idx.index(seq), :, pos])  # the same pass, same batches
        assert set(fidelity(run)["heldout_index"]) <= set(held_idx)
        dirs.setdefault(seed, set()).add(run.moments_dir("stripped"))
    assert len(dirs[0]) == 1 and dirs[0] != dirs[1]  # seed 0 again reuses its own calibration


def test_new_weights_at_the_same_path_recompute_every_artifact(tiny_pair_dirs, tmp_path, monkeypatch):
    """Issue 20 §2: a same-shape model saved over the source's directory is another model: the calibration,
    mapper, evaluation and speed artifacts all get new keys, and the next run calibrates again."""
    import shutil

    from kvtransfer.runner.artifacts import ARTIFACTS
    from tiny_models import tiny_model

    source = tmp_path / "source"
    shutil.copytree(tiny_pair_dirs["small"], source)
    dirs = dict(tiny_pair_dirs, small=str(source))
    calls = []
    real = calibrate_stage.collect_moments
    monkeypatch.setattr(calibrate_stage, "collect_moments", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = execute(_tiny_cfg(dirs, tmp_path, "stage=[calibrate,fit]"), tmp_path / "r1")
    before = Run(_tiny_cfg(dirs, tmp_path), "x")
    keys = {name: before.key(name) for name in ARTIFACTS}
    model = tiny_model("qwen3", layers=2, hidden=32, heads=4, seed=99)  # the fixture's shapes, other weights
    model.resize_token_embeddings(len(json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]),
                                  mean_resizing=False)
    model.config.vocab_size = model.get_input_embeddings().weight.shape[0]
    model.save_pretrained(source)
    after = Run(_tiny_cfg(dirs, tmp_path), "x")
    for name in ARTIFACTS:
        if name == "bench_shapes":  # random weights with the pair's configs: reads no model's weights
            assert after.key(name) == keys[name]
        else:
            assert after.key(name) != keys[name], f"{name} would be reused for other weights"
    second = execute(_tiny_cfg(dirs, tmp_path, "stage=[calibrate,fit]"), tmp_path / "r2")
    assert len(calls) == 2 and second["mapper"]["path"] != first["mapper"]["path"]


def test_no_layout_that_keeps_the_numbers_fits_so_the_run_refuses_naming_a_node(tiny_pair_dirs, tmp_path, monkeypatch):
    """One command, one number: on a node whose disk cannot hold the float64 masters' checkpoint the run is refused
    before anything loads (no knob changes the moments' precision), naming the smallest node preset that runs it;
    a user who types calib.dtype=float32 gets float32 masters everywhere, nothing applied behind their back."""
    from kvtransfer import plan as P
    from run_configs import FIXED_RATES

    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=calibrate", "device=cpu", "calib.mlp_samples=0")
    big = P.Node("big", 0, 0.0, 64.0, 64.0)

    def disk(c):   # bytes of the calibrate stage's disk peak as the plan sums them
        return P.stage_usage(P.Setup(c, *P.load_shapes(c), big, FIXED_RATES))["calibrate"].disk

    fp64, fp32 = disk(cfg), disk(dict(cfg, calib=dict(cfg["calib"], dtype="float32")))
    assert cfg["calib"]["dtype"] == "float64" and cfg["calib"]["accumulate"] == "twolevel" and fp32 < fp64
    node = P.Node("small disk", 0, 0.0, 64.0, (fp64 + fp32) / 2 / 0.95 / P.GiB)   # fits float32 masters only
    monkeypatch.setattr(P, "detect_node", lambda c: node)
    with pytest.raises(Exception, match="smallest node preset that runs it") as err:
        execute(cfg, tmp_path / "refused_auto")
    assert type(err.value).__name__ == "PlanError" and "calib.dtype" not in str(err.value)
    assert not (tmp_path / "refused_auto" / "summary.json").exists()
    typed = dict(cfg, calib=dict(cfg["calib"], dtype="float32"))
    summary = execute(typed, tmp_path / "run")
    assert summary["resources"]["applied"] == []
    out = tmp_path / "run"
    ran = json.loads((out / "config.json").read_text())
    assert ran["calib"]["dtype"] == "float32"
    train, _, _ = Run(ran, out).moments()
    assert train.dtype == torch.float32
    with pytest.raises(Exception, match="smallest node preset") as err:
        execute(dict(cfg, plan=dict(cfg["plan"], auto=False)), tmp_path / "refused")
    assert type(err.value).__name__ == "PlanError" and not (tmp_path / "refused" / "summary.json").exists()
