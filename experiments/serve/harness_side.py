"""The harness's side of the equivalence proof: the project's `transfer` mode on the perplexity windows.

    python experiments/serve/harness_side.py --real DIR --mapper DIR --out FILE [--windows 32] [--max-new 32]
        [--tail 1] [--cold] [--gate GATE.json --block-size 128]

Runs in the project's own environment (transformers 5.2x: kvtransfer.core.cache passes `cache=`, which the
serving environment's transformers 5.19 does not take). Per window of the perplexity protocol at
P = 256 (kvtransfer.eval.perplexity: draw_windows(seed 0, max_prefix 256, continuation 64), context =
<|endoftext|> + the 256 prefix tokens): the source prefills context[:-tail], `transfer` maps it with the
mapper's native sink, the target runs the tail and then greedy-decodes `max-new` tokens on that cache;
the first token's log-softmax (top 20) and the tokens are written. --cold adds the target's own full
prefill (the floor the two engines differ by without any map).

--gate: the gated configuration, as the connector serves it (kvtransfer.serve.gating), with the harness's code:
the map of context[:-tail] is scored by kvtransfer.core.gate.tail_score over its last `tail` tokens (the
artifact's tail) and decided by core.gate.decide on the artifact's thresholds; the first position the target
computes itself is kvtransfer.serve.gating.recompute_start (map: the gate's tail; recompute: the `recent` rule at
block granularity; full: 0), and the cache is core.recompute.selective_recompute(select="recent") of that many
tokens (full: the target's own prefill). Each row also records the decision and that start.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def contexts(tokenizer, n_windows: int, prefix: int = 256) -> list[list[int]]:
    """The perplexity protocol's contexts at P = prefix: start ids + the prefix tokens of each window."""
    from kvtransfer.core.context import start_ids
    from kvtransfer.eval.perplexity import draw_windows, load_pages, prefix_pairs

    pages = load_pages(ROOT / "data/benchmarks/wikitext2.jsonl")
    windows = draw_windows(tokenizer, pages, max_prefix=256, cont_len=64, n_windows=32, seed=0)[:n_windows]
    start = start_ids(tokenizer, "prefix_token")
    return [ctx for ctx, _ in prefix_pairs(windows, prefix, 256, start[0], start)]


@torch.no_grad()
def greedy(model, layers, run: list[int], max_new: int) -> tuple[torch.Tensor, list[int]]:
    """First-step log-probs [vocab] and `max_new` greedy tokens of `model` continuing `run` after cache `layers`."""
    from kvtransfer.core.cache import cache_to_layers, forward_on_cache

    first, tokens = None, []
    for _ in range(max_new):
        logits, cache = forward_on_cache(model, layers, None, torch.tensor([run]), return_cache=True)
        logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
        first = logprobs if first is None else first
        tokens.append(int(logprobs.argmax()))
        layers, run = cache_to_layers(cache), tokens[-1:]
    return first, tokens


def gated_layers(target, mapped, ids: torch.Tensor, gate: dict, sink: int, block_size: int):
    """(layers, record) of the served gate's decision on the mapped cache of `ids` [1, hi] (see the module doc)."""
    from kvtransfer.core.cache import prefill
    from kvtransfer.core.gate import decide, tail_score
    from kvtransfer.core.recompute import selective_recompute
    from kvtransfer.serve import gating

    hi, tail = ids.shape[1], int(gate["tail"])
    head_end = gating.plan(0, hi, tail, sink)
    if head_end is None:
        decision = gating.unscored("no score: nothing mapped before the gate's tail")
        head_end = hi
    else:
        score, _ = tail_score(target, mapped, ids, None, tail)
        decision = decide(float(score[0]), gate["thresholds"])
    start = gating.recompute_start(decision, lo=0, head_end=head_end, hi=hi, native_sink=sink, block_size=block_size)
    if start < max(sink, 1):
        layers = prefill(target, ids)
    else:
        layers, _ = selective_recompute(target, ids, mapped, (hi - start) / (hi - sink), select="recent",
                                        native_sink=sink)
    return layers, decision.as_dict() | {"start": start}


