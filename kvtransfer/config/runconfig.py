"""What a run's plain config means, resolved in one place for the runner (`runner.pipeline.Run`, `execute`)
and the resource plan (`kvtransfer.plan`), so the two can never read a key differently.

    parse_stages(cfg.stage)   -> the stages to run, in pipeline order (unknown names are an error)
    resolve(cfg)              -> Resolved: effective k / lambda / key space / rope_at_inference (ablation.*
                                 over mapper.*), mapper kind, direction, stages
    side_spec(cfg, side)      -> pair.<side> of the model playing `side` under pair.direction
    calib_split(cfg)          -> (train, held-out) sequence indices (calibrate.split_heldout)
    kept_positions(calib)     -> calibration positions kept per sequence (calibrate.subsample_positions)
    source_features(mapper)   -> what the calibration and the map read of the source: "kv", or its hidden states
                                 (mapper=hidden, kvtransfer.core.hidden)
    learning_rates(mapper)    -> mapper.lr as a list: several only for mapper=trained (chosen on the stop split)
    group_overrides(overrides, conf) -> the overrides that choose a config group's option (pair=..., mapper=mlp)
    check_groups(cfg, defaults)      -> refuses a single value typed where the config has a group of keys
                                        (eval.gate=true for eval.gate.enabled=true), naming the group's keys

Part of the core: imports only the core (no Hydra, no runner, no plan).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STAGES = ("calibrate", "fit", "eval", "bench", "report")
DIRECTIONS = ("forward", "reverse")


def parse_stages(stage) -> list[str]:
    """'all', a comma string or a list of stage names -> ordered list of stages; ValueError naming the
    valid names for an unknown one."""
    if isinstance(stage, (list, tuple)):
        names = list(stage)
    else:
        names = STAGES if stage == "all" else [s.strip() for s in str(stage).split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}: use one of {', '.join(STAGES)} or all")
    return [s for s in STAGES if s in names]


@dataclass(frozen=True)
class Resolved:
    """The effective settings of a run (what the stages and the plan use, after ablation overrides)."""

    stages: list
    k: object                # int, or "all" (every source layer)
    lam: float
    key_space: str           # "stripped" | "rotated"
    rope_at_inference: bool
    mapper_kind: str         # "ridge" | "trained" | "hidden" | "mlp"
    direction: str           # "forward" | "reverse"

    def k_layers(self, n_source_layers: int) -> int:
        """k as a number of source layers ("all" = every one)."""
        return n_source_layers if self.k == "all" else int(self.k)


def resolve(cfg: dict) -> Resolved:
    """Resolve a plain run config (see the module docstring). ablation.k / ablation.lam override mapper.k /
    mapper.lam when set (not None)."""
    ablation = cfg.get("ablation") or {}
    mapper = cfg["mapper"]
    direction = resolve_direction(cfg)
    return Resolved(stages=parse_stages(cfg.get("stage", "all")),
                    k=ablation.get("k") if ablation.get("k") is not None else mapper["k"],
                    lam=ablation.get("lam") if ablation.get("lam") is not None else mapper["lam"],
                    key_space=ablation.get("key_space", "stripped"),
                    rope_at_inference=ablation.get("rope_at_inference", True),
                    mapper_kind=mapper.get("kind", "ridge"), direction=direction)


def side_spec(cfg: dict, side: str) -> dict:
    """pair.<side> ({"id", "path", ...}) of the model playing `side` ("source" | "target"): under
    pair.direction=reverse the configured target is the source and vice versa."""
    if resolve_direction(cfg) == "reverse":
        side = {"source": "target", "target": "source"}[side]
    return cfg["pair"][side]


def resolve_direction(cfg: dict) -> str:
    """pair.direction, checked."""
    direction = (cfg.get("pair") or {}).get("direction", "forward")
    if direction not in DIRECTIONS:
        raise ValueError(f"pair.direction must be forward or reverse, got {direction!r}")
    return direction


def calib_split(cfg: dict, n_sequences: int | None = None) -> tuple[list[int], list[int]]:
    """(train, held-out) sequence indices of the calibration: `calibrate.split_heldout` over
    `n_sequences` (default calib.n_sequences) with calib.heldout_fraction and the run's seed."""
    from ..core.calibrate import split_heldout

    calib = cfg["calib"]
    n = int(calib["n_sequences"]) if n_sequences is None else n_sequences
    return split_heldout(n, float(calib.get("heldout_fraction", 0.1)), cfg.get("seed", 0))


