"""The paper's map trained end to end for the target's next-token distribution (issue 23 §1; beyond the paper).

Same parameterisation as the ridge map and the layer-local objective (kvtransfer.maps.train_map): weight
[L_t, 2, p, q], bias [L_t, 2, q], the same support and apply FLOPs (`mapper.TrainedMapper`), started from the
ridge solution. Here the maps of all target layers are trained jointly for

    loss = mean over sequences and continuation positions j of KL(p_native(. | j) || p_mapped(. | j))   (nats/token)

Each calibration sequence is split into a context (its first C tokens) and a continuation (the next T). The
context's cache is what `transfer.transfer` builds: the source's K/V of the context (keys RoPE-stripped when
key_space="stripped"), mapped per target layer (`train_map.affine_kv`), keys re-rotated with the target's RoPE
at positions 0..C-1, positions < native_sink the target's own. The frozen target then reads the continuation
on that cache (positions C..C+T-1), as the fidelity diagnostics read a transferred prefix (their KL is this
loss on held-out sequences); p_native is the target reading its own cache of the same context. The start is
the ridge map, never a layer-local-trained one: a two-stage start would make that artifact an input of this
one, which is not built.

Gradient path: the mapped K/V go into an HF `DynamicCache` (its `update` concatenates with torch.cat, which
autograd differentiates), the target's forward runs with its parameters' requires_grad off (no weight
gradients are formed: backward computes activation gradients only, ~2x the forward rather than ~3x), and
autograd carries d loss / d cache back through the RoPE re-application and the map GEMM into (weight, bias).
Nothing re-implements the target: whatever attention kernel, sliding window or norm it has is what is
differentiated (checked against central finite differences in float64, tests/test_train_e2e.py).

Memory: `collect_e2e` runs source and target once over the sequences and keeps the source features of the
context, the native sink K/V and the target's final hidden states on the continuation (not its log-probs:
V / hidden ~ 100x smaller on Qwen; the native log-probs are recomputed per step through the LM head, +1/3 of
the LM head's share of a step) -- bytes `e2e_nbytes`. One step's activations: `e2e_step_nbytes`; its FLOPs:
`e2e_step_flops`. `train_e2e` runs Adam on (weight, bias) of all layers, evaluates the stop split's KL every
`eval_every` steps and keeps the best evaluated weights (early stopping with `patience`); unless that best is
strictly below the start's stop KL it returns the starting weights bit for bit (`kept_start`), and when it is
above the start or no evaluation was finite it says so (`worse_than_start`; the start is the ridge map, so
also `worse_than_ridge`). The numerical core: no Hydra, no lm-eval, no W&B.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..core import rope
from ..core.cache import _check_extended, layers_to_cache, prefill
from ..core.models import decoder, kv_shape, text_config
from .train_map import EarlyStop, TrainSettings, _finite, affine_kv, minibatches
from ..core.transfer import codec_for, place_on_layers

OBJECTIVE = "end_to_end"


# -- sizes --------------------------------------------------------------------------------------------------
def e2e_nbytes(n_sequences: int, context: int, continuation: int, used_source_layers: int, source_width: int,
               target_layers: int, n_kv_t: int, head_dim_t: int, hidden_t: int, native_sink: int,
               value_bytes: int = 4) -> int:
    """Bytes `collect_e2e` keeps (values of `value_bytes`, float32 by default; ids int64):
        n_seq * [b_v * (2 C U w_s  +  T h_t  +  L_t * 2 * min(sink, C) * n_kv_t * d_t)  +  8 T]
    the source K and V features of the U used source layers over the context (w_s = n_kv_s * d_s), the
    target's final hidden states over the continuation (h_t), the native sink K/V, the continuation ids."""
    per_seq = (value_bytes * (2 * context * used_source_layers * source_width + continuation * hidden_t
                              + target_layers * 2 * min(native_sink, context) * n_kv_t * head_dim_t)
               + 8 * continuation)
    return n_sequences * per_seq


