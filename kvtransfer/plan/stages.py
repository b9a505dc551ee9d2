"""Per-stage usage of a run, as `runner.pipeline.execute` runs the requested stages in one process.

calibrate  (`collect_moments`) both models on the device (co-resident; `capture=sequential`: the source,
           then the target); per batch the features x [m, Dx] / y [m, Dy] in float32 and, on the
           *target's device*, the batch's centred products cxx [Dx, Dx] + cxy [Dx, Dy] for K and V in
           `compute_dtype` (default: `dtype`); the running train moments (`Moments`, both kinds) in
           `calib.dtype` on `calib.store_device`, and the held-out raw features (`HeldOut`) on the same store;
           the merge ships one kind's products to the store. The checkpoint (train moments + held-out features,
           `io.save_tensor_dir`) is rewritten in place one piece at a time, so the disk holds the calibration +
           one piece at the peak; the finished checkpoint is the artifact. `calib.accumulate=device`: the train
           moments live on the target's GPU and each batch is merged in place (`Moments.accumulate`).
fit        train moments + held-out features in host memory, the single-source R² pass and one ridge solve
           per (target layer, kind) in float64 on the host CPU, the float64 weights until `Mapper.from_ridge`
           stacks them (3x float64 at its peak); no model is loaded (an MLP / attention-mass / trained fit loads
           both; the trained map also holds its layer-local collection, `train_map.layer_local_nbytes`, or its
           end-to-end collection, `train_e2e.e2e_nbytes`, with the map's Adam state and one step's activations,
           `train_e2e.e2e_step_nbytes`, on the device).
eval       both models + the float32 mapper on the target's device, per batch a source prefill, the mapped
           cache and the scorer's logits (kvtransfer.plan.evalbench).
bench      both models + mapper, the largest `bench.tokens` source caches, mapped cache and target prefill.
report     Table-7 ridge fits for `report.variance_k` on the moments and, with `report.rotated_heatmap`, a
           second full calibration on rotated keys (the first released before it).
Weight offload (`pair.<side>.max_memory`): the layers past the GPU budget live in host memory and every
forward pass copies them to the GPU once.
"""
from __future__ import annotations

from ..config.runconfig import STAGES
from .evalbench import bench, evaluate
from .node import GiB
from .setup import Setup
from .shapes import forward_bytes, mapper_params, moments_kind_bytes, prefill_flops, weight_bytes
from .usage import Usage, place


def _calib_device(s: Setup) -> dict:
    """Device bytes of the calibration loop (weights, moments when on the device, the batch's working set)."""
    m, dx, dy = s.rows, s.dx, s.dy
    fwd_t = forward_bytes(s.tgt, s.batch, s.seq, s.w, math_attention=s.math_attention())
    fwd_s = forward_bytes(s.src, s.batch, s.seq, s.w, math_attention=s.math_attention())
    feat_y, feat_x = 2 * m * dy * 4, 2 * m * dx * 4
    if s.twolevel:   # Moments.accumulate into the float32 buffer (the masters are on the host)
        add_work = m * (dx + dy) * 4 + (m + 2) * (2 * dx + dy) * 4
        moments_dev = s.buffer
        merge_dev = 0
    elif s.in_place:   # Moments.accumulate: one kind at a time: xb/yb in dtype, centred rows, the [m+2, .] operands
        add_work = m * (dx + dy) * s.a * (1 if s.a == 4 else 2) + (m + 2) * (2 * dx + dy) * s.a
        moments_dev = s.moments + (s.heldout if s.store == "cuda" else 0)
        merge_dev = 0
    else:
        prod = moments_kind_bytes(dx, dy, s.c)                       # one kind's batch products
        add_work = 2 * prod + 2 * m * (dx + dy) * s.c * (2 if s.c != 4 else 1)   # both kinds + xb/yb/xc/yc
        moments_dev = s.calibration if s.store == "cuda" else 0
        merge_dev = moments_kind_bytes(dx, dy, s.a) if (s.store == "cuda" and s.c != s.a) else 0
    accumulate = feat_x + feat_y + add_work + merge_dev
    if not s.sequential:
        return {"source + target weights": s.weights("src", "tgt"), "train moments + held-out features": moments_dev,
                "prefill / features + batch products": max(fwd_t, feat_y + fwd_s, accumulate)}
    phase1 = s.weights("src") + fwd_s + feat_x   # pass 1: source alone, features to disk; pass 2: target + moments
    phase2 = s.weights("tgt") + moments_dev + max(fwd_t, accumulate)
    if phase1 > phase2:
        return {"source weights (pass 1)": s.weights("src"), "prefill + features": fwd_s + feat_x}
    return {"target weights (pass 2)": s.weights("tgt"), "train moments + held-out features": moments_dev,
            "prefill / features + batch products": max(fwd_t, accumulate)}


