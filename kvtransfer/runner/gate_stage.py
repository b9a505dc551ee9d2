"""The per-request gate's artifact: thresholds on the gate's score (kvtransfer.core.gate; the signal eval.gate.score
of kvtransfer.core.signals, default the tail score), chosen on held-out calibration text -- never on evaluation
items -- for eval.gate's stated rates, and cached next to the mapper."""
from __future__ import annotations


def gate(run) -> dict:
    """The gate artifact (kvtransfer.core.gate.save_gate): thresholds fitted on held-out calibration sequences
    (never evaluation items) for eval.gate's rates. Each of up to eval.gate.sequences held-out sequences
    is one request: the source prefills it, the map (with its native sink) maps it, and the target's score of it
    is taken: signal eval.gate.score (kvtransfer.core.signals.request_signals; tail_kv = the tail score over its
    last eval.gate.tail tokens, kvtransfer.core.gate.tail_score); the thresholds are quantiles of those scores
    (kvtransfer.core.gate.fit_thresholds), recorded with "score": the signal's name. Cached next to the mapper."""
    from ..core.context import start_ids
    from ..core.gate import fit_thresholds, load_gate, save_gate
    from ..core.signals import DEFAULT_SCORE, check_score, request_signals
    from ..core.transfer import transfer

    gcfg = run.cfg["eval"]["gate"]
    name = check_score(gcfg.get("score", DEFAULT_SCORE))
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
    (source, tokenizer), target = run.model("source"), run.model("target")[0]
    start = start_ids(tokenizer, run.context_start)  # what every calibration sequence starts with (core.data)
    mapper = mapper.to(target.device)
    scores = []
    batch = int(run.cfg["calib"].get("batch_size", 8))
    for begin in range(0, len(index), batch):
        rows = ids[index[begin:begin + batch]].to(source.device)
        src, hidden = run.source_prefill(rows, mapper)
        mapped = transfer(src, mapper, source, target, input_ids=rows, native_sink=sink,
                          rope_at_inference=run.rope_at_inference, as_layers=True, source_hidden=hidden)
        scores += request_signals(target, mapped, rows.to(target.device), None, tail=int(gcfg["tail"]),
                                  start_ids=start, native_sink=sink, names=[name])[name].tolist()
    thresholds = fit_thresholds(scores, recompute_rate=gcfg["recompute_rate"], full_rate=gcfg["full_rate"],
                                fraction=gcfg["fraction"])
    save_gate(path, thresholds, {"score": name, "tail": int(gcfg["tail"]), "sequences": index,
                                 "on_train_sequences": not held, "sequence_tokens": int(ids.shape[1]), "scores": scores,
                                 "native_sink": sink, "produced_by": run.stamp("gate")})
    data = load_gate(path)
    run.note("gate", path, data.get("produced_by"))
    return data