def e2e_step_nbytes(batch: int, context: int, continuation: int, *, layers: int, hidden: int, intermediate: int,
                    heads: int, kv_heads: int, head_dim: int, vocab: int, p: int, act_bytes: int = 4,
                    map_bytes: int = 4) -> int:
    """Bytes autograd saves for one training step's backward (counted on HF Qwen3 with eager attention,
    tests/test_train_e2e.py; an upper bound for SDPA and for Qwen2, which has no q/k norms), b sequences of C
    context + T continuation tokens, the target's activations in `act_bytes`, log-probs and the map in `map_bytes`:
        act_bytes * b * [L * (T (2 h + 3 I + 2 n_q d + n_kv d) + 2 (C + T) n_q d + n_q T (C + T)) + T h]
      + map_bytes * b * (2 T V + 2 L C p)
    per layer and continuation token the two RMSNorm inputs (2 h), the gated MLP's gate, activation and up
    outputs (3 I), the q/k-norm inputs and the rotated queries (2 n_q d + n_kv d); per layer the keys and values
    over all C + T positions expanded to the query heads (GQA repeat: 2 (C + T) n_q d) and the attention
    probabilities (n_q T (C + T): eager / math attention only; flash and memory-efficient SDPA keep none); the
    final norm's input (T h); the mapped and the native log-probs (2 T V); per target layer the gathered map
    features, K and V (2 C p). Weights are never saved copies (the target's are read in place; no weight
    gradients); the first layer's pre-attention activations need no gradient and are counted anyway (the bound's
    slack: T (h + n_q d + n_kv d) + (C + T) n_q d of one layer)."""
    t, c, qd = continuation, context, heads * head_dim
    per_layer = t * (2 * hidden + 3 * intermediate + 2 * qd + kv_heads * head_dim) + 2 * (c + t) * qd + heads * t * (c + t)
    return act_bytes * batch * (layers * per_layer + t * hidden) + map_bytes * batch * (2 * t * vocab + 2 * layers * c * p)


def e2e_step_flops(batch: int, context: int, continuation: int, *, layer_params: int, layers: int, hidden: int,
                   heads: int, head_dim: int, vocab: int, p: int, q: int) -> float:
    """FLOPs of one training step (2 per multiply-add), b sequences:
        b * [4 N_L T  +  3 * 4 L n_q d T (C + (T + 1) / 2)  +  6 h V T  +  8 L C p q]
    the target's linear layers forward + backward over the T continuation tokens (N_L = L * layer_params; no
    weight gradients: backward is one GEMM per forward GEMM), attention over C + causal T keys (QK^T and PV
    forward, ~2x that backward), the LM head forward + backward plus the native log-probs' LM head (6 h V T),
    and the map: forward 2 * 2 C p q per layer (K and V), its weight gradient the same again (8 L C p q).
    The context itself never runs through the target (its K/V come from the map)."""
    t, c = continuation, context
    return float(batch * (4 * layers * layer_params * t + 12 * layers * heads * head_dim * t * (c + (t + 1) / 2)
                          + 6 * hidden * vocab * t + 8 * layers * c * p * q))