def fit_gate(target, source, mapper, ctxs: list[list[int]], path: str, *, tail: int = 8, recompute_rate: float = 0.3,
             full_rate: float = 0.3, fraction: float = 0.5) -> dict:
    """A gate artifact fitted (core.gate.fit_thresholds) on the tail scores of calibration contexts `ctxs` -- windows
    the comparison never evaluates -- each scored as the served gate scores it (context[:-1] mapped)."""
    import kvtransfer as kt
    from kvtransfer.core.cache import prefill
    from kvtransfer.core.gate import fit_thresholds, load_gate, save_gate, tail_score

    scores = []
    for ctx in ctxs:
        ids = torch.tensor([ctx[:-1]])
        layers = kt.transfer(prefill(source, ids), mapper, source, target, input_ids=ids, as_layers=True)
        scores.append(float(tail_score(target, layers, ids, None, tail)[0][0]))
    t = fit_thresholds(scores, recompute_rate=recompute_rate, full_rate=full_rate, fraction=fraction)
    save_gate(path, t, {"tail": tail, "scores": scores, "calibration": "experiments/serve/harness_side.py --fit-gate: "
                        "perplexity windows after the evaluated ones"})
    return load_gate(path)


def top(logprobs: torch.Tensor, k: int = 20) -> dict[int, float]:
    values, ids = logprobs.topk(k)
    return {int(i): float(v) for i, v in zip(ids, values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", required=True)
    ap.add_argument("--mapper", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--tail", type=int, default=1)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--gate", default=None)
    ap.add_argument("--source", default=None)
    ap.add_argument("--fit-gate", default=None, help="write a gate fitted on the windows after --windows here, then "
                    "use it (as --gate)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--block-size", type=int, default=128, help="the serving engine's cache block (vLLM CPU: 128)")
    args = ap.parse_args()
    import kvtransfer as kt
    from kvtransfer.core.cache import prefill

    torch.manual_seed(0)
    hf = Path(args.real) / "hf"
    source, tok = kt.load_model(args.source or str(hf / "qwen25coder-0.5b"), dtype="float32", device="cpu")
    target, _ = kt.load_model(args.target or str(hf / "qwen25coder-1.5b"), dtype="float32", device="cpu")
    mapper = kt.load_mapper(args.mapper, source, target)
    gate = None
    if args.fit_gate:
        gate = fit_gate(target, source, mapper, contexts(tok, 32)[args.windows:], args.fit_gate)
    elif args.gate:
        from kvtransfer.core.gate import load_gate

        gate = load_gate(args.gate)
    rows = []
    for i, ctx in enumerate(contexts(tok, args.windows)):
        head, tail = ctx[:-args.tail], ctx[-args.tail:]
        ids = torch.tensor([head])
        layers = kt.transfer(prefill(source, ids), mapper, source, target, input_ids=ids, as_layers=True)
        row = {"window": i, "context": ctx}
        if gate is not None:
            layers, row["gate"] = gated_layers(target, layers, ids, gate, int(mapper.native_sink), args.block_size)
        first, tokens = greedy(target, layers, tail, args.max_new)
        row |= {"first_logprobs": top(first), "tokens": tokens}
        if args.cold:
            cold_first, cold_tokens = greedy(target, prefill(target, torch.tensor([ctx[:-1]])), ctx[-1:], args.max_new)
            row |= {"cold_first_logprobs": top(cold_first), "cold_tokens": cold_tokens}
        rows.append(row)
        print(f"window {i}: {tokens[:8]}", flush=True)
    from kvtransfer.config.provenance import json_provenance

    Path(args.out).write_text(json.dumps({"mapper": args.mapper, "tail": args.tail, "gate": args.gate,
                                          "windows": rows, "provenance": json_provenance()}))


if __name__ == "__main__":
    main()
