"""Where the package finds its Hydra configs (conf/), in a source checkout and in an installed wheel."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # kvtransfer/


def conf_dir() -> Path:
    """The Hydra config directory: the repository's conf/ next to kvtransfer/ in a checkout (an editable install
    reads it there), else the copy a wheel ships as package data (kvtransfer/conf, see setup.py)."""
    for candidate in (_PACKAGE.parent / "conf", _PACKAGE / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"no conf/config.yaml next to {_PACKAGE} nor inside it: a broken install of kvtransfer "
                            "(reinstall it with `pip install .` from a checkout, which ships conf/ in the wheel)")
