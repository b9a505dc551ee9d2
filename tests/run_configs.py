"""Test helpers shared by the config-reading tests: the project's Hydra config as a plain dict, and the
fixed device rates the plan tests compute times with (so their figures do not depend on this machine)."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvtransfer import plan as P

ROOT = Path(__file__).resolve().parents[1]
FIXED_RATES = P.Rates("fixed", "test", {"bfloat16": 5e14, "float32": 4e13, "float64": 4e13}, 3e12,
                      {"float64": 5e11, "float32": 1e12}, 5e10, 1e10, 2e9, 2e9)


def compose_config(*overrides: str) -> dict:
    """conf/config.yaml composed with `overrides` (out_dir set to a placeholder), resolved to plain containers."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["out_dir=unused", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)
