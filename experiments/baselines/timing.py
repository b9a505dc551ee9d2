"""The equal-cost tables' seconds, measured by the timing protocol: every mode timed in one process, interleaved.

    python experiments/baselines/timing.py --run results/baselines/runs/real_wikitext2_1024_w24   # P = 1,024
    python experiments/baselines/timing.py --run results/baselines/runs/real_wikitext2_1024_w24 --prefix 256 \
        --modes no_context,transfer,target,truncate_tokens_1,truncate_tokens_4,recompute_recent_0.05,truncate_0.05
    STEPS="timing_1024 timing_256 timing_512" bash experiments/baselines/run.sh    # the committed measurements

Reads the run's resolved config (its config.json: models, map, start ids, map dtype, the windows' draw) and
loads what its eval loaded, then times, for a fixed subsample of the run's windows (the first --windows of its
draw, one context at a time: the handoff's unit), what each mode's target does before scoring -- the work the
eval's context timing counts:

- `target`, `truncate_tokens_m`, `no_context`: the target's prefill of the context[:-1] it reads (the whole
  prefix, the start ids and the last m tokens, the start ids alone);
- `transfer`: the map applied to the source's prefilled cache of the context[:-1], the target's native-sink
  prefill included (kvtransfer.core.transfer.transfer, as the eval builds the cache); the source's prefill is
  computed once, untimed: a handoff's source has read the context already;
- `recompute_<select>_<r>`: the map, then the target's recompute of its share (kvtransfer.eval.prefix.repair_prefix);
- `source`: that source prefill, timed, for the convention that counts it.

Modes run in interleaved rounds (kvtransfer.core.timing.interleaved: A B C ... per round, a warm-up round, at least
5 timed rounds), each mode's cost relative to `target`'s re-prefill taken within each round, so the load of the
machine falls on every mode alike; the load average and the machine are kept beside the numbers.
Writes results/baselines/timing/<set>_P<P>.json once (<set>_P<P>_reverse.json for a large -> small run,
pair.direction=reverse; an existing file is never overwritten: remove it to remeasure); collect.py prices every
mode of that (set, P) and direction with it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.config.provenance import produced_by  # noqa: E402
from kvtransfer.core.cache import prefill  # noqa: E402
from kvtransfer.core.recompute import prefill_flops  # noqa: E402
from kvtransfer.core.io import atomic_write_json  # noqa: E402
from kvtransfer.core.timing import MIN_REPEATS, interleaved  # noqa: E402
from kvtransfer.core.transfer import transfer  # noqa: E402
from kvtransfer.eval.prefix import repair_prefix  # noqa: E402
from kvtransfer.eval.repair import is_truncate_mode  # noqa: E402
from kvtransfer.eval.perplexity import ppl_contexts  # noqa: E402
from kvtransfer.runner.eval_stage import control_lm, eval_lm  # noqa: E402
from kvtransfer.runner.run import Run  # noqa: E402

OUT = ROOT / "results" / "baselines" / "timing"


def ids_of(tokens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """([1, n] token ids, [1, n] ones mask) of one unpadded context on `device`."""
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    return ids, torch.ones_like(ids)


def read_prefix(lm, mode: str, context: list[int]) -> list[int]:
    """The context[:-1] an own-prefill mode's target prefills before scoring (eval.truncate.time_one_pass)."""
    used = lm.truncated_context(context) if mode.startswith("truncate") else \
        lm._floor_context(context) if mode == "no_context" else context
    return used[:-1]


