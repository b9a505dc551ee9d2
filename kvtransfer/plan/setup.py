"""Setup: everything the stage formulas read, derived from a plain config (through the run's own resolver,
`kvtransfer.config.runconfig`) + the two model shapes + the node + the rates."""
from __future__ import annotations

from ..config.runconfig import calib_split, kept_positions, learning_rates, resolve, source_features
from .node import GiB, Node
from .rates import Rates
from .shapes import (ModelShape, dtype_bytes, heldout_bytes, moments_bytes, offloaded_bytes, sample_bytes,
                     weight_bytes)

RUNTIME_HOST = 1.5 * GiB   # python + torch + transformers (+ CUDA libraries on a GPU node: RUNTIME_HOST_CUDA)
RUNTIME_HOST_CUDA = 3.0 * GiB
RUNTIME_GPU = 1.0 * GiB    # CUDA context + cuBLAS workspaces
LOAD_SHARD = 5 * GiB       # host bytes while loading with device_map (one safetensors shard at a time)


def run_device(cfg: dict, node: Node) -> str:
    """"cuda" or "cpu": where the run computes on this node (cfg.device, auto = a GPU when there is one)."""
    return "cpu" if str(cfg.get("device", "auto")) == "cpu" or node.gpus == 0 else "cuda"


class Setup:
    """The config read once for the stage formulas. `src` / `tgt` are the shapes of the models playing source
    and target (pair.direction applied); every count comes from the run's own resolver."""

    def __init__(self, cfg: dict, src: ModelShape, tgt: ModelShape, node: Node, rates: Rates):
        self.cfg, self.node, self.rates = cfg, node, rates
        self.resolved = resolve(cfg)
        if self.resolved.direction == "reverse":
            src, tgt = tgt, src
        self.src, self.tgt = src, tgt
        self.stages = self.resolved.stages
        self.device = run_device(cfg, node)
        self.notes = ([f"device={cfg.get('device')} but the node has no GPU: planned on the CPU"]
                      if self.device == "cpu" and str(cfg.get("device", "auto")).startswith("cuda") else [])
        self._models()
        self._calibration()
        self.k = self.resolved.k_layers(src.layers)
        self.p, self.q = self.k * self.fw, tgt.width
        self.mapper_kind = self.resolved.mapper_kind
        self.key_space = self.resolved.key_space

    def _models(self) -> None:
        """Weights: dtype, spread over GPUs (device_map), offloaded to the host (max_memory)."""
        from ..core.models import device_map_for, max_memory_for, size_bytes

        cfg, node = self.cfg, self.node
        # per model: its own pair.<side>.device_map, else the run-wide one (models.device_map_for)
        self.mapped = {attr: bool(device_map_for(cfg, side)) for attr, side in (("src", "source"), ("tgt", "target"))}
        self.spread = {attr: node.gpus if (self.device == "cuda" and on and node.gpus > 1) else 1
                       for attr, on in self.mapped.items()}
        mdtype = cfg["pair"].get("dtype", "auto")
        self.w = 2 if mdtype == "auto" else dtype_bytes(mdtype)
        self.mdtype = {2: "bfloat16", 4: "float32"}.get(self.w, "float64")
        self.offload = {}
        for attr, side in (("src", "source"), ("tgt", "target")):
            mm = max_memory_for(cfg, side) if self.device == "cuda" else None
            self.offload[attr] = offloaded_bytes(getattr(self, attr), self.w, mm, node.gpus)
            cpu = size_bytes(mm["cpu"]) if mm and "cpu" in mm else None
            if self.offload[attr] and cpu is not None and cpu < self.offload[attr]:
                self.notes.append(f"pair.{side}.max_memory: cpu {cpu / GiB:.1f} GiB < {self.offload[attr] / GiB:.1f} "
                                  "GiB offloaded; accelerate puts the rest on disk (offload_folder), not planned here")

    def _calibration(self) -> None:
        """Calibration counts: the train / held-out split, kept positions, batches, checkpoints, dtypes."""
        c = self.calib = self.cfg["calib"]
        self.n_seq, self.seq, self.stride = int(c["n_sequences"]), int(c["seq_len"]), int(c["stride"])
        self.batch = int(c["batch_size"])
        train, held = calib_split(self.cfg)
        self.n_train, self.n_held = len(train), len(held)
        self.kept = kept_positions(c)
        cap = c.get("heldout_observations")
        self.held_rows = self.n_held * self.kept if cap is None else min(int(cap), self.n_held * self.kept)
        self.n_batches = -(-self.n_train // self.batch) + -(-self.n_held // self.batch)
        self.train_batch_rows = [min(self.batch, self.n_train - i) * self.kept for i in range(0, self.n_train, self.batch)]
        self.rows = self.batch * self.kept                      # m: observations per batch
        self.every = max(1, int(c.get("checkpoint_every", 64)) // self.batch)
        acc = c.get("accumulate", "host")
        if acc not in ("host", "device", "twolevel"):
            raise ValueError(f"calib.accumulate must be twolevel, host or device, got {acc!r}")
        self.twolevel = acc == "twolevel"   # float32 buffer on the device, float64 masters on the host
        self.flush = int(c.get("flush_batches", 8))
        if self.twolevel:                  # collect_moments checkpoints at flush boundaries
            self.every = -(-self.every // self.flush) * self.flush
        self.n_flushes = -(-len(self.train_batch_rows) // self.flush) if self.twolevel else 0
        self.n_checkpoints = -(-self.n_batches // self.every)    # the last batch always checkpoints
        self.a = dtype_bytes(c.get("dtype", "float64"))
        self.c = dtype_bytes(c["compute_dtype"]) if c.get("compute_dtype") else self.a
        self.store = "cuda" if str(c.get("store_device", "cpu")) != "cpu" and self.device == "cuda" else "cpu"
        self.sequential = c.get("capture", "co-resident") == "sequential"
        self.in_place = acc == "device"   # Moments.accumulate (on the target's device)
        # the source's features per layer: its K or V (the paper's), or its hidden states (mapper=hidden,
        # kvtransfer.core.hidden: H or H + n_kv_s * d_s columns per layer and kind) -- every size below follows
        from ..core.hidden import feature_width

        self.src_features = source_features(self.cfg["mapper"])
        self.n_lrs = len(learning_rates(self.cfg["mapper"]))  # mapper=trained trains once per learning rate
        self.fw = feature_width(self.src_features, self.src.hidden, self.src.width)
        self.dx, self.dy = self.src.layers * self.fw, self.tgt.layers * self.tgt.width

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
        return moments_bytes(self.dx, self.dy, self.a, wide=self.in_place)

    @property
    def buffer(self) -> int:
        """calib.accumulate=twolevel: the float32 buffer (float64 means and cyy) on the target's device."""
        return moments_bytes(self.dx, self.dy, 4, wide=True) if self.twolevel else 0

    @property
    def heldout(self) -> int:
        """The held-out raw features kept (float32)."""
        return heldout_bytes(self.held_rows, self.dx, self.dy)

    @property
    def calibration(self) -> int:
        """What a calibration holds and stores (= its checkpoint and artifact): train moments + held-out features."""
        return self.moments + self.heldout

    @property
    def checkpoint(self) -> int:
        return self.calibration

    @property
    def piece(self) -> int:
        """The largest piece file of the checkpoint directory (`io._pieces`): a tensor, or a block of
        <= io.PIECE_BYTES of its rows (at least one row)."""
        from ..core.io import PIECE_BYTES

        wide = max(self.dx, self.dy)
        largest = max(self.dx * wide * self.a, self.held_rows * wide * 4)
        return min(largest, max(PIECE_BYTES, wide * max(self.a, 4)))

    @property
    def features(self) -> int:
        """Sequential capture: every batch's source features on disk (float32, K and V)."""
        return 2 * self.n_seq * self.kept * self.dx * 4 if self.sequential else 0

    @property
    def sample_rows(self) -> int:
        """Rows of the calibration's feature sample (calib.mlp_samples; `FeatureSampler.rows_at`)."""
        from ..maps.mlp import FeatureSampler

        return FeatureSampler.rows_at(int(self.calib.get("mlp_samples") or 0), self.train_batch_rows)

    @property
    def mlp_sample(self) -> int:
        """The calibration's kept feature rows (float32 x and y, K and V): kept whenever calib.mlp_samples > 0,
        whatever the mapper (one calibration serves ridge, MLP and weighting=attention_mass fits) -- except a
        hidden-state calibration (mapper=hidden), which keeps none (`Run._calibrate_locked`)."""
        return sample_bytes(self.sample_rows, self.dx, self.dy) if self.src_features == "kv" else 0

    @property
    def mass_weighted(self) -> bool:
        """Whether the fit is weighting=attention_mass (reads the feature sample and runs the target)."""
        return self.mapper_kind == "ridge" and self.cfg["mapper"].get("weighting", "none") == "attention_mass"

    @property
    def mapper_values(self) -> int:
        """Float32 values the fitted mapper stores, asked of its kind (`Mapper.params_at`,
        `MLPMapper.values_at`, `families.map_cost` for a restricted support or rank)."""
        m, t = self.cfg["mapper"], self.tgt
        if self.mapper_kind == "mlp":
            from ..core.mapper import MLPMapper

            return MLPMapper.values_at(t.layers, t.kv_heads, self.p, int(m.get("hidden", 1024)), t.head_dim)
        if m.get("support", "full") != "full" or m.get("rank") is not None:
            from ..maps.families import map_cost

            return map_cost(t.layers, self.k, self.src.kv_heads, self.src.head_dim, t.kv_heads, t.head_dim,
                            support=m.get("support", "full"), rank=m.get("rank"))["n_parameters"]
        from ..core.mapper import Mapper

        return Mapper.params_at(t.layers, self.p, self.q)

    @property
    def used_layers(self) -> int:
        """Source layers a map reads at most (the union of the selections is not known before the fit)."""
        return min(self.src.layers, self.k * self.tgt.layers)

    @property
    def hidden_per_token(self) -> int:
        """Hidden-state values per token a hidden-state map reads beside the cache (0 for K/V maps): H per used
        source layer (`hidden.hidden_map_cost`'s store minus the K/V a cache holds anyway)."""
        return self.used_layers * self.src.hidden if self.src_features != "kv" else 0

    @property
    def mapper_w32(self) -> int:
        return self.mapper_values * 4

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
