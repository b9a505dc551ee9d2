"""The paper's map trained for the target's attention output, layer by layer (issue 23 §1; beyond the paper).

The map keeps the ridge map's form -- weight [L_t, 2, p, q], bias [L_t, 2, q], the same support and the same
apply FLOPs (`mapper.TrainedMapper`) -- and starts from its ridge solution. For target layer t the objective
is layer-local: the attention output, through o_proj, that the target's own queries get from the mapped K/V
vs from its native K/V, as a fraction of the native output's energy,

    loss_t = sum_{seq, i} |(A_i(Q, K^map, V^map) - A_i(Q, K, V)) W_o^T|^2 / sum_{seq, i} |A_i(Q, K, V) W_o^T|^2

over the calibration sequences and the kept query positions i (`query_positions`). A_i is the layer's causal
softmax attention (query i reads keys 0..i, grouped-query heads, the layer's own scaling), computed in
float32; Q, K, V are the target's own post-RoPE queries and cached K/V on that text; K^map = RoPE_t(x_K W_K +
b_K) re-rotated at each key's position with `rope.rotate`'s formula (the map is applied as `transfer` applies
it) and V^map = x_V W_V + b_V, with x the source's features at the selected layers (keys RoPE-stripped, as
the calibration features); positions < native_sink hold the target's native K/V (as `transfer` leaves them).
Every kept query reads the mapped K/V of every earlier position and of its own (in a real transfer the
continuation's own positions are native: the difference is the query's own key only).

Nothing is back-propagated through a model. `collect_layer_local` runs source and target once over the
sequences and keeps, per sequence, the source features of the used source layers and, per target layer,
the queries at the kept positions, the native attention output there and the native sink K/V (memory:
`layer_local_nbytes`). `train_layer` then trains one layer's map with Adam on its own, evaluating the loss on
a separate split of sequences (the stop split) every `eval_every` steps and keeping the best evaluated
weights (early stopping); a layer whose best trained stop-split loss is above its ridge start keeps its ridge
weights and says so (`worse_than_ridge`). The numerical core: no Hydra, no lm-eval, no W&B.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..core import rope
from ..core.cache import prefill
from ..core.models import decoder, kv_shape, text_config
from ..core.transfer import codec_for

OBJECTIVES = ("layer_local", "end_to_end")  # end_to_end: kvtransfer.maps.train_e2e (all layers jointly)


@dataclass(frozen=True)
class TrainSettings:
    """Adam on one layer's (weight, bias): at most `steps` steps of `batch_sequences` sequences each, the stop
    split evaluated every `eval_every` steps, stopping after `patience` evaluations without improvement."""

    lr: float = 1e-4
    steps: int = 300
    batch_sequences: int = 4
    eval_every: int = 20
    patience: int = 3
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        for name in ("steps", "batch_sequences", "eval_every", "patience"):
            low = 0 if name == "steps" else 1
            if int(getattr(self, name)) < low:
                raise ValueError(f"mapper.{name} must be >= {low}, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"mapper.lr must be > 0, got {self.lr}")


def query_positions(seq_len: int, n_queries: int) -> torch.Tensor:
    """The kept query positions [n] int64: the last position of each of n equal blocks of 0..seq_len-1
    (n = seq_len keeps them all), so every context length up to the whole sequence is read."""
    if not 1 <= n_queries <= seq_len:
        raise ValueError(f"mapper.query_positions={n_queries} must be in 1..seq_len ({seq_len})")
    return torch.tensor([((j + 1) * seq_len) // n_queries - 1 for j in range(n_queries)], dtype=torch.long)  # device: host-side positions


def split_stop(train_index: list[int], n_fit: int, n_stop: int, seed: int) -> tuple[list[int], list[int]]:
    """(fit, stop) sequence indices, disjoint, drawn from the calibration's train split `train_index` by a
    seeded permutation: the stop split is its first n_stop, the fit split the next n_fit (fewer if the split is
    short). Never touches the held-out split the fidelity numbers are reported on."""
    if n_stop < 1:
        raise ValueError("mapper.stop_sequences must be >= 1: early stopping needs sequences to stop on")
    if n_fit < 1:
        raise ValueError("mapper.train_sequences must be >= 1")
    if len(train_index) < n_stop + 1:
        raise ValueError(f"the calibration's train split has {len(train_index)} sequences, too few for "
                         f"mapper.stop_sequences={n_stop} plus one to train on: lower mapper.stop_sequences or "
                         "raise calib.n_sequences")
    order = torch.randperm(len(train_index), generator=torch.Generator().manual_seed(seed + 7919)).tolist()  # device: host-side order
    stop = sorted(train_index[i] for i in order[:n_stop])
    fit = sorted(train_index[i] for i in order[n_stop:n_stop + n_fit])
    return fit, stop


def layer_local_nbytes(n_sequences: int, seq_len: int, used_source_layers: int, source_width: int,
                       target_layers: int, n_q: int, head_dim_t: int, n_queries: int, n_kv_t: int,
                       native_sink: int) -> int:
    """Bytes (float32) `collect_layer_local` keeps:
        4 * n_seq * [2 * S * U * w_s  +  L_t * (2 * S_q * n_q * d_t  +  2 * min(sink, S) * n_kv_t * d_t)]
    source K and V features of the U used source layers (w_s = n_kv_s * d_s), per target layer the queries
    and the native attention output at the S_q kept positions, and the native sink K/V."""
    per_seq = (2 * seq_len * used_source_layers * source_width
               + target_layers * (2 * n_queries * n_q * head_dim_t + 2 * min(native_sink, seq_len) * n_kv_t * head_dim_t))
    return 4 * n_sequences * per_seq


@dataclass
class LayerProblem:
    """Everything one target layer's loss reads, for n sequences of S tokens (float32).

    x_k, x_v [n, S, p]: the layer's source features (selected source layers in feature order); queries
    [n, n_q, S_q, d] post-RoPE at `positions` [S_q]; native_out [n, S_q, n_q * d]: A(Q, K, V) before o_proj;
    sink_k, sink_v [n, n_kv, n_sink, d] native post-RoPE; o_proj [hidden, n_q * d]; cos, sin [S, d] the
    target's RoPE at positions 0..S-1 (None: the map works on rotated keys, nothing is re-rotated)."""

    x_k: torch.Tensor
    x_v: torch.Tensor
    queries: torch.Tensor
    native_out: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    o_proj: torch.Tensor
    scaling: float
    positions: torch.Tensor
    n_kv: int
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def to(self, device) -> LayerProblem:
        """A copy with every tensor on `device`."""
        moved = {name: (v.to(device) if isinstance(v, torch.Tensor) else v) for name, v in vars(self).items()}
        return LayerProblem(**moved)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """Grouped-query causal attention of queries q [b, n_q, S_q, d] at key positions `positions` [S_q] over
    keys/values k, v [b, n_kv, S, d]: query j reads keys 0..positions[j]. Returns [b, S_q, n_q * d] (the
    layout o_proj reads). Softmax in float32; differentiable."""
    b, n_q, s_q, d = q.shape
    n_kv, seq = k.shape[1], k.shape[2]
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads do not split into {n_kv} KV groups")
    g = n_q // n_kv
    qg = q.reshape(b, n_kv, g * s_q, d)  # heads of one KV group share its keys: no repeat of K/V
    scores = (qg @ k.transpose(-1, -2)).float() * scaling  # [b, n_kv, g * S_q, S]
    future = torch.arange(seq, device=q.device)[None, :] > positions.to(q.device)[:, None]  # [S_q, S]
    scores = scores.masked_fill(future.repeat(g, 1), float("-inf"))
    out = scores.softmax(-1).to(v.dtype) @ v  # [b, n_kv, g * S_q, d]
    return out.reshape(b, n_q, s_q, d).transpose(1, 2).reshape(b, s_q, n_q * d)