def calls(run, modes: list[str], contexts: list[list[int]], seed: int) -> tuple[dict, dict]:
    """({mode: a call that does mode's pre-scoring work on every context once}, {mode: its FLOPs over the contexts,
    None where the eval counts them}), in `modes`' order, `source` after the first mapped mode."""
    lm, modes = eval_lm(run, modes)
    target = lm.target_model
    fns, flops = {}, {}
    for mode in modes:
        moded, adapter_mode = control_lm(lm, mode, run, seed)
        if adapter_mode == "transfer" and mode != "gated":
            source = moded.source_model
            prefixes = [moded.cut(c)[0] for c in contexts]
            inputs = [ids_of(p, source.device) for p in prefixes]
            with torch.no_grad():
                caches = [prefill(source, ids, mask) for ids, mask in inputs]   # the handoff's: untimed

            @torch.no_grad()
            def apply_map(moded=moded, inputs=inputs, caches=caches, source=source):
                for (ids, mask), cache in zip(inputs, caches):
                    layers = transfer(cache, moded.mapper, source, target, attention_mask=mask, input_ids=ids,
                                      native_sink=moded.native_sink, as_layers=True,
                                      rope_at_inference=moded.rope_at_inference)
                    if getattr(moded, "repair", False):   # map + recompute: the target re-reads its share
                        repair_prefix(moded, layers, ids.to(target.device), mask.to(target.device))

            @torch.no_grad()
            def source_prefill(inputs=inputs, source=source):
                for ids, mask in inputs:
                    prefill(source, ids, mask)
            fns[mode] = apply_map
            flops[mode] = None   # the map's and a repair's FLOPs are the eval's (collect.py reads them there)
            if "source" not in fns:
                fns["source"] = source_prefill
                flops["source"] = sum(prefill_flops(source.config, len(p)) for p in prefixes)
        elif mode in ("target", "no_context") or is_truncate_mode(mode):
            inputs = [ids_of(read_prefix(moded, adapter_mode, c), target.device) for c in contexts]

            @torch.no_grad()
            def own_prefill(inputs=inputs):
                for ids, mask in inputs:
                    if ids.shape[1]:
                        prefill(target, ids, mask)
            fns[mode] = own_prefill
            flops[mode] = sum(prefill_flops(target.config, ids.shape[1]) for ids, _ in inputs if ids.shape[1])
        else:
            raise SystemExit(f"mode {mode!r}: only target, no_context, transfer, recompute_<select>_<r> and "
                             "truncate modes are timed here")
    return fns, flops


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, type=Path, help="a finished run directory (its config.json is read)")
    ap.add_argument("--set", default=None, help="perplexity set (default: the run's first)")
    ap.add_argument("--prefix", type=int, default=None, help="P (default: the run's largest)")
    ap.add_argument("--windows", type=int, default=8, help="the fixed subsample: the first N windows of the draw")
    ap.add_argument("--modes", default=None, help="comma-separated (default: the run's eval.modes)")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    cfg = json.loads((args.run / "config.json").read_text())
    ecfg, seed = cfg["eval"], cfg.get("seed", 0)
    pcfg = ecfg["ppl"]
    set_name = args.set or pcfg["sets"][0]
    p = args.prefix if args.prefix is not None else max(pcfg["prefixes"])
    reverse = cfg["pair"].get("direction") == "reverse"   # large -> small: its own file, keyed apart in collect.py
    path = args.out / f"{set_name}_P{p}{'_reverse' if reverse else ''}.json"
    if path.exists():
        raise SystemExit(f"{path} exists: results are never overwritten (remove it to measure again)")
    modes = args.modes.split(",") if args.modes else list(ecfg["modes"])
    modes = [m for m in modes if not (is_truncate_mode(m) and m.startswith("truncate_tokens_")
                                      and int(m.rpartition("_")[2]) >= p)]
    if "gated" in modes:   # its work differs per window by the gate's choice: priced by FLOPs, not timed here
        modes.remove("gated")
    if "target" not in modes:
        modes.insert(0, "target")
    if p > max(pcfg["prefixes"]):
        raise SystemExit(f"P = {p} is longer than the run's windows ({max(pcfg['prefixes'])}): pick a run drawn at it")
    run = Run(cfg, args.run)
    lm, _ = eval_lm(run, ["target"])
    contexts, docs = ppl_contexts(lm, ecfg, set_name, p, args.windows, seed)
    fns, flops = calls(run, modes, contexts, seed)
    note = (f"the first {len(contexts)} of the draw's {pcfg['windows']} windows of {set_name} at P = {p}, one context "
            f"at a time; each call does a mode's pre-scoring work on all {len(contexts)}")
    timing = interleaved(fns, repeats=args.repeats, warmup=args.warmup, reference="target", note=note,
                         machine={"torch_threads": torch.get_num_threads(), "dtype": str(lm.target_model.dtype)})
    out = {"set": set_name + ("@reverse" if reverse else ""), "prefix": p, "windows": len(contexts), "docs": docs, "run": args.run.name,
           "map_dtype": str(ecfg.get("map_dtype")), "flops": flops, "timing": timing, "provenance": produced_by()}
    atomic_write_json(path, out)
    for mode in timing["order"]:
        rel = timing["relative"][mode]
        print(f"{mode:24s} {timing['median'][mode]:8.3f} s  x target {rel['median']:.4f} ± {rel['se']:.4f}")
    print(f"load {timing['load_avg']}; wrote {path}")


if __name__ == "__main__":
    main()
