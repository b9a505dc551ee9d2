"""`kvtransfer-run` (= `python run.py` in a checkout): the Hydra entry point of a run, normal or dry.

    kvtransfer-run                                   # tiny embedded pair, end to end, offline (from a checkout)
    kvtransfer-run pair=qwen3_14b_32b                # a paper pair (HF hub or pair.source.path=...)
    kvtransfer-run pair=qwen3_14b_32b dry_run=true   # the same on stand-ins, on this CPU, in minutes
    kvtransfer-run -m mapper.k=1,2,4         # a sweep on the tiny pair (its source has 4 layers): one table
"""
import warnings

import hydra
from omegaconf import DictConfig, OmegaConf

from kvtransfer.config.paths import conf_dir

# conf/hydra/launcher/submitit_local.yaml shadows the plugin's preset of that name on purpose (CPU defaults) and is
# typed by the plugin's schema; Hydra warns about that on every run. tests/test_launchers.py checks it by the schema.
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_local' is validated against ConfigStore schema")


def launcher_threads() -> int | None:
    """The launcher's `cpus_per_task` when this job runs under one that sets it (submitit presets), else None."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    launcher = HydraConfig.get().get("launcher") or {}
    cpus = launcher.get("cpus_per_task")
    return int(cpus) if cpus else None


def check_config_groups(plain: dict) -> None:
    """Refuse this job's resolved config when a key override gave a single value where the config has a group of
    keys (kvtransfer.config.runconfig.check_groups), before anything loads; call inside the Hydra app."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from kvtransfer.config.runconfig import check_groups, group_overrides

    # the structure to keep: the same group choices (pair=..., mapper=...), none of the key overrides
    chosen = group_overrides(HydraConfig.get().overrides.task, conf_dir())
    check_groups(plain, OmegaConf.to_container(compose(config_name="config", overrides=chosen), resolve=False))


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    """Run the configured stages for one (job's) config and print the summary's retention rows."""
    threads = launcher_threads()
    if threads:  # submitit's local executor starts every job at once and ignores cpus_per_task: honour it here
        import torch

        torch.set_num_threads(threads)
        print(f"[kvtransfer] torch threads: {threads} (hydra.launcher.cpus_per_task)")
    from kvtransfer.runner.console import warn_once_per_run

    warn_once_per_run()  # lm-eval repeats its generation_kwargs warning per mode and task: show each warning once
    plain = OmegaConf.to_container(cfg, resolve=True)
    check_config_groups(plain)
    if plain.get("dry_run"):  # stand-in models, the real data sources, tiny sizes (kvtransfer.dryrun)
        from kvtransfer.dryrun import dry_run

        summary = dry_run(plain, plain["out_dir"])
    else:
        from kvtransfer.runner import execute

        summary = execute(plain, plain["out_dir"])
    print(f"[kvtransfer] {summary['pair']}: wrote {plain['out_dir']}/summary.json")
    for line in summary_lines(summary):
        print(line)


def summary_lines(summary: dict) -> list[str]:
    """The run's headline as one table: a row per task and per perplexity (set, prefix), the modes' scores, gap
    closed (floor -> target) and the content share (kvtransfer.eval.metrics), each rounded to what its paired
    bootstrap SE supports; a ratio whose SE exceeds its magnitude reads "not measurable at this n"."""
    from kvtransfer.eval.metrics import format_with_se

    def ratio(value, se) -> str:
        if value is None:
            return "–"
        if se is not None and se > abs(value):
            return "not measurable at this n"
        return format_with_se(value, se, scale=100, unit=" %")

    rows = [("", "target", "transfer", "no_context", "gap closed", "content share")]
    for task, r in (summary.get("tasks") or {}).items():
        rows.append((f"{task} (n = {r.get('n')})",
                     *(format_with_se(r.get(m), r.get(f"stderr_{m}")) if r.get(m) is not None else "–"
                       for m in ("target", "transfer", "no_context")),
                     ratio(r.get("gap_closed"), r.get("stderr_gap_closed")),
                     ratio(r.get("content_share"), r.get("content_share_se"))))
    sets = summary.get("ppl_sets") or {"": summary.get("ppl") or []}
    for name, ppl_rows in sets.items():
        for r in ppl_rows:
            if r.get("transfer_gap_closed") is None:
                continue
            label = f"ppl {name + ' ' if name else ''}@{r['prefix']}" + (f" ({r['windows']} docs)" if r.get("windows") else "")
            rows.append((label, *(f"{r[m]:.4g}" if r.get(m) is not None else "–" for m in ("target", "transfer", "no_context")),
                         ratio(r["transfer_gap_closed"], r.get("transfer_gap_closed_se")),
                         ratio(r.get("content_share"), r.get("content_share_se"))))
    if len(rows) == 1:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