def _calib_host(s: Setup, held_host: float, loaded: frozenset) -> dict:
    """Host bytes of the calibration loop (moments when on the host, the merge, model loading before it)."""
    dx, dy = s.dx, s.dy
    # (on a CPU run the in-place moments are device parts, which `place` puts on the host)
    host_moments = (s.heldout if s.in_place else s.calibration) if s.store == "cpu" else 0
    if s.twolevel:   # the fold (Moments.absorb) brings the buffer over in float64 row chunks of <= 256 MiB
        merge_host = min(256 << 20, s.buffer)
    elif not s.in_place and s.store == "cpu" and (s.device == "cuda" or s.c != s.a):
        merge_host = moments_kind_bytes(dx, dy, s.a) + (dx * max(dx, dy) * s.c if s.c != s.a else 0)
    else:
        merge_host = 0
    # or, at a checkpoint, the device->host copy of one piece when the moments are on the GPU (host tensors are
    # written from their own memory: measured, tests/test_plan.py::test_plan_matches_measured_host_peak)
    merge_host = max(merge_host, s.piece if s.in_place and s.device == "cuda" else 0)
    loads = [s.load_host(x) for x in ("src", "tgt") if x not in loaded]
    loop_host = host_moments + merge_host + s.mlp_sample + s.n_seq * s.seq * 8
    # models load (on the host, then .to(device)) before the moments are allocated: the larger phase counts
    load_extra = max(0.0, max(loads) - loop_host) if loads and s.device == "cuda" else 0.0
    return {"held from earlier stages": held_host,
            "train moments + held-out features + merge of one kind": loop_host,
            "model loading (transient, before the moments)": load_extra}


def _calib_seconds(s: Setup, loaded: frozenset) -> dict:
    """Estimated seconds of the calibration, by part."""
    r, m, dx, dy = s.rates, s.rows, s.dx, s.dy
    fwd = s.n_seq * (prefill_flops(s.src, s.seq, s.seq) + prefill_flops(s.tgt, s.seq, s.seq)) / s.flops_rate(s.mdtype)
    cdt = "float32" if s.twolevel else {8: "float64", 4: "float32", 2: "bfloat16"}[s.a if s.in_place else s.c]
    products = s.n_batches * 2 * 2 * m * (dx * dx + dx * dy) / (r.flops.get(cdt) or r.flops["float32"])
    elems = s.n_batches * 2 * (dx * dx + dx * dy)
    if s.twolevel:   # in-place float32 GEMMs on the device; per flush the buffer crosses the link once and is
        # added into the float64 masters (read 4 + read/write 16 bytes an entry on the host)
        per_flush = 2 * (dx * dx + dx * dy)
        link = s.n_flushes * per_flush * 4 / r.link if (s.device == "cuda" and r.link) else 0.0
        merge = elems * 2 * 4 / (r.bw if s.device == "cuda" else r.host_bw) + s.n_flushes * per_flush * 20 / r.host_bw
    elif s.in_place:   # the merge is inside the GEMM (C += A^T B reads and writes C once per batch)
        link = s.n_checkpoints * s.moments / r.link if (s.device == "cuda" and r.link) else 0.0
        merge = elems * 2 * s.a / (r.bw if s.device == "cuda" else r.host_bw)
    else:
        link = elems * s.c / r.link if (s.device == "cuda" and s.store == "cpu" and r.link) else 0.0
        merge = elems * (s.c + 6 * s.a) / (r.host_bw if s.store == "cpu" else r.bw)
    return {"load weights": s.load_seconds(*[x for x in ("src", "tgt") if x not in loaded]),
            "forward passes": fwd, "batch products": products, "device->host copies": link,
            "merge into the moments": merge, "checkpoints": s.n_checkpoints * s.checkpoint / r.disk,
            "feature files": 2 * s.features / r.disk,
            "offloaded weights streamed": s.stream_seconds("src", s.n_batches) + s.stream_seconds("tgt", s.n_batches)}