def mapped_kv(problem: LayerProblem, rows, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(keys, values) [b, n_kv, S, d] of sequences `rows` through the map weight [2, p, q], bias [2, q]:
    keys re-rotated at positions 0..S-1 (unless problem.cos is None), the first n_sink positions native.
    What `transfer.map_layers` stores for these tokens, to rounding; differentiable in weight and bias."""
    return affine_kv(problem.x_k[rows], problem.x_v[rows], weight, bias, problem.n_kv, problem.cos, problem.sin,
                     problem.sink_k[rows], problem.sink_v[rows])


def affine_kv(x_k: torch.Tensor, x_v: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_kv: int,
              cos: torch.Tensor | None, sin: torch.Tensor | None, sink_k: torch.Tensor,
              sink_v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(keys, values) [b, n_kv, S, d] of features x_k, x_v [b, S, p] through weight [2, p, q], bias [2, q]: keys
    re-rotated with cos, sin [S, d] (None: not rotated), the first n_sink positions replaced by sink_k, sink_v
    [b, n_kv, n_sink, d]. What `transfer.map_layers` stores, to rounding; differentiable in weight and bias
    (the layer-local and the end-to-end objectives both map through this)."""
    x = torch.stack([x_k, x_v])  # [2, b, S, p]
    _, b, seq, p = x.shape
    y = torch.baddbmm(bias[:, None, :], x.reshape(2, b * seq, p), weight)  # [2, b * S, q]
    y = y.view(2, b, seq, n_kv, -1).transpose(2, 3)  # [2, b, n_kv, S, d]
    k, v = y[0], y[1]
    if cos is not None:  # rope.rotate's formula, written with autograd-friendly ops
        k = k * cos + rope.rotate_half(k) * sin
    n_sink = sink_k.shape[2]
    if n_sink:
        k = torch.cat([sink_k.to(k.dtype), k[:, :, n_sink:]], dim=2)
        v = torch.cat([sink_v.to(v.dtype), v[:, :, n_sink:]], dim=2)
    return k, v


@torch.no_grad()
def native_energy(problem: LayerProblem, chunk: int = 4) -> torch.Tensor:
    """|A_native W_o^T|^2 summed per sequence over the kept query positions: [n] float32 (the loss's denominator,
    fixed by the data, so computed once rather than every step)."""
    out = [((x @ problem.o_proj.T) ** 2).sum((1, 2)) for x in problem.native_out.split(chunk)]
    return torch.cat(out)


def output_error(problem: LayerProblem, rows, weight: torch.Tensor, bias: torch.Tensor,
                 energy: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(sum |(A_map - A_native) W_o^T|^2, sum |A_native W_o^T|^2) over sequences `rows` and the kept query
    positions (float32 scalars; the first differentiable in weight and bias). energy: `native_energy(problem)`,
    when the caller has it (else the denominator is computed here)."""
    k, v = mapped_kv(problem, rows, weight, bias)
    out = causal_attention(problem.queries[rows], k, v, problem.positions, problem.scaling)
    native = problem.native_out[rows]
    err = (out - native) @ problem.o_proj.T
    if energy is None:
        ref = native @ problem.o_proj.T
        return (err * err).sum(), (ref * ref).sum()
    return (err * err).sum(), energy[rows].sum()


@torch.no_grad()
def relative_loss(problem: LayerProblem, rows: list[int], weight: torch.Tensor, bias: torch.Tensor,
                  chunk: int = 4) -> float:
    """loss_t (module docstring) of the map on sequences `rows`, in chunks of `chunk` sequences (float64 sums)."""
    if not rows:
        raise ValueError("the loss needs at least one sequence")
    sse = sst = 0.0
    for i in range(0, len(rows), chunk):
        a, b = output_error(problem, rows[i:i + chunk], weight, bias)
        sse, sst = sse + float(a), sst + float(b)
    return sse / max(sst, torch.finfo(torch.float64).tiny)


def minibatches(fit_rows: list[int], batch: int, seed: int) -> Iterator[list[int]]:
    """Endless minibatches of `batch` rows of `fit_rows`: seeded shuffled epochs, an epoch's remainder carried into
    the next batch (so every row is seen once per epoch)."""
    gen = torch.Generator().manual_seed(seed)  # device: draws host-side row orders
    order: list[int] = []
    while True:
        if len(order) < batch:  # a new epoch over the fit sequences
            order += [fit_rows[i] for i in torch.randperm(len(fit_rows), generator=gen).tolist()]  # device: host-side order
        rows, order = order[:batch], order[batch:]
        yield rows


class EarlyStop:
    """Early stopping on stop-split evaluations: `best` = (loss, (weight, bias) copies, step) of the lowest finite
    loss seen ((inf, None, 0) before any); `update` returns True once `patience` evaluations in a row found none lower."""

    def __init__(self, patience: int):
        self.patience, self.bad = patience, 0
        self.best: tuple = (math.inf, None, 0)

    def update(self, loss: float, weight: torch.Tensor, bias: torch.Tensor, step: int) -> bool:
        """Record one evaluation of the current weights; True when training should stop."""
        if loss < self.best[0]:  # NaN never improves: a diverged run keeps its last finite best (or none)
            self.best, self.bad = (loss, (weight.detach().clone(), bias.detach().clone()), step), 0
            return False
        self.bad += 1
        return self.bad >= self.patience


def train_layer(problem: LayerProblem, weight: torch.Tensor, bias: torch.Tensor, fit_rows: list[int],
                stop_rows: list[int], settings: TrainSettings) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Train one layer's map from (weight [2, p, q], bias [2, q]) on sequences `fit_rows` of `problem`, early
    stopping on `stop_rows`. Returns (weight, bias, record), float32 on the CPU: the best evaluated trained
    weights, or the starting ones when no step ran or the best trained stop loss is above the start's
    (`worse_than_ridge`). record: stop_loss_ridge, stop_loss_trained (best evaluated; None when no step ran
    or no evaluation was finite), stop_loss_final (of the weights returned), worse_than_ridge, steps (run),
    best_step, train_loss_first / train_loss_last (mean minibatch loss of the first / last evaluation window;
    None when not finite), seconds."""
    started = time.perf_counter()
    problem = problem.to(settings.device)
    w0 = weight.detach().to(settings.device, torch.float32)
    b0 = bias.detach().to(settings.device, torch.float32)
    ridge_loss = relative_loss(problem, stop_rows, w0, b0, settings.batch_sequences)
    energy = native_energy(problem, settings.batch_sequences)
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = torch.optim.Adam([w, b], lr=settings.lr)
    batches = minibatches(fit_rows, settings.batch_sequences, settings.seed)
    stopper = EarlyStop(settings.patience)
    window: list[float] = []
    first = last = None
    step = 0
    for step in range(1, settings.steps + 1):
        rows = next(batches)
        sse, sst = output_error(problem, rows, w, b, energy)
        loss = sse / sst.clamp_min(torch.finfo(torch.float32).tiny)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window.append(loss.item())
        if step % settings.eval_every and step != settings.steps:
            continue
        first = first if first is not None else _finite(sum(window) / len(window))
        last, window = _finite(sum(window) / len(window)), []
        stop = relative_loss(problem, stop_rows, w.detach(), b.detach(), settings.batch_sequences)
        if stopper.update(stop, w, b, step):
            break
    best = stopper.best
    trained = best[0] if best[1] is not None else None
    worse = trained is not None and trained > ridge_loss
    diverged = settings.steps > 0 and trained is None  # steps ran, no finite stop loss: as bad as it gets
    keep_ridge = trained is None or worse
    w_out, b_out = (w0, b0) if keep_ridge else best[1]
    record = {"stop_loss_ridge": ridge_loss, "stop_loss_trained": trained,
              "stop_loss_final": ridge_loss if keep_ridge else trained,
              "worse_than_ridge": bool(worse or diverged), "steps": step,
              "best_step": best[2] if best[1] is not None else 0, "train_loss_first": first, "train_loss_last": last,
              "seconds": round(time.perf_counter() - started, 3)}
    return w_out.detach().float().cpu(), b_out.detach().float().cpu(), record


def lowest_stop_loss(lrs: Sequence[float], train_at: Callable[[float], tuple[torch.Tensor, torch.Tensor, dict]],
                     key: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Learning-rate choice on the stop split only: `train_at(lr)` -> (weight, bias, record) once per rate in `lrs`
    (each from the same start, same minibatch order); returns the run whose record[key] (its stop-split loss of
    the weights it returns, e.g. "stop_loss_final") is lowest -- the first listed on a tie -- with "lr" added to
    its record and, for several rates, "by_lr": [{lr, key, stop loss trained, steps, best_step, worse_than_ridge}]
    of every run. Only the kept run's weights are held while the next trains."""
    if not lrs:
        raise ValueError("mapper.lr: give at least one learning rate")
    best, runs = None, []
    for lr in lrs:
        weight, bias, record = train_at(float(lr))
        runs.append({"lr": float(lr), **{k: record.get(k) for k in (key, key.replace("_final", "_trained"), "steps",
                                                                    "best_step", "worse_than_ridge")}})
        if best is None or record[key] < best[2][key]:
            best = (weight, bias, {**record, "lr": float(lr)})
    if len(runs) > 1:
        best[2]["by_lr"] = runs
    return best


def _finite(x: float) -> float | None:
    """x, or None when it is NaN/inf (a diverged window; the record is JSON)."""
    return x if math.isfinite(x) else None


# -- collection ----------------------------------------------------------------------------------------------
@dataclass
class LayerLocalData:
    """What `collect_layer_local` keeps of n sequences of S tokens (float32, CPU).

    source_k, source_v [n, S, U * w_s]: the source's K (RoPE-stripped when `rotate`) and V of `used_layers`
    (U of them, w_s = n_kv_s * d_s columns each, head-major as the mapper's features); per target layer:
    queries [n, n_q, S_q, d_t], native_out [n, S_q, n_q * d_t], sink_k / sink_v [n, n_kv_t, n_sink, d_t],
    o_proj [hidden, n_q * d_t], scaling; positions [S_q]; cos / sin [S, d_t] of the target's RoPE."""

    source_k: torch.Tensor
    source_v: torch.Tensor
    used_layers: list[int]
    queries: list[torch.Tensor]
    native_out: list[torch.Tensor]
    sink_k: list[torch.Tensor]
    sink_v: list[torch.Tensor]
    o_proj: list[torch.Tensor]
    scaling: list[float]
    positions: torch.Tensor
    n_kv: int
    cos: torch.Tensor
    sin: torch.Tensor
    rotate: bool

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors kept (what `layer_local_nbytes` predicts, plus o_proj and the RoPE tables)."""
        tensors = [self.source_k, self.source_v, *self.queries, *self.native_out, *self.sink_k, *self.sink_v]
        return sum(t.numel() * t.element_size() for t in tensors)

    def layer(self, t: int, selected: list[int]) -> LayerProblem:
        """Target layer t's problem, its source features gathered from source layers `selected` (feature order)."""
        missing = [s for s in selected if s not in self.used_layers]
        if missing:
            raise ValueError(f"source layers {missing} were not collected (collected: {self.used_layers})")
        w_s = self.source_k.shape[-1] // len(self.used_layers)
        cols = torch.cat([torch.arange(w_s) + self.used_layers.index(s) * w_s for s in selected])  # device: indexes the host-side features
        return LayerProblem(x_k=self.source_k[..., cols], x_v=self.source_v[..., cols], queries=self.queries[t],
                            native_out=self.native_out[t], sink_k=self.sink_k[t], sink_v=self.sink_v[t],
                            o_proj=self.o_proj[t], scaling=self.scaling[t], positions=self.positions, n_kv=self.n_kv,
                            cos=self.cos if self.rotate else None, sin=self.sin if self.rotate else None)


def _check_attention(model) -> None:
    """Refuse attention `causal_attention` does not reproduce (sliding windows, logit soft-capping)."""
    cfg = text_config(model.config)
    if getattr(cfg, "attn_logit_softcapping", None):
        raise NotImplementedError("the layer-local objective computes plain softmax attention; this target soft-caps "
                                  "its attention logits")
    for i, layer in enumerate(decoder(model).layers):
        if getattr(layer.self_attn, "sliding_window", None):
            raise NotImplementedError(f"target layer {i} uses sliding-window attention; the layer-local objective "
                                      "computes full causal attention")


def _query_hooks(model, positions: torch.Tensor, captured: dict) -> list:
    """Hooks keeping each layer's content-space queries [b, S_q, n_q, d] at `positions` (float32): the output of
    q_norm where the model has one (Qwen3, before RoPE), else of q_proj (as families.query_energy reads them)."""
    d = kv_shape(model).head_dim
    hooks = []
    for i, layer in enumerate(decoder(model).layers):
        attn = layer.self_attn
        module = getattr(attn, "q_norm", None) or attn.q_proj

        def hook(_m, _inp, out, i=i):
            q = out.reshape(out.shape[0], out.shape[1], -1, d)
            captured[i] = q[:, positions.to(q.device)].float()
        hooks.append(module.register_forward_hook(hook))
    return hooks


@torch.no_grad()
def _target_part(target, ids: torch.Tensor, positions: torch.Tensor, n_sink: int, cos_q, sin_q) -> list[tuple]:
    """Per target layer (queries, native_out, sink_k, sink_v) of one batch of ids [b, S] (float32, CPU)."""
    captured: dict = {}
    hooks = _query_hooks(target, positions, captured)
    try:
        native = prefill(target, ids)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for t, (k, v) in enumerate(native):
        attn = decoder(target).layers[t].self_attn
        q = captured[t].to(k.device).transpose(1, 2)  # [b, n_q, S_q, d]
        q = rope.rotate(q, cos_q.to(q.device), sin_q.to(q.device))
        scaling = float(getattr(attn, "scaling", q.shape[-1] ** -0.5))
        native_out = causal_attention(q, k.float(), v.float(), positions, scaling)
        out.append((q.cpu(), native_out.cpu(), k[:, :, :n_sink].float().cpu(), v[:, :, :n_sink].float().cpu()))
    return out


@torch.no_grad()
def collect_layer_local(source, target, token_ids: torch.Tensor, used_layers: list[int], *, n_queries: int,
                        native_sink: int = 0, key_space: str = "stripped", batch_size: int = 8,
                        progress=None) -> LayerLocalData:
    """Run source and target over unpadded ids [n, S] (positions 0..S-1) and keep what every target layer's
    layer-local loss reads (`LayerLocalData`; bytes: `layer_local_nbytes`). Source keys are RoPE-stripped
    when key_space="stripped" (as the calibration features), queries are rotated with the target's RoPE."""
    if key_space not in ("stripped", "rotated"):
        raise ValueError(f"key_space must be stripped or rotated, got {key_space!r}")
    _check_attention(target)
    n, seq = token_ids.shape
    positions = query_positions(seq, n_queries)
    all_pos = torch.arange(seq)  # device: host-side positions (RopeCodec moves them to its tables)
    cos, sin = (x[0, 0].cpu() for x in codec_for(target).cos_sin(all_pos))  # [S, d_t]
    src_codec = codec_for(source)
    n_sink = min(int(native_sink), seq)
    feats: dict = {"k": [], "v": []}
    parts: list = []
    wrap = progress or (lambda it, **_: it)
    for start in wrap(range(0, n, batch_size), desc="layer-local collection"):
        ids = token_ids[start:start + batch_size]
        src = prefill(source, ids.to(next(source.parameters()).device))
        for kind, i in (("k", 0), ("v", 1)):
            cols = []
            for s in used_layers:
                x = src[s][i]
                if kind == "k" and key_space == "stripped":
                    x = src_codec.strip(x, all_pos.to(x.device))
                cols.append(x.float().permute(0, 2, 1, 3).reshape(x.shape[0], seq, -1).cpu())  # [b, S, n_kv * d]
            feats[kind].append(torch.cat(cols, dim=-1))
        del src
        parts.append(_target_part(target, ids.to(next(target.parameters()).device), positions, n_sink,
                                  cos[positions], sin[positions]))
    layers = decoder(target).layers
    per_layer = [[torch.cat([p[t][j] for p in parts]) for t in range(len(layers))] for j in range(4)]
    return LayerLocalData(source_k=torch.cat(feats["k"]), source_v=torch.cat(feats["v"]), used_layers=list(used_layers),
                          queries=per_layer[0], native_out=per_layer[1], sink_k=per_layer[2], sink_v=per_layer[3],
                          o_proj=[layer.self_attn.o_proj.weight.detach().float().cpu() for layer in layers],
                          scaling=[float(getattr(layer.self_attn, "scaling", kv_shape(target).head_dim ** -0.5))
                                   for layer in layers],
                          positions=positions, n_kv=kv_shape(target).n_kv, cos=cos, sin=sin,
                          rotate=key_space == "stripped")


def train_map(weight: torch.Tensor, bias: torch.Tensor, selected_layers: list[list[int]], data: LayerLocalData,
              fit_rows: list[int], stop_rows: list[int], settings: TrainSettings,
              progress=None, lrs: Sequence[float] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """Train every target layer's map independently (`train_layer`) from weight [L_t, 2, p, q] and bias
    [L_t, 2, q] (the ridge map), on rows `fit_rows` of `data`, early stopping on rows `stop_rows`. With `lrs`
    (default: settings.lr alone) each layer trains once per learning rate and keeps the run of the lowest
    stop-split loss (`lowest_stop_loss`). Returns (weight, bias, per-layer records with the kept "lr") in the
    input's shapes, float32."""
    overlap = set(fit_rows) & set(stop_rows)
    if overlap:
        raise ValueError(f"rows {sorted(overlap)} are in both the fit and the stop split")
    if len(selected_layers) != weight.shape[0] or len(data.queries) != weight.shape[0]:
        raise ValueError(f"{weight.shape[0]} mapped layers, {len(selected_layers)} selections and "
                         f"{len(data.queries)} collected target layers must agree")
    out_w, out_b, records = torch.empty_like(weight, dtype=torch.float32), torch.empty_like(bias, dtype=torch.float32), []
    wrap = progress or (lambda it, **_: it)
    for t in wrap(range(weight.shape[0]), desc="layer-local training"):
        problem = data.layer(t, list(selected_layers[t]))
        layer_seed = settings.seed * 1_000_003 + t

        def at(lr: float, t=t, problem=problem, layer_seed=layer_seed):
            layer_settings = TrainSettings(**{**vars(settings), "lr": lr, "seed": layer_seed})
            return train_layer(problem, weight[t], bias[t], fit_rows, stop_rows, layer_settings)

        out_w[t], out_b[t], record = lowest_stop_loss(lrs or [settings.lr], at, "stop_loss_final")
        records.append({"layer": t, **record})
    return out_w, out_b, records