def kept_positions(calib: dict) -> int:
    """Positions per sequence the calibration keeps (0, stride, 2 * stride, ... < seq_len)."""
    from ..core.calibrate import subsample_positions

    return int(subsample_positions(int(calib["seq_len"]), int(calib["stride"])).numel())


def source_features(mapper: dict) -> str:
    """What the calibration and the map read of the source per layer (kvtransfer.core.hidden.FEATURES): mapper.features
    for mapper=hidden ("hidden" | "hidden_kv"), else the paper's K/V ("kv")."""
    if mapper.get("kind", "ridge") != "hidden":
        return "kv"
    features = mapper.get("features", "hidden")
    if features not in ("hidden", "hidden_kv"):
        raise ValueError(f"mapper=hidden reads mapper.features=hidden or hidden_kv, got {features!r} (the K/V-only map "
                         "is mapper=ridge)")
    return features


def learning_rates(mapper: dict) -> list[float]:
    """mapper.lr as a list of positive floats. A list of several is for mapper=trained only, which trains once per
    rate from the same ridge start and keeps, per target layer (end_to_end: for the joint map), the run of the
    lowest stop-split loss (`train_map.lowest_stop_loss`); the MLP reads one rate."""
    lr = mapper.get("lr", 1e-4)
    lrs = [lr] if isinstance(lr, (int, float, str)) else list(lr)
    try:
        lrs = [float(x) for x in lrs]
    except (TypeError, ValueError):
        raise ValueError(f"mapper.lr must be a number or a list of numbers, got {lr!r}") from None
    if not lrs or not all(x > 0 for x in lrs):
        raise ValueError(f"mapper.lr must be > 0 (one rate, or a non-empty list of rates), got {lr!r}")
    if len(lrs) > 1 and mapper.get("kind", "ridge") != "trained":
        raise ValueError(f"mapper.lr={lrs}: only mapper=trained chooses among several learning rates (on its stop "
                         f"split); mapper={mapper.get('kind', 'ridge')} takes one, e.g. mapper.lr={lrs[0]}")
    return lrs


def needs_feature_sample(mapper: dict) -> bool:
    """Whether a mapper config fits on the calibration's kept feature rows (mapper=mlp, weighting=attention_mass)."""
    return mapper.get("kind", "ridge") == "mlp" or mapper.get("weighting", "none") == "attention_mass"


def group_overrides(overrides, conf: str | Path) -> list[str]:
    """The Hydra overrides among `overrides` (strings as typed) that choose an option of a config group, i.e. whose
    key names a directory of the config directory `conf` (pair=qwen3_14b_32b, mapper=mlp, +experiment=...); the
    config composed with only these is the one whose structure the user's key overrides must keep (hydra/...
    launcher choices are left out: they shape no key of the run's config)."""
    out = []
    for override in overrides:
        if "=" not in override:
            continue
        key = override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        if key and not key.startswith("hydra") and (Path(conf) / key).is_dir():
            out.append(override)
    return out


def check_groups(cfg: dict, defaults: dict) -> None:
    """Refuse, before anything loads, a plain config that holds a single value (or a list) where `defaults` -- the
    same config composed with the same group choices but none of the key overrides (`group_overrides`) -- holds a
    group of keys: ValueError naming every such key, its group's keys and the spelling that sets one of them."""
    problems = []

    def spell(value) -> str:   # as typed on a command line
        return "true" if value is True else "false" if value is False else "null" if value is None else str(value)

    def walk(got: dict, want: dict, prefix: str) -> None:
        for key, default in want.items():
            if key not in got or not isinstance(default, dict):
                continue
            path, value = f"{prefix}{key}", got[key]
            if isinstance(value, dict):
                walk(value, default, f"{path}.")
            elif default:
                keys = list(default)
                problems.append(f"{path} is a group of keys ({', '.join(map(str, keys))}), not a single value: set one "
                                f"of them, e.g. {path}.{keys[0]}={spell(value)}")
            else:
                problems.append(f"{path} is a mapping (empty by default), not a single value: add entries to it, "
                                f"e.g. +{path}.<name>={spell(value)}")

    walk(cfg, defaults, "")
    if problems:
        raise ValueError("config: " + "; ".join(problems))