def calibrate(s: Setup, held_host: float = 0.0, loaded: frozenset = frozenset(), disk_before: float = 0.0) -> Usage:
    """collect_moments + Run._calibrate (see the module docstring)."""
    u = Usage()
    # sequential capture holds one model at a time
    sides = (max(("src", "tgt"), key=lambda x: s.offload[x]),) if s.sequential else ("src", "tgt")
    place(s, u, _calib_device(s), _calib_host(s, held_host, loaded), sides)
    # disk: [features] + the checkpoint directory rewritten in place, one piece at a time (+ its temp file)
    u.set_disk({"earlier artifacts": disk_before, "sequential source features": s.features,
                "checkpoint, rewritten in place (calibration + one piece)": s.checkpoint + s.piece,
                "MLP feature sample": s.mlp_sample})
    u.set_seconds(_calib_seconds(s, loaded))
    if s.n_checkpoints > 0 and s.checkpoint > 8 * GiB:
        u.notes.append(f"{s.n_checkpoints} checkpoints, each rewriting {s.checkpoint / GiB:.1f} GiB")
    return u


def fit_transient(s: Setup, p: int) -> float:
    """Host bytes of one fit_layer + head_r2 (Cholesky of the gathered [p, p] block, float64)."""
    return p * p * (s.a + 8 + (8 if s.a != 8 else 0))


def ridge_flops(s: Setup, p: int) -> float:
    """fit_ridge: per (target layer, kind) Cholesky p^3/3, solve 2 p^2 q, train R² 2 p^2 q, held-out R² on the
    raw features 2 n_held p q."""
    return 2 * s.tgt.layers * (p ** 3 / 3 + 2 * p * p * s.q + 2 * p * p * s.q + 2 * s.held_rows * p * s.q)


def r2_flops(s: Setup) -> float:
    """r2_matrix: per (kind, source layer) Cholesky of [W_s, W_s], solve against all Dy columns, a
    per-target-layer train R², and the held-out residuals of all Dy columns on the raw features."""
    ws = s.fw
    return 2 * s.src.layers * (ws ** 3 / 3 + 2 * ws * ws * s.dy + s.tgt.layers * 2 * ws * ws * s.q
                               + 2 * s.held_rows * ws * s.dy)


def _fit_mlp(s: Setup, dev: dict) -> tuple[dict, float]:
    """(host work, seconds) of fit_mlp; adds its device parts to `dev`."""
    n = s.sample_rows
    per_layer = s.mapper_values // max(1, s.tgt.layers)   # MLPMapper.values_at, per target layer
    dev["MLP sample of one target layer + its nets, Adam state"] = 2 * n * (s.p + s.q) * 4 + per_layer * 16
    flops = 6 * per_layer * s.tgt.layers * n * int(s.cfg["mapper"].get("epochs", 20))
    rate = s.flops_rate("float32") if s.device == "cuda" else s.rates.host_flops["float32"]
    return {"MLP sample": s.mlp_sample}, flops / rate


