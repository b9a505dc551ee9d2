"""kvtransfer entry point in a checkout (installed: `kvtransfer-run`, the same function).

    python run.py                                   # tiny embedded pair, end to end, offline
    python run.py pair=qwen3_14b_32b                # a paper pair (HF hub or pair.source.path=...)
    python run.py pair=qwen3_14b_32b dry_run=true   # the same on stand-ins, on this CPU, in minutes: before booking a node
    python run.py -m mapper.k=1,2,4         # a sweep on the tiny pair (its source has 4 layers): one table
    python run.py -m ablation=full,no_rerotation,no_rope,no_rope_k1,no_rope_k1_no_ridge
    python run.py -m hydra/launcher=submitit_local mapper.k=1,2   # jobs as local subprocesses (".[slurm]")
    python run.py -m hydra/launcher=slurm pair=qwen3_14b_32b mapper.k=4,8,12   # jobs on a SLURM cluster
"""
from kvtransfer.cli import launcher_threads, main, summary_lines  # noqa: F401  (summary_lines: tests, notebooks)

if __name__ == "__main__":
    main()
