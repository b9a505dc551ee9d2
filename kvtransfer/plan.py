"""Resource plan of a run: peak GPU memory, host memory, disk and wall time per stage, before anything loads.

    python -m kvtransfer.plan pair=qwen3_14b_32b [calib.dtype=float32 ...] [--node h200 | --gpu-mem GiB
        --host-mem GiB --disk GiB --gpus N --gpu H100|H200|A100] [--weights-on-disk] [--json] [--out DIR]

Every figure is computed from the code's data layout (kvtransfer.calibrate / moments / ridge / select /
mapper / transfer / runner.pipeline), not measured; the formulas are in the functions below and each names
the code it follows. What a run holds, by stage, when `runner.pipeline.execute` runs them in one process:

calibrate  (`collect_moments`) both models on the device (co-resident; `capture=sequential`: the source,
           then the target); per batch the features x [m, Dx] / y [m, Dy] in float32 and, on the
           *target's device*, the batch's centred products cxx [Dx, Dx] + cxy [Dx, Dy] for K and V in
           `compute_dtype` (default: `dtype`); the running train moments (both kinds) in `calib.dtype` on
           `calib.store_device`, and the held-out raw features (`HeldOut`: at most
           `calib.heldout_observations` rows of x [Dx] and y [Dy] per kind, float32) on the same store; the
           merge ships one kind's products to the store (a blocking copy converts on the host: a temporary of
           the largest tensor). The checkpoint (train moments + held-out features, a tensor directory:
           `io.save_tensor_dir`) is rewritten in place one piece (<= `io.PIECE_BYTES` of rows) at a time, so
           the disk holds the calibration + one piece at the peak; the finished checkpoint is the artifact
           (no final copy); sequential capture first writes every batch's source features to disk. Nothing
           is read back: each later stage reads the moments it needs and releases them
           (`Run.release_moments`), so eval and bench hold none.
           `calib.accumulate=device`: the train moments live on the target's GPU in `calib.dtype` (means and
           cyy float64) and each batch is merged in place by one GEMM per matrix (`Moments.accumulate`): no
           batch products, no device->host traffic except one piece per checkpoint write.
fit        train moments + held-out features in host memory (device cpu), the single-source R² pass and
           one ridge solve per (target layer, kind) in float64 on the host CPU (`fit_layer`, Cholesky),
           the float64 weights of every layer until `Mapper.from_ridge` stacks them (3x float64 at its
           peak); no model is loaded (the mapper's pair identity comes from the configs, `Run.identity`;
           an MLP mapper trains on the GPU and loads both).
eval       both models + the float32 mapper on the target's device, per batch a source prefill, the
           mapped cache (`map_layers`' buffers) and the scorer's logits; wall time from token counts of the
           configured tasks (approximate dataset sizes and prompt lengths, `EVAL_TASKS`).
bench      both models + mapper, the largest `bench.tokens` source caches, mapped cache and target prefill.
report     Table-7 ridge fits for `report.variance_k` on the held moments and, with
           `report.rotated_heatmap`, a second full calibration on rotated keys while the first is held.
Weight offload (`pair.<side>.max_memory`, accelerate): the layers past the GPU budget live in host memory
(`offloaded_bytes`; the GPU keeps the resident layers + room for one offloaded layer) and every forward
pass copies them to the GPU once: calibrate per batch, eval per forward call (decode steps included),
bench per timed prefill.

Rates: on a CPU-only run, measured here (a ~0.2 s matmul/copy micro-benchmark); on a GPU, the
device table `DEVICES` (NVIDIA datasheet peaks x `EFFICIENCY`), and for host-side work on a GPU
node the assumptions in `HOST_ASSUMED` (or this machine's measured CPU when planning the machine
the plan runs on). Times are estimates to an order of magnitude, memory and disk to ~10 %.

No Hydra / lm-eval / W&B import at module level: `main` composes the Hydra config inside.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1 << 30
STAGES = ("calibrate", "fit", "eval", "bench", "report")
DTYPE_BYTES = {"float64": 8, "double": 8, "float32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
               "fp16": 2, "fp32": 4, "half": 2}
ROOT = Path(__file__).resolve().parents[1]

# -- device rates ------------------------------------------------------------------------------------
# Peak dense rates (FLOP/s) and memory bandwidth (bytes/s) from NVIDIA's SXM datasheets: H100 SXM5
# 80 GB: BF16/FP16 tensor 989 TFLOP/s (dense), FP32 67, FP64 tensor core 67, HBM3 3.35 TB/s; H200 SXM:
# the same compute, HBM3e 4.8 TB/s, 141 GB; A100 SXM 80 GB: BF16 312, FP32 19.5, FP64 tensor 19.5,
# 2.04 TB/s. torch runs FP32 matmuls without TF32 by default, hence the plain FP32 rate.
DEVICES = {
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float64": 67e12, "bw": 3.35e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float64": 67e12, "bw": 4.8e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12, "float64": 19.5e12, "bw": 2.04e12},
}
DEVICE_SOURCE = ("NVIDIA H100/H200/A100 SXM datasheets (dense peaks) x efficiency "
                 "{matmul: 0.6, bandwidth: 0.8}")
EFFICIENCY = {"matmul": 0.6, "bandwidth": 0.8}
# Host side of a GPU node (the fit's float64 solves, the moments merge, checkpoints) -- ASSUMPTIONS for a
# typical 2-socket server, used when the plan is made for a node other than the one it runs on:
HOST_ASSUMED = {"float64": 0.5e12, "float32": 1.0e12, "bw": 50e9,   # sustained CPU GEMM, memory traffic
                "link": 10e9,                                       # device <-> pageable host copies
                "disk": 2e9, "load": 2e9}                           # local NVMe write/read, weight loading
HOST_SOURCE = ("ASSUMED host: 0.5 TFLOP/s fp64 / 1 TFLOP/s fp32 CPU GEMM, 50 GB/s memory traffic, "
               "10 GB/s device<->host, 2 GB/s disk and weight loading")
# Node shapes of issue 10. GPU memory per device as nvidia-smi reports it (H200: 143,771 MiB,
# H100-80GB: 81,559 MiB); "1 TB" disk = 1e12 bytes.
NODES = {
    "h200": dict(name="1xH200", gpus=1, gpu_gib=140.4, host_gib=128.0, disk_gib=64.0, gpu="H200"),
    "8xh100": dict(name="8xH100-80GB", gpus=8, gpu_gib=79.6, host_gib=1024.0, disk_gib=1e12 / GiB, gpu="H100"),
}
RUNTIME_HOST = 1.5 * GiB   # python + torch + transformers (+ CUDA libraries on a GPU node: RUNTIME_HOST_CUDA)
RUNTIME_HOST_CUDA = 3.0 * GiB
RUNTIME_GPU = 1.0 * GiB    # CUDA context + cuBLAS workspaces
LOAD_SHARD = 5 * GiB       # host bytes while loading with device_map (one safetensors shard at a time)


@dataclass
class Node:
    """What the run has: `gpus` devices of `gpu_gib` each (0 = CPU only), host memory, local disk."""

    name: str = "this machine"
    gpus: int = 0
    gpu_gib: float = 0.0
    host_gib: float = 0.0
    disk_gib: float = 0.0
    gpu: str | None = None   # key of DEVICES, or None (CPU, or an unknown GPU: rates measured)
    weights_on_disk: bool = False


@dataclass
class Rates:
    """Sustained rates the time estimates use (FLOP/s, bytes/s)."""

    name: str
    source: str
    flops: dict          # on the compute device, by dtype
    bw: float            # compute device memory bandwidth
    host_flops: dict     # host CPU, by dtype
    host_bw: float
    link: float | None   # device <-> host copies (None: the compute device is the host)
    disk: float
    load: float


_MEASURED: dict = {}


def measure_cpu() -> dict:
    """This CPU's sustained fp64/fp32 matmul rate and copy bandwidth (best of 3; ~0.2 s; cached)."""
    if "cpu" in _MEASURED:
        return _MEASURED["cpu"]
    import torch

    out = {}
    for name, dtype, n in (("float64", torch.float64, 384), ("float32", torch.float32, 512)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        out[name] = 2 * n ** 3 / best
    src = torch.randn(8 << 20)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    out["bw"] = 2 * src.numel() * 4 / best
    _MEASURED["cpu"] = out
    return out


def rates_for(node: Node, device: str, *, local: bool = False) -> Rates:
    """Rates for `device` ("cpu" / "cuda") on `node`. local=True: the plan runs on that node, so its CPU
    is measured; otherwise a GPU node's host side uses HOST_ASSUMED."""
    if device == "cpu":
        m = measure_cpu()
        flops = {"float64": m["float64"], "float32": m["float32"], "bfloat16": m["float32"] / 2,
                 "float16": m["float32"] / 2}
        return Rates("cpu (measured here)", "micro-benchmark on this CPU: matmul fp64 384^3 / fp32 512^3, "
                     "32 MiB copy; bf16 = fp32/2 (assumed); disk 1 GB/s (assumed)",
                     flops, m["bw"], flops, m["bw"], None, 1e9, 1e9)
    spec = DEVICES.get(node.gpu or "")
    if spec is None:
        spec, gpu_src = _measure_gpu(), "measured on this GPU (matmul 4096^3 per dtype, 1 GiB copy)"
    else:
        gpu_src = DEVICE_SOURCE
    flops = {k: v * EFFICIENCY["matmul"] for k, v in spec.items() if k != "bw"}
    if local:
        m = measure_cpu()
        host = {"float64": m["float64"], "float32": m["float32"]}
        host_bw, host_src = m["bw"], "host CPU measured here"
    else:
        host, host_bw, host_src = ({k: HOST_ASSUMED[k] for k in ("float64", "float32")}, HOST_ASSUMED["bw"],
                                   HOST_SOURCE)
    return Rates(node.gpu or "cuda (measured)", f"{gpu_src}; {host_src}", flops, spec["bw"] * EFFICIENCY["bandwidth"],
                 host, host_bw, HOST_ASSUMED["link"], HOST_ASSUMED["disk"], HOST_ASSUMED["load"])


def _measure_gpu() -> dict:
    import torch

    out = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("float64", torch.float64)):
        a = torch.randn(4096, 4096, device="cuda", dtype=dtype)
        a @ a
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ a
        torch.cuda.synchronize()
        out[name] = 2 * 4096 ** 3 / (time.perf_counter() - t0) / EFFICIENCY["matmul"]
    out["float16"] = out["bfloat16"]
    src = torch.empty(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    out["bw"] = 2 * src.numel() * 4 / (time.perf_counter() - t0) / EFFICIENCY["bandwidth"]
    return out


# -- model shapes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model's text stack (from a real transformers config)."""

    name: str
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie: bool
    load_extra_params: int = 0   # loaded with the checkpoint, then dropped (a VLM's vision tower)

    @property
    def width(self) -> int:
        """K (or V) features per token per layer: n_kv * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q,k,v,o (+ q/k/v biases for qwen2, q/k norms for qwen3),
        gated MLP, two RMSNorms."""
        h, qd = self.hidden, self.heads * self.head_dim
        n = 2 * h * qd + 2 * h * self.width + 3 * h * self.intermediate + 2 * h
        if self.model_type == "qwen2":
            n += qd + 2 * self.width
        if self.model_type == "qwen3":
            n += 2 * self.head_dim
        return n

    @property
    def body_params(self) -> int:
        """Decoder layers + final norm (what `prefill` runs; no embeddings)."""
        return self.layers * self.layer_params + self.hidden

    @property
    def params(self) -> int:
        """All parameters of the causal LM: embeddings + body + LM head (0 when tied)."""
        return self.body_params + self.vocab * self.hidden * (1 if self.tie else 2)


def shape_from_config(config, name: str = "", load_extra_params: int = 0) -> ModelShape:
    """ModelShape of a transformers config (its text config for VLMs)."""
    from .models import kv_shape, text_config

    cfg = text_config(config)
    kv = kv_shape(cfg)
    return ModelShape(name or str(getattr(cfg, "_name_or_path", "")), cfg.model_type, kv.n_layers, cfg.hidden_size,
                      cfg.intermediate_size, cfg.num_attention_heads, kv.n_kv, kv.head_dim, cfg.vocab_size,
                      bool(getattr(cfg, "tie_word_embeddings", False)), load_extra_params)


def load_shape(spec: dict, trust_remote_code: bool = False) -> ModelShape:
    """Shape of a pair side {"id", "path"}: the local directory's config.json when `path` is set,
    else the shipped table (kvtransfer.resources.model_configs), else a config already in the local HF cache.
    Never downloads and never reads weights."""
    from transformers import AutoConfig

    from .resources.model_configs import MODEL_CONFIGS

    path, hub_id = spec.get("path"), spec.get("id")
    if path:
        return shape_from_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), str(path))
    if hub_id in MODEL_CONFIGS:
        fields = dict(MODEL_CONFIGS[hub_id])
        extra = fields.pop("load_extra_params", 0)
        return shape_from_config(AutoConfig.for_model(fields.pop("model_type"), **fields), hub_id, extra)
    try:
        cfg = AutoConfig.from_pretrained(hub_id, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 -- any failure means: no local config
        raise ValueError(f"no config for {hub_id!r}: set pair.<side>.path to a local model directory, or add its "
                         "fields to kvtransfer/resources/model_configs.py") from err
    return shape_from_config(cfg, hub_id)


# -- size formulas -----------------------------------------------------------------------------------
def dtype_bytes(name) -> int:
    """Bytes per element of a dtype name ("float64", "bfloat16", torch.float32, ...)."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}")
    return DTYPE_BYTES[key]


def moments_kind_bytes(dx: int, dy: int, nbytes: int) -> int:
    """One kind (K or V) of a `Moments`: mean_x [Dx], mean_y [Dy], cxx [Dx, Dx], cxy [Dx, Dy], cyy [Dy]."""
    return (dx * dx + dx * dy + dx + 2 * dy) * nbytes


def moments_bytes(dx: int, dy: int, nbytes: int) -> int:
    """One set of calibration moments (the train split): K and V."""
    return 2 * moments_kind_bytes(dx, dy, nbytes)


def heldout_bytes(rows: int, dx: int, dy: int, nbytes: int = 4) -> int:
    """Held-out raw features (`moments.HeldOut`): x [rows, Dx] and y [rows, Dy] for K and V (float32), plus the
    int64 row selection."""
    return 2 * rows * (dx + dy) * nbytes + rows * 8


def mapper_params(ls_width: int, target: ModelShape, k: int) -> int:
    """Ridge mapper parameters: L_t * 2 * (p * q + q), p = k * n_kv_s * d_s, q = n_kv_t * d_t (the paper's
    count + biases)."""
    p, q = k * ls_width, target.width
    return target.layers * 2 * (p * q + q)


def prefill_flops(m: ModelShape, tokens: int, seq: int, lm_head: bool = False) -> float:
    """FLOPs of running `tokens` tokens in sequences of length `seq` through the body (+ LM head):
    2 * params * tokens + causal attention 2 * L * seq * (heads * d) per token."""
    attn = 2 * m.layers * seq * m.heads * m.head_dim * tokens
    return 2 * m.body_params * tokens + attn + (2 * m.vocab * m.hidden * tokens if lm_head else 0)


def forward_bytes(m: ModelShape, batch: int, seq: int, w: int, *, math_attention: bool, cache: bool = True) -> int:
    """Device bytes of one `prefill` of [batch, seq]: the KV cache of every layer (kept) + one layer's
    activations (residual and norms ~4 h, gated MLP 3 I, q/attention output 2 * heads * d) + the
    boolean 4D mask; the math/eager attention path (CPU) also materialises scores [batch, heads, seq, seq] fp32 x2."""
    t = batch * seq
    kv = m.layers * 2 * t * m.width * w if cache else 0
    act = t * (4 * m.hidden + 3 * m.intermediate + 2 * m.heads * m.head_dim) * w
    mask = batch * seq * seq
    scores = 2 * batch * m.heads * seq * seq * 4 if math_attention else 0
    return kv + act + mask + scores


def weight_bytes(m: ModelShape, w: int, *, with_extra: bool = False) -> int:
    """Bytes of the model's weights in dtype size `w` (with_extra: as loaded, incl. a dropped vision tower)."""
    return (m.params + (m.load_extra_params if with_extra else 0)) * w


def offloaded_bytes(m: ModelShape, w: int, max_memory: dict | None, gpus: int) -> int:
    """Weights that `max_memory` keeps off the GPUs (on the host, streamed to the GPU on every forward).

    Follows accelerate's `infer_auto_device_map`: modules fill the GPU budgets in order, and once
    something must be offloaded the first GPU keeps room for the largest offloaded layer (which is
    copied there to run). GPU keys past the node's `gpus` count for nothing."""
    if not max_memory:
        return 0
    from .models import size_bytes

    total = weight_bytes(m, w)
    budget = sum(size_bytes(v) for k, v in max_memory.items() if isinstance(k, int) and k < max(1, gpus))
    if total <= budget:
        return 0
    return total - max(0, budget - m.layer_params * w)


# -- the stage model ---------------------------------------------------------------------------------
@dataclass
class Usage:
    """Peak of one stage: bytes per GPU (the fullest one), host bytes, disk bytes, seconds, and
    the named parts behind each peak (for plan.md)."""

    gpu: float = 0.0
    host: float = 0.0
    disk: float = 0.0
    seconds: float = 0.0
    parts: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    dev_parts: dict = field(default_factory=dict)    # before placement: what sits on the compute device
    host_parts: dict = field(default_factory=dict)   # ... and what sits on the host regardless


# lm-eval tasks: items (full split), requests per item, distinct contexts per item, mean context and
# continuation tokens, generated tokens (generation tasks), longest context. APPROXIMATE (public split
# sizes; prompt lengths estimated for Llama/Qwen tokenizers); the "tiny" rows are data/tiny's sizes.
EVAL_TASKS = {
    "arc_challenge": dict(items=1172, choices=4, contexts=1, ctx=45, cont=6, gen=0, longest=256),
    "hellaswag": dict(items=10042, choices=4, contexts=1, ctx=75, cont=30, gen=0, longest=256),
    "winogrande": dict(items=1267, choices=2, contexts=2, ctx=25, cont=10, gen=0, longest=128),
    "mmlu": dict(items=14042, choices=4, contexts=1, ctx=620, cont=1, gen=0, longest=2048),
    "gsm8k_cot": dict(items=1319, choices=1, contexts=1, ctx=900, cont=0, gen=-1, longest=1536),
    "gsm8k": dict(items=1319, choices=1, contexts=1, ctx=800, cont=0, gen=-1, longest=1536),
    "tiny_cloze": dict(items=300, choices=4, contexts=1, ctx=60, cont=20, gen=0, longest=256),
    "tiny_completion": dict(items=200, choices=1, contexts=1, ctx=100, cont=0, gen=-1, longest=256),
}
_UNKNOWN_TASK = dict(items=1000, choices=4, contexts=1, ctx=200, cont=10, gen=0, longest=1024)
COQA_CONTEXT = 350  # tokens of story + history per turn (approximate)


class Setup:
    """Everything the stage formulas read, derived from a plain config dict + shapes + node + rates."""

    def __init__(self, cfg: dict, src: ModelShape, tgt: ModelShape, node: Node, rates: Rates):
        self.cfg, self.node, self.rates = cfg, node, rates
        pair = cfg["pair"]
        if pair.get("direction", "forward") == "reverse":
            src, tgt = tgt, src
        self.src, self.tgt = src, tgt
        self.device = run_device(cfg, node)
        self.notes = ([f"device={cfg.get('device')} but the node has no GPU: planned on the CPU"]
                      if self.device == "cpu" and str(cfg.get("device", "auto")).startswith("cuda") else [])
        from .models import device_map_for

        # per model: its own pair.<side>.device_map, else the run-wide one (models.device_map_for)
        self.mapped = {attr: bool(device_map_for(cfg, side)) for attr, side in (("src", "source"), ("tgt", "target"))}
        self.spread = {attr: node.gpus if (self.device == "cuda" and on and node.gpus > 1) else 1
                       for attr, on in self.mapped.items()}
        mdtype = pair.get("dtype", "auto")
        self.w = 2 if mdtype == "auto" else dtype_bytes(mdtype)
        # weight offload (pair.<side>.max_memory): what stays on the host and is streamed per forward pass
        from .models import max_memory_for, size_bytes

        self.offload = {}
        for attr, side in (("src", "source"), ("tgt", "target")):
            mm = max_memory_for(cfg, side) if self.device == "cuda" else None
            self.offload[attr] = offloaded_bytes(getattr(self, attr), self.w, mm, node.gpus)
            cpu = size_bytes(mm["cpu"]) if mm and "cpu" in mm else None
            if self.offload[attr] and cpu is not None and cpu < self.offload[attr]:
                self.notes.append(f"pair.{side}.max_memory: cpu {cpu / GiB:.1f} GiB < {self.offload[attr] / GiB:.1f} "
                                  "GiB offloaded; accelerate puts the rest on disk (offload_folder), not planned here")
        self.mdtype = "bfloat16" if self.w == 2 else ("float32" if self.w == 4 else "float64")
        c = cfg["calib"]
        self.calib = c
        self.n_seq, self.seq, self.stride = int(c["n_sequences"]), int(c["seq_len"]), int(c["stride"])
        self.batch = int(c["batch_size"])
        hf = float(c.get("heldout_fraction", 0.1))
        n_held = int(round(self.n_seq * hf))
        if hf > 0 and n_held == 0:
            n_held = 1
        self.n_held, self.n_train = n_held, self.n_seq - n_held
        self.kept = -(-self.seq // self.stride)
        cap = c.get("heldout_observations")
        self.held_rows = n_held * self.kept if cap is None else min(int(cap), n_held * self.kept)
        self.n_batches = -(-self.n_train // self.batch) + -(-self.n_held // self.batch)
        self.rows = self.batch * self.kept                      # m: observations per batch
        self.every = max(1, int(c.get("checkpoint_every", 64)) // self.batch)
        self.n_checkpoints = -(-self.n_batches // self.every)    # the last batch always checkpoints
        self.a = dtype_bytes(c.get("dtype", "float64"))
        self.c = dtype_bytes(c["compute_dtype"]) if c.get("compute_dtype") else self.a
        self.store = "cpu" if str(c.get("store_device", "cpu")) == "cpu" else "cuda"
        if self.store == "cuda" and self.device == "cpu":
            self.store = "cpu"
        self.sequential = c.get("capture", "co-resident") == "sequential"
        if c.get("accumulate", "host") not in ("host", "device"):
            raise ValueError(f"calib.accumulate must be host or device, got {c.get('accumulate')!r}")
        self.in_place = c.get("accumulate", "host") == "device"   # Moments.accumulate (on the target's device)
        shard = c.get("target_layers")
        self.t_layers = len(shard) if shard else tgt.layers
        self.dx, self.dy = src.layers * src.width, self.t_layers * tgt.width
        m = cfg["mapper"]
        ab = cfg.get("ablation") or {}
        k = ab.get("k") if ab.get("k") is not None else m.get("k", pair.get("k"))
        self.k = src.layers if k == "all" else int(k)
        self.p, self.q = self.k * src.width, tgt.width
        self.mapper_kind = m.get("kind", "ridge")
        self.key_space = ab.get("key_space", "stripped")
        self.stages = _parse_stages(cfg.get("stage", "all"))

    # device-side bytes: on the GPU (per GPU, weights spread by device_map) or on the host (cpu runs);
    # an offloaded model holds its resident part + the one offloaded layer being run
    def weights(self, *sides: str) -> float:
        return sum((weight_bytes(getattr(self, s), self.w) - self.offload[s]) / self.spread[s]
                   + (getattr(self, s).layer_params * self.w if self.offload[s] else 0) for s in sides)

    def offloaded(self, *sides: str) -> float:
        """Host bytes of the offloaded weights of `sides` (pair.<side>.max_memory)."""
        return sum(self.offload[s] for s in sides)

    def stream_seconds(self, side: str, passes: float) -> float:
        """Time to copy `side`'s offloaded weights to the GPU once per forward pass, `passes` times."""
        return passes * self.offload[side] / (self.rates.link or self.rates.host_bw) if self.offload[side] else 0.0

    def math_attention(self) -> bool:
        return self.device == "cpu" or self.cfg.get("attn_implementation") == "eager"

    def flops_rate(self, dtype: str) -> float:
        return self.rates.flops.get(dtype) or self.rates.flops["float32"]

    @property
    def moments(self) -> int:
        """The train moments in calib.dtype (calib.accumulate=device: means and cyy in float64)."""
        wide = 2 * (self.dx + 2 * self.dy) * (8 - self.a) if self.in_place else 0
        return moments_bytes(self.dx, self.dy, self.a) + wide

    @property
    def heldout(self) -> int:
        """The held-out raw features kept (float32)."""
        return heldout_bytes(self.held_rows, self.dx, self.dy)

    @property
    def calibration(self) -> int:
        """What a calibration holds and stores: train moments + held-out features."""
        return self.moments + self.heldout

    @property
    def checkpoint(self) -> int:
        """The calibration checkpoint (= the artifact): train moments + held-out features (+ small headers)."""
        return self.calibration

    @property
    def piece(self) -> int:
        """The largest piece file of the checkpoint directory (`io._pieces`): a tensor, or a block of
        <= io.PIECE_BYTES of its rows (at least one row)."""
        from .io import PIECE_BYTES

        wide = max(self.dx, self.dy)
        largest = max(self.dx * wide * self.a, self.held_rows * wide * 4)
        return min(largest, max(PIECE_BYTES, wide * max(self.a, 4)))

    @property
    def features(self) -> int:
        """Sequential capture: every batch's source features on disk (float32, K and V)."""
        return 2 * self.n_seq * self.kept * self.dx * 4 if self.sequential else 0

    @property
    def mlp_sample(self) -> int:
        """The calibration's kept feature rows (float32 x and y, K and V): kept whenever calib.mlp_samples > 0,
        whatever the mapper (one calibration serves ridge, MLP and weighting=attention_mass fits); at most the
        train observations."""
        n = min(int(self.calib.get("mlp_samples") or 0), self.n_train * self.kept)
        return 2 * n * (self.dx + self.dy) * 4

    @property
    def mass_weighted(self) -> bool:
        """Whether the fit is weighting=attention_mass (reads the feature sample and runs the target)."""
        return self.mapper_kind == "ridge" and self.cfg["mapper"].get("weighting", "none") == "attention_mass"

    @property
    def mapper_w32(self) -> int:
        return mapper_params(self.src.width, self.tgt, self.k) * 4

    def load_host(self, side: str) -> float:
        """Host bytes while loading one model: the whole checkpoint (from_pretrained loads on the CPU, then
        .to(device)), or one shard with device_map."""
        if self.device == "cuda" and self.mapped[side]:
            return LOAD_SHARD
        return weight_bytes(getattr(self, side), self.w, with_extra=True)

    def load_seconds(self, *sides: str) -> float:
        return sum(weight_bytes(getattr(self, s), self.w, with_extra=True) for s in sides) / self.rates.load

    def runtime_host(self) -> float:
        return RUNTIME_HOST_CUDA if self.device == "cuda" else RUNTIME_HOST


def run_device(cfg: dict, node: Node) -> str:
    """"cuda" or "cpu": where the run computes on this node (cfg.device, auto = a GPU when there is one)."""
    device = str(cfg.get("device", "auto"))
    if device == "cpu" or node.gpus == 0:
        return "cpu"
    return "cuda"


def _parse_stages(stage) -> list[str]:
    names = list(stage) if isinstance(stage, (list, tuple)) else (
        list(STAGES) if stage == "all" else [s.strip() for s in str(stage).split(",") if s.strip()])
    return [s for s in STAGES if s in names]


def _place(s: Setup, u: Usage, device_bytes: dict, host_bytes: dict, sides: tuple = ()) -> None:
    """Put 'device' parts on the GPU (or on the host for a CPU run) and sum the peaks; the offloaded
    weights of the loaded models `sides` sit on the host."""
    if s.offloaded(*sides):
        host_bytes = {**host_bytes, "offloaded weights (max_memory; streamed to the GPU per forward)":
                      s.offloaded(*sides)}
    u.dev_parts, u.host_parts = dict(device_bytes), dict(host_bytes)
    if s.device == "cuda":
        u.parts["gpu"] = {"CUDA context": RUNTIME_GPU, **device_bytes}
        u.parts["host"] = {"runtime": s.runtime_host(), **host_bytes}
    else:
        u.parts["gpu"] = {}
        u.parts["host"] = {"runtime": s.runtime_host(), **device_bytes, **host_bytes}
    u.gpu = sum(u.parts["gpu"].values())
    u.host = sum(u.parts["host"].values())


def _calibrate(s: Setup, held_host: float = 0.0, loaded: frozenset = frozenset(), disk_before: float = 0.0) -> Usage:
    """collect_moments + Run._calibrate (see the module docstring)."""
    u = Usage()
    src, tgt, w = s.src, s.tgt, s.w
    m, dx, dy = s.rows, s.dx, s.dy
    math_attn = s.math_attention()
    fwd_t = forward_bytes(tgt, s.batch, s.seq, w, math_attention=math_attn)
    fwd_s = forward_bytes(src, s.batch, s.seq, w, math_attention=math_attn)
    feat_y, feat_x = 2 * m * dy * 4, 2 * m * dx * 4
    if s.in_place:   # Moments.accumulate: the train moments on the device, merged by one GEMM per matrix
        # one kind at a time: xb/yb in dtype (when not float32), centred rows xc/yc, the [m+2, .] operands
        add_work = m * (dx + dy) * s.a * (1 if s.a == 4 else 2) + (m + 2) * (2 * dx + dy) * s.a
        moments_dev = s.moments + (s.heldout if s.store == "cuda" else 0)
        merge_dev = 0
    else:
        prod = moments_kind_bytes(dx, dy, s.c)                       # one kind's batch products
        add_work = 2 * prod + 2 * m * (dx + dy) * s.c * (2 if s.c != 4 else 1)   # both kinds + xb/yb/xc/yc
        moments_dev = s.calibration if s.store == "cuda" else 0
        merge_dev = moments_kind_bytes(dx, dy, s.a) if (s.store == "cuda" and s.c != s.a) else 0
    accumulate = feat_x + feat_y + add_work + merge_dev
    if s.sequential:  # pass 1: source alone, features to disk; pass 2: target + moments
        phase1 = s.weights("src") + fwd_s + feat_x
        phase2 = s.weights("tgt") + moments_dev + max(fwd_t, accumulate)
        if phase1 > phase2:
            dev = {"source weights (pass 1)": s.weights("src"), "prefill + features": fwd_s + feat_x}
        else:
            dev = {"target weights (pass 2)": s.weights("tgt"), "train moments + held-out features": moments_dev,
                   "prefill / features + batch products": max(fwd_t, accumulate)}
    else:
        dev = {"source + target weights": s.weights("src", "tgt"), "train moments + held-out features": moments_dev,
               "prefill / features + batch products": max(fwd_t, feat_y + fwd_s, accumulate)}
    if s.in_place:   # (on a CPU run the in-place moments are device parts, which _place puts on the host)
        host_moments = s.heldout if s.store == "cpu" else 0
    else:
        host_moments = s.calibration if s.store == "cpu" else 0
    if s.in_place:
        merge_host = 0
    elif s.store == "cpu" and (s.device == "cuda" or s.c != s.a):
        merge_host = moments_kind_bytes(dx, dy, s.a) + (dx * max(dx, dy) * s.c if s.c != s.a else 0)
    else:
        merge_host = 0
    # or, at a checkpoint, the device->host copy of one piece when the moments are on the GPU (host tensors are
    # written from their own memory: measured, tests/test_plan.py::test_plan_matches_measured_host_peak)
    merge_host = max(merge_host, s.piece if s.in_place and s.device == "cuda" else 0)
    loads = [s.load_host(x) for x in ("src", "tgt") if x not in loaded]
    loop_host = host_moments + merge_host + s.mlp_sample + s.n_seq * s.seq * 8
    # models load (on the host, then .to(device)) before the moments are allocated: the larger phase
    # counts; on a CPU run the weights are already counted as device bytes
    load_extra = max(0.0, max(loads) - loop_host) if loads and s.device == "cuda" else 0.0
    host = {"held from earlier stages": held_host,
            "train moments + held-out features + merge of one kind": loop_host,
            "model loading (transient, before the moments)": load_extra}
    # sequential capture holds one model at a time
    sides = (max(("src", "tgt"), key=lambda x: s.offload[x]),) if s.sequential else ("src", "tgt")
    _place(s, u, dev, host, sides)
    # disk: [features] + the checkpoint directory rewritten in place, one piece at a time (+ its temp file)
    u.parts["disk"] = {"earlier artifacts": disk_before, "sequential source features": s.features,
                       "checkpoint, rewritten in place (calibration + one piece)": s.checkpoint + s.piece,
                       "MLP feature sample": s.mlp_sample}
    u.disk = sum(u.parts["disk"].values())
    # time
    r = s.rates
    fwd = s.n_seq * (prefill_flops(src, s.seq, s.seq) + prefill_flops(tgt, s.seq, s.seq)) / s.flops_rate(s.mdtype)
    cdt = {8: "float64", 4: "float32", 2: "bfloat16"}[s.a if s.in_place else s.c]
    products = s.n_batches * 2 * 2 * m * (dx * dx + dx * dy) / (r.flops.get(cdt) or r.flops["float32"])
    elems = s.n_batches * 2 * (dx * dx + dx * dy)
    if s.in_place:   # the merge is inside the GEMM (C += A^T B reads and writes C once per batch)
        link = s.n_checkpoints * s.moments / r.link if (s.device == "cuda" and r.link) else 0.0
        merge = elems * 2 * s.a / (r.bw if s.device == "cuda" else r.host_bw)
    else:
        link = elems * s.c / r.link if (s.device == "cuda" and s.store == "cpu" and r.link) else 0.0
        merge = elems * (s.c + 6 * s.a) / (r.host_bw if s.store == "cpu" else r.bw)
    ckpt = s.n_checkpoints * s.checkpoint / r.disk
    feats = 2 * s.features / r.disk
    load = s.load_seconds(*[x for x in ("src", "tgt") if x not in loaded])
    stream = s.stream_seconds("src", s.n_batches) + s.stream_seconds("tgt", s.n_batches)
    u.parts["seconds"] = {"load weights": load, "forward passes": fwd, "batch products": products,
                          "device->host copies": link, "merge into the moments": merge,
                          "checkpoints": ckpt, "feature files": feats, "offloaded weights streamed": stream}
    u.seconds = sum(u.parts["seconds"].values())
    if s.n_checkpoints > 0 and s.checkpoint > 8 * GiB:
        u.notes.append(f"{s.n_checkpoints} checkpoints, each rewriting {s.checkpoint / GiB:.1f} GiB")
    return u


def _fit_transient(s: Setup, p: int) -> float:
    """Host bytes of one fit_layer + head_r2 (Cholesky of the gathered [p, p] block, float64)."""
    return p * p * (s.a + 8 + (8 if s.a != 8 else 0))


def _ridge_flops(s: Setup, p: int) -> float:
    """fit_ridge: per (target layer, kind) Cholesky p^3/3, solve 2 p^2 q, train R² 2 p^2 q, held-out R² on the
    raw features 2 n_held p q."""
    return 2 * s.t_layers * (p ** 3 / 3 + 2 * p * p * s.q + 2 * p * p * s.q + 2 * s.held_rows * p * s.q)


def _r2_flops(s: Setup) -> float:
    """r2_matrix: per (kind, source layer) Cholesky of [W_s, W_s], solve against all Dy columns, a
    per-target-layer train R², and the held-out residuals of all Dy columns on the raw features."""
    ws = s.src.width
    return 2 * s.src.layers * (ws ** 3 / 3 + 2 * ws * ws * s.dy + s.t_layers * 2 * ws * ws * s.q
                               + 2 * s.held_rows * ws * s.dy)


def _fit(s: Setup, held_host: float, loaded: frozenset, disk_before: float) -> Usage:
    """Run._fit: moments on the host, R² matrix, ridge per target layer, pack the float64 weights."""
    u = Usage()
    r = s.rates
    moments = s.calibration
    dev = {"source + target weights": s.weights("src", "tgt") if s.mapper_kind == "mlp" else 0.0}
    if s.mapper_kind == "mlp":
        hidden = int(s.cfg["mapper"].get("hidden", 1024))
        n = int(s.calib.get("mlp_samples") or 0)
        per_layer = 2 * s.tgt.kv_heads * (s.p * hidden + hidden * hidden + hidden * s.tgt.head_dim + 2 * hidden)
        dev["MLP sample of one target layer + its nets, Adam state"] = 2 * n * (s.p + s.q) * 4 + per_layer * 16
        work = {"MLP sample": s.mlp_sample}
        flops = 6 * per_layer * s.t_layers * n * int(s.cfg["mapper"].get("epochs", 20))
        fit_s = flops / s.flops_rate("float32") if s.device == "cuda" else flops / r.host_flops["float32"]
        w64 = per_layer * s.t_layers * 4
    else:
        w64 = mapper_params(s.src.width, s.tgt, s.k) * 8
        # + the held-out residuals of one row chunk (ridge.FEATURE_CHUNK rows x Dy, fp64, x3)
        r2_work = s.src.width * s.dy * (s.a + 16) + 2048 * s.dy * 8 * 3
        work = {"R² pass / one ridge solve / packing (3 x float64 weights)":
                max(r2_work, w64 + _fit_transient(s, s.p), 3 * w64)}
        fit_s = (_r2_flops(s) + _ridge_flops(s, s.p)) / r.host_flops["float64"]
        fit_s += 2 * s.t_layers * 3 * s.p * s.p * s.a / r.host_bw  # gathers of the [p, p] blocks
        if s.mass_weighted:  # families.attention_mass over the train sequences, then weighted moments per layer
            n = s.mlp_sample // (2 * 4 * (s.dx + s.dy))
            # both models: the source too, for a sample-only pass when the calibration kept no rows
            dev["source + target weights + one layer's eager attention weights (attention-mass pass)"] = (
                s.weights("src", "tgt") + s.batch * s.tgt.heads * s.seq * s.seq * 4)
            work["feature sample + one layer's weighted rows (float64)"] = s.mlp_sample + n * (2 * s.p + s.q) * 8
            fit_s += s.n_train * prefill_flops(s.tgt, s.seq, s.seq) / s.flops_rate(s.mdtype)
            fit_s += 2 * s.t_layers * 2 * n * (s.p * s.p + s.p * s.q) / r.host_flops["float64"]
    models = ("src", "tgt") if s.mapper_kind == "mlp" or s.mass_weighted else ()
    loads = [s.load_host(x) for x in models if x not in loaded]
    host = {"train moments + held-out features": moments if not held_host else held_host, **work,
            "model loading (after the moments are read)": max(loads) if loads and s.device == "cuda" else 0.0}
    _place(s, u, dev, host, models)
    u.parts["disk"] = {"earlier artifacts": disk_before, "mapper (float32)": s.mapper_w32}
    u.disk = sum(u.parts["disk"].values())
    u.parts["seconds"] = {"read moments": 0.0 if held_host else moments / r.disk, "solves (host float64)": fit_s,
                          "load weights": s.load_seconds(*[x for x in models if x not in loaded]),
                          "save mapper": s.mapper_w32 / r.disk}
    u.seconds = sum(u.parts["seconds"].values())
    if s.mapper_kind == "ridge":
        ratio = s.p / max(1, s.n_train * s.kept)
        if ratio >= 0.5:
            u.notes.append(f"p/n = {ratio:.2f} >= 0.5: fit_ridge refuses (mapper.force=true to override)")
    return u


def _eval_tokens(s: Setup) -> dict:
    """Token counts per model and decode steps over the configured modes and tasks (see EVAL_TASKS)."""
    e = s.cfg.get("eval") or {}
    modes = list(e.get("modes", ["target", "source", "transfer", "native_injected", "no_context"]))
    limits, limit = e.get("limits") or {}, e.get("limit")
    gen_default = int(e.get("max_gen_toks", 256))
    b = max(1, int(e.get("batch_size", 8)))
    out = {"source": 0.0, "target": 0.0, "map": 0.0, "decode_batches_source": 0.0, "decode_batches_target": 0.0,
           "decode_single_target": 0.0, "passes_source": 0.0, "passes_target": 0.0}   # passes: forward calls
    jobs = []
    for task in e.get("tasks", []):
        t = dict(EVAL_TASKS.get(task, _UNKNOWN_TASK))
        lim = limits.get(task, limit)
        if lim is not None:
            t["items"] = min(t["items"], int(lim))
        if t["gen"] < 0:
            t["gen"] = gen_default
        jobs.append(t)
    ppl = e.get("ppl") or {}
    if ppl.get("enabled"):
        for prefix in ppl.get("prefixes", []):
            jobs.append(dict(items=int(ppl.get("windows", 32)), choices=1, contexts=1, ctx=max(1, int(prefix)),
                             cont=int(ppl.get("continuation", 256)), gen=0))
    for mode in modes:
        for t in jobs:
            req, ctx_once = t["items"] * t["choices"], t["items"] * t["contexts"] * t["ctx"]
            full = req * (t["ctx"] + t["cont"])
            short = req * (1 + t["cont"])
            calls, ctx_calls = math.ceil(req / b), math.ceil(t["items"] * t["contexts"] / b)
            if mode == "target":
                out["target"] += full
                out["passes_target"] += calls
            elif mode == "source":
                out["source"] += full
                out["passes_source"] += calls
            elif mode in ("transfer", "identity"):
                out["source"] += ctx_once
                out["map"] += ctx_once if mode == "transfer" else 0
                out["target"] += short
                out["passes_source"] += ctx_calls
                out["passes_target"] += calls
            elif mode == "native_injected":
                out["target"] += ctx_once + short
                out["passes_target"] += ctx_calls + calls
            elif mode == "no_context":
                out["target"] += req * (2 + t["cont"])
                out["passes_target"] += calls
            if t["gen"]:
                side = "source" if mode == "source" else "target"
                out[f"decode_batches_{side}"] += math.ceil(t["items"] / b) * t["gen"]
                out[f"passes_{side}"] += math.ceil(t["items"] / b) * t["gen"]
    coqa = e.get("coqa") or {}
    if coqa.get("enabled"):
        conv, turns = int(coqa.get("conversations", 100)), int(coqa.get("turns", 10))
        n_all = conv * turns * len(coqa.get("protocols", ["every_turn", "once"]))
        for mode in [m for m in modes if m in ("target", "transfer")]:
            n = n_all if mode == "transfer" else conv * turns   # target: one protocol serves both (eval_stage._coqa)
            if mode == "transfer":
                out["source"] += n * COQA_CONTEXT
                out["map"] += n * COQA_CONTEXT
                out["passes_source"] += n
            else:
                out["target"] += n * COQA_CONTEXT
            out["decode_single_target"] += n * int(coqa.get("max_gen_toks", 32))
            out["passes_target"] += n * (1 + int(coqa.get("max_gen_toks", 32)))
    fid = e.get("fidelity") or {}
    if fid.get("enabled", True):
        out["source"] += int(fid.get("sequences", 4)) * s.seq
        out["target"] += 2 * int(fid.get("sequences", 4)) * s.seq
        out["map"] += int(fid.get("sequences", 4)) * s.seq
    return out


def _eval_longest(s: Setup) -> int:
    e = s.cfg.get("eval") or {}
    longest = max([EVAL_TASKS.get(t, _UNKNOWN_TASK)["longest"] for t in e.get("tasks", [])] or [256])
    ppl = e.get("ppl") or {}
    if ppl.get("enabled") and ppl.get("prefixes"):
        longest = max(longest, max(ppl["prefixes"]) + int(ppl.get("continuation", 256)))
    return longest


def _eval_longest_continuation(s: Setup) -> int:
    """Longest scored continuation (tokens) over the configured tasks and the perplexity protocol."""
    e = s.cfg.get("eval") or {}
    cont = max([EVAL_TASKS.get(t, _UNKNOWN_TASK)["cont"] for t in e.get("tasks", [])] or [1])
    ppl = e.get("ppl") or {}
    if ppl.get("enabled"):
        cont = max(cont, int(ppl.get("continuation", 256)))
    return cont


def _truthy(value) -> bool:
    return str(value).lower() in ("true", "1", "yes")


def _map_buffers(s: Setup, rows: int) -> float:
    """map_layers per chunk (float32 mapper): used source layers [2, rows, used*W_s] (+ stripped keys
    when not in place), gather buffer [2, rows, p]."""
    used = min(s.src.layers, s.k * s.tgt.layers)
    return 2 * rows * used * s.src.width * 4 + rows * used * s.src.width * 4 + 2 * rows * s.p * 4


def _eval(s: Setup, held_host: float, loaded: frozenset, disk_before: float) -> Usage:
    u = Usage()
    r = s.rates
    e = s.cfg.get("eval") or {}
    b, n = max(1, int(e.get("batch_size", 8))), _eval_longest(s)
    math_attn = s.math_attention()
    # logits (model dtype + the float32 log-softmax): for every position of a one-pass forward; with
    # share_prefix the context is prefilled by the decoder body alone (no LM head, cache.prefill) and only
    # the last context token + continuation reach the head
    logit_rows = min(n, _eval_longest_continuation(s) + 1) if _truthy(e.get("share_prefix")) else n
    logits = b * logit_rows * s.tgt.vocab * (s.w + 4)
    target_pass = forward_bytes(s.tgt, b, n, s.w, math_attention=math_attn)
    transfer_pass = (forward_bytes(s.src, b, n, s.w, math_attention=math_attn)
                     + s.tgt.layers * 2 * b * n * s.tgt.width * s.w
                     + _map_buffers(s, min(b * n, 8192)))
    dev = {"source + target weights": s.weights("src", "tgt"), "mapper (float32)": s.mapper_w32,
           f"largest batch ({b} x {n} tokens: caches, activations)": max(target_pass, transfer_pass),
           f"logits ({b} x {logit_rows} rows x vocab, + float32 log-softmax)": logits}
    loads = [s.load_host(x) for x in ("src", "tgt") if x not in loaded]
    host = {"held from earlier stages": held_host,
            "model loading / mapper load (transient)": (max(loads + [s.mapper_w32]) if s.device == "cuda"
                                                        else s.mapper_w32),
            "lm-eval datasets and requests": GiB if not e.get("data_dir") else GiB / 4}
    _place(s, u, dev, host, ("src", "tgt"))
    u.parts["disk"] = {"earlier artifacts": disk_before, "HF datasets cache": 2 * GiB if not e.get("data_dir") else 0}
    u.disk = sum(u.parts["disk"].values())
    tok = _eval_tokens(s)
    rate = s.flops_rate(s.mdtype)
    step_t = weight_bytes(s.tgt, s.w) / r.bw
    step_s = weight_bytes(s.src, s.w) / r.bw
    map_flops = 2 * 2 * s.p * s.q * s.tgt.layers * tok["map"]
    u.parts["seconds"] = {
        "load weights": s.load_seconds(*[x for x in ("src", "tgt") if x not in loaded]),
        "source forward": prefill_flops(s.src, tok["source"], 512, lm_head=True) / rate,
        "target forward": prefill_flops(s.tgt, tok["target"], 512, lm_head=True) / rate,
        "mapping (float32 GEMMs)": map_flops / s.flops_rate("float32"),
        "generation (memory-bound decode)": (tok["decode_batches_target"] + tok["decode_single_target"]) * step_t
        + tok["decode_batches_source"] * step_s,
        "offloaded weights streamed (one copy per forward call)":
            s.stream_seconds("src", tok["passes_source"]) + s.stream_seconds("tgt", tok["passes_target"])}
    u.seconds = sum(u.parts["seconds"].values())
    u.notes.append("eval time from approximate task sizes and prompt lengths (EVAL_TASKS)")
    return u


def _bench(s: Setup, held_host: float, loaded: frozenset, disk_before: float) -> Usage:
    u = Usage()
    r = s.rates
    bc = s.cfg.get("bench") or {}
    tokens = [int(t) for t in bc.get("tokens", [])] or [64]
    limit = 1 << 30
    n_max = max([t for t in tokens if t <= limit] or [64])
    n_inputs, reps = 3, int(bc.get("warmup", 3)) + int(bc.get("repeats", 10))
    math_attn = s.math_attention()
    src_caches = n_inputs * s.src.layers * 2 * n_max * s.src.width * s.w
    mapped = s.tgt.layers * 2 * n_max * s.tgt.width * s.w
    prefill = forward_bytes(s.tgt, 1, n_max, s.w, math_attention=math_attn)
    work = src_caches + mapped + max(prefill, _map_buffers(s, min(n_max, 8192)))
    dev = {"source + target weights": s.weights("src", "tgt") if not bc.get("shapes_only") else 0.0,
           "mapper": s.mapper_w32, f"caches + prefill at {n_max} tokens": work}
    if bc.get("shapes_only"):
        dev["shapes-only models (bench dtype)"] = s.weights("src", "tgt")
    _place(s, u, dev, {"held from earlier stages": held_host}, () if bc.get("shapes_only") else ("src", "tgt"))
    u.parts["disk"] = {"earlier artifacts": disk_before}
    u.disk = disk_before
    rate = s.flops_rate(s.mdtype)
    secs = 0.0
    for t in tokens:
        pf = prefill_flops(s.tgt, t, t) / rate
        mp = 2 * 2 * s.p * s.q * s.tgt.layers * t / s.flops_rate("float32")
        mp = max(mp, (s.mapper_w32 + mapped * t / n_max * 2) / r.bw)
        secs += reps * (pf + mp) + n_inputs * prefill_flops(s.src, t, t) / rate
    stream = s.stream_seconds("tgt", reps * len(tokens)) + s.stream_seconds("src", n_inputs * len(tokens))
    u.parts["seconds"] = {"timed runs": secs, "offloaded weights streamed": stream,
                          "load weights": s.load_seconds(*[x for x in ("src", "tgt") if x not in loaded])}
    u.seconds = sum(u.parts["seconds"].values())
    return u


def _report(s: Setup, held_host: float, loaded: frozenset, disk_before: float) -> Usage:
    """Report: with report.rotated_heatmap a second calibration (rotated keys) -- the stripped moments are
    released before it (`Run.release_moments`) and read back for the Table-7 ridge fits for
    report.variance_k (those the p/n guard lets through)."""
    u = Usage()
    r = s.rates
    rep = s.cfg.get("report") or {}
    stripped = s.calibration
    n_obs = s.n_train * s.kept
    ks = [s.src.layers if k == "all" else int(k) for k in rep.get("variance_k", [])]
    ks = [k for k in ks if k <= s.src.layers and k * s.src.width / max(1, n_obs) < 0.5]
    fits_host = max([_fit_transient(s, k * s.src.width) + mapper_params(s.src.width, s.tgt, k) * 8 for k in ks] or [0])
    secs = {"Table-7 fits (host float64)": sum(_ridge_flops(s, k * s.src.width) for k in ks) / r.host_flops["float64"],
            "read moments": stripped / r.disk}
    dev = {"source + target weights": s.weights("src", "tgt")}
    host = {"held from earlier stages": held_host, "stripped moments (read back)": stripped,
            "Table-7 fits (largest k)": fits_host}
    disk = {"earlier artifacts": disk_before}
    if rep.get("rotated_heatmap"):
        rot = _calibrate(s, held_host=held_host, loaded=loaded, disk_before=disk_before)
        rot_host = sum(v for k, v in rot.host_parts.items() if not k.startswith("offloaded weights"))
        host = {"rotated calibration peak (nothing else held), or moments + Table-7 fits":
                max(rot_host, held_host + s.calibration + fits_host)}
        dev = rot.dev_parts
        disk = {"earlier artifacts": disk_before, "rotated calibration": rot.disk - disk_before}
        secs["rotated calibration + its R² matrix"] = rot.seconds + _r2_flops(s) / r.host_flops["float64"]
    _place(s, u, dev, host, ("src", "tgt"))
    u.parts["disk"] = disk
    u.disk = sum(disk.values())
    u.parts["seconds"] = secs
    u.seconds = sum(secs.values())
    return u


def stage_usage(s: Setup) -> dict[str, Usage]:
    """Peak usage of every stage, as `runner.pipeline.execute` would run the requested stages in one process
    (earlier requested stages leave models loaded and moments held); a stage not requested is planned
    as if run alone with its inputs already cached."""
    out = {}
    persistent = {"calibrate": s.calibration + s.mlp_sample, "fit": s.mapper_w32}
    weights_disk = (sum(weight_bytes(m, s.w, with_extra=True) for m in (s.src, s.tgt))
                    if s.node.weights_on_disk else 0.0)
    for stage in STAGES:
        prior = [x for x in s.stages if STAGES.index(x) < STAGES.index(stage)] if stage in s.stages else []
        loaded: set = set()
        for x in prior:
            if x == "calibrate":
                loaded |= {"tgt"} if s.sequential else {"src", "tgt"}
            if x in ("eval", "report") or (x == "fit" and s.mapper_kind == "mlp") or (
                    x == "bench" and not (s.cfg.get("bench") or {}).get("shapes_only")):
                loaded |= {"src", "tgt"}
        held = 0.0   # every stage reads the moments it needs and releases them (`Run.release_moments`)
        disk_before = weights_disk + (persistent["calibrate"] if stage != "calibrate" else 0) + (
            persistent["fit"] if stage not in ("calibrate", "fit") else 0)
        fn = {"calibrate": _calibrate, "fit": _fit, "eval": _eval, "bench": _bench, "report": _report}[stage]
        out[stage] = fn(s, held, frozenset(loaded), disk_before)
    return out


# -- the plan ----------------------------------------------------------------------------------------
def _resources(node: Node) -> dict:
    return {"gpu": node.gpu_gib * GiB, "host": node.host_gib * GiB, "disk": node.disk_gib * GiB}


def _over(u: Usage, node: Node, headroom: float, device: str) -> dict:
    """{resource: need / (headroom * capacity)} for the resources over budget."""
    cap = _resources(node)
    need = {"gpu": u.gpu if device == "cuda" else 0.0, "host": u.host, "disk": u.disk}
    return {k: need[k] / (headroom * cap[k]) if cap[k] > 0 else math.inf for k in need
            if need[k] > headroom * cap[k]}


def _set(cfg: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(cfg)
    d = out
    keys = dotted.split(".")
    for key in keys[:-1]:
        d = d.setdefault(key, {})
    d[keys[-1]] = value
    return out


def _get(cfg: dict, dotted: str, default=None):
    d = cfg
    for key in dotted.split("."):
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def knob_candidates(cfg: dict, stage: str, node: Node, target_layers: int) -> list[tuple[str, object, str]]:
    """(config key, value, what it does) of the existing knobs worth trying for `stage` under this config."""
    c = cfg["calib"]
    out = []
    if str(c.get("dtype", "float64")) == "float64":
        out.append(("calib.dtype", "float32", "halves the moments (the fit still solves in float64)"))
    if stage in ("calibrate", "report"):
        if str(c.get("compute_dtype") or c.get("dtype", "float64")) == "float64" and node.gpus > 0:
            out.append(("calib.compute_dtype", "float32", "float32 batch products on the device"))
        if c.get("accumulate", "host") != "device" and node.gpus > 0:
            out.append(("calib.accumulate", "device", "train moments on the GPU in calib.dtype, merged in place "
                        "per batch (no batch products, nothing shipped to the host)"))
        if c.get("capture", "co-resident") != "sequential":
            out.append(("calib.capture", "sequential", "one model in memory at a time; features go to disk"))
        else:
            out.append(("calib.capture", "co-resident", "no feature files on disk"))
            out.append(("calib.n_sequences", max(2, int(c["n_sequences"]) // 2),
                        "fewer feature files (and fewer observations: check p/n)"))
        if node.gpus > 0:
            out.append(("calib.store_device", "cuda" if str(c.get("store_device", "cpu")) == "cpu" else "cpu",
                        "where the running moments live"))
        held = c.get("heldout_observations")
        if held is None or int(held) > 2048:
            out.append(("calib.heldout_observations", 2048, "fewer held-out feature rows (held-out R² noisier)"))
        if int(c.get("batch_size", 4)) > 1:
            out.append(("calib.batch_size", max(1, int(c["batch_size"]) // 4), "smaller prefill activations"))
        if "target_layers" in c:
            out.append(("calib.target_layers", list(range(target_layers // 2)), "one shard of target layers per run"))
    mapper = cfg.get("mapper") or {}
    if int(c.get("mlp_samples") or 0) > 0 and mapper.get("kind", "ridge") == "ridge" and \
            mapper.get("weighting", "none") != "attention_mass":  # the sample is in host memory, then on disk
        out.append(("calib.mlp_samples", 0, "keep no feature sample (only mapper=mlp and "
                    "mapper.weighting=attention_mass fits read it)"))
    if node.gpus > 1 and not cfg.get("device_map"):
        out.append(("device_map", "auto", "spreads each model over all GPUs (calibration across devices: "
                    "issue 10 §5)"))
    if stage == "eval" and int((cfg.get("eval") or {}).get("batch_size", 8)) > 1:
        out.append(("eval.batch_size", max(1, int(cfg["eval"]["batch_size"]) // 4), "smaller eval batches"))
    if stage == "bench":
        toks = sorted(int(t) for t in (cfg.get("bench") or {}).get("tokens", []))
        if len(toks) > 1:
            out.append(("bench.tokens", toks[:-1], "drop the longest token count"))
    if stage == "report":
        rep = cfg.get("report") or {}
        if rep.get("rotated_heatmap"):
            out.append(("report.rotated_heatmap", False, "skip the second (rotated-key) calibration"))
        vk = rep.get("variance_k", [])
        if any(k == "all" or int(k) > 8 for k in vk):
            out.append(("report.variance_k", [k for k in vk if k != "all" and int(k) <= 8], "smaller Table-7 fits"))
    return out


def _figures(u: Usage) -> dict:
    return {"gpu_gib": round(u.gpu / GiB, 2), "host_gib": round(u.host / GiB, 2), "disk_gib": round(u.disk / GiB, 2),
            "seconds": round(u.seconds, 1)}


def _evaluate(cfg, src, tgt, node, rates) -> dict[str, Usage]:
    return stage_usage(Setup(cfg, src, tgt, node, rates))


def make_plan(cfg: dict, node: Node, *, shapes: tuple[ModelShape, ModelShape] | None = None,
              rates: Rates | None = None, local: bool = False, knobs: bool = True) -> dict:
    """The resource plan of `cfg` (a resolved plain config dict) on `node`, as one JSON-able dict:

    {"pair", "node", "protocol", "rates", "stages": {stage: {"gpu_gib", "host_gib", "disk_gib", "seconds",
     "fits", "over", "requested", "knobs": [{"set", "gpu_gib", "host_gib", "disk_gib", "seconds", "fits", "note"}],
     "parts", "notes"}}}.
    shapes: (source, target) as named by pair.source / pair.target (default: `load_shape`).
    """
    if shapes is None:
        trc = bool(cfg.get("trust_remote_code", False))
        shapes = (load_shape(cfg["pair"]["source"], trc), load_shape(cfg["pair"]["target"], trc))
    src, tgt = shapes
    rates = rates or rates_for(node, run_device(cfg, node), local=local)
    s = Setup(cfg, src, tgt, node, rates)
    headroom = float(_get(cfg, "plan.headroom", 0.95))
    usage = stage_usage(s)
    stages = {}
    for name, u in usage.items():
        over = _over(u, node, headroom, s.device)
        entry = {**_figures(u), "fits": not over, "over": sorted(over), "requested": name in s.stages, "knobs": []}
        if over and knobs:
            entry["knobs"] = _knobs_for(cfg, name, node, rates, src, tgt, headroom, over)
        entry["parts"] = {res: {k: round(v / GiB, 6) if res != "seconds" else round(v, 1) for k, v in part.items() if v}
                          for res, part in u.parts.items()}
        entry["notes"] = u.notes
        stages[name] = entry
    obs = s.n_train * s.kept
    return {
        "pair": cfg["pair"].get("name"),
        "source": src.name, "target": tgt.name,
        "node": {"name": node.name, "gpus": node.gpus, "gpu_gib": node.gpu_gib, "host_gib": node.host_gib,
                 "disk_gib": round(node.disk_gib, 1), "gpu": node.gpu, "device": s.device,
                 "weights_on_disk": node.weights_on_disk, "headroom": headroom},
        "protocol": {"n_sequences": s.n_seq, "seq_len": s.seq, "stride": s.stride, "batch_size": s.batch,
                     "k": s.k, "dx": s.dx, "dy": s.dy, "p": s.p, "observations": obs,
                     "p_over_n": round(s.p / max(1, obs), 4), "calib_dtype": str(s.calib.get("dtype", "float64")),
                     "compute_dtype": str(s.calib.get("compute_dtype") or s.calib.get("dtype", "float64")),
                     "capture": s.calib.get("capture", "co-resident"),
                     "store_device": (s.device if s.in_place else s.store),
                     "accumulate": "device (in place)" if s.in_place else "host",
                     "moments_split_gib": round(s.moments / GiB, 2),
                     "heldout_observations": s.held_rows, "heldout_gib": round(s.heldout / GiB, 2),
                     "source_weights_gib": round(weight_bytes(src, s.w) / GiB, 2),
                     "target_weights_gib": round(weight_bytes(tgt, s.w) / GiB, 2),
                     "mapper_params": mapper_params(s.src.width, s.tgt, s.k)},
        "rates": {"name": rates.name, "source": rates.source},
        "notes": s.notes,
        "stages": stages,
    }


def _score(over: dict) -> float:
    return sum(min(v, 1e6) - 1 for v in over.values())


def _knobs_for(cfg, stage, node, rates, src, tgt, headroom, over) -> list[dict]:
    """Each candidate knob's figures for `stage` (the plan recomputed with it), for those that lower an
    over-budget resource; then the greedy combination of them when it takes more than one, pruned of
    the knobs it does not need. Weight offload (`pair.<side>.max_memory`) is a candidate whose value
    is computed for the config it is added to (what the GPU has left for the target's weights)."""
    def trial(c):
        u = _evaluate(c, src, tgt, node, rates)[stage]
        return u, _over(u, node, headroom, run_device(c, node))

    def resolve(c, item):   # (key, value) for config c; None when the knob has nothing to offer there
        if item[1] is not _OFFLOAD:
            return item[0], item[1]
        offer = _offload_knob(c, stage, node, rates, src, tgt, headroom)
        return None if offer is None else offer[:2]

    def apply(items):       # the config with `items` added to cfg in order, and what was set
        c, done = cfg, []
        for item in items:
            kv = resolve(c, item)
            if kv is not None:
                c = _set(c, *kv)
                done.append(kv)
        return c, done

    base, _ = trial(cfg)
    need = lambda u: {"gpu": u.gpu, "host": u.host, "disk": u.disk}  # noqa: E731
    candidates = list(knob_candidates(cfg, stage, node, Setup(cfg, src, tgt, node, rates).tgt.layers))
    offload = _offload_knob(cfg, stage, node, rates, src, tgt, headroom) if "gpu" in over else None
    if offload is not None:
        candidates.append((offload[0], _OFFLOAD, offload[2]))
    helpful, out = [], []
    for item in candidates:
        c, done = apply([item])
        u, o = trial(c)
        if done and any(need(u)[r] < 0.99 * need(base)[r] for r in over):
            helpful.append(item)
            out.append({"set": " + ".join(f"{k}={_fmt_value(v)}" for k, v in done), **_figures(u), "fits": not o,
                        "note": item[2]})
    chosen, cur_over, remaining = [], over, list(helpful)
    while cur_over and remaining:
        scored = []
        for i, item in enumerate(remaining):
            u, o = trial(apply(chosen + [item])[0])
            scored.append((_score(o), i, item, o))
        score, _, item, o = min(scored, key=lambda x: (x[0], x[1]))
        if score >= _score(cur_over):
            break
        chosen.append(item)
        cur_over = o
        remaining.remove(item)
    # prune: a knob the others (with the offload recomputed) no longer need goes, when that is no slower
    final, _ = trial(apply(chosen)[0])
    pruned = True
    while pruned and len(chosen) > 1:
        pruned = False
        for item in list(chosen):
            rest = [x for x in chosen if x is not item]
            u, o = trial(apply(rest)[0])
            if _score(o) <= _score(cur_over) and u.seconds <= final.seconds * 1.001:
                chosen, cur_over, final, pruned = rest, o, u, True
                break
    if len(chosen) > 1:
        c, done = apply(chosen)
        out.append({"set": " + ".join(f"{k}={_fmt_value(v)}" for k, v in done), **_figures(final),
                    "fits": not cur_over, "note": "together"})
    return out


_OFFLOAD = object()   # marks the weight-offload candidate, whose value depends on the config it joins


def _offload_knob(cfg, stage, node, rates, src, tgt, headroom) -> tuple | None:
    """(key, value, note) of the `max_memory` that makes `stage` fit the GPU by keeping part of the target's
    weights on the host, or None (no single-GPU node, nothing worth keeping resident, or no offload needed).
    The GPU budget is what the stage leaves after everything but the target's weights, in whole GiB."""
    s = Setup(cfg, src, tgt, node, rates)
    if s.device != "cuda" or node.gpus != 1:
        return None
    u = stage_usage(s)[stage]
    budget = math.floor((headroom * node.gpu_gib * GiB - (u.gpu - s.weights("tgt"))) / GiB)
    layer = s.tgt.layer_params * s.w
    if budget * GiB < 4 * layer or budget * GiB >= weight_bytes(s.tgt, s.w):
        return None
    side = "source" if (cfg.get("pair") or {}).get("direction", "forward") == "reverse" else "target"
    value = {0: f"{budget}GiB", "cpu": f"{math.floor(headroom * node.host_gib)}GiB"}
    off = offloaded_bytes(s.tgt, s.w, value, node.gpus)
    return (f"pair.{side}.max_memory", value,
            f"keeps {off / GiB:.0f} GiB of the target's layers on the host; accelerate copies them to the GPU "
            "on every forward pass (time: see the plan's 'offloaded weights streamed')")


def shell_overrides(knob_set: str) -> str:
    """A knob set ("a=1 + b={0:8GiB,cpu:9GiB}") as shell-ready overrides: values with braces, brackets or
    commas quoted, since bash would expand `{0:8GiB,cpu:9GiB}` into two words."""
    import shlex

    parts = [p.strip() for p in knob_set.split(" + ")]
    return " ".join(shlex.quote(p) if any(c in p for c in "{}[],") else p for p in parts)


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    if isinstance(v, dict):   # Hydra's override syntax: {0:84GiB,cpu:121GiB}
        return "{" + ",".join(f"{k}:{x}" for k, x in v.items()) + "}"
    return str(v)


# -- text --------------------------------------------------------------------------------------------
def _dur(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_plan(plan: dict, *, markdown: bool = False, details: bool = True) -> str:
    """The plan as a table (plain text or markdown) + the knobs of stages that do not fit."""
    n, pr = plan["node"], plan["protocol"]
    cap = f"{n['gpus']} x {n['gpu_gib']:.1f} GiB GPU" if n["gpus"] else "no GPU"
    lines = [f"{'## ' if markdown else ''}Resource plan: {plan['pair']} ({plan['source']} -> {plan['target']})",
             "",
             f"node {n['name']}: {cap}, host {n['host_gib']:.0f} GiB, disk {n['disk_gib']:.0f} GiB; "
             f"device {n['device']}; "
             f"a stage fits within {100 * n['headroom']:.0f} % of each"
             + ("; model weights counted on the local disk" if n.get("weights_on_disk") else ""),
             f"protocol: {pr['n_sequences']} x {pr['seq_len']} tokens, stride {pr['stride']}, "
             f"batch {pr['batch_size']}, "
             f"k={pr['k']}; Dx {pr['dx']:,}, Dy {pr['dy']:,}, p {pr['p']:,}, n {pr['observations']:,} "
             f"(p/n {pr['p_over_n']:.3f}); moments {pr['calib_dtype']} on {pr['store_device']}, accumulated "
             f"{pr.get('accumulate', 'host')} "
             f"({pr['moments_split_gib']:.1f} GiB train; held-out {pr.get('heldout_observations', 0):,} rows of raw "
             f"features, {pr.get('heldout_gib', 0.0):.1f} GiB), products {pr['compute_dtype']}, capture {pr['capture']}; "
             f"weights {pr['source_weights_gib']:.1f} + {pr['target_weights_gib']:.1f} GiB",
             f"rates: {plan['rates']['source']}", ""]
    head = ["stage", "GPU GiB", "host GiB", "disk GiB", "time", "fits"]
    rows = []
    for name, st in plan["stages"].items():
        fits = "yes" if st["fits"] else "NO (" + ", ".join(st["over"]) + ")"
        rows.append([name + ("" if st.get("requested", True) else " *"), f"{st['gpu_gib']:.1f}",
                     f"{st['host_gib']:.1f}", f"{st['disk_gib']:.1f}", _dur(st["seconds"]), fits])
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        lines += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in [head, *rows]]
    if any(not st.get("requested", True) for st in plan["stages"].values()):
        lines.append("* not requested by this run (planned as if run alone)")
    for name, st in plan["stages"].items():
        if st["knobs"]:
            lines += ["", f"{name} does not fit ({', '.join(st['over'])}); knobs:"]
            for kb in st["knobs"]:
                lines.append(f"{'- ' if markdown else '  '}{shell_overrides(kb['set'])}: GPU {kb['gpu_gib']:.1f}, "
                             f"host {kb['host_gib']:.1f}, "
                             f"disk {kb['disk_gib']:.1f} GiB, {_dur(kb['seconds'])} -> "
                             f"{'fits' if kb['fits'] else 'still does not fit'} ({kb['note']})")
        elif not st["fits"]:
            lines += ["", f"{name} does not fit ({', '.join(st['over'])}) and no existing knob helps"]
        for note in st.get("notes", []):
            lines.append(f"{'- ' if markdown else '  '}note ({name}): {note}")
    if details and markdown:
        lines += ["", "<details><summary>what each peak is made of (GiB; seconds)</summary>", ""]
        for name, st in plan["stages"].items():
            for res, part in st["parts"].items():
                if part:
                    lines.append(f"- {name} {res}: " + ", ".join(f"{k} {v:,.2f}" for k, v in part.items()))
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


# -- for the runner (its plan hook: kvtransfer.runner.pipeline.plan_run) ---------------------------
class PlanError(RuntimeError):
    """A requested stage will not fit the node; the message names the knobs that help."""


def detect_node(cfg: dict) -> Node:
    """The machine this process runs on: free GPU memory, total host memory (the node's capacity, as the
    node presets give it; other jobs running now are not subtracted), free disk at cache_dir."""
    import torch

    device = str(cfg.get("device", "auto"))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    gpus, gpu_gib, gpu = 0, 0.0, None
    if use_cuda:
        gpus = torch.cuda.device_count()
        gpu_gib = torch.cuda.mem_get_info(0)[0] / GiB
        name = torch.cuda.get_device_name(0)
        gpu = next((k for k in DEVICES if k in name), None)
    host = 0.0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    host = int(line.split()[1]) * 1024 / GiB
    except OSError:
        host = float("inf")
    where = Path(cfg.get("cache_dir", "artifacts")).resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    disk = shutil.disk_usage(where).free / GiB
    return Node("this machine", gpus, gpu_gib, host, disk, gpu,
                bool(_get(cfg, "plan.weights_on_disk", False)))


def refusal_message(plan: dict, stages: list[str] | None = None) -> str | None:
    """None when every (requested) stage fits; else the message naming each failing stage and its knobs."""
    bad = {k: v for k, v in plan["stages"].items() if not v["fits"] and (stages is None or k in stages)}
    if not bad:
        return None
    n = plan["node"]
    lines = [f"resource plan: {', '.join(bad)} will not fit {n['name']} "
             f"({n['gpus']} x {n['gpu_gib']:.1f} GiB GPU, {n['host_gib']:.1f} GiB host, {n['disk_gib']:.1f} GiB disk):"]
    for name, st in bad.items():
        lines.append(f"  {name}: needs GPU {st['gpu_gib']:.1f} GiB, host {st['host_gib']:.1f} GiB, disk "
                     f"{st['disk_gib']:.1f} GiB (over: {', '.join(st['over'])})")
        for kb in st["knobs"]:
            lines.append(f"    try {shell_overrides(kb['set'])}: GPU {kb['gpu_gib']:.1f}, host {kb['host_gib']:.1f}, disk "
                         f"{kb['disk_gib']:.1f} GiB -> {'fits' if kb['fits'] else 'still over'}")
        if not st["knobs"]:
            lines.append("    no existing knob makes it fit (see issue 10 §2)")
    lines.append("Set the knobs above, or plan.enforce=false to run anyway. Details: plan.json / "
                 "python -m kvtransfer.plan pair=... --help")
    return "\n".join(lines)


def check_plan(cfg: dict, node: Node | None = None, *, shapes=None, rates=None,
               stages: list[str] | None = None) -> dict:
    """The plan of `cfg` on `node` (default: this machine); raises PlanError naming the knobs when a
    stage (of `stages`, default: the requested ones) does not fit. Returns the plan."""
    node = node or detect_node(cfg)
    plan = make_plan(cfg, node, shapes=shapes, rates=rates, local=True)
    msg = refusal_message(plan, stages if stages is not None else _parse_stages(cfg.get("stage", "all")))
    if msg:
        raise PlanError(msg)
    return plan


def write_plan(plan: dict, out_dir) -> None:
    """plan.json + plan.md into out_dir (atomic)."""
    from .io import atomic_write_bytes, atomic_write_json

    out_dir = Path(out_dir)
    atomic_write_json(out_dir / "plan.json", plan)
    atomic_write_bytes(out_dir / "plan.md", format_plan(plan, markdown=True).encode())


# -- CLI ---------------------------------------------------------------------------------------------
def compose_config(overrides: list[str]) -> dict:
    """The run's resolved config from conf/ (Hydra compose API; out_dir defaults to a placeholder)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    if not any(o.split("=", 1)[0].lstrip("+~") == "out_dir" for o in overrides):
        overrides = ["out_dir=plan", *overrides]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtransfer.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for run.py (pair=..., calib.dtype=...)")
    parser.add_argument("--node", choices=sorted(NODES), help="a node shape of issue 10 (sets the four below)")
    parser.add_argument("--gpu-mem", type=float, help="GiB per GPU")
    parser.add_argument("--host-mem", type=float, help="GiB of host memory")
    parser.add_argument("--disk", type=float, help="GiB of local disk")
    parser.add_argument("--gpus", type=int, help="number of GPUs (0 = CPU only)")
    parser.add_argument("--gpu", choices=sorted(DEVICES), help="GPU model for the rate table")
    parser.add_argument("--weights-on-disk", action="store_true", help="count the weights against --disk")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--out", help="write plan.json + plan.md here (default: runs/plan/<pair>)")
    args = parser.parse_args(argv)
    cfg = compose_config(args.overrides)
    explicit = any(v is not None for v in (args.gpu_mem, args.host_mem, args.disk, args.gpus, args.node))
    if args.node:
        node = Node(**NODES[args.node])
    else:
        node = detect_node(cfg) if not explicit else Node(name="given", gpus=1 if args.gpu_mem else 0)
    for attr, value in (("gpu_gib", args.gpu_mem), ("host_gib", args.host_mem), ("disk_gib", args.disk),
                        ("gpus", args.gpus), ("gpu", args.gpu)):
        if value is not None:
            setattr(node, attr, value)
    if explicit and not args.node:
        if node.gpus and node.gpu is None:
            node.gpu = "H100"  # for the rates only; the name says so
            node.name = f"{node.gpus} x GPU {node.gpu_gib:g} GiB (H100 rates assumed)"
        else:
            node.name = f"{node.gpus} x {node.gpu} {node.gpu_gib:g} GiB" if node.gpus else "CPU only"
    node.weights_on_disk = args.weights_on_disk or bool(_get(cfg, "plan.weights_on_disk", False))
    plan = make_plan(cfg, node, local=not explicit)
    out = Path(args.out or ROOT / "runs" / "plan" / str(plan["pair"]))
    write_plan(plan, out)
    if args.json:
        print(json.dumps(plan))
    else:
        print(format_plan(plan, details=False), end="")
        print(f"(written to {out}/plan.json and plan.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