def _fit_ridge(s: Setup, dev: dict) -> tuple[dict, float]:
    """(host work, seconds) of the ridge fit (+ the attention-mass pass); adds its device parts to `dev`."""
    r = s.rates
    w64 = mapper_params(s.fw, s.tgt, s.k) * 8
    # + the held-out residuals of one row chunk (ridge.FEATURE_CHUNK rows x Dy, fp64, x3)
    r2_work = s.fw * s.dy * (s.a + 16) + 2048 * s.dy * 8 * 3
    work = {"R² pass / one ridge solve / packing (3 x float64 weights)":
            max(r2_work, w64 + fit_transient(s, s.p), 3 * w64)}
    secs = (r2_flops(s) + ridge_flops(s, s.p)) / r.host_flops["float64"]
    secs += 2 * s.tgt.layers * 3 * s.p * s.p * s.a / r.host_bw  # gathers of the [p, p] blocks
    if s.mass_weighted:  # families.attention_mass over the train sequences, then weighted moments per layer
        n = s.sample_rows
        # both models: the source too, for a sample-only pass when the calibration kept no rows
        dev["source + target weights + one layer's eager attention weights (attention-mass pass)"] = (
            s.weights("src", "tgt") + s.batch * s.tgt.heads * s.seq * s.seq * 4)
        work["feature sample + one layer's weighted rows (float64)"] = s.mlp_sample + n * (2 * s.p + s.q) * 8
        secs += s.n_train * prefill_flops(s.tgt, s.seq, s.seq) / s.flops_rate(s.mdtype)
        secs += 2 * s.tgt.layers * 2 * n * (s.p * s.p + s.p * s.q) / r.host_flops["float64"]
    return work, secs


def _fit_trained(s: Setup, dev: dict) -> tuple[dict, float]:
    """(host work, seconds) of mapper=trained: the ridge fit it starts from, the layer-local collection
    (`train_map.layer_local_nbytes`, every source layer counted as used) over train + stop sequences, and per
    target layer at most mapper.steps Adam steps (forward + backward ~3x the forward: the map GEMM on all
    batch_sequences x S tokens, scores and softmax x V at the kept queries, o_proj); adds its device parts to `dev`."""
    from ..maps.train_map import layer_local_nbytes

    m = s.cfg["mapper"]
    if m.get("objective") == "end_to_end":
        return _fit_trained_e2e(s, dev)
    work, secs = _fit_ridge(s, dev)
    n_seq = min(int(m["train_sequences"]), max(0, s.n_train - int(m["stop_sequences"]))) + int(m["stop_sequences"])
    s_q, b, t = int(m["query_positions"]), int(m["batch_sequences"]), s.tgt
    nbytes = layer_local_nbytes(n_seq, s.seq, s.src.layers, s.src.width, t.layers, t.heads, t.head_dim, s_q,
                                t.kv_heads, int(m.get("native_sink") or 0))
    # the collected inputs live on the host; one layer's problem (its p gathered columns) + weights, Adam state
    layer = nbytes // max(1, t.layers) + 2 * n_seq * s.seq * s.p * 4 + 2 * (s.p * s.q + s.q) * 4 * 4
    work["layer-local collection (train + stop sequences, float32)"] = nbytes
    dev["source + target weights (collection), one layer's problem + map + Adam state"] = max(
        s.weights("src", "tgt") + forward_bytes(t, s.batch, s.seq, s.w, math_attention=s.math_attention()), layer)
    step = 3 * b * (2 * 2 * s.seq * s.p * s.q + 2 * 2 * t.heads * s_q * s.seq * t.head_dim + 2 * s_q * t.hidden * t.heads * t.head_dim)
    rate = s.flops_rate("float32") if s.device == "cuda" else s.rates.host_flops["float32"]
    secs += n_seq * (prefill_flops(s.src, s.seq, s.seq) + prefill_flops(t, s.seq, s.seq)) / s.flops_rate(s.mdtype)
    secs += s.n_lrs * t.layers * int(m["steps"]) * step / rate  # once per learning rate of mapper.lr
    return work, secs


