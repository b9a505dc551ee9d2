"""The per-request gate's artifact: thresholds on the tail score (kvtransfer.core.gate), chosen on held-out
calibration text -- never on evaluation items -- for eval.gate's stated rates, and cached next to the mapper."""
from __future__ import annotations


def gate(run) -> dict:
    """The gate artifact (kvtransfer.core.gate.save_gate): thresholds fitted on held-out calibration sequences
    (never evaluation items) for eval.gate's rates. Each of up to eval.gate.sequences held-out sequences
    is one request: the source prefills it, the map (with its native sink) maps it, and the target's tail
    score over its last eval.gate.tail tokens is taken (kvtransfer.core.gate.tail_score); the thresholds are
    quantiles of those scores (kvtransfer.core.gate.fit_thresholds). Cached next to the mapper."""
    from ..core.gate import fit_thresholds, load_gate, save_gate, tail_score
    from ..core.transfer import transfer

    gcfg = run.cfg["eval"]["gate"]
    path = run.mapper_dir() / f"gate_{run.key('gate')}.json"
    if path.exists():
        data = load_gate(path)
        run.note("gate", path, data.get("produced_by"))
        return data
    mapper = run.mapper()
    sink = run.native_sink(mapper)
    ids = run.token_ids()
    _, held = run.split()
    index = held[:int(gcfg["sequences"])] or list(range(min(int(gcfg["sequences"]), ids.shape[0])))
    source, target = run.model("source")[0], run.model("target")[0]
    mapper = mapper.to(target.device)
    scores = []
    batch = int(run.cfg["calib"].get("batch_size", 8))
    for start in range(0, len(index), batch):
        rows = ids[index[start:start + batch]].to(source.device)
        src, hidden = run.source_prefill(rows, mapper)
        mapped = transfer(src, mapper, source, target, input_ids=rows, native_sink=sink,
                          rope_at_inference=run.rope_at_inference, as_layers=True, source_hidden=hidden)
        score, _ = tail_score(target, mapped, rows.to(target.device), None, int(gcfg["tail"]))
        scores += score.tolist()
    thresholds = fit_thresholds(scores, recompute_rate=gcfg["recompute_rate"], full_rate=gcfg["full_rate"],
                                fraction=gcfg["fraction"])
    save_gate(path, thresholds, {"tail": int(gcfg["tail"]), "sequences": index, "on_train_sequences": not held,
                                 "sequence_tokens": int(ids.shape[1]), "scores": scores, "native_sink": sink,
                                 "produced_by": run.stamp("gate")})
    data = load_gate(path)
    run.note("gate", path, data.get("produced_by"))
    return data
