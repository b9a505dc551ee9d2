"""Fidelity diagnostics of a fitted map on held-out calibration sequences: what the target does with the mapped
cache against its own (kvtransfer.core.diagnostics), cached next to the mapper."""
from __future__ import annotations

import json

from ..core.io import atomic_write_json

def fidelity(run) -> dict:
    """What the target does with the mapped cache on held-out calibration sequences.

    Up to eval.fidelity.sequences held-out sequences: the first seq_len - continuation tokens
    (continuation at most seq_len / 2) are the prefix (source prefill -> mapper, with its native sink), the rest the continuation.
    Returns {"per_layer": compare_caches(...), "per_position": position_diagnostics(...),
    "sequences", "prefix", "continuation", "native_sink"}; cached next to the mapper.
    """
    from ..core.cache import prefill
    from ..core.diagnostics import compare_caches, position_diagnostics
    from ..core.transfer import transfer

    ecfg = run.cfg.get("eval", {})
    fcfg = ecfg.get("fidelity") or {}
    n_seq, cont = int(fcfg.get("sequences", 4)), int(fcfg.get("continuation", 32))
    mapper = run.mapper()
    sink = run.native_sink(mapper)
    path = run.mapper_dir() / f"fidelity_{run.key('fidelity')}.json"
    if path.exists():
        result = json.loads(path.read_text())
        run.note("fidelity", path, result.get("produced_by"))
        return result
    ids = run.token_ids()
    _, held = run.split()
    # calib.heldout_fraction=0 holds nothing out: the diagnostics then run on train sequences and say so
    rows = ids[held[:n_seq] or list(range(min(n_seq, ids.shape[0])))]
    cont = min(cont, rows.shape[1] // 2)  # short calibration sequences: half prefix, half continuation
    source, target = run.model("source")[0], run.model("target")[0]
    prefix, continuation = rows[:, :-cont], rows[:, -cont:]
    mapper = mapper.to(target.device)
    src, hidden = run.source_prefill(prefix.to(source.device), mapper)  # + hidden states for mapper=hidden
    mapped = transfer(src, mapper, source, target, input_ids=prefix.to(source.device), native_sink=sink,
                      rope_at_inference=run.rope_at_inference, as_layers=True, source_hidden=hidden)
    native = prefill(target, prefix.to(target.device))
    continuation = continuation.to(target.device)
    result = {"sequences": int(rows.shape[0]), "heldout_index": held[:n_seq], "on_train_sequences": not held,
              "prefix": int(prefix.shape[1]),
              "continuation": cont,
              "native_sink": sink, "per_layer": compare_caches(target, native, mapped, continuation),
              "per_position": position_diagnostics(target, native, mapped, continuation),
              "produced_by": run.stamp("fidelity")}
    atomic_write_json(path, result)
    run.note("fidelity", path, result["produced_by"])
    return result

# -- variance explained vs k (Table 7) --------------------------------------------------------