def _fit_trained_e2e(s: Setup, dev: dict) -> tuple[dict, float]:
    """(host work, seconds) of mapper=trained mapper.objective=end_to_end: the ridge fit it starts from, the
    collection (`train_e2e.e2e_nbytes`, every source layer counted as used) over train + stop sequences, at most
    mapper.steps steps (`train_e2e.e2e_step_flops`) and a stop-split evaluation every mapper.eval_every steps (a
    forward: half a step's FLOPs per sequence); on the device both models, the map with its gradient and Adam state
    (float32, 4 copies) and one step's saved activations (`train_e2e.e2e_step_nbytes`); adds them to `dev`."""
    from ..maps.train_e2e import e2e_nbytes, e2e_step_flops, e2e_step_nbytes

    m = s.cfg["mapper"]
    work, secs = _fit_ridge(s, dev)
    n_stop = int(m["stop_sequences"])
    n_seq = min(int(m["train_sequences"]), max(0, s.n_train - n_stop)) + n_stop
    cont = int(m["continuation_tokens"])
    ctx = s.seq - cont if m.get("context_tokens") is None else int(m["context_tokens"])
    b, t, steps = int(m["batch_sequences"]), s.tgt, int(m["steps"])
    work["end-to-end collection (train + stop sequences, float32)"] = e2e_nbytes(
        n_seq, ctx, cont, s.src.layers, s.src.width, t.layers, t.kv_heads, t.head_dim, t.hidden,
        int(m.get("native_sink") or 0))
    shape = dict(layers=t.layers, hidden=t.hidden, heads=t.heads, head_dim=t.head_dim, vocab=t.vocab, p=s.p)
    step_bytes = e2e_step_nbytes(b, ctx, cont, intermediate=t.intermediate, kv_heads=t.kv_heads, act_bytes=s.w, **shape)
    # (+ the kept run's map while the next learning rate trains, for several)
    dev["source + target weights (collection, training), map + gradient + Adam state, one step's activations"] = (
        s.weights("src", "tgt") + (4 + (s.n_lrs > 1)) * s.mapper_w32 + step_bytes)
    step = e2e_step_flops(b, ctx, cont, layer_params=t.layer_params, q=s.q, **shape)
    evals = -(-steps // int(m["eval_every"])) if steps else 0
    per_seq = e2e_step_flops(1, ctx, cont, layer_params=t.layer_params, q=s.q, **shape)
    rate = s.flops_rate(s.mdtype) if s.device == "cuda" else s.rates.host_flops["float32"]
    secs += n_seq * (prefill_flops(s.src, ctx, ctx) + prefill_flops(t, ctx + cont, ctx + cont)) / s.flops_rate(s.mdtype)
    secs += s.n_lrs * (steps * step + evals * n_stop * per_seq / 2) / rate  # once per learning rate of mapper.lr
    return work, secs


def fit(s: Setup, held_host: float, loaded: frozenset, disk_before: float) -> Usage:
    """Run._fit: moments on the host, R² matrix, ridge per target layer, pack the float64 weights."""
    u, r = Usage(), s.rates
    dev = {"source + target weights": s.weights("src", "tgt") if s.mapper_kind == "mlp" else 0.0}
    fit_fn = {"mlp": _fit_mlp, "trained": _fit_trained}.get(s.mapper_kind, _fit_ridge)
    work, fit_s = fit_fn(s, dev)
    models = ("src", "tgt") if s.mapper_kind in ("mlp", "trained") or s.mass_weighted else ()
    loads = [s.load_host(x) for x in models if x not in loaded]
    host = {"train moments + held-out features": s.calibration if not held_host else held_host, **work,
            "model loading (after the moments are read)": max(loads) if loads and s.device == "cuda" else 0.0}
    place(s, u, dev, host, models)
    u.set_disk({"earlier artifacts": disk_before, "mapper (float32)": s.mapper_w32})
    u.set_seconds({"read moments": 0.0 if held_host else s.calibration / r.disk, "solves (host float64)": fit_s,
                   "load weights": s.load_seconds(*[x for x in models if x not in loaded]),
                   "save mapper": s.mapper_w32 / r.disk})
    if s.mapper_kind in ("ridge", "trained", "hidden"):
        ratio = s.p / max(1, s.n_train * s.kept)
        if ratio >= 0.5:
            u.notes.append(f"p/n = {ratio:.2f} >= 0.5: fit_ridge refuses (mapper.force=true to override)")
    return u


def report(s: Setup, held_host: float, loaded: frozenset, disk_before: float) -> Usage:
    """Report: with report.rotated_heatmap a second calibration (rotated keys) -- the stripped moments are
    released before it (`Run.release_moments`) and read back for the Table-7 ridge fits for
    report.variance_k (those the p/n guard lets through)."""
    u, r = Usage(), s.rates
    rep = s.cfg.get("report") or {}
    n_obs = s.n_train * s.kept
    ks = [s.src.layers if k == "all" else int(k) for k in rep.get("variance_k", [])]
    ks = [k for k in ks if k <= s.src.layers and k * s.fw / max(1, n_obs) < 0.5]
    fits_host = max([fit_transient(s, k * s.fw) + mapper_params(s.fw, s.tgt, k) * 8 for k in ks] or [0])
    secs = {"Table-7 fits (host float64)": sum(ridge_flops(s, k * s.fw) for k in ks) / r.host_flops["float64"],
            "read moments": s.calibration / r.disk}
    dev = {"source + target weights": s.weights("src", "tgt")}
    host = {"held from earlier stages": held_host, "stripped moments (read back)": s.calibration,
            "Table-7 fits (largest k)": fits_host}
    disk = {"earlier artifacts": disk_before}
    if rep.get("rotated_heatmap"):
        rot = calibrate(s, held_host=held_host, loaded=loaded, disk_before=disk_before)
        rot_host = sum(v for k, v in rot.host_parts.items() if not k.startswith("offloaded weights"))
        host = {"rotated calibration peak (nothing else held), or moments + Table-7 fits":
                max(rot_host, held_host + s.calibration + fits_host)}
        dev = rot.dev_parts
        disk = {"earlier artifacts": disk_before, "rotated calibration": rot.disk - disk_before}
        secs["rotated calibration + its R² matrix"] = rot.seconds + r2_flops(s) / r.host_flops["float64"]
    place(s, u, dev, host, ("src", "tgt"))
    u.set_disk(disk)
    u.set_seconds(secs)
    return u


def _loaded_before(s: Setup, stage: str) -> frozenset:
    """Models the requested stages before `stage` leave loaded (none when `stage` is not requested)."""
    loaded: set = set()
    prior = [x for x in s.stages if STAGES.index(x) < STAGES.index(stage)] if stage in s.stages else []
    for x in prior:
        if x == "calibrate":
            loaded |= {"tgt"} if s.sequential else {"src", "tgt"}
        if x in ("eval", "report") or (x == "fit" and s.mapper_kind in ("mlp", "trained")) or (
                x == "bench" and not (s.cfg.get("bench") or {}).get("shapes_only")):
            loaded |= {"src", "tgt"}
    return frozenset(loaded)


def stage_usage(s: Setup) -> dict[str, Usage]:
    """Peak usage of every stage, as `runner.pipeline.execute` would run the requested stages in one process
    (earlier requested stages leave models loaded); every stage reads the moments it needs and releases them
    (`Run.release_moments`); a stage not requested is planned as if run alone with its inputs cached."""
    weights_disk = (sum(weight_bytes(m, s.w, with_extra=True) for m in (s.src, s.tgt))
                    if s.node.weights_on_disk else 0.0)
    fns = {"calibrate": calibrate, "fit": fit, "eval": evaluate, "bench": bench, "report": report}
    out = {}
    for stage in STAGES:
        disk_before = weights_disk + (s.calibration + s.mlp_sample if stage != "calibrate" else 0) + (
            s.mapper_w32 if stage not in ("calibrate", "fit") else 0)
        out[stage] = fns[stage](s, 0.0, _loaded_before(s, stage), disk_before)
    return out