# -- collection ---------------------------------------------------------------------------------------------
@dataclass
class E2EData:
    """What `collect_e2e` keeps of n sequences: context C tokens, continuation T tokens (CPU, `dtype`).

    source_k, source_v [n, C, U * w_s]: the source's K (RoPE-stripped when `rotate`) and V of the context at
    `used_layers` (w_s = n_kv_s * d_s columns each, head-major, as the mapper's features); continuation [n, T]
    int64; native_hidden [n, T, h_t]: the target's final (normed) hidden states reading its native cache of
    the context; sink_k / sink_v per target layer [n, n_kv_t, n_sink, d_t] native post-RoPE; cos / sin [C, d_t]
    the target's RoPE at positions 0..C-1."""

    source_k: torch.Tensor
    source_v: torch.Tensor
    used_layers: list[int]
    continuation: torch.Tensor
    native_hidden: torch.Tensor
    sink_k: list[torch.Tensor]
    sink_v: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    n_kv: int
    rotate: bool

    @property
    def context(self) -> int:
        """C: context tokens per sequence."""
        return self.source_k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors kept (what `e2e_nbytes` predicts; the RoPE tables aside)."""
        tensors = [self.source_k, self.source_v, self.continuation, self.native_hidden, *self.sink_k, *self.sink_v]
        return sum(t.numel() * t.element_size() for t in tensors)

    def columns(self, selected: list[int]) -> torch.Tensor:
        """Feature columns [p] int64 of source layers `selected` (feature order) in source_k / source_v."""
        missing = [s for s in selected if s not in self.used_layers]
        if missing:
            raise ValueError(f"source layers {missing} were not collected (collected: {self.used_layers})")
        w_s = self.source_k.shape[-1] // len(self.used_layers)
        return torch.cat([torch.arange(w_s) + self.used_layers.index(s) * w_s for s in selected])  # device: host-side columns, moved where used


def check_target(model) -> None:
    """Refuse targets whose logits are not lm_head(final hidden state) (the native log-probs are recomputed
    from stored hidden states through the LM head alone)."""
    cfg = text_config(model.config)
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, name, None):
            raise NotImplementedError(f"the end-to-end objective recomputes native logits as lm_head(hidden); this "
                                      f"target post-processes them ({name}={getattr(cfg, name)})")
    if model.get_output_embeddings() is None:
        raise NotImplementedError("the target has no LM head (get_output_embeddings() is None)")


def _body_on_cache(model, layers, continuation: torch.Tensor, context: int) -> torch.Tensor:
    """The decoder body's final hidden states [b, T, h] on continuation ids [b, T] at positions C..C+T-1 after a
    cache of `layers` (C unpadded positions); differentiable in the cache tensors."""
    b, t = continuation.shape
    cache = layers_to_cache(layers, model.config)
    mask = torch.ones(b, context + t, dtype=torch.long, device=continuation.device)
    pos = torch.arange(context, context + t, device=continuation.device)[None].expand(b, -1)
    out = decoder(model)(input_ids=continuation, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    _check_extended(cache, context, t)
    return out.last_hidden_state


def _strip(codec, keys: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Content-space keys [b, n_kv, S, d]: `RopeCodec.strip`'s rounding (float32, then the cache dtype) unless
    the collection is float64, which strips in float64 (a float64 check then sees float64 rounding only)."""
    if dtype != torch.float64:
        return codec.strip(keys, positions.to(keys.device))
    cos, sin = (x.to(keys.device, torch.float64) for x in codec.cos_sin(positions))
    return rope.rotate(keys.to(torch.float64), cos, sin, inverse=True)


@torch.no_grad()
def collect_e2e(source, target, token_ids: torch.Tensor, used_layers: list[int], *, context: int,
                native_sink: int = 0, key_space: str = "stripped", batch_size: int = 8,
                dtype: torch.dtype = torch.float32, progress=None) -> E2EData:
    """Run source and target over unpadded ids [n, C + T] (context = C; the rest is the continuation) and keep
    what the end-to-end loss reads (`E2EData`; bytes: `e2e_nbytes`), in `dtype` on the CPU. Source keys are
    RoPE-stripped when key_space="stripped" (as the calibration features)."""
    if key_space not in ("stripped", "rotated"):
        raise ValueError(f"key_space must be stripped or rotated, got {key_space!r}")
    check_target(target)
    n, total = token_ids.shape
    if not 1 <= context < total:
        raise ValueError(f"context={context} must leave at least one continuation token of the {total} given")
    ctx_pos = torch.arange(context)  # device: host-side positions (RopeCodec moves them to its tables)
    cos, sin = (x[0, 0].cpu().to(dtype) for x in codec_for(target).cos_sin(ctx_pos))  # [C, d_t]
    src_codec = codec_for(source)
    n_sink = min(int(native_sink), context)
    src_dev, tgt_dev = next(source.parameters()).device, next(target.parameters()).device
    feats: dict = {"k": [], "v": []}
    hidden, sinks = [], []
    wrap = progress or (lambda it, **_: it)
    for start in wrap(range(0, n, batch_size), desc="end-to-end collection"):
        ids = token_ids[start:start + batch_size]
        ctx, cont = ids[:, :context], ids[:, context:]
        src = prefill(source, ctx.to(src_dev))
        for kind, i in (("k", 0), ("v", 1)):
            cols = []
            for s in used_layers:
                x = src[s][i]
                if kind == "k" and key_space == "stripped":
                    x = _strip(src_codec, x, ctx_pos, dtype)
                cols.append(x.to(dtype).permute(0, 2, 1, 3).reshape(x.shape[0], context, -1).cpu())
            feats[kind].append(torch.cat(cols, dim=-1))
        del src
        native = prefill(target, ctx.to(tgt_dev))
        sinks.append([(k[:, :, :n_sink].to(dtype).cpu(), v[:, :, :n_sink].to(dtype).cpu()) for k, v in native])
        hidden.append(_body_on_cache(target, native, cont.to(tgt_dev), context).to(dtype).cpu())
    n_layers = len(sinks[0])
    return E2EData(source_k=torch.cat(feats["k"]), source_v=torch.cat(feats["v"]), used_layers=list(used_layers),
                   continuation=token_ids[:, context:].clone(), native_hidden=torch.cat(hidden),
                   sink_k=[torch.cat([s[t][0] for s in sinks]) for t in range(n_layers)],
                   sink_v=[torch.cat([s[t][1] for s in sinks]) for t in range(n_layers)],
                   cos=cos, sin=sin, n_kv=kv_shape(target).n_kv, rotate=key_space == "stripped")


