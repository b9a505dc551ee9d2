"""kvtransfer entry point.

    python run.py                                   # tiny embedded pair, end to end, offline
    python run.py pair=qwen3_14b_32b                # a paper pair (HF hub or pair.source.path=...)
    python run.py pair=qwen3_14b_32b dry_run=true   # the same on stand-ins, on this CPU, in minutes: before booking a node
    python run.py -m mapper.k=1,2,4,8               # a sweep; rows collected into one table
    python run.py -m ablation=full,no_rerotation,no_rope,no_rope_k1,no_rope_k1_no_ridge
    python run.py -m hydra/launcher=submitit_local mapper.k=1,2   # jobs as local subprocesses (".[slurm]")
    python run.py -m hydra/launcher=slurm pair=qwen3_14b_32b mapper.k=4,8,12   # jobs on a SLURM cluster
"""
import warnings

import hydra
from omegaconf import DictConfig, OmegaConf

from kvtransfer.runner import execute


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


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Run the configured stages for one (job's) config and print the summary's retention rows."""
    threads = launcher_threads()
    if threads:  # submitit's local executor starts every job at once and ignores cpus_per_task: honour it here
        import torch

        torch.set_num_threads(threads)
        print(f"[kvtransfer] torch threads: {threads} (hydra.launcher.cpus_per_task)")
    plain = OmegaConf.to_container(cfg, resolve=True)
    if plain.get("dry_run"):  # stand-in models, the real data sources, tiny sizes (kvtransfer.dryrun)
        from kvtransfer.dryrun import dry_run

        summary = dry_run(plain, plain["out_dir"])
    else:
        summary = execute(plain, plain["out_dir"])
    print(f"[kvtransfer] {summary['pair']}: wrote {plain['out_dir']}/summary.json")
    for line in summary_lines(summary):
        print(line)


def summary_lines(summary: dict) -> list[str]:
    """The summary's headline numbers, each rounded to what its paired bootstrap SE supports
    (kvtransfer.eval.metrics.format_with_se), e.g. `target 0.397 ± 0.028`."""
    from kvtransfer.eval.metrics import format_with_se

    lines = []
    for task, r in (summary.get("tasks") or {}).items():
        parts = [f"{m} {format_with_se(r.get(m), r.get(f'stderr_{m}'))}" for m in ("target", "transfer", "no_context")
                 if r.get(m) is not None]
        parts += [f"{name} {format_with_se(r.get(name), r.get(f'stderr_{name}'), scale=100, unit=' %')}"
                  for name in ("gap_closed", "retention") if r.get(name) is not None]
        lines.append(f"  {task:<16} " + " | ".join(parts))
    for r in summary.get("ppl") or []:
        if r.get("transfer_gap_closed") is not None:
            lines.append(f"  ppl@{r['prefix']:<12} target {r['target']:.4g} | transfer {r['transfer']:.4g} | no_context "
                         f"{r['no_context']:.4g} | gap_closed (log-ppl) "
                         f"{format_with_se(r['transfer_gap_closed'], r.get('transfer_gap_closed_se'), scale=100, unit=' %')}")
    return lines


if __name__ == "__main__":
    main()
