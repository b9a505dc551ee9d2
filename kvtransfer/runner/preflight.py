"""Before any weights load: resolve every data source the run will read, and check the model table.

`preflight(cfg, stages)` lists the run's sources -- the calibration text (calib.files or calib.dataset),
and for the eval stage each task's data, the perplexity text and the CoQA conversations, only of what
the run evaluates (kvtransfer.eval.sources) -- and resolves each: files exist and their first record
has the fields the reader takes; a hub dataset id resolves (online, or from the datasets cache offline)
with the splits and fields the reader takes. Every failure is collected and raised together as a
PreflightError naming the key that fixes it, in seconds, never after a stage has run.

It also compares the model table (kvtransfer.resources.model_configs, which the resource plan sizes
the run with) with each hub model's real config.json wherever that file can be had -- from the hub
online, or from the local HF cache offline -- and stops on a difference. Skipped inside a dry run's
stand-in context (the cache there holds the stand-ins, not the real configs).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..eval.sources import Source, eval_sources
from ..config.hub import data_access, standins_active


class PreflightError(RuntimeError):
    """A data source or a model config the run needs is missing or differs; the message names the fix."""


CALIB_STAGES = ("calibrate", "fit", "eval", "bench", "report")


def calib_source(cfg: dict) -> Source:
    """The calibration text of `cfg`: calib.files, else calib.dataset (streamed)."""
    calib = cfg["calib"]
    field = calib.get("text_field", "text")
    if calib.get("files"):
        return Source("calibration", files=tuple(map(str, calib["files"])), fields=(field,),
                      fix="calib.files / calib.text_field")
    if calib.get("dataset"):
        return Source("calibration", dataset=calib["dataset"], name=calib.get("dataset_name"),
                      splits=(calib.get("split", "train"),), fields=(field,), streaming=True,
                      fix="calib.dataset / dataset_name / split / text_field")
    raise PreflightError("the run calibrates but names no text: set calib.files=[...] or calib.dataset=...")


def run_sources(cfg: dict, stages: list[str]) -> list[Source]:
    """Every data source `stages` of `cfg` read (a shapes-only bench alone reads none)."""
    out = []
    shapes_only_bench = stages == ["bench"] and bool((cfg.get("bench") or {}).get("shapes_only"))
    if any(s in CALIB_STAGES for s in stages) and not shapes_only_bench:
        out.append(calib_source(cfg))
    if "eval" in stages:
        out += eval_sources(cfg["eval"])
    return out


def _first_record(path: Path) -> dict | None:
    with path.open() as f:
        for line in f:
            if line.strip():
                return json.loads(line)
    return None


def check_files(src: Source) -> str:
    """'' when every file exists and its first record has the source's fields; else the problem."""
    for name in src.files:
        path = Path(name)
        if not path.is_file():
            return f"{path} does not exist"
        if path.suffix != ".jsonl":
            if not path.read_text().strip():
                return f"{path} is empty"
            continue
        try:
            record = _first_record(path)
        except json.JSONDecodeError as err:
            return f"{path} is not JSONL ({err})"
        if record is None:
            return f"{path} holds no records"
        missing = [f for f in src.fields if not any(a in record for a in f.split("|"))]
        if missing:
            return f"{path} records lack {missing} (fields: {sorted(record)})"
    return ""


def check_dataset(src: Source) -> str:
    """'' when the hub dataset resolves with the source's splits and fields; else the problem."""
    import datasets

    try:
        with data_access():
            if src.streaming:
                row = next(iter(datasets.load_dataset(src.dataset, src.name, split=src.splits[0], streaming=True)))
                columns = set(row)
            else:
                info = datasets.load_dataset_builder(src.dataset, src.name).info
                splits = set(info.splits or {})
                if splits and not set(src.splits) <= splits:
                    return f"has splits {sorted(splits)}, the reader needs {list(src.splits)}"
                columns = set(info.features or {}) or set(src.fields)
    except Exception as err:  # noqa: BLE001 -- any failure to resolve is the message
        return f"does not resolve ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    missing = [f for f in src.fields if not any(a in columns for a in f.split("|"))]
    return f"rows lack {missing} (fields: {sorted(columns)})" if missing else ""


def check_source(src: Source) -> str:
    """The problem with one source, '' if none."""
    return check_dataset(src) if src.dataset else check_files(src)


def model_config_differences(cfg: dict) -> tuple[list[str], list[str]]:
    """(differences, notes): the model table vs each pair model's real config.json, where one can be had."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from ..resources.model_configs import MODEL_CONFIGS, compare_config

    diffs, notes = [], []
    online = _hub_reachable()
    for side in ("source", "target"):
        spec = cfg["pair"].get(side) or {}
        hub_id = spec.get("id")
        if spec.get("path") or not hub_id:
            continue
        if hub_id not in MODEL_CONFIGS:
            notes.append(f"{hub_id}: not in the model table (the plan reads its cached config, if any)")
            continue
        try:
            path = hf_hub_download(hub_id, "config.json", local_files_only=not online)
        except LocalEntryNotFoundError:
            notes.append(f"{hub_id}: config.json neither reachable (hub {'up' if online else 'offline'}) nor cached: "
                         "table not compared")
            continue
        except Exception as err:  # noqa: BLE001 -- gated, missing repo, no access: the real run fails there too
            diffs.append(f"{hub_id}: config.json cannot be read ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}); a gated model needs its licence "
                         "accepted on the hub and `huggingface-cli login`")
            continue
        found = compare_config(hub_id, json.loads(Path(path).read_text()))
        diffs += found
        if not found:
            notes.append(f"{hub_id}: table agrees with config.json")
    return diffs, notes


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub endpoint answers a TCP connection now (never in offline mode): without this check an
    unreachable hub costs a minute of huggingface_hub's retries per file."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def preflight(cfg: dict, stages: list[str], *, log=print) -> dict:
    """Resolve every data source of `stages` and check the model table (see module doc). Returns
    {"sources": [{"what", "source", "ok"}], "models": [notes]}; raises PreflightError listing every problem."""
    sources = run_sources(cfg, stages)
    with ThreadPoolExecutor(max_workers=8) as pool:  # hub look-ups are network-bound: MMLU has 57 subjects
        problems = list(pool.map(check_source, sources))
    lines = [f"  {s.what}: {s.describe()}: {p} -> set {s.fix}" for s, p in zip(sources, problems) if p]
    diffs, notes = ([], ["stand-in models: the table is compared by the dry run before they are built"]) \
        if standins_active() else model_config_differences(cfg)
    lines += [f"  {d} -> correct kvtransfer/resources/model_configs.py (or the pair's id)" for d in diffs]
    if lines:
        raise PreflightError("preflight: the run would fail on\n" + "\n".join(lines))
    log(f"[preflight] {len(sources)} data source(s) resolved: "
        + "; ".join(f"{s.what}: {s.describe()}" for s in _unique(sources)))
    for note in notes:
        log(f"[preflight] {note}")
    return {"sources": [{"what": s.what, "source": s.describe(), "ok": True} for s in sources], "models": notes}


def _unique(sources: list[Source]) -> list[Source]:
    """Sources for the log: the 57 MMLU subjects as one line."""
    out, seen = [], set()
    for s in sources:
        key = (s.what.split(" (")[0], s.dataset)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out
