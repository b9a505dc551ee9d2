"""lm-eval model `kvtransfer`: the target model scores continuations on a (transferred) KV cache.

Modes (what builds the cache of context[:-1], and which model scores):
    target           target alone, one forward over context + continuation (= stock lm-eval `hf`)
    source           source alone, the same way
    transfer         source prefills context[:-1], the mapper maps it, the target runs the last
                     context token + the continuation (so it scores the first continuation token);
                     with native_tail=m the target runs the last m context tokens itself on top of
                     the mapped cache of context[:-m] (a partial re-prefill: m tokens of P)
    native_injected  as transfer, on the target's own prefill round-tripped through cache I/O (= `target`)
    identity         the source cache given to the target unmapped (needs equal cache shapes)
    no_context       the floor: the target reads only the context's start ids (see below) and its
                     last token, then the continuation -- what a mapped cache that carries nothing
                     would give. A transfer below this floor destroys the context.
    truncate         the equal-cost baseline: the target reads the start ids and only the last context tokens
                     (`truncate_tokens` / `truncate_fraction`; kvtransfer.eval.truncate), scored like `target`

`wrong_context=True` (any mode; the content controls `target_wrong` / `transfer_wrong` of the eval stage)
replaces each context by another item's of the same request set, cut or drawn to the same token length,
keeping the start ids and the true last context token (kvtransfer.maps.controls.wrong_contexts, seeded by
`wrong_context_seed`): what the same cache shape and genre give without this item's content.

`context_start` (kvtransfer.core.context): position 0 of every context is what the tokenizer adds ("tokenizer")
or always BOS, else EOS ("prefix_token"); a mapper calibrated under another is refused.

`recompute_fraction=r` (transfer mode; kvtransfer.core.recompute): after mapping, the target recomputes the KV of a
fraction r of each cached prefix's tokens (chosen by `recompute_select`: deviation / random / recent), attending
to the mapped KV of the rest. `gate=thresholds` (transfer mode; kvtransfer.core.gate): per cached prefix a score
(signal `gate_score` of kvtransfer.core.signals, default the tail score over the last `gate_tail` prefix tokens)
decides map / recompute(thresholds' fraction) / the target's own prefill; `gate_signals` are recorded beside it. Both
record per cached prefix in `events` (action, fraction, score, tokens recomputed, FLOPs / re-prefill, seconds).

`map_dtype` (transfer mode; kvtransfer.core.map_dtype): the dtype the map is applied in, "float32" (the fitted
map) or "bfloat16"; None (the default) applies the mapper in the dtype it is given in. A mapper given through
`with_mode(mapper=...)` (the content controls) is applied in the same dtype.

`time_contexts=True`: `timing` accumulates what reading the contexts cost, per mode (kvtransfer.eval.truncate).

`share_prefix=True`: target/source modes also prefill each context[:-1] once for all its continuations (equal to one
pass up to float rounding; off by default: `target` equals stock lm-eval `hf` bit for bit). Tokenization and left-
truncation are lm-eval's / HFLM's; requests grouped by cached prefix (one source prefill + map each: eval.prefix).
"""
from __future__ import annotations

import copy
import logging
from collections import defaultdict

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs,
                                  postprocess_generated_text, resolve_max_length)

from ..core.context import check_mapper, check_policy, start_ids
from ..maps.controls import wrong_contexts
from ..core.cache import continuation_logprobs, forward_on_cache
from ..core.map_dtype import in_map_dtype, map_dtype as parse_map_dtype
from ..core.mapper import MapperBase, load_mapper
from ..core.models import check_same_tokenizer, kv_shape, load_model
from ..core.gate import check_thresholds
from ..core.signals import check_score, check_signals
from ..core.recompute import choose_tokens
from .decode import chunks as _chunks, greedy_decode, hit_stop as _hit_stop, pad as _pad
from .hooks import SPLIT_MODES, loglikelihood_rolling, model_info
from .prefix import build_prefix_cache
from .truncate import (OWN_PREFILL_MODES, check_truncate, new_timing, time_one_pass, timed_prefix_cache,
                       truncated_context)

log = logging.getLogger(__name__)

MODES = ("target", "source", "transfer", "native_injected", "identity", "no_context", "truncate")