# -- the loss -----------------------------------------------------------------------------------------------
def mapped_layers(data: E2EData, rows: list[int], weight: torch.Tensor, bias: torch.Tensor,
                  selected: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per target layer the mapped context cache (keys, values) [b, n_kv_t, C, d_t] of sequences `rows` through
    weight [L_t, 2, p, q], bias [L_t, 2, q] (in their dtype and device): what `transfer.transfer` builds for
    those contexts, to rounding; differentiable in weight and bias."""
    dev, dt = weight.device, weight.dtype
    idx = torch.as_tensor(rows, dtype=torch.long)  # device: indexes the host-side E2EData
    xk, xv = data.source_k[idx].to(dev, dt), data.source_v[idx].to(dev, dt)
    cos, sin = (data.cos.to(dev, dt), data.sin.to(dev, dt)) if data.rotate else (None, None)
    out = []
    for t, sel in enumerate(selected):
        cols = data.columns(list(sel)).to(dev)
        out.append(affine_kv(xk.index_select(-1, cols), xv.index_select(-1, cols), weight[t], bias[t], data.n_kv,
                             cos, sin, data.sink_k[t][idx].to(dev, dt), data.sink_v[t][idx].to(dev, dt)))
    return out


def mapped_logprobs(target, data: E2EData, rows: list[int], weight: torch.Tensor, bias: torch.Tensor,
                    selected: list[list[int]]) -> torch.Tensor:
    """log p_mapped [b, T, V] of sequences `rows`: the target reading the mapped context cache (in its own dtype)
    on the continuation; float64 when the map is float64, else float32; differentiable in weight and bias."""
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    mdt, dev = target.dtype, next(target.parameters()).device
    idx = torch.as_tensor(rows, dtype=torch.long)  # device: indexes the host-side E2EData
    layers = [(k.to(mdt), v.to(mdt)) for k, v in mapped_layers(data, rows, weight, bias, selected)]
    hidden = _body_on_cache(target, place_on_layers(layers, target), data.continuation[idx].to(dev), data.context)
    return target.get_output_embeddings()(hidden).to(acc).log_softmax(-1)


@torch.no_grad()
def native_logprobs(target, data: E2EData, rows: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """log p_native [b, T, V] of sequences `rows` in `dtype`: the LM head on the stored native hidden states."""
    dev = next(target.parameters()).device
    hidden = data.native_hidden[torch.as_tensor(rows, dtype=torch.long)].to(dev, target.dtype)  # device: indexes the host-side E2EData
    return target.get_output_embeddings()(hidden).to(dtype).log_softmax(-1)


def kl_sum(target, data: E2EData, rows: list[int], weight: torch.Tensor, bias: torch.Tensor,
           selected: list[list[int]]) -> tuple[torch.Tensor, int]:
    """(sum over sequences `rows` and continuation positions of KL(p_native || p_mapped) in nats, the number of
    positions). The sum is a scalar in float64 when the map is float64, else float32, differentiable in weight
    and bias."""
    logq = mapped_logprobs(target, data, rows, weight, bias, selected)
    logp = native_logprobs(target, data, rows, logq.dtype)  # a constant of the data
    kl = (logp.exp() * (logp - logq)).sum()
    return kl.to(weight.device), logq.shape[0] * logq.shape[1]


@torch.no_grad()
def mean_kl(target, data: E2EData, rows: list[int], weight: torch.Tensor, bias: torch.Tensor,
            selected: list[list[int]], chunk: int = 4) -> float:
    """KL(p_native || p_mapped) in nats per continuation token over sequences `rows`, in chunks of `chunk`
    sequences (float64 sums)."""
    if not rows:
        raise ValueError("the loss needs at least one sequence")
    total, count = 0.0, 0
    for i in range(0, len(rows), chunk):
        s, c = kl_sum(target, data, rows[i:i + chunk], weight, bias, selected)
        total, count = total + float(s), count + c
    return total / count


@contextmanager
def frozen(model):
    """The model's parameters with requires_grad off for the duration (restored after): autograd then forms
    activation gradients only. Refuses a model in training mode (dropout would make the loss random)."""
    if model.training:
        raise ValueError("the target must be in eval mode (model.eval()): the objective is its inference behaviour")
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


# -- training -----------------------------------------------------------------------------------------------
def train_e2e(target, data: E2EData, weight: torch.Tensor, bias: torch.Tensor, selected: list[list[int]],
              fit_rows: list[int], stop_rows: list[int], settings: TrainSettings,
              progress=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Train all target layers' maps jointly from (weight [L_t, 2, p, q], bias [L_t, 2, q]) -- the ridge map --
    on sequences `fit_rows` of `data`, early stopping on `stop_rows` (disjoint). Returns (weight, bias, record),
    float32 on the CPU (float64 when the start is float64): the best evaluated trained weights, or the starting
    ones, unchanged, when no step ran or no trained evaluation is below the start's stop KL.
    record (KL in nats per continuation token): objective, start ("ridge"), stop_kl_start, stop_kl_trained (best
    evaluated; None when no step ran or none was finite), stop_kl_final (of the weights returned),
    worse_than_start (= worse_than_ridge: the best trained evaluation above the start, or none finite after
    steps ran), kept_start (the starting weights returned), steps, best_step, train_kl_first / train_kl_last (mean minibatch KL of the
    first / last evaluation window), train_kl (per step; None where not finite), evaluations [{step, train_kl
    (window mean), stop_kl}], seconds."""
    overlap = set(fit_rows) & set(stop_rows)
    if overlap:
        raise ValueError(f"rows {sorted(overlap)} are in both the fit and the stop split")
    if not fit_rows:
        raise ValueError("the end-to-end objective needs at least one sequence to train on")
    if len(selected) != weight.shape[0] or len(data.sink_k) != weight.shape[0]:
        raise ValueError(f"{weight.shape[0]} mapped layers, {len(selected)} selections and {len(data.sink_k)} "
                         "collected target layers must agree")
    started = time.perf_counter()
    out_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w0 = weight.detach().to(settings.device, out_dtype)
    b0 = bias.detach().to(settings.device, out_dtype)
    chunk = settings.batch_sequences
    with frozen(target):
        start_kl = mean_kl(target, data, stop_rows, w0, b0, selected, chunk)
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        opt = torch.optim.Adam([w, b], lr=settings.lr)
        batches = minibatches(fit_rows, settings.batch_sequences, settings.seed)
        stopper = EarlyStop(settings.patience)
        window: list[float] = []
        per_step: list[float | None] = []
        evaluations: list[dict] = []
        first = last = None
        step = 0
        steps = range(1, settings.steps + 1)
        for step in (progress(steps, desc="end-to-end training") if progress else steps):
            rows = next(batches)
            s, count = kl_sum(target, data, rows, w, b, selected)
            loss = s / count
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            window.append(loss.item())
            per_step.append(_finite(window[-1]))
            if step % settings.eval_every and step != settings.steps:
                continue
            mean = _finite(sum(window) / len(window))
            first = first if first is not None else mean
            last, window = mean, []
            stop = mean_kl(target, data, stop_rows, w.detach(), b.detach(), selected, chunk)
            evaluations.append({"step": step, "train_kl": mean, "stop_kl": _finite(stop)})
            if stopper.update(stop, w, b, step):
                break
    best = stopper.best
    trained = best[0] if best[1] is not None else None
    diverged = settings.steps > 0 and trained is None  # steps ran, no finite stop KL: as bad as it gets
    # strictly better or keep the start: a tie gains nothing and the start is the documented map
    keep_start = trained is None or not trained < start_kl
    worse = bool(diverged or (trained is not None and trained > start_kl))
    w_out, b_out = (w0, b0) if keep_start else best[1]
    record = {"objective": OBJECTIVE, "start": "ridge", "stop_kl_start": start_kl, "stop_kl_trained": trained,
              "stop_kl_final": start_kl if keep_start else trained, "worse_than_start": worse,
              "worse_than_ridge": worse, "kept_start": keep_start, "steps": step,
              "best_step": best[2] if best[1] is not None else 0, "train_kl_first": first, "train_kl_last": last,
              "train_kl": per_step, "evaluations": evaluations, "seconds": round(time.perf_counter() - started, 3)}
    return w_out.detach().to("cpu", out_dtype), b_out.detach().to("cpu", out_dtype), record
