"""Which Hugging Face hub a model id and a dataset id resolve against, in one process.

A dry run (kvtransfer.dryrun) loads stand-in models saved under the REAL hub ids in a cache of its
own, offline, while the data stays real: dataset ids resolve against the user's hub (online, or the
user's offline cache). `standin_models(cache)` switches model resolution (huggingface_hub's cache dir
and offline flag, which transformers reads on every `from_pretrained`) for the whole run;
`data_access()` wraps every place that reads a dataset (kvtransfer.core.data, the eval stage, the
preflight) and restores the process's own settings there. Outside a dry run both are no-ops.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

_SAVED: list[tuple] = []   # (HF_HUB_CACHE, HF_HUB_OFFLINE) of the process while stand-ins are active
_INSIDE: list[tuple] = []  # the stand-in settings while data_access has switched them away
_DATA_DEPTH = 0
_LOCK = threading.Lock()


@contextmanager
def standin_models(cache: str | Path):
    """While active, `from_pretrained(hub_id)` resolves `hub_id` offline from `cache` (an HF hub cache:
    models--<org>--<name>/snapshots/<rev>/ + refs/main), never from the network."""
    from huggingface_hub import constants

    _SAVED.append((constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE))
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = str(cache), True
    try:
        yield
    finally:
        constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = _SAVED.pop()


@contextmanager
def data_access():
    """Read datasets under the process's own hub settings (a no-op unless `standin_models` is active).

    Nested and concurrent uses (the preflight resolves sources in threads) share one switch: the first to
    enter switches to the process's settings, the last to leave switches back to the stand-ins."""
    global _DATA_DEPTH
    if not _SAVED:
        yield
        return
    from huggingface_hub import constants

    with _LOCK:
        if _DATA_DEPTH == 0:
            _INSIDE[:] = [(constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE)]
            constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = _SAVED[0]
        _DATA_DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DATA_DEPTH -= 1
            if _DATA_DEPTH == 0:
                constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = _INSIDE.pop()


def standins_active() -> bool:
    """Whether model ids resolve from a dry run's stand-in cache right now."""
    return bool(_SAVED)


def is_offline() -> bool:
    """Whether dataset ids resolve offline in this process (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)