@register_model("kvtransfer")
class KVTransferLM(TemplateLM):
    """lm-eval LM that scores with the target model on a cache built per `mode` (see module doc).

    Give paths (`source=`, `target=`, `mapper=` a saved mapper dir) or loaded objects
    (`source_model=`, `target_model=`, `tokenizer=`, `mapper=` a Mapper). `native_sink`: the target
    computes the first N context tokens itself (transfer mode); default: the mapper artifact's. `native_tail`:
    the target computes the last m context tokens itself on top of the mapped cache (split modes; default 1,
    the paper's protocol: only the last context token; target/source modes ignore it). `rope_at_inference=False`: the
    "no re-rotation at inference" ablation (see `map_layers`). `max_length`: token limit for
    left-truncation (default: the scoring model's config limit, as HFLM resolves it).
    """

    def __init__(self, source: str | None = None, target: str | None = None, mapper=None, mode: str = "transfer",
                 *, source_model=None, target_model=None, tokenizer=None, native_sink: int | None = None,
                 native_tail: int = 1, rope_at_inference: bool = True, context_start: str = "tokenizer",
                 allow_context_start_mismatch: bool = False, share_prefix: bool = False,
                 wrong_context: bool = False, wrong_context_seed: int = 0, progress: bool = False,
                 recompute_fraction: float = 0.0, recompute_select: str = "deviation", recompute_seed: int = 0,
                 gate: dict | None = None, gate_tail: int = 8, gate_score: str = "tail_kv", gate_signals=None,
                 truncate_tokens: int | None = None, truncate_fraction: float | None = None, time_contexts=False,
                 map_dtype: str | None = None,
                 batch_size: int | str = 1, max_batch_size: int | None = None, max_length: int | None = None,
                 device: str | None = None, dtype="auto", add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, trust_remote_code: bool = False, **unused) -> None:
        super().__init__()
        if unused:
            log.warning("kvtransfer ignores model_args %s", sorted(unused))
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto is not supported by kvtransfer; give an integer")
        self.mode = mode
        self.progress = bool(progress)
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            log.warning("device=%s requested but CUDA is unavailable; using cpu (as HFLM does)", device)
            device = "cpu"
        needs_source = mode in ("source", "transfer", "identity")
        needs_target = mode != "source"
        src_tok = tgt_tok = None
        if needs_source and source_model is None:
            if not source:
                raise ValueError(f"mode={mode} needs the source model: pass source=<path or hub id>")
            source_model, src_tok = load_model(source, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        if needs_target and target_model is None:
            if not target:
                raise ValueError(f"mode={mode} needs the target model: pass target=<path or hub id>")
            target_model, tgt_tok = load_model(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        if device is not None:
            for m in (source_model, target_model):
                if m is not None:
                    m.to(device)
        self.source_model, self.target_model = source_model, target_model
        if src_tok is not None and tgt_tok is not None:
            check_same_tokenizer(src_tok, tgt_tok)
        self.tokenizer = tokenizer or tgt_tok or src_tok
        if self.tokenizer is None:
            raise ValueError("pass tokenizer= when giving loaded models")
        self.mapper = None
        if mode == "transfer":
            if mapper is None:
                raise ValueError("mode=transfer needs mapper=<saved mapper dir or Mapper>; fit one with "
                                 "collect_moments -> fit_ridge -> Mapper.from_ridge(...).save(dir)")
            self.mapper = mapper if isinstance(mapper, MapperBase) else load_mapper(mapper, source_model, target_model)
            self.mapper.check_pair(source_model, target_model)
            self.mapper.to(self.target_model.device)
        self.map_dtype = None if map_dtype is None else parse_map_dtype(map_dtype)
        if self.mapper is not None and self.map_dtype is not None:
            self.mapper = in_map_dtype(self.mapper, self.map_dtype)  # a copy: the caller's mapper keeps its dtype
        self.context_start = check_policy(context_start)
        self.allow_context_start_mismatch = str(allow_context_start_mismatch).lower() in ("true", "1", "yes")
        if self.mapper is not None:
            check_mapper(self.mapper.calibration, self.context_start, strict=not self.allow_context_start_mismatch)
        if mode == "identity" and kv_shape(source_model) != kv_shape(target_model):
            raise ValueError(f"mode=identity needs equal cache shapes, but source is {kv_shape(source_model)} and "
                             f"target is {kv_shape(target_model)}; use mode=transfer with a fitted mapper")
        artifact_sink = self.mapper.native_sink if self.mapper is not None else 0
        if native_sink is not None and int(native_sink) != artifact_sink and self.mapper is not None:
            log.warning("native_sink=%s overrides the mapper artifact's native_sink=%s (the map was fitted to be "
                        "applied with the latter)", native_sink, artifact_sink)
        self.native_sink = artifact_sink if native_sink is None else int(native_sink)
        self.native_tail = int(native_tail)
        if self.native_tail < 1:
            raise ValueError(f"native_tail={native_tail}: the target runs at least the last context token (use 1, "
                             "the paper's protocol, or more for a partial re-prefill)")
        self.share_prefix = str(share_prefix).lower() in ("true", "1", "yes")
        self.wrong_context = str(wrong_context).lower() in ("true", "1", "yes")
        self.wrong_context_seed = int(wrong_context_seed)
        self.rope_at_inference = str(rope_at_inference).lower() not in ("false", "0", "no")
        self.recompute_fraction = float(recompute_fraction)
        choose_tokens(1, self.recompute_fraction, recompute_select)  # ValueError naming the fix for a bad r / rule
        self.recompute_select, self.recompute_seed = recompute_select, int(recompute_seed)
        self.gate, self.gate_tail = None if gate is None else check_thresholds(gate), int(gate_tail)
        self.gate_score, self.gate_signals = check_score(gate_score), check_signals(gate_signals)
        self.repair = self.gate is not None or self.recompute_fraction > 0  # True: records events even at r = 0
        self.events: list[dict] = []
        self.truncate_tokens, self.truncate_fraction = truncate_tokens, truncate_fraction
        self.time_contexts = str(time_contexts).lower() in ("true", "1", "yes")
        self.timing = new_timing()
        self.batch_size_per_gpu = int(batch_size)
        self._max_length = int(max_length) if max_length else None
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.batch_sizes = {}
        self._start_ids = start_ids(self.tokenizer, self.context_start)
        self._device = self.scoring_model.device

    # ------------------------------------------------------------------ properties
    def with_mode(self, mode: str, **changes) -> "KVTransferLM":
        """A shallow copy in another mode (same loaded models/mapper); `changes` set attributes."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if mode == "transfer" and self.mapper is None:
            raise ValueError("mode=transfer needs a mapper; construct with mapper=")
        if mode in ("source", "identity") and self.source_model is None:
            raise ValueError(f"mode={mode} needs the source model")
        if mode == "identity" and kv_shape(self.source_model) != kv_shape(self.target_model):
            raise ValueError("mode=identity needs equal cache shapes; use mode=transfer with a fitted mapper")
        other = copy.copy(self)
        other.mode = mode
        other.timing = new_timing()  # each mode (copy) times its own contexts
        for k, v in changes.items():
            setattr(other, k, v)
        if other.mode == "truncate":
            check_truncate(other.truncate_tokens, other.truncate_fraction)
        if "mapper" in changes and "native_sink" not in changes and other.mapper is not None:
            other.native_sink = other.mapper.native_sink  # a map comes with its sink
        if "mapper" in changes and other.mapper is not None and other.map_dtype is not None:
            other.mapper = in_map_dtype(other.mapper, other.map_dtype)  # a control is applied as the map is
        if other.mode == "transfer":
            other.mapper.check_pair(other.source_model, other.target_model)
        if "context_start" in changes or "mapper" in changes:
            other.context_start = check_policy(other.context_start)
            other._start_ids = start_ids(other.tokenizer, other.context_start)
            if other.mapper is not None:
                check_mapper(other.mapper.calibration, other.context_start,
                             strict=not other.allow_context_start_mismatch)
        other._device = other.scoring_model.device
        return other

    @property
    def scoring_model(self):
        """The model whose logits are scored: the source in `source` mode, else the target."""
        return self.source_model if self.mode == "source" else self.target_model

    @property
    def eot_token_id(self) -> int:
        """End-of-text id (the tokenizer's EOS)."""
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Token used as context for an empty context (HFLM's rule: custom, else BOS, else EOS)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Max tokens the scoring model sees (explicit, else its config limit, else tokenizer, else 2048)."""
        if self._max_length:
            return self._max_length
        return resolve_max_length(self.scoring_model.config, self.tokenizer, default=2048)

    @property
    def max_gen_toks(self) -> int:
        """Default generation budget when a task sets none (HFLM's 256)."""
        return 256

    @property
    def batch_size(self) -> int:
        """Rows per forward (prefixes per prefill, continuations per scoring pass)."""
        return self.batch_size_per_gpu

    @property
    def device(self):
        """Device of the scoring model."""
        return self._device

    @property
    def tokenizer_name(self) -> str:
        """Tokenizer name for lm-eval's request-cache fingerprints."""
        return self.tokenizer.name_or_path.replace("/", "__")

    @property
    def pad_token_id(self) -> int:
        """Id used for padding (always masked): pad, else EOS, else 0."""
        tok = self.tokenizer
        for t in (tok.pad_token_id, tok.eos_token_id, 0):
            if t is not None:
                return t

    # lm-eval hooks kept in kvtransfer.eval.hooks: run metadata, rolling log-likelihood (target / source only)
    get_model_info, loglikelihood_rolling = model_info, loglikelihood_rolling

    # ------------------------------------------------------------------ tokenization
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        """Token ids of `string`, HFLM's rules (no second BOS when the string starts with one).

        Under context_start="prefix_token" a context (add_special_tokens not False) always starts
        with the prefix token, whatever the tokenizer adds itself.
        """
        if self.context_start == "prefix_token" and add_special_tokens is not False:
            ids = self.tokenizer.encode(string, add_special_tokens=False)
            if ids[:len(self._start_ids)] != self._start_ids:
                ids = self._start_ids + ids
            return ids[-left_truncate_len:] if left_truncate_len else ids
        kw = {}
        if add_special_tokens is not None:
            kw["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            kw["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **kw)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        """Text of token ids (special tokens dropped by default, as HFLM)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ caches
    @torch.no_grad()
    def prefix_cache(self, prefixes: list[list[int]]):
        """Target-format cache of left-padded `prefixes`, built per mode: (layers, mask [G, P]) or (None, None).

        layers: per target layer (K, V) [G, n_kv, P, d]. In `target` / `source` mode this is the
        scoring model's own prefill (used by the multi-turn protocol; lm-eval scoring runs one pass).
        """
        return build_prefix_cache(self, prefixes)

    def cut(self, context: list[int]) -> tuple[list[int], list[int]]:
        """(cached prefix, context tail the scorer runs itself) of a context in a cached-prefix mode.

        The tail is the last `native_tail` tokens in split modes (at most len - 1, so a prefix remains)
        and the last token in target/source modes, whose cache is the scorer's own either way."""
        m = max(1, min(self.native_tail, len(context) - 1)) if self.mode in SPLIT_MODES else 1
        return context[:-m], context[-m:]

    def split(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """(cached prefix, tokens the scorer runs) for one request after HFLM's left-truncation.

        Split modes: prefix, tail = cut(context) (context[:-1], context[-1:] by default), run = tail +
        continuation[:-1]; one-pass
        modes: prefix = [], run = context + continuation[:-1]. Raises if the continuation alone
        exceeds max_length.
        """
        if not context or not continuation:
            raise ValueError("context and continuation must both be non-empty token lists")
        if len(continuation) > self.max_length:
            raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length={self.max_length}; "
                             "raise max_length (model_args max_length=...) or shorten the continuation")
        full = (context + continuation)[-(self.max_length + 1):]
        ctx = full[:len(full) - len(continuation)]
        if self.mode == "no_context":
            return [], (self._floor_context(ctx) + continuation)[:-1]
        if self.mode == "truncate":
            ctx = self.truncated_context(ctx)
            full = ctx + continuation
        if self._cached_prefix():
            prefix, tail = self.cut(ctx)
            return prefix, tail + continuation[:-1]
        return [], full[:-1]

    def _cached_prefix(self) -> bool:
        """Whether context[:-1] goes through a prefix cache: split modes always; target/source with
        share_prefix (one prefill per shared context; equal to one pass up to float rounding)."""
        return self.mode in SPLIT_MODES or (self.share_prefix and self.mode in OWN_PREFILL_MODES)

    def truncated_context(self, ctx: list[int]) -> list[int]:
        """truncate mode: the context cut as kvtransfer.eval.truncate.truncated_context cuts it."""
        return truncated_context(ctx, self._start_ids, self.truncate_tokens, self.truncate_fraction)

    def _floor_context(self, ctx: list[int]) -> list[int]:
        """no_context mode: the start ids and the last context token (the context itself if shorter)."""
        body = ctx[len(self._start_ids):] if ctx[:len(self._start_ids)] == self._start_ids else ctx
        return self._start_ids + body[-1:] if body else list(ctx)

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]], *, disable_tqdm: bool = False
                     ) -> list[tuple[torch.Tensor, bool]]:
        """(per-token log-probs float32 [len(continuation)] on CPU, is_greedy) per (context, continuation).

        One prefix cache per unique cached prefix; continuations batched (right-padded) by batch_size. A
        progress bar counts scored requests when the LM was built with progress=True and lm-eval does not
        pass disable_tqdm.
        """
        bar = self._bar(len(pairs), f"scoring ({self.mode})", disable_tqdm)
        out: list[tuple | None] = [None] * len(pairs)
        if self.wrong_context:
            pairs = self.swap_contexts(pairs)
        groups: dict[tuple, list[int]] = defaultdict(list)
        runs = []
        reference: dict[tuple, int] = {}  # cached prefix -> tokens of a re-prefill of its whole context[:-1]
        for i, (ctx, cont) in enumerate(pairs):
            prefix, run = self.split(list(ctx), list(cont))
            groups[tuple(prefix)].append(i)
            runs.append(run)
            reference[tuple(prefix)] = min(len(ctx), self.max_length + 1 - len(cont)) - 1
        if self.time_contexts and not self._cached_prefix():
            time_one_pass(self, pairs)
        n_long = sum(1 for c, k in pairs if len(c) + len(k) > self.max_length + 1)
        if n_long:
            log.warning("%d request(s) exceed max_length=%d; left-truncated like HFLM", n_long, self.max_length)
        # longest first; empty prefixes (one-pass modes, 1-token contexts) batched on their own
        keys = sorted(groups, key=lambda k: (-len(k), k))
        for part in ([k for k in keys if k], [k for k in keys if not k]):
            if not part:
                continue
            if not part[0]:  # one group holding every request with an empty prefix
                rows = sorted(groups[()], key=lambda i: (-len(runs[i]), i))
                for chunk in _chunks(rows, self.batch_size):
                    self._score_batch(None, None, [0] * len(chunk), chunk, runs, pairs, out)
                    bar.update(len(chunk))
                continue
            for gchunk in _chunks(part, self.batch_size):
                layers, pmask = timed_prefix_cache(self, [list(k) for k in gchunk], [reference[k] for k in gchunk])
                rows = [(g, i) for g, k in enumerate(gchunk) for i in groups[k]]
                for chunk in _chunks(rows, self.batch_size):
                    self._score_batch(layers, pmask, [g for g, _ in chunk], [i for _, i in chunk], runs, pairs, out)
                    bar.update(len(chunk))
        bar.close()
        return out

    def _bar(self, total: int, desc: str, disable: bool):
        """A tqdm bar over `total` requests, or a no-op one when progress is off (or lm-eval disables it)."""
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="req", disable=disable or not self.progress, leave=False)

    def swap_contexts(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
        """(wrong context, continuation) per (context, continuation): each distinct context replaced by
        kvtransfer.maps.controls.wrong_contexts over this request set (same length, start ids and last token kept)."""
        swap = wrong_contexts([list(c) for c, _ in pairs], self._start_ids, self.wrong_context_seed)
        return [(swap[tuple(c)], list(k)) for c, k in pairs]

    def _score_batch(self, layers, pmask, gidx, idx, runs, pairs, out) -> None:
        """Score requests `idx` (rows of prefix group `gidx`) in one forward; fill `out`."""
        model = self.scoring_model
        ids, mask = _pad([runs[i] for i in idx], self.pad_token_id, "right", model.device)
        if layers is not None:
            sel = torch.tensor(gidx, device=pmask.device)
            layers = [(k.index_select(0, sel.to(k.device)), v.index_select(0, sel.to(v.device))) for k, v in layers]
            pmask = pmask.index_select(0, sel)
        logits = forward_on_cache(model, layers, pmask, ids, mask)
        for row, i in enumerate(idx):
            cont = torch.tensor(pairs[i][1], device=logits.device)
            n, end = len(cont), len(runs[i])
            lp = continuation_logprobs(logits[row:row + 1, end - n:end], cont[None])[0]
            greedy = bool((logits[row, end - n:end].argmax(-1) == cont).all())
            out[i] = (lp.cpu(), greedy)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """lm-eval hook: [((context, continuation), context_enc, continuation_enc)] -> [(logprob, is_greedy)]."""
        scored = self.score_tokens([(ctx, cont) for _, ctx, cont in requests], disable_tqdm=disable_tqdm)
        results = []
        for (key, _, _), (lp, greedy) in zip(requests, scored):
            answer = (float(lp.sum()), greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_tokens(self, contexts: list[list[int]], *, until: list[str], max_gen_toks: int,
                        disable_tqdm: bool = False) -> list[list[int]]:
        """Greedy continuation token ids of each context (stops at EOS, a stop string or max_gen_toks)."""
        out: list[list[int] | None] = [None] * len(contexts)
        bar = self._bar(len(contexts), f"generating ({self.mode})", disable_tqdm)
        if self.wrong_context:
            contexts = [c for c, _ in self.swap_contexts([(c, []) for c in contexts])]
        order = sorted(range(len(contexts)), key=lambda i: (-len(contexts[i]), i))
        split = self._cached_prefix()
        parts = ([i for i in order if len(contexts[i]) > 1], [i for i in order if len(contexts[i]) <= 1]) if split \
            else (order,)
        for part in parts:
            for chunk in _chunks(part, self.batch_size):
                ctxs = [contexts[i] for i in chunk]
                for i, toks in zip(chunk, self._generate_batch(ctxs, until, max_gen_toks)):
                    out[i] = toks
                bar.update(len(chunk))
        bar.close()
        return out

    def _eos_ids(self) -> set[int]:
        """Ids that end a generation: the scoring model's generation_config EOS(s) plus the tokenizer's."""
        eos = getattr(getattr(self.scoring_model, "generation_config", None), "eos_token_id", None)
        ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _generate_batch(self, ctxs: list[list[int]], until: list[str], max_gen_toks: int) -> list[list[int]]:
        model = self.scoring_model
        if self.mode == "truncate":
            ctxs = [self.truncated_context(c) for c in ctxs]
        if self._cached_prefix():
            cuts = [self.cut(c) for c in ctxs]
            layers, pmask = timed_prefix_cache(self, [prefix for prefix, _ in cuts],
                                                     [len(c) - 1 for c in ctxs])
            ids, mask = _pad([tail for _, tail in cuts], self.pad_token_id, "left", model.device)
        else:
            layers, pmask = None, None
            if self.mode == "no_context":
                ctxs = [self._floor_context(c) for c in ctxs]
            ids, mask = _pad(ctxs, self.pad_token_id, "left", model.device)
        return greedy_decode(model, layers, pmask, ids, mask, max_gen_toks=max_gen_toks,
                             eos_ids=self._eos_ids(), is_done=lambda toks: _hit_stop(self.tokenizer, toks, until))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """lm-eval hook: greedy generation per (context, gen_kwargs); text cut at the first stop string."""
        results: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_kwargs[repr(sorted(req.args[1].items()))].append(i)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for idx in by_kwargs.values():
            kwargs = normalize_gen_kwargs(requests[idx[0]].args[1], self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("kvtransfer generates greedily; set do_sample=False")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            max_ctx = self.max_length - max_gen_toks
            if max_ctx <= 0:
                raise ValueError(f"max_gen_toks={max_gen_toks} must be below max_length={self.max_length}")
            contexts = [self.tok_encode(requests[i].args[0], left_truncate_len=max_ctx) for i in idx]
            gens = self.generate_tokens(contexts, until=until, max_gen_toks=max_gen_toks, disable_tqdm=disable_tqdm)
            for i, toks in zip(idx, gens):
                text = postprocess_generated_text(self.tok_decode(toks), stop=until, think_end_token=None)
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
                results[i] = text
        return results
